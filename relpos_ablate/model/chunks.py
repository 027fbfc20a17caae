"""Chunked attention (Llama 4's attention_chunk_size; `attention.chunk`): the segment's L queries
are cut into chunks of C tokens from its first token, and a query sees only the keys of its own
chunk up to itself. Memory keys lie in earlier chunks, so a chunked layer sees none.

A causal query never sees a later key, and every encoding here reads distances only (config.model
refuses chunks with FIRE's query position and randomized positions), so each chunk is an attention
call of its own at positions 0 .. C - 1: the chunks become rows of the batch, [B, L] -> [B·n, C],
and every kernel runs them as it runs any call, in O(L·C). The last chunk is padded at its end;
causal queries never see the padding, and its own rows are cut off again. Positions that depend on
where the query is (Llama 4's temperature) are computed for the whole segment first and split with
it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.diagnostics import AttentionStatistics, LayerStatistics
from relpos_ablate.model.kernels.call import AttentionOptions


@dataclass(frozen=True)
class Chunks:
    """L queries after M memory keys, cut into n chunks of `size`."""

    size: int  # C
    n_queries: int  # L
    n_mem: int  # M

    @property
    def count(self) -> int:
        """n = ceil(L / C)."""
        return math.ceil(self.n_queries / self.size)

    @property
    def padding(self) -> int:
        return self.count * self.size - self.n_queries

    def split(self, t: Tensor, fill: float | bool = 0) -> Tensor:
        """[B, L, ...] -> [B·n, C, ...], the last chunk padded with `fill`."""
        pad = [0, 0] * (t.dim() - 2) + [0, self.padding]
        padded = F.pad(t, pad, value=fill) if self.padding else t
        return padded.reshape(t.shape[0] * self.count, self.size, *t.shape[2:])  # (B·n, C, ...)

    def merge(self, t: Tensor) -> Tensor:
        """[B·n, C, ...] -> [B, L, ...]."""
        b = t.shape[0] // self.count
        # (B, n·C, ...) -> (B, L, ...)
        return t.reshape(b, self.count * self.size, *t.shape[2:])[:, : self.n_queries]

    def query_positions(self, x: Tensor) -> Tensor:
        """[B·n, C]: where the queries of x [B, L, ...] sit in the whole call (M .. M + L - 1),
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
            # (B, M + L) -> (B·n, C): memory is not seen
            padding = self.split(padding[:, self.n_mem :], fill=True)
        statistics = options.statistics
        if statistics is not None:
            target = statistics.target
            # (B, L) -> (B·n, C): padded queries weigh 0
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
        """[B·n, ..., C, C] per chunk -> [B, ..., L, M + L]: each chunk's block on the diagonal,
        `fill` elsewhere (memory columns and other chunks' keys)."""
        b = maps.shape[0] // self.count
        per_chunk = maps.reshape(b, self.count, *maps.shape[1:])  # (B, n, ..., C, C)
        out = maps.new_full(
            (b, *maps.shape[1:-2], self.n_queries, self.n_mem + self.n_queries), fill
        )
        for k in range(self.count):
            rows = min(self.size, self.n_queries - k * self.size)
            start = k * self.size
            out[..., start : start + rows, self.n_mem + start : self.n_mem + start + rows] = (
                per_chunk[:, k, ..., :rows, :rows]
            )
        return out
