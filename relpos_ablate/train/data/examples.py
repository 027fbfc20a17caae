"""Example-based tasks for length generalization, generated from the seed (no download).

Each example is one sequence `<bos> prompt <sep> answer` of a task length n (what n counts: the
`DataConfig.task` docstring; token counts: `DataConfig.sequence_length`). A causal LM reads all but
its last token and predicts the next one; loss and accuracy count the answer tokens only (`mask`).
Examples of a batch are right-padded with <pad>: a causal query never sees a later key, so no real
token sees a pad, and every example starts at position 0 in its own row (no packing, so positions
need no restart). Exact match = every answer token right under teacher forcing, which equals greedy
decoding's exact match: a fully right answer is reproduced token by token, and the first wrong token
of greedy decoding is wrong under teacher forcing too.

The tasks themselves and their tokens: example_tasks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relpos_ablate.config import DataConfig
from relpos_ablate.config.data import TASKS
from relpos_ablate.train.data.example_tasks import (  # noqa: F401 (API: the token layout, as before)
    BIT,
    BOS,
    CLOSE,
    COUNTED,
    DIGIT,
    FILLER,
    FIRST,
    IGNORE,
    KEY,
    OPEN,
    PAD,
    PLUS,
    READ,
    SEP,
    TASK_GENERATORS,
    WRITE,
    vocab_size,
)
from relpos_ablate.train.data.streams import SegmentStreams
from relpos_ablate.train.data.synthetic import SPLITS


@dataclass(frozen=True)
class Examples:
    """N examples, right-padded to a common input length T."""

    inputs: Tensor
    """[N, T] tokens read: <bos> prompt <sep> answer without its last token, then <pad>."""
    targets: Tensor
    """[N, T] the next token of each input token (<pad> past the end)."""
    mask: Tensor
    """[N, T] bool: targets that are answer tokens (loss, accuracy, exact match)."""
    lengths: Tensor
    """[N] task length n of each example."""
    depths: Tensor
    """[N] depth tasks (data.DEPTH_TASKS): where their needle sits, as a fraction of the filler (NaN
    for other tasks)."""

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def padded(self, length: int) -> Examples:
        """The same examples padded (or cut: only <pad> may go) to input length `length`."""
        have = self.inputs.shape[1]
        if length < have and bool(
            self.mask[:, length:].any() or (self.inputs[:, length:] != PAD).any()
        ):
            raise ValueError(f"examples of input length up to {have} do not fit in {length} tokens")
        if length <= have:
            return Examples(
                self.inputs[:, :length],
                self.targets[:, :length],
                self.mask[:, :length],
                self.lengths,
                self.depths,
            )
        pad = (0, length - have)
        return Examples(
            torch.nn.functional.pad(self.inputs, pad, value=PAD),
            torch.nn.functional.pad(self.targets, pad, value=PAD),
            torch.nn.functional.pad(self.mask, pad, value=False),
            self.lengths,
            self.depths,
        )


def generate(
    data: DataConfig,
    seed: int,
    split: str,
    count: int,
    lengths: tuple[int, int],
    depth: float | None = None,
    stream: tuple[int, ...] = (),
) -> Examples:
    """`count` examples of `data.task` with n uniform in [lengths[0], lengths[1]]; depth tasks at
    `depth` (None: uniform). `stream` tells apart the example sets of one split (e.g. a bin and a
    depth)."""
    rng = np.random.default_rng([seed, SPLITS.index(split), TASKS.index(data.task), *stream])
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=count)
    if depth is None:
        depths = rng.random(count)
    else:
        depths = np.full(count, float(depth))
    width = data.sequence_length(int(sizes.max()))
    tokens = np.full((count, width), PAD, dtype=np.int64)
    answers = np.zeros((count, width), dtype=bool)
    for n in np.unique(sizes):  # one vectorised draw per task length
        rows = np.flatnonzero(sizes == n)
        seq, answer = TASK_GENERATORS[data.task](data, rng, int(n), len(rows), depths[rows])
        tokens[rows, : seq.shape[1]] = seq
        answers[rows, : seq.shape[1]] = answer
    sequences = torch.from_numpy(tokens)
    read = (
        torch.arange(width - 1)[None]
        < torch.tensor([data.input_length(int(n)) for n in sizes])[:, None]
    )
    return Examples(
        sequences[:, :-1].masked_fill(~read, PAD),
        sequences[:, 1:].contiguous(),
        torch.from_numpy(answers[:, 1:].copy()),
        torch.from_numpy(sizes),
        torch.from_numpy(depths if data.depth_task else np.full(count, np.nan)),
    )


def as_streams(examples: Examples, rows: int, segment_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, targets, mask), each [rows, S·segment_len]: segment t of row r is example t·rows +
    r, padded to segment_len, so segment t of streams.py is the batch of examples t·rows ..
    (t+1)·rows - 1. The examples that do not fill a last batch are left out."""
    batches = len(examples) // rows
    if batches < 1:
        raise ValueError(f"{len(examples)} examples cannot fill {rows} rows")
    padded = examples.padded(segment_len)
    # (S·rows, T) -> (S, rows, T) -> (rows, S·T)
    return tuple(
        t[: batches * rows].view(batches, rows, segment_len).transpose(0, 1).reshape(rows, -1)
        for t in (padded.inputs, padded.targets, padded.mask)
    )


def by_length(examples: Examples, rows: int, seed: int) -> Examples:
    """The examples reordered into batches of `rows` of about one length (sorted by length, then the
    batches shuffled): a batch cut to its longest example then carries little padding."""
    order = torch.argsort(examples.lengths, stable=True)
    batches = len(order) // rows
    shuffled = torch.randperm(batches, generator=torch.Generator().manual_seed(seed))
    # (batches, rows): whole batches move
    order = order[: batches * rows].view(batches, rows)[shuffled].reshape(-1)
    return Examples(
        *(
            t[order]
            for t in (
                examples.inputs,
                examples.targets,
                examples.mask,
                examples.lengths,
                examples.depths,
            )
        )
    )


class TrimmedSegments(SegmentStreams):
    """Segments of example batches (as_streams), each cut after its longest example: the columns
    where every row is padding are dropped (a causal model's real tokens never read them)."""

    def __getitem__(self, t: int):
        inputs, targets, mask = super().__getitem__(t)
        width = int((inputs != PAD).any(0).nonzero().max()) + 1
        return inputs[:, :width], targets[:, :width], mask[:, :width]
