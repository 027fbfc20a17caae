"""Synthetic tasks, each probing one capability of a position scheme. Generated from the seed, no
download.

Every task yields B streams of (inputs, targets, mask), [B, N]; mask marks the positions whose
target is determined by what the model can see, the only ones that count for loss and accuracy.

- offset_copy: i.i.d. symbols; the target at t is the input at t - offset. Symbols carry no hint of
  where they are, so only an exact relative position (terms b/d, a bias, rope) solves it; NoPE
  cannot. Counted only where t - offset lies inside the segment: memory does not help.
- recall: "pair" tokens (key, value) and "query" tokens (key); the target at a query is the pair
  stored under its key. Each stream's key -> value map is redrawn every `rebind_every` tokens.
  Counted only where the segment so far holds pairs of that key with exactly one value (the right
  one): the answer is then found by content alone (term a), no position needed.
- repeat: a random block of `period` symbols followed by the same block again; next-token targets,
  counted inside the repetition. With period > segment_len the source lies in an earlier segment:
  needs memory plus the relative distance `period`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.config import DataConfig
from relpos_ablate.config.data import TASKS
from relpos_ablate.train.data.streams import SegmentMask, SegmentStreams

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class TaskStreams:
    """A generated task: whole-stream arrays plus the per-segment mask rule (if any)."""

    inputs: Tensor
    """[B, N] input tokens."""
    targets: Tensor
    """[B, N] target tokens."""
    mask: Tensor
    """[B, N] targets determined by the stream (before the per-segment rule)."""
    segment_mask: SegmentMask | None = None
    """Refines the mask of one segment (offset_copy, recall)."""

    def segments(self, segment_len: int) -> SegmentStreams:
        return SegmentStreams(self.inputs, self.targets, self.mask, segment_len, self.segment_mask)


def vocab_size(data: DataConfig) -> int:
    """Symbols of the task: recall has num_keys * num_symbols pair tokens plus num_keys query
    tokens."""
    if data.task == "recall":
        return data.num_keys * data.num_symbols + data.num_keys
    return data.num_symbols


def generate(data: DataConfig, seed: int, split: str, rows: int, length: int) -> TaskStreams:
    """`rows` streams of `length` tokens of `data.task`; train and eval streams are independent
    draws."""
    rng = np.random.default_rng([seed, SPLITS.index(split), TASKS.index(data.task)])
    return _GENERATORS[data.task](data, rng, rows, length)


def _offset_copy(data: DataConfig, rng: np.random.Generator, rows: int, length: int) -> TaskStreams:
    k = data.offset
    inputs = torch.from_numpy(rng.integers(0, data.num_symbols, size=(rows, length)))
    targets = torch.zeros_like(inputs)
    targets[:, k:] = inputs[:, :-k]
    mask = torch.arange(length).expand(rows, length) >= k
    return TaskStreams(inputs, targets, mask, functools.partial(_source_in_segment, offset=k))


def _source_in_segment(inputs: Tensor, targets: Tensor, mask: Tensor, offset: int) -> Tensor:
    """offset_copy: count position t only when its source t - offset lies in the same segment."""
    return mask & (torch.arange(inputs.shape[1]) >= offset)


def _recall(data: DataConfig, rng: np.random.Generator, rows: int, length: int) -> TaskStreams:
    n_keys, n_values = data.num_keys, data.num_symbols
    episodes = -(-length // data.rebind_every)
    maps = rng.integers(0, n_values, size=(rows, episodes, n_keys))  # value of each key per episode
    is_query = rng.random((rows, length)) < 0.5
    keys = rng.integers(0, n_keys, size=(rows, length))
    episode = np.arange(length) // data.rebind_every
    values = maps[np.arange(rows)[:, None], episode[None, :], keys]  # [rows, length]
    pair = keys * n_values + values
    inputs = np.where(is_query, n_keys * n_values + keys, pair)
    targets = np.where(is_query, pair, 0)
    rule = functools.partial(_answer_in_segment, n_keys=n_keys, n_values=n_values)
    return TaskStreams(
        torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(is_query), rule
    )


def _answer_in_segment(
    inputs: Tensor, targets: Tensor, mask: Tensor, n_keys: int, n_values: int
) -> Tensor:
    """recall: count a query only if the segment so far stored exactly one value under its key, the
    target."""
    b, length = inputs.shape
    n_pairs = n_keys * n_values
    # queries -> an extra class dropped below
    pair_ids = torch.where(inputs < n_pairs, inputs, n_pairs)
    # A query is never itself a pair, so the inclusive cumulative count is "pairs seen before t".
    seen = F.one_hot(pair_ids, n_pairs + 1)[..., :n_pairs].cumsum(1) > 0  # [B, L, K*V]
    seen = seen.view(b, length, n_keys, n_values)
    key = (inputs - n_pairs).clamp(0, n_keys - 1)  # [B, L]; meaningful at queries only
    # [B, L, V]
    values = seen.gather(2, key[:, :, None, None].expand(b, length, 1, n_values)).squeeze(2)
    answer = key * n_values + values.int().argmax(-1)
    return mask & (values.sum(-1) == 1) & (answer == targets)


def _repeat(data: DataConfig, rng: np.random.Generator, rows: int, length: int) -> TaskStreams:
    period = data.period
    blocks = -(-(length + 1) // (2 * period))
    block = rng.integers(0, data.num_symbols, size=(rows, blocks, 1, period))
    # [rows, length+1]
    stream = torch.from_numpy(np.tile(block, (1, 1, 2, 1)).reshape(rows, -1)[:, : length + 1])
    # Position of each target within its (block, repetition) pair: the repetition is the second
    # half.
    target_pos = torch.arange(1, length + 1) % (2 * period)
    mask = (target_pos >= period).expand(rows, length)
    return TaskStreams(stream[:, :-1], stream[:, 1:], mask)


_GENERATORS = {"offset_copy": _offset_copy, "recall": _recall, "repeat": _repeat}
