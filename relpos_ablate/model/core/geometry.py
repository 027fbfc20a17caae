"""The geometry of an attention call that the call (call.py), the score terms reading its blocks
(core/terms.py) and the statistics gathered from them (diagnostics.py) share, so that none of those
imports another: who sees whom (`Visibility`, narrowed per row by key padding and documents:
`per_row`), a block of queries (`QueryBlock`), what a block shows
its observers (`BlockView`), and the protocol through which a call reaches the statistics without
importing them.

Notation as in attention.py: L queries, M memory keys, K = M + L keys; query i sits at key index
i' = M + i; a query block covers queries i0 .. i1 - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class Visibility:
    """Which keys each query sees, by index: causal (j <= i'), within the window (i' - j < W)."""

    n_mem: int
    causal: bool
    window: int | None = None

    def __call__(self, query_index: Tensor, key_index: Tensor) -> Tensor:
        """Bool, broadcast over the two index tensors (flex.py calls it with scalars as its
        mask_mod)."""
        return self.at_distance(self.n_mem + query_index - key_index)

    def at_distance(self, distance: Tensor) -> Tensor:
        """Bool: is a key at index distance i' - j visible (the rule depends on nothing else)."""
        if not self.causal:
            return torch.ones_like(distance, dtype=torch.bool)
        seen = distance >= 0
        return seen if self.window is None else seen & (distance < self.window)


def per_row(
    seen: Tensor,
    padding: Tensor | None,
    documents: Tensor | None,
    n_mem: int,
    rows: slice,
    keys: slice,
) -> Tensor:
    """The visibility by index `seen` [L_b, K_b] of queries `rows` and keys `keys`, narrowed per
    row by key padding [B, K] (True: hidden) and documents [B, K] (a query sees its own document's
    keys): [B, 1, L_b, K_b]; `seen` itself without either."""
    if padding is None and documents is None:
        return seen
    seen = seen[None, None]
    if padding is not None:
        seen = seen & ~padding[:, None, None, keys]
    if documents is not None:
        query_docs = documents[:, n_mem + rows.start : n_mem + rows.stop]
        seen = seen & (query_docs[:, None, :, None] == documents[:, None, None, keys])
    return seen


def rows_within(block_scores: int, window: int) -> int:
    """The most rows n whose windowed block, n x (n + W - 1), holds at most block_scores entries."""
    n = int((math.sqrt((window - 1) ** 2 + 4 * block_scores) - (window - 1)) / 2)
    while n * (n + window - 1) > block_scores:  # (the square root's rounding)
        n -= 1
    return n


@dataclass(frozen=True)
class QueryBlock:
    """Queries i0 .. i1 - 1 against keys k0 .. n_keys - 1 (k0 > 0: the keys before lie outside every
    window of the block); rel_cols / distance_cols: the columns of rel_keys and distance_scores this
    block reads; n_sinks: learned sink slots the kernels' keys start with."""

    i0: int
    i1: int
    n_keys: int
    rel_cols: slice
    distance_cols: slice
    n_sinks: int = 0
    k0: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.i0, self.i1)

    @property
    def width(self) -> int:
        """K_b: the block's keys of the stream, k0 .. n_keys - 1."""
        return self.n_keys - self.k0

    @property
    def keys(self) -> slice | list[int]:
        """The block's columns of the kernels' keys and values, [sinks; keys k0 .. n_keys - 1]: a
        slice (a view) unless both sinks and skipped keys make it two ranges."""
        if not self.k0:
            return slice(0, self.n_sinks + self.n_keys)
        if not self.n_sinks:
            return slice(self.k0, self.n_keys)
        return [*range(self.n_sinks), *range(self.n_sinks + self.k0, self.n_sinks + self.n_keys)]


class BlockView(NamedTuple):
    """A query block as its observers see it (AttentionCall.view)."""

    rows: slice  # the block's queries i0 .. i1 - 1
    visible: Tensor  # bool [L_b, K_b], or [B, 1, L_b, K_b] with key padding: may query i see key j
    query_index: Tensor  # [L_b] key index i' = M + i of each query
    key_index: Tensor  # [K_b] index of each key
    # [L_b] positions the encodings read (explicit or randomized ones included)
    query_positions: Tensor
    key_positions: Tensor  # [K_b]


class StatisticsSink(Protocol):
    """Where a call hands each block's probabilities (AttentionOptions.statistics:
    diagnostics.LayerStatistics)."""

    def add(self, view: BlockView, probs: Tensor) -> None:
        """probs [B, H, L_b, K_b] over the stream's keys of the block (sinks left out)."""
