"""Chunked attention (Llama 4's attention_chunk_size; `attention.chunk`): the segment's L queries
are cut into chunks of C tokens from its first token, and a query sees only the keys of its own
chunk up to itself. Memory keys lie in earlier chunks, so a chunked layer sees none.

A causal query never sees a later key, and every encoding here reads distances only (config.model
refuses chunks with FIRE's query position and randomized positions), so each chunk is an attention
call of its own at positions 0 .. C - 1: the chunks become rows of the batch, [B, L] -> [B·n, W],
and every kernel runs them as it runs any call, in O(L·W). A row is W = min(C, L) tokens wide: a
chunk at least as long as the segment is one row of the L tokens present, full attention's cost
whatever C (Llama 4's 8192 on a 32-token segment is one call of 32 per sequence), never padded to
C. Shorter chunks are rows of C, the last padded at its end; causal queries never see the padding,
and its own rows are cut off again. Positions that depend on where the query is (Llama 4's
temperature) are computed for the whole segment first and split with it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.diagnostics import AttentionStatistics, LayerStatistics


@dataclass(frozen=True)
class Chunks:
    """L queries after M memory keys, cut into n chunks of `size`, each a row of `width` tokens."""

    size: int  # C
    n_queries: int  # L
    n_mem: int  # M

    @property
    def width(self) -> int:
        """W = min(C, L) (at least 1): the tokens of a row. A chunk that holds the whole segment is
        as wide as the segment, not padded to C."""
        return max(1, min(self.size, self.n_queries))

    @property
    def count(self) -> int:
        """n = ceil(L / W) = ceil(L / C)."""
        return math.ceil(self.n_queries / self.width)

    @property
    def padding(self) -> int:
        """n·W - L: at most C - 1 tokens, only where C < L (the last chunk's)."""
        return self.count * self.width - self.n_queries

    def split(self, t: Tensor, fill: float | bool = 0) -> Tensor:
        """[B, L, ...] -> [B·n, W, ...], the last chunk padded with `fill`."""
        pad = [0, 0] * (t.dim() - 2) + [0, self.padding]
        padded = F.pad(t, pad, value=fill) if self.padding else t
        return padded.reshape(t.shape[0] * self.count, self.width, *t.shape[2:])  # (B·n, W, ...)

    def merge(self, t: Tensor) -> Tensor:
        """[B·n, W, ...] -> [B, L, ...]."""
        b = t.shape[0] // self.count
        # (B, n·W, ...) -> (B, L, ...)
        return t.reshape(b, self.count * self.width, *t.shape[2:])[:, : self.n_queries]

    def query_positions(self, x: Tensor) -> Tensor:
        """[B·n, W]: where the queries of x [B, L, ...] sit in the whole call (M .. M + L - 1),
        split like them: what temperature tuning reads."""
        at = torch.arange(self.n_mem, self.n_mem + self.n_queries, device=x.device)
        return self.split(at.expand(x.shape[0], -1))

    def options(self, options: AttentionOptions) -> AttentionOptions:
        """The chunks' options: key padding and the statistics' query weights split like the
        queries."""
        if options.positions is not None or options.distances is not None:
            raise ValueError(
                "chunk: a chunked layer computes every chunk at the positions of the first; "
                "explicit positions or distances cannot apply (evaluate it with consecutive "
                "positions)"
            )
        padding = options.key_padding_mask
        if padding is not None:
            # (B, M + L) -> (B·n, W): memory is not seen
            padding = self.split(padding[:, self.n_mem :], fill=True)
        statistics = options.statistics
        if statistics is not None:
            target = statistics.target
            # (B, L) -> (B·n, W): padded queries weigh 0
            weights = self.split(target.query_weight, fill=0)
            chunked = AttentionStatistics(
                target.sums.shape[1],
                target.sums.shape[2],
                weights,
                target.max_seen_distance,
                sums=target.sums,
            )
            statistics = LayerStatistics(chunked, statistics.layer)
        return dataclasses.replace(options, key_padding_mask=padding, statistics=statistics)

    def scatter(self, maps: Tensor, fill: float | bool = 0) -> Tensor:
        """[B·n, ..., W, W] per chunk -> [B, ..., L, M + L]: each chunk's block on the diagonal,
        `fill` elsewhere (memory columns and other chunks' keys)."""
        b = maps.shape[0] // self.count
        per_chunk = maps.reshape(b, self.count, *maps.shape[1:])  # (B, n, ..., W, W)
        out = maps.new_full(
            (b, *maps.shape[1:-2], self.n_queries, self.n_mem + self.n_queries), fill
        )
        for k in range(self.count):
            rows = min(self.width, self.n_queries - k * self.width)
            start = k * self.width
            out[..., start : start + rows, self.n_mem + start : self.n_mem + start + rows] = (
                per_chunk[:, k, ..., :rows, :rows]
            )
        return out
