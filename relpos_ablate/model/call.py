"""One attention call as the kernels see it, and the options and shared parameters it is built from.

Notation as in attention.py: L queries, M memory keys, K = M + L keys; query i sits at key index
i' = M + i; a query block covers queries i0 .. i1 - 1.

`AttentionCall` is everything a kernel needs besides the folded queries, keys and values: which keys
each query sees (`Visibility` + key padding), where queries and keys sit (`query_positions`,
`key_positions`, read by RoPE and by a bias that depends on the query position), and the
per-distance tensors the position terms are built from (shift.py's column order). Positions are
consecutive today; randomized positions or packed examples would set the two position tensors and a
visibility rule here, and every kernel would follow without new arguments. (The per-distance
shortcuts, `rel_keys` and `distance_scores`, assume consecutive positions.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from relpos_ablate.model.position import BiasScheme
from relpos_ablate.model.shift import descending_distances, rel_shift, toeplitz

MIN_BLOCK = 16  # fewest queries in a block when long key ranges shrink the blocks


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """Options of one forward call, the same for every layer (e.g. an evaluation setting)."""

    clamp_len: int | None = None
    """Distances beyond this share R_clamp in terms b/d (None: the config's clamp_len)."""
    window: int | None = None
    """Causal only: query i' sees key j iff 0 <= i' - j < window (itself and window - 1 earlier keys).
    Transformer-XL's same_length is window = mem_len."""
    key_padding_mask: Tensor | None = None
    """[B, M + L], True at keys no query may see."""

    def __post_init__(self):
        for name in ("clamp_len", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} is out of range; use an integer >= 1 or None")


@dataclass(frozen=True, eq=False)
class SharedParameters:
    """Parameters a model shares across its layers (share_uv, share_bias); None: each layer owns its own."""

    content_bias_u: nn.Parameter | None = None
    position_bias_v: nn.Parameter | None = None
    bias_scheme: BiasScheme | None = None


@dataclass(frozen=True)
class Visibility:
    """Which keys each query sees, by index: causal (j <= i'), within the window (i' - j < W)."""

    n_mem: int
    causal: bool
    window: int | None = None

    def __call__(self, query_index: Tensor, key_index: Tensor) -> Tensor:
        """Bool, broadcast over the two index tensors (flex.py calls it with scalars as its mask_mod)."""
        distance = self.n_mem + query_index - key_index
        if not self.causal:
            return torch.ones_like(distance, dtype=torch.bool)
        seen = distance >= 0
        return seen if self.window is None else seen & (distance < self.window)


@dataclass(frozen=True)
class QueryBlock:
    """Queries i0 .. i1 - 1 against keys 0 .. n_keys - 1; rel_cols / distance_cols: the columns of
    rel_keys and distance_scores this block reads."""

    i0: int
    i1: int
    n_keys: int
    rel_cols: slice
    distance_cols: slice

    @property
    def rows(self) -> slice:
        return slice(self.i0, self.i1)


def _narrow(t: Tensor | None, dim: int, cols: slice) -> Tensor | None:
    return None if t is None else t.narrow(dim, cols.start, cols.stop - cols.start)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call (see the module docstring)."""

    visibility: Visibility
    n_queries: int  # L
    scale: float  # s: the scale of terms a-d
    query_positions: Tensor  # [L] positions the encodings read
    key_positions: Tensor  # [K]
    key_padding_mask: Tensor | None = None  # [B, K]
    rel_keys: Tensor | None = None  # [H, n, dh], n = K + L - 1: s·W_R R_d per descending distance (term b's keys)
    distance_scores: Tensor | None = None  # [H, n]: additive scores of distance alone (term d without b, a bias)
    pair_bias: BiasScheme | None = None  # a bias that also depends on the query position (FIRE)
    pair_bias_curve_until: float = float("inf")  # up to this query position pair_bias is a curve over i' - j
    bias_scale: float = 1.0  # s_B
    query_chunk: int = 0  # queries per block (0: one block)

    @property
    def n_mem(self) -> int:
        return self.visibility.n_mem

    @property
    def n_keys(self) -> int:
        return self.n_mem + self.n_queries

    @property
    def causal(self) -> bool:
        return self.visibility.causal

    @property
    def distances(self) -> Tensor:
        """[n] the distances between all queries and keys, descending (the per-distance column order)."""
        return descending_distances(self.n_mem, self.n_queries, self.n_keys, self.query_positions.device)

    def visible(self, block: QueryBlock) -> Tensor:
        """Bool [L_b, K_b], or [B, 1, L_b, K_b] with key padding: may query i see key j."""
        device = self.query_positions.device
        rows = torch.arange(block.i0, block.i1, device=device)
        seen = self.visibility(rows[:, None], torch.arange(block.n_keys, device=device)[None, :])
        if self.key_padding_mask is None:
            return seen
        return seen[None, None] & ~self.key_padding_mask[:, None, None, : block.n_keys]

    @property
    def all_queries(self) -> QueryBlock:
        return self.block(0, self.n_queries)

    def block(self, i0: int, i1: int) -> QueryBlock:
        """Queries i0 .. i1 - 1: causal ones see keys up to the last of them; the columns they read."""
        lq = i1 - i0
        n_keys = self.n_mem + i1 if self.causal else self.n_keys
        t0 = self.n_queries - i1  # column of this block's largest distance in the descending layout
        # causal: K_b + 1 columns suffice for rel_shift (the rest would only fill masked entries)
        n_rel = min(n_keys + 1, lq + n_keys - 1) if self.causal else lq + n_keys - 1
        return QueryBlock(i0, i1, n_keys, slice(t0, t0 + n_rel), slice(t0, t0 + lq + n_keys - 1))

    def blocks(self, block_scores: int) -> list[QueryBlock]:
        """Blocks of query_chunk queries, shrunk for long key ranges so that one block's score map
        stays near `block_scores` entries per head (bounded transient memory)."""
        if not self.query_chunk:
            return [self.all_queries]
        blocks, i0 = [], 0
        while i0 < self.n_queries:
            keys = self.n_mem + i0 + self.query_chunk if self.causal else self.n_keys
            i1 = min(i0 + max(MIN_BLOCK, min(self.query_chunk, block_scores // keys)), self.n_queries)
            blocks.append(self.block(i0, i1))
            i0 = i1
        return blocks

    def block_inputs(self, block: QueryBlock, q_position: Tensor | None, rel_keys: Tensor | None,
                     distance_scores: Tensor | None):
        """The block's slices (views) of the position query [B, H, L, dh], rel_keys [H, n, dh] and
        distance_scores [H, n]; None stays None."""
        return (_narrow(q_position, 2, block.rows), _narrow(rel_keys, 1, block.rel_cols),
                _narrow(distance_scores, 1, block.distance_cols))

    def additive_scores(self, block: QueryBlock, q_position: Tensor | None, rel_keys: Tensor | None,
                        distance_scores: Tensor | None) -> Tensor | None:
        """Terms b, d and the bias for the block: [B or 1, H, L_b, K_b], or None when there is none.
        The inputs are the block's slices (block_inputs), passed in so that backward can rebuild this."""
        lq, n_keys = block.i1 - block.i0, block.n_keys
        total = None
        if rel_keys is not None:
            total = rel_shift(q_position @ rel_keys.transpose(1, 2), n_keys)  # (B, H, L_b, n) -> (B, H, L_b, K_b)
        if distance_scores is not None:
            by_distance = toeplitz(distance_scores, lq, n_keys)[None]  # (1, H, L_b, K_b)
            total = by_distance if total is None else total + by_distance
        if self.pair_bias is not None:
            pair = self.pair_bias_scores(block)
            total = pair if total is None else total + pair
        return total

    def pair_bias_scores(self, block: QueryBlock) -> Tensor:
        """s_B·B_h(i', j) of the query-dependent bias: [1, H, L_b, K_b]. Where every query of the
        block is within the scheme's distance-only range, one curve over the block's L_b + K_b - 1
        distances replaces the evaluation at every (i, j) pair."""
        q_offset, lq = self.n_mem + block.i0, block.i1 - block.i0
        if q_offset + lq - 1 <= self.pair_bias_curve_until:
            distances = descending_distances(q_offset, lq, block.n_keys, self.query_positions.device)
            scores = toeplitz(self.pair_bias.curve(distances), lq, block.n_keys)
        else:
            scores = self.pair_bias.bias(self.query_positions[block.rows], self.key_positions[: block.n_keys])
        return scores[None] * self.bias_scale
