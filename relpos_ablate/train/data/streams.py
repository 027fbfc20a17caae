"""Contiguous token streams cut into segments: the batch layout segment recurrence needs.

Every source (synthetic task or text corpus) ends up as B parallel streams: `inputs`, `targets` and
`mask` of shape [B, N]. Batch t holds segment t of every stream, so the memory a model keeps from
batch t is exactly the context that precedes batch t + 1 in each row (Transformer-XL's layout).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch.utils.data import Dataset, Sampler

Batch = tuple[Tensor, Tensor, Tensor]
#: Refines the mask of one segment given its (inputs, targets, mask), all [B, L]; used by tasks whose
#: answer is only determined when the evidence lies inside the segment.
SegmentMask = Callable[[Tensor, Tensor, Tensor], Tensor]


class SegmentStreams(Dataset):
    """B streams of N tokens; item t = (inputs, targets, mask) of segment t, each [B, segment_len].

    The tail of each stream that does not fill a whole segment is dropped. Arrays may be stored compactly
    (int32 tokens, an expanded all-True mask); each segment comes out as long tokens and a bool mask.
    """

    def __init__(self, inputs: Tensor, targets: Tensor, mask: Tensor, segment_len: int,
                 segment_mask: SegmentMask | None = None):
        if not (inputs.shape == targets.shape == mask.shape) or inputs.dim() != 2:
            raise ValueError(f"inputs, targets, mask must share one [B, N] shape, got "
                             f"{tuple(inputs.shape)}, {tuple(targets.shape)}, {tuple(mask.shape)}")
        self.inputs, self.targets, self.mask = inputs, targets, mask
        self.segment_len = segment_len
        self.segment_mask = segment_mask

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

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


class CyclicSegments(Dataset):
    """Item i = segment i mod len(streams): the training run is one long pass of `total` batches.

    Indexing by the global step (instead of epochs of len(streams) batches) makes resuming exact: the
    sampler starts at the restored step, and the streams restart (memory reset) every len(streams) steps.
    """

    def __init__(self, streams: SegmentStreams, total: int):
        self.streams, self.total = streams, total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> Batch:
        return self.streams[i % len(self.streams)]


class ResumeSampler(Sampler[int]):
    """Yields start(), ..., total - 1, where start() is read when iteration begins (the restored step)."""

    def __init__(self, total: int, start: Callable[[], int]):
        self.total, self.start = total, start

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        return iter(range(self.start(), self.total))


def batchify(tokens: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Next-token (inputs, targets), each [rows, N]: the 1-D token array cut into `rows` contiguous streams."""
    per_row = tokens.numel() // rows
    if per_row < 2:
        raise ValueError(f"{tokens.numel()} tokens cannot fill {rows} streams")
    streams = tokens[: rows * per_row].view(rows, per_row)  # [rows, per_row]
    return streams[:, :-1], streams[:, 1:]
