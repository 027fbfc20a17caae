"""Contiguous token streams cut into segments: the batch layout segment recurrence needs.

Every source (synthetic task or text corpus) ends up as B parallel streams: `inputs`, `targets` and
`mask` of shape [B, N]. Batch t holds segment t of every stream, so the memory a model keeps from
batch t is exactly the context that precedes batch t + 1 in each row (Transformer-XL's layout).

Data parallelism splits the streams, never the segments: process r of W owns rows
[r*B/W, (r+1)*B/W) for the whole run and keeps their memory (a sampler that shuffles or splits
segments would break recurrence). Gradient accumulation splits a process's rows again into
`accumulate` groups, each with its own memory (XL's batch_chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

Batch = tuple[Tensor, Tensor, Tensor]
#: Refines the mask of one segment given its (inputs, targets, mask), all [B, L]; used by tasks
#: whose answer is only determined when the evidence lies inside the segment.
SegmentMask = Callable[[Tensor, Tensor, Tensor], Tensor]


class SegmentStreams(Dataset):
    """B streams of N tokens; item t = (inputs, targets, mask) of segment t, each [B, segment_len].

    The tail of each stream that does not fill a whole segment is dropped. Arrays may be stored
    compactly (int32 tokens, an expanded all-True mask); each segment comes out as long tokens and a
    bool mask.
    """

    def __init__(
        self,
        inputs: Tensor,
        targets: Tensor,
        mask: Tensor,
        segment_len: int,
        segment_mask: SegmentMask | None = None,
    ):
        if not (inputs.shape == targets.shape == mask.shape) or inputs.dim() != 2:
            raise ValueError(
                f"inputs, targets, mask must share one [B, N] shape, got "
                f"{tuple(inputs.shape)}, {tuple(targets.shape)}, {tuple(mask.shape)}"
            )
        self.inputs, self.targets, self.mask = inputs, targets, mask
        self.segment_len = segment_len
        self.segment_mask = segment_mask

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    def select(self, rows: slice) -> SegmentStreams:
        """The same segments of some of the streams (views, no copy; the per-segment rule is per
        row), as the same class (a subclass's way of cutting segments is kept)."""
        return type(self)(
            self.inputs[rows],
            self.targets[rows],
            self.mask[rows],
            self.segment_len,
            self.segment_mask,
        )

    def __len__(self) -> int:
        return self.inputs.shape[1] // self.segment_len

    def __getitem__(self, t: int) -> Batch:
        if not 0 <= t < len(self):
            raise IndexError(f"segment {t} out of range (0..{len(self) - 1})")
        window = slice(t * self.segment_len, (t + 1) * self.segment_len)
        inputs = self.inputs[:, window].long().contiguous()
        targets = self.targets[:, window].long().contiguous()
        mask = self.mask[:, window].bool().contiguous()
        if self.segment_mask is not None:
            mask = self.segment_mask(inputs, targets, mask)
        return inputs, targets, mask


def loss_mask(mask: Tensor, loss_on: str) -> Tensor:
    """The targets the training loss counts: 'half' keeps only the most recent half of the segment,
    positions t >= L // 2 (XL Table 6)."""
    if loss_on == "full":
        return mask
    return mask & (torch.arange(mask.shape[1], device=mask.device) >= mask.shape[1] // 2)


def shard_rows(rows: int, rank: int, world: int) -> slice:
    """The streams process `rank` of `world` owns: [rank*rows//world, (rank+1)*rows//world)."""
    return slice(rank * rows // world, (rank + 1) * rows // world)


class TrainBatch(NamedTuple):
    """One micro-batch: some rows of one training segment, with what the step's loss needs."""

    inputs: Tensor
    """[b, L] input tokens of this micro-batch's streams."""
    targets: Tensor
    """[b, L] next tokens."""
    mask: Tensor
    """[b, L] targets determined by the stream (the task's rule)."""
    counted_in_step: Tensor
    """() the targets the loss counts in this step's whole global batch (every process, every
    group): the denominator of the step's token mean."""
    group: int
    """Which of the process's `accumulate` row groups this is; each group keeps its own memory."""


class TrainingSegments(Dataset):
    """Micro-batch i = row group i % accumulate of this process's streams, at segment (i //
    accumulate) mod len(streams): training is one long pass of `steps` optimizer steps.

    Indexing by the step (instead of epochs of len(streams) batches) makes resuming exact: the
    sampler starts at the restored step, and the streams restart (memory reset) every len(streams)
    steps.
    """

    def __init__(
        self,
        streams: SegmentStreams,
        steps: int,
        loss_on: str,
        rank: int = 0,
        world: int = 1,
        accumulate: int = 1,
    ):
        self.streams, self.steps, self.loss_on, self.accumulate = (
            streams,
            steps,
            loss_on,
            accumulate,
        )
        mine = shard_rows(streams.rows, rank, world)
        per_group = (mine.stop - mine.start) // accumulate
        self.groups = [
            streams.select(slice(mine.start + g * per_group, mine.start + (g + 1) * per_group))
            for g in range(accumulate)
        ]
        self._counted_at: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return self.steps * self.accumulate

    def __getitem__(self, i: int) -> TrainBatch:
        step, group = divmod(i, self.accumulate)
        t = step % len(self.streams)
        return TrainBatch(*self.groups[group][t], counted_in_step=self._counted(t), group=group)

    def _counted(self, t: int) -> Tensor:
        """Targets the loss counts in segment t of all the streams (every process computes the
        same); at least 1, so a segment with nothing to count adds 0 to the loss."""
        if t not in self._counted_at:
            _inputs, _targets, mask = self.streams[t]
            self._counted_at[t] = loss_mask(mask, self.loss_on).sum().clamp(min=1)
        return self._counted_at[t]


class ResumeSampler(Sampler[int]):
    """Yields start(), ..., total - 1, where start() is read when iteration begins (the restored
    position)."""

    def __init__(self, total: int, start: Callable[[], int]):
        self.total, self.start = total, start

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        return iter(range(self.start(), self.total))


def batchify(tokens: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Next-token (inputs, targets), each [rows, N]: the 1-D token array cut into `rows` contiguous
    streams."""
    per_row = tokens.numel() // rows
    if per_row < 2:
        raise ValueError(f"{tokens.numel()} tokens cannot fill {rows} streams")
    streams = tokens[: rows * per_row].view(rows, per_row)  # [rows, per_row]
    return streams[:, :-1], streams[:, 1:]
