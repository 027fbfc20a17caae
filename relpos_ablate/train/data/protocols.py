"""Evaluation protocols on one canonical layout: which targets each forward scores, with what
context (docs/guide/evaluation.md#evaluation-protocols).

The layout, the same for every protocol and length: the evaluation split cut into B =
eval.batch_size contiguous streams, inputs x[b, 0..T-1] and targets x[b, 1..T] (each stream's first
token is never a target, as in Transformer-XL's evaluation; `max_targets` keeps the first
max_targets // B targets of each stream). Every protocol scores each of the B·T targets exactly
once, so token counts match across protocols and lengths; for a task with a per-segment rule
(offset_copy, recall: the segment_mask of its streams) only the targets the rule finds determined
inside their segment or window count, and those depend on where segments and windows start:

- non_overlapping / xl: batch t is columns [tL, (t+1)L) of every stream; the last, partial segment
  is padded and the padding masked (not dropped); memory, if any, carries from batch t to t + 1.
- sliding (window L, stride S): window k of a stream ends at e_k = min(L + kS, T) and covers columns
  [e_k - L, e_k); it scores the targets after the previous window's end, i.e. all L for the first
  window and the last S (fewer for the final one) after it: each with L - S + 1 .. L tokens of
  context. Windows are independent rows (no memory), batched sliding_batch_tokens // L at a time.

Every batch is (inputs, targets, mask, index), each [R, L]: `mask` marks the targets this batch
scores, `index` their place b·T + p in the layout (-1 elsewhere); per-token losses are stored in
that order. The column is the target's position in its segment or window, which the loss-by-position
curve bins.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from relpos_ablate.config import EvalSetting
from relpos_ablate.train.data.streams import SegmentStreams

EvalBatch = tuple[Tensor, Tensor, Tensor, Tensor]


class EvalLayout:
    """The B evaluation streams of T targets (a SegmentStreams' arrays and its task's rule, if any);
    window(...) cuts any batch of windows out of them."""

    def __init__(self, streams: SegmentStreams, max_targets: int = 0):
        """`max_targets` > 0 keeps the first max_targets // B targets of each stream."""
        keep = (
            streams.inputs.shape[1]
            if not max_targets
            else min(streams.inputs.shape[1], max_targets // streams.rows)
        )
        self.inputs, self.targets, self.mask = (
            a[:, :keep] for a in (streams.inputs, streams.targets, streams.mask)
        )
        self.segment_mask = streams.segment_mask

    @property
    def streams(self) -> int:
        return self.inputs.shape[0]

    @property
    def length(self) -> int:
        """T: targets per stream."""
        return self.inputs.shape[1]

    def window(self, rows: Tensor, starts: Tensor, first_scored: Tensor, length: int) -> EvalBatch:
        """Columns [start, start + length) of stream `rows[r]` for each r, scoring columns from
        start + first_scored[r] on; columns past T are padding (masked). rows, starts, first_scored:
        [R]."""
        offsets = torch.arange(length)
        columns = starts[:, None] + offsets  # (R, L)
        inside = columns < self.length
        columns = columns.clamp(max=self.length - 1)
        inputs = self.inputs[rows[:, None], columns].long()  # (R, L)
        targets = self.targets[rows[:, None], columns].long()
        mask = (
            self.mask[rows[:, None], columns].bool() & inside & (offsets >= first_scored[:, None])
        )
        if self.segment_mask is not None:
            mask = self.segment_mask(inputs, targets, mask)
        index = torch.where(mask, rows[:, None] * self.length + columns, -1)
        return inputs, targets, mask, index


class SegmentBatches(Dataset):
    """non_overlapping and xl: item t = segment t (columns [tL, (t+1)L)) of every stream in
    `rows`."""

    def __init__(self, layout: EvalLayout, segment_len: int, rows: Tensor | None = None):
        self.layout, self.segment_len = layout, segment_len
        self.rows = torch.arange(layout.streams) if rows is None else rows

    def __len__(self) -> int:
        return math.ceil(self.layout.length / self.segment_len)

    def __getitem__(self, t: int) -> EvalBatch:
        if not 0 <= t < len(self):
            raise IndexError(f"segment {t} out of range (0..{len(self) - 1})")
        starts = torch.full_like(self.rows, t * self.segment_len)
        return self.layout.window(self.rows, starts, torch.zeros_like(self.rows), self.segment_len)


def window_ends(length: int, window: int, stride: int) -> Tensor:
    """End column (exclusive) of every sliding window over `length` targets: window, window +
    stride, ..., then `length` itself; a single window when length <= window."""
    ends = torch.arange(window, max(window, length), stride)
    return torch.cat([ends, torch.tensor([length])])


class WindowBatches(Dataset):
    """sliding: every (stream, window) pair of the streams in `rows`, in stream-major order,
    `per_batch` windows per item."""

    def __init__(
        self,
        layout: EvalLayout,
        window: int,
        stride: int,
        per_batch: int,
        rows: Tensor | None = None,
    ):
        self.layout, self.window, self.per_batch = layout, window, per_batch
        ends = window_ends(layout.length, window, stride)  # (K,)
        # where the previous window's scoring stopped
        previous = torch.cat([ends.new_zeros(1), ends[:-1]])
        starts = (ends - window).clamp(min=0)
        n = len(ends)
        rows = torch.arange(layout.streams) if rows is None else rows
        self.rows = rows.repeat_interleave(n)  # (B*K,)
        self.starts = starts.repeat(len(rows))
        self.first_scored = (previous - starts).repeat(len(rows))

    @property
    def windows(self) -> int:
        return len(self.rows)

    def __len__(self) -> int:
        return math.ceil(self.windows / self.per_batch)

    def __getitem__(self, i: int) -> EvalBatch:
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range (0..{len(self) - 1})")
        part = slice(i * self.per_batch, (i + 1) * self.per_batch)
        return self.layout.window(
            self.rows[part], self.starts[part], self.first_scored[part], self.window
        )


def protocol_batches(
    layout: EvalLayout, setting: EvalSetting, sliding_batch_tokens: int, rows: slice | None = None
) -> Dataset:
    """The batches that evaluate `setting` on `layout`'s streams `rows` (all by default: a process
    of a data-parallel run evaluates its share; indices stay those of the whole layout)."""
    owned = torch.arange(layout.streams)[rows if rows is not None else slice(None)]
    if setting.protocol == "sliding":
        per_batch = max(1, sliding_batch_tokens // setting.segment_len)
        return WindowBatches(layout, setting.segment_len, setting.stride, per_batch, owned)
    return SegmentBatches(layout, setting.segment_len, owned)


def eval_loader(
    streams: SegmentStreams,
    setting: EvalSetting,
    sliding_batch_tokens: int,
    rows: slice | None = None,
) -> DataLoader:
    """A DataLoader of `setting`'s batches over the evaluation streams `rows` (in order: memory
    carries)."""
    layout = EvalLayout(streams, setting.max_targets)
    return DataLoader(
        protocol_batches(layout, setting, sliding_batch_tokens, rows),
        batch_size=None,
        shuffle=False,
    )


def log_bins(length: int) -> list[int]:
    """Edges of the loss-by-position bins over positions 0..length-1: 0, 1, 2, 4, 8, ..., length."""
    edges = [0] + [2**k for k in range(max(1, length).bit_length()) if 2**k < length]
    return edges + [length]


def unigram_loss(train_targets: Tensor, eval_targets: Tensor, vocab_size: int) -> float:
    """Mean negative log-likelihood (nats) of `eval_targets` under the training targets' unigram
    distribution with add-one smoothing: the reference a language model has to beat (a run's
    reference comes from counts, `target_counts`, so that a memory-mapped split is never read
    through its map)."""
    return unigram_loss_of_counts(
        torch.bincount(train_targets.flatten().long(), minlength=vocab_size),
        torch.bincount(eval_targets.flatten().long(), minlength=vocab_size),
    )


def unigram_loss_of_counts(train_counts: Tensor, eval_counts: Tensor) -> float:
    """`unigram_loss` from how often each id occurs among the training and the evaluation targets
    ([vocab] each)."""
    smoothed = train_counts.double() + 1.0
    log_p = smoothed.log() - smoothed.sum().log()
    eval_counts = eval_counts.double()
    return float(-(eval_counts * log_p).sum() / eval_counts.sum())


def target_counts(tokens: Tensor, rows: int, whole: Tensor) -> Tensor:
    """How often each id occurs among the targets `streams.batchify(tokens, rows)` makes, from the
    split's counts `whole` [vocab]: those less each stream's first token (no target) and the tail
    that fills no stream; a handful of reads, never the whole split."""
    per_row = tokens.numel() // rows
    dropped = torch.cat([tokens[: rows * per_row : per_row], tokens[rows * per_row :]]).long()
    return whole.double() - torch.bincount(dropped, minlength=whole.numel()).double()
