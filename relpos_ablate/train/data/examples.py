"""Example-based tasks for length generalization, generated from the seed (no download).

Each example is one sequence `<bos> prompt <sep> answer` of a task length n (what n counts: the
`DataConfig.task` docstring; token counts: `DataConfig.sequence_length`). A causal LM reads all but
its last token and predicts the next one; loss and accuracy count the answer tokens only (`mask`).
Examples of a batch are right-padded with <pad>: a causal query never sees a later key, so no real
token sees a pad, and every example starts at position 0 in its own row (no packing, so positions
need no restart). Exact match = every answer token right under teacher forcing, which equals greedy
decoding's exact match: a fully right answer is reproduced token by token, and the first wrong token
of greedy decoding is wrong under teacher forcing too.

Answers inline: mqar answers each query right after it (`<sep> q1 a1 q2 a2 ...`); flip_flop's answers
are the bits after its read instructions (no <sep>).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relpos_ablate.config import DataConfig
from relpos_ablate.config.data import TASKS
from relpos_ablate.train.data.streams import SegmentStreams
from relpos_ablate.train.data.synthetic import SPLITS

PAD, BOS, SEP = 0, 1, 2
FIRST = 3  # the first task token
DIGIT, PLUS, KEY = FIRST, FIRST + 10, FIRST + 10  # digits 0-9; addition's '+' and passkey's <key> follow them
WRITE, READ, IGNORE, BIT = FIRST, FIRST + 1, FIRST + 2, FIRST + 3  # flip_flop's instructions, then bits 0 and 1


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
    """[N] passkey: where the key sits, as a fraction of the filler (NaN for other tasks)."""

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def padded(self, length: int) -> Examples:
        """The same examples padded (or cut: only <pad> may go) to input length `length`."""
        have = self.inputs.shape[1]
        if length < have and bool(self.mask[:, length:].any() or (self.inputs[:, length:] != PAD).any()):
            raise ValueError(f"examples of input length up to {have} do not fit in {length} tokens")
        if length <= have:
            return Examples(self.inputs[:, :length], self.targets[:, :length], self.mask[:, :length], self.lengths,
                            self.depths)
        pad = (0, length - have)
        return Examples(torch.nn.functional.pad(self.inputs, pad, value=PAD),
                        torch.nn.functional.pad(self.targets, pad, value=PAD),
                        torch.nn.functional.pad(self.mask, pad, value=False), self.lengths, self.depths)


def vocab_size(data: DataConfig) -> int:
    """<pad>, <bos>, <sep>, then the task's tokens."""
    return FIRST + {
        "copy": data.num_symbols, "reverse": data.num_symbols, "sort": data.num_symbols,
        "addition": 11,  # ten digits and '+'
        "parity": 2,
        "mqar": data.num_keys + data.num_symbols,  # keys, then values
        "flip_flop": 5,  # write, read, ignore, 0, 1
        "passkey": 11 + data.num_symbols,  # ten digits, <key>, filler symbols
    }[data.task]


def generate(data: DataConfig, seed: int, split: str, count: int, lengths: tuple[int, int],
             depth: float | None = None, stream: tuple[int, ...] = ()) -> Examples:
    """`count` examples of `data.task` with n uniform in [lengths[0], lengths[1]]; passkey at `depth`
    (None: uniform). `stream` tells apart the example sets of one split (e.g. a bin and a depth)."""
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
        seq, answer = _TASKS[data.task](data, rng, int(n), len(rows), depths[rows])
        tokens[rows, : seq.shape[1]] = seq
        answers[rows, : seq.shape[1]] = answer
    sequences = torch.from_numpy(tokens)
    read = torch.arange(width - 1)[None] < torch.tensor([data.input_length(int(n)) for n in sizes])[:, None]
    return Examples(sequences[:, :-1].masked_fill(~read, PAD), sequences[:, 1:].contiguous(),
                    torch.from_numpy(answers[:, 1:].copy()), torch.from_numpy(sizes),
                    torch.from_numpy(depths if data.task == "passkey" else np.full(count, np.nan)))


def _framed(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """<bos> prompt <sep> answer, with the answer marked: ([count, T], [count, T])."""
    count = prompt.shape[0]
    seq = np.concatenate([np.full((count, 1), BOS), prompt, np.full((count, 1), SEP), answer], axis=1)
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, seq.shape[1] - answer.shape[1]:] = True
    return seq, marked


def _copy(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, x)


def _reverse(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, x[:, ::-1])


def _sort(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, np.sort(x, axis=1))


def _addition(data, rng, n, count, depths):
    """Two n-digit numbers (leading zeros allowed), most significant digit first; their n+1-digit sum."""
    a, b = rng.integers(0, 10, size=(2, count, n))
    total, carry = np.zeros((count, n + 1), dtype=np.int64), np.zeros(count, dtype=np.int64)
    for k in range(n - 1, -1, -1):  # schoolbook addition from the least significant digit
        digit = a[:, k] + b[:, k] + carry
        total[:, k + 1], carry = digit % 10, digit // 10
    total[:, 0] = carry
    answer = total[:, ::-1] if data.addition_reversed else total
    return _framed(np.concatenate([a, np.full((count, 1), PLUS - DIGIT), b], axis=1) + DIGIT, answer + DIGIT)


