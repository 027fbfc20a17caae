"""Learned tables indexed by distance: their rows (also term b/d's R table and Shaw's value table),
the Transformer-XL-style clamped bias table and T5 buckets."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.bias import BiasScheme


def table_rows(max_distance: int, causal: bool) -> int:
    """Rows of a learned table with one row per distance up to max_distance: causal attention never
    sees a negative distance (0 .. max_distance), bidirectional sees both signs."""
    return max_distance + 1 if causal else 2 * max_distance + 1


def table_row(distances: Tensor, clamp: int, max_distance: int, causal: bool) -> Tensor:
    """Row of that table for each distance, distances beyond clamp (<= max_distance) sharing clamp's
    row."""
    return distances.clamp(0, clamp) if causal else distances.clamp(-clamp, clamp) + max_distance


class XLTableBias(BiasScheme):
    """A learned scalar per head and clamped distance: B_h(i, j) = T[clamp(i - j, -K, K), h].

    Causal attention never sees negative distances, so its table has K + 1 rows (0..K); distances
    beyond K share row K (evaluation beyond the training length never indexes out of range).
    """

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        self.max_distance = config.max_distance
        rows = self.max_distance + 1 if self.causal else 2 * self.max_distance + 1
        # (rows, H)
        self.table = nn.Parameter(nn.init.trunc_normal_(torch.empty(rows, n_heads), std=0.02))

    def row_index(self, distances: Tensor) -> Tensor:
        return table_row(distances, self.max_distance, self.max_distance, self.causal)

    def curve(self, distances):
        return self.table[self.row_index(distances)].T  # (H, n)

    def saturation(self):
        return self.max_distance if self.causal else None

    def boundaries(self):
        return [float(self.max_distance)] + ([] if self.causal else [-float(self.max_distance)])


def t5_bucket(distances: Tensor, causal: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's relative-position bucket for distances i - j (T5 itself is written for j - i).

    Bidirectional: half the buckets for keys after the query. Within a half, the first half of the
    buckets are exact distances, the rest grow logarithmically up to max_distance and then saturate.
    """
    rp = -distances  # T5's relative_position = key - query
    if causal:
        n = (-rp).clamp(min=0)
        offset = torch.zeros_like(n)
    else:
        num_buckets //= 2
        offset = (rp > 0).long() * num_buckets
        n = rp.abs()
    max_exact = num_buckets // 2
    log_ratio = torch.log(n.clamp(min=1).double() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return offset + torch.where(n < max_exact, n, large)


class T5Bias(BiasScheme):
    """T5 bucketed bias: B_h(i, j) = E[bucket(i - j), h] (Raffel et al. 2020)."""

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        self.num_buckets = config.num_buckets
        self.max_distance = config.max_distance
        self.table = nn.Parameter(torch.randn(self.num_buckets, n_heads) * 0.02)  # (buckets, H)
        # a number of the config, found once here: where every forward asks, torch.compile would
        # break its graph at far_bucket_start's data-dependent indexing
        far = far_bucket_start(self.num_buckets, self.max_distance)
        self._saturation = far if self.causal else None

    def saturation(self):
        return self._saturation

    def curve(self, distances):
        return self.table[t5_bucket(distances, self.causal, self.num_buckets, self.max_distance)].T

    def boundaries(self):
        """Distances where a logarithmic bucket starts, the first of them where the exact buckets
        (one distance each, which a plot need not mark one by one) end (one side; mirrored when
        bidirectional)."""
        buckets = self.num_buckets if self.causal else self.num_buckets // 2
        d = torch.arange(0, 2 * self.max_distance + 1)
        b = t5_bucket(d, True, buckets, self.max_distance)
        edges = [float(x) for x in d[1:][b[1:] != b[:-1]] if x >= buckets // 2]
        return edges + ([] if self.causal else [-e for e in edges])


def far_bucket_start(num_buckets: int, max_distance: int) -> int:
    """The smallest distance in T5's last (far) causal bucket, by t5_bucket itself: every longer
    distance shares it, so a model whose training distances stop below it never trains it."""
    distances = torch.arange(0, 2 * max_distance + num_buckets + 1)
    buckets = t5_bucket(distances, True, num_buckets, max_distance)
    return int(distances[buckets == num_buckets - 1][0])