def _parity(data, rng, n, count, depths):
    bits = rng.integers(0, 2, size=(count, n))
    return _framed(bits + FIRST, bits.sum(1, keepdims=True) % 2 + FIRST)


def _mqar(data, rng, n, count, depths):
    """n pairs with distinct keys, then min(mqar_queries, n) distinct keys each followed by its value."""
    keys = np.argsort(rng.random((count, data.num_keys)), axis=1)[:, :n]  # distinct keys per example
    values = rng.integers(0, data.num_symbols, size=(count, n))
    asked = np.argsort(rng.random((count, n)), axis=1)[:, : min(data.mqar_queries, n)]  # which pairs
    value_token = FIRST + data.num_keys
    pairs = np.stack([keys + FIRST, values + value_token], axis=2).reshape(count, 2 * n)
    queries = np.stack([np.take_along_axis(keys, asked, 1) + FIRST,
                        np.take_along_axis(values, asked, 1) + value_token], axis=2).reshape(count, -1)
    seq, _ = _framed(pairs, queries)
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, 2 * n + 3::2] = True  # the value after each query
    return seq, marked


def _flip_flop(data, rng, n, count, depths):
    """An opening write, then n instructions with a bit each, the last a read; reads repeat the last write.

    The opening write makes every n >= 1 answerable (n = 1: write b, read -> b)."""
    p_write = (1.0 - data.flip_flop_ignore) / 2
    ops = rng.choice([WRITE, READ, IGNORE], size=(count, n + 1), p=[p_write, p_write, data.flip_flop_ignore])
    ops[:, 0], ops[:, -1] = WRITE, READ
    bits = rng.integers(0, 2, size=(count, n + 1))
    last_write = np.maximum.accumulate(np.where(ops == WRITE, np.arange(n + 1), 0), axis=1)
    bits = np.where(ops == READ, np.take_along_axis(bits, last_write, 1), bits)
    pairs = np.stack([ops, bits + BIT], axis=2).reshape(count, 2 * (n + 1))
    seq = np.concatenate([np.full((count, 1), BOS), pairs], 1)
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, 2::2] = ops == READ
    return seq, marked


def _passkey(data, rng, n, count, depths):
    """n filler symbols with <key> d_1 .. d_k inserted after round(depth·n) of them; then <sep> d_1 .. d_k."""
    filler = rng.integers(0, data.num_symbols, size=(count, n)) + KEY + 1
    digits = rng.integers(0, 10, size=(count, data.passkey_digits)) + DIGIT
    at = np.rint(depths * n).astype(np.int64)  # filler tokens before the key
    hidden = np.concatenate([np.full((count, 1), KEY), digits], axis=1)
    width = n + hidden.shape[1]
    column = np.arange(width)[None, :]
    in_key = (column >= at[:, None]) & (column < at[:, None] + hidden.shape[1])
    prompt = np.empty((count, width), dtype=np.int64)
    prompt[in_key] = hidden.reshape(-1)
    prompt[~in_key] = filler.reshape(-1)
    return _framed(prompt, digits)


_TASKS = {"copy": _copy, "reverse": _reverse, "sort": _sort, "addition": _addition, "parity": _parity, "mqar": _mqar,
          "flip_flop": _flip_flop, "passkey": _passkey}


def as_streams(examples: Examples, rows: int, segment_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, targets, mask), each [rows, S·segment_len]: segment t of row r is example t·rows + r,
    padded to segment_len, so segment t of streams.py is the batch of examples t·rows .. (t+1)·rows - 1.
    The examples that do not fill a last batch are left out."""
    batches = len(examples) // rows
    if batches < 1:
        raise ValueError(f"{len(examples)} examples cannot fill {rows} rows")
    padded = examples.padded(segment_len)
    return tuple(t[: batches * rows].view(batches, rows, segment_len).transpose(0, 1).reshape(rows, -1)
                 for t in (padded.inputs, padded.targets, padded.mask))  # (S·rows, T) -> (S, rows, T) -> (rows, S·T)


def by_length(examples: Examples, rows: int, seed: int) -> Examples:
    """The examples reordered into batches of `rows` of about one length (sorted by length, then the
    batches shuffled): a batch cut to its longest example then carries little padding."""
    order = torch.argsort(examples.lengths, stable=True)
    batches = len(order) // rows
    shuffled = torch.randperm(batches, generator=torch.Generator().manual_seed(seed))
    order = order[: batches * rows].view(batches, rows)[shuffled].reshape(-1)  # (batches, rows): whole batches move
    return Examples(*(t[order] for t in (examples.inputs, examples.targets, examples.mask, examples.lengths,
                                         examples.depths)))


class TrimmedSegments(SegmentStreams):
    """Segments of example batches (as_streams), each cut after its longest example: the columns where
    every row is padding are dropped (a causal model's real tokens never read them)."""

    def __getitem__(self, t: int):
        inputs, targets, mask = super().__getitem__(t)
        width = int((inputs != PAD).any(0).nonzero().max()) + 1
        return inputs[:, :width], targets[:, :width], mask[:, :width]
