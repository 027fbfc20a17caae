"""One attention call as the kernels see it, and the options and shared parameters it is built from.

Notation as in attention.py: L queries, M memory keys, K = M + L keys; query i sits at key index
i' = M + i; a query block covers queries i0 .. i1 - 1.

`AttentionCall` is everything a kernel needs besides the folded queries, keys and values: which keys
each query sees (`Visibility` + key padding), where queries and keys sit (`query_positions`,
`key_positions`), and the per-distance tensors the position terms are built from.

Two things are kept apart on purpose:
- **Visibility is by index**: query i (key index i' = M + i) sees key j by the causal rule, the
  window and key padding, whatever positions they carry.
- **Encodings read positions**: RoPE rotates by them, every bias and terms b/d are evaluated at the
  distance q_pos - k_pos. By default positions are consecutive (query i at M + i, keys 0 .. K - 1),
  and the per-distance tensors are laid out per key by strided views (shift.py: `rel_shift`,
  `toeplitz`), the fast path. Explicit positions (`AttentionOptions.positions`: randomized
  positions, or any scheme that moves tokens) set `distance_index`: the column of every (query, key)
  pair in the per-distance tensors, which are then gathered instead (`per_key`, `term_b`). Every
  kernel reads the scores through these two methods, so a scheme that needs other positions sets
  them here and every backend follows, without new arguments.

The per-call tensors travel in one carrier, `ScoreInputs` (`AttentionCall.inputs`); the schemes that
are objects are handed to the call as such, each with its dense, point-wise and gradient forms in
its own file: FoX (`decay`: fox.ForgetGate, D_ij = Λ_i' - Λ_j from `log_decay`), CoPE (`contextual`,
scored from a block's queries and keys), a bias that reads the query position (`pair_bias`: FIRE).
`additive_terms` builds each additive term of a block and `sum_terms` adds them: the one sum every
dense path uses. A per-query multiplier of the whole score (`query_scale`: log-n, a learned
temperature), and learned sink slots at the front of the kernels' keys (`n_sinks`: `with_sinks` pads
a block's mask and scores). A block may skip the keys before its window (`block(...,
windowed=True)`, `QueryBlock.k0`).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from relpos_ablate.model.kernels.geometry import (
    BlockView,
    ContextualScores,
    DecayScores,
    QueryBlock,
    StatisticsSink,
    Visibility,
)
from relpos_ablate.model.kernels.shift import descending_distances, rel_shift, toeplitz
from relpos_ablate.model.position import BiasScheme, RopeScaling

MIN_BLOCK = 16  # fewest queries in a block when long key ranges shrink the blocks


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """Options of one forward call (e.g. an evaluation setting); randomized draws differ by
    layer."""

    clamp_len: int | None = None
    """Distances beyond this share R_clamp in terms b/d (None: the config's clamp_len)."""
    window: int | None = None
    """Causal only: query i' sees key j iff 0 <= i' - j < window (itself and window - 1 earlier
    keys). Transformer-XL's same_length is window = mem_len."""
    key_padding_mask: Tensor | None = None
    """[B, M + L], True at keys no query may see."""
    positions: Tensor | None = None
    """[M + L] positions of the keys (memory first, then this segment; the queries are the last L),
    shared by the batch, as the encodings read them: RoPE's angles, every bias and terms b/d at the
    distance q_pos - k_pos. Visibility stays by index. None: consecutive, 0 .. M + L - 1."""
    distances: Tensor | None = None
    """[M + L] d_0 .. d_(M+L-1): the distance the relative encodings (every bias, terms b/d, Shaw's
    tables) read at key-index offset r = i' - j, d_r for r >= 0 and -d_(-r) for r < 0 (Ruoss et
    al.'s randomized relative encodings draw them); the per-distance tensors keep their strided
    layout. RoPE and the absolute tables still read `positions`. None: the distance of the
    positions."""
    statistics: StatisticsSink | None = None
    """Where this call adds its attention statistics (entropy, sink mass, distances:
    diagnostics.py); the probabilities are then computed per query block (no fused kernel). None: no
    statistics."""
    rope_scaling: RopeScaling | None = None
    """RoPE extended to a longer context (position interpolation, NTK, YaRN; an evaluation setting's
    rope_scaling). None: the trained frequencies."""

    def __post_init__(self):
        for name in ("clamp_len", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} is out of range; use an integer >= 1 or None")


@dataclass(frozen=True, eq=False)
class SharedParameters:
    """Parameters a model shares across its layers (share_uv, share_bias); None: each layer owns its
    own."""

    content_bias_u: nn.Parameter | None = None
    position_bias_v: nn.Parameter | None = None
    bias_scheme: BiasScheme | None = None


class ScoreInputs(NamedTuple):
    """The one carrier of a call's per-call tensors: what its additive terms are built from (None:
    not used by this call). The call holds them (`AttentionCall.inputs`) and every kernel reads them
    from here; the block kernel passes them to autograd explicitly, so that its backward can rebuild
    a block's map and differentiate it."""

    # [B, H, L, dh] term b's query: (q + v)·λ on the kernels, q·λ on the explicit path
    q_position: Tensor | None = None
    rel_keys: Tensor | None = None  # [H, n, dh] s·W_R R_d per distance (term b's keys)
    # [H, n] s·v·W_R R_d where term d is its own term (explicit path; kernels fold it)
    term_d: Tensor | None = None
    # [H, n] scores of distance alone (the bias; the kernels add term d without b)
    distance_scores: Tensor | None = None
    log_decay: Tensor | None = None  # [B, H, K] FoX's Λ_j = Σ_{l<=j} log f_l, float64
    # [B or 1, H or 1, L, 1] λ: temperature × log_{L_train}(n) per query
    query_scale: Tensor | None = None


def _narrow(t: Tensor | None, dim: int, cols: slice) -> Tensor | None:
    return None if t is None else t.narrow(dim, cols.start, cols.stop - cols.start)


def place(
    visibility: Visibility,
    n_queries: int,
    positions: Tensor | None,
    device,
    distances: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """Where the queries and keys of a call sit, and the distances its per-distance tensors list.

    Consecutive positions (None): keys 0 .. K - 1, queries M .. K - 1, the K + L - 1 distances in
    shift.py's descending order, no index (strided views lay them out). Explicit positions [K]: the
    distances q_pos - k_pos of the visible pairs, from the largest to the smallest, and
    distance_index [L, K], the column of each pair (pairs no query sees are clamped into range: the
    mask hides them). Reading the range costs one host sync per call. Explicit distances [K]
    (AttentionOptions.distances): the descending offsets of the consecutive layout, each read as its
    drawn distance, so the strided views still lay them out; positions, if given, only place
    RoPE."""
    n_keys = visibility.n_mem + n_queries
    if distances is not None:
        if distances.shape != (n_keys,):
            raise ValueError(
                f"distances: expected [M + L] = [{n_keys}] distances d_0 .. d_(M+L-1), "
                f"got {list(distances.shape)}"
            )
        keys = (
            torch.arange(n_keys, device=device)
            if positions is None
            else _checked(positions, n_keys, device)
        )
        offsets = descending_distances(visibility.n_mem, n_queries, n_keys, device)
        drawn = distances.to(device=device, dtype=torch.long)[offsets.abs()] * offsets.sign()
        return dict(
            query_positions=keys[visibility.n_mem :],
            key_positions=keys,
            distances=drawn,
            distance_index=None,
            drawn_distances=True,
        )
    if positions is None:
        consecutive = torch.arange(n_keys, device=device)
        return dict(
            query_positions=consecutive[visibility.n_mem :],
            key_positions=consecutive,
            distances=descending_distances(visibility.n_mem, n_queries, n_keys, device),
            distance_index=None,
        )
    positions = _checked(positions, n_keys, device)
    query_positions = positions[visibility.n_mem :]
    pair_distances = query_positions[:, None] - positions[None, :]  # (L, K)
    seen = visibility(
        torch.arange(n_queries, device=device)[:, None],
        torch.arange(n_keys, device=device)[None, :],
    )
    smallest, largest = (int(d) for d in torch.aminmax(pair_distances[seen]))
    return dict(
        query_positions=query_positions,
        key_positions=positions,
        distances=torch.arange(largest, smallest - 1, -1, device=device),
        distance_index=(largest - pair_distances).clamp(0, largest - smallest),
    )


def _checked(positions: Tensor, n_keys: int, device) -> Tensor:
    if positions.shape != (n_keys,):
        raise ValueError(
            f"positions: expected [M + L] = [{n_keys}] key positions shared by the batch, "
            f"got {list(positions.shape)}"
        )
    return positions.to(device=device, dtype=torch.long)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call (see the module docstring)."""

    visibility: Visibility
    n_queries: int  # L
    scale: float  # s: the scale of terms a-d
    query_positions: Tensor  # [L] positions the encodings read
    key_positions: Tensor  # [K]
    # [n] the distances the per-distance tensors list, descending (their column order)
    distances: Tensor
    # [L, K] column of each pair; None: consecutive positions (strided views)
    distance_index: Tensor | None = None
    # distances are drawn per offset (AttentionOptions.distances), not the positions'
    drawn_distances: bool = False
    key_padding_mask: Tensor | None = None  # [B, K]
    query_chunk: int = 0  # queries per block (0: one block)
    # learned sink slots at the front of the kernels' keys and values (no position)
    n_sinks: int = 0
    dtype: torch.dtype = torch.float32  # the kernels' dtype (FoX's decay is built in at least fp32)
    # the per-call tensors (term b's query left out until a kernel adds it)
    inputs: ScoreInputs = ScoreInputs()
    # the score terms that are objects, each in its scheme's file with its dense, point-wise and
    # gradient forms
    pair_bias: BiasScheme | None = None  # a bias that also depends on the query position (FIRE)
    # below this query position pair_bias is a curve over i' - j
    pair_bias_curve_until: float = float("inf")
    bias_scale: float = 1.0  # s_B
    # [H] s_B·m_h where inputs.distance_scores is -s_B·m_h·(i' - j) (ALiBi, causal)
    linear_bias: Tensor | None = None
    decay: DecayScores | None = None  # FoX (fox.py): D_ij = Λ_i' - Λ_j from inputs.log_decay
    # CoPE (cope.py): scores from the block's queries and keys
    contextual: ContextualScores | None = None
    # every per-distance input is the same at each distance >= saturation (a clamp of R, the bias's
    # last bucket); None: no such distance. far_from: the band kernel's call (band.py), the pairs at
    # i' - j >= far_from left to the causal flash kernel on s·q·kᵀ alone, the window far_from the
    # band's
    saturation: int | None = None
    far_from: int | None = None

    # the carrier's tensors by name (read-only)
    rel_keys = property(lambda self: self.inputs.rel_keys)
    distance_scores = property(lambda self: self.inputs.distance_scores)
    log_decay = property(lambda self: self.inputs.log_decay)
    query_scale = property(lambda self: self.inputs.query_scale)

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
    def consecutive(self) -> bool:
        """Positions 0 .. K - 1: the per-distance tensors are laid out per key by strided views."""
        return self.distance_index is None

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole stream at consecutive positions, and every additive term a function
        of distances or keys alone: no drawn distances, window, key padding, sinks, query-dependent
        bias, CoPE, query scale or term d of its own (what the low-rank and band kernels need beside
        their own terms)."""
        inputs = self.inputs
        return (
            self.causal
            and self.consecutive
            and not self.drawn_distances
            and self.visibility.window is None
            and self.key_padding_mask is None
            and not self.n_sinks
            and self.pair_bias is None
            and self.contextual is None
            and inputs.query_scale is None
            and inputs.term_d is None
        )

    @property
    def has_additive(self) -> bool:
        """Whether anything is added to s·q_content·kᵀ (otherwise plain SDPA can do it all)."""
        return any(
            t is not None
            for t in (
                self.rel_keys,
                self.inputs.term_d,
                self.distance_scores,
                self.pair_bias,
                self.log_decay,
                self.contextual,
            )
        )

    def hidden_distances(self, like: Tensor) -> Tensor:
        """[n] additive mask per distance of the call, 0 where a key at that distance is visible and
        -inf where not, in like's dtype and device: with consecutive positions visibility is a
        function of the distance."""
        hidden = ~self.visibility.at_distance(self.distances)
        return torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(
            hidden, float("-inf")
        )

    def visible(self, block: QueryBlock) -> Tensor:
        """Bool [L_b, K_b], or [B, 1, L_b, K_b] with key padding: may query i see key j (sinks not
        included)."""
        device = self.query_positions.device
        rows = torch.arange(block.i0, block.i1, device=device)
        seen = self.visibility(
            rows[:, None], torch.arange(block.k0, block.n_keys, device=device)[None, :]
        )
        if self.key_padding_mask is None:
            return seen
        return seen[None, None] & ~self.key_padding_mask[:, None, None, block.k0 : block.n_keys]

    def causal_diagonal(self, block: QueryBlock) -> int | None:
        """d where the block's visibility is causal without key padding: row r sees no key past
        column r + d, and every other key it does not see lies before its window (None
        otherwise)."""
        if not self.visibility.causal or self.key_padding_mask is not None:
            return None
        return self.n_mem + block.i0 - block.k0

    def view(self, block: QueryBlock) -> BlockView:
        """What the statistics read of a block: who sees whom, key indices and positions
        (geometry.py)."""
        device = self.query_positions.device
        return BlockView(
            block.rows,
            self.visible(block),
            torch.arange(self.n_mem + block.i0, self.n_mem + block.i1, device=device),
            torch.arange(block.k0, block.n_keys, device=device),
            self.query_positions[block.rows],
            self.key_positions[block.k0 : block.n_keys],
        )

    def with_sinks(self, block_map: Tensor, fill: float | bool) -> Tensor:
        """A block's [..., L_b, K_b] mask or scores with the sink columns in front, filled with
        `fill` (visible: True; additive scores: 0, sinks carry no position): [..., L_b, S + K_b]."""
        if not self.n_sinks:
            return block_map
        front = block_map.new_full((*block_map.shape[:-1], self.n_sinks), fill)
        return torch.cat([front, block_map], dim=-1)

    @property
    def all_queries(self) -> QueryBlock:
        return self.block(0, self.n_queries)

    def block(
        self, i0: int, i1: int, windowed: bool = False, whole_rows: bool = False
    ) -> QueryBlock:
        """Queries i0 .. i1 - 1: causal ones see keys up to the last of them, and `windowed`, none
        before the window of the first of them; `whole_rows`: every key of the call; the columns
        they read."""
        window = self.visibility.window
        n_keys = self.n_mem + i1 if self.causal and not whole_rows else self.n_keys
        k0 = (
            max(0, self.n_mem + i0 - window + 1)
            if windowed and self.causal and window is not None
            else 0
        )
        return self._block(i0, i1, k0, n_keys)

    def _block(self, i0: int, i1: int, k0: int, n_keys: int) -> QueryBlock:
        """Queries i0 .. i1 - 1 against keys k0 .. n_keys - 1, with the per-distance columns they
        read."""
        lq, width = i1 - i0, n_keys - k0
        if not self.consecutive:  # distance_index picks the columns: every block reads them all
            every = slice(0, self.distances.numel())
            return QueryBlock(i0, i1, n_keys, every, every, self.n_sinks, k0)
        # column of this block's largest distance in the descending layout
        t0 = self.n_queries - i1 + k0
        # causal up to the block's last query: K_b + 1 columns suffice for rel_shift (the rest would
        # only fill masked entries); a tile of keys before the diagonal sees every entry
        diagonal = self.causal and n_keys == self.n_mem + i1
        n_rel = min(width + 1, lq + width - 1) if diagonal else lq + width - 1
        return QueryBlock(
            i0, i1, n_keys, slice(t0, t0 + n_rel), slice(t0, t0 + lq + width - 1), self.n_sinks, k0
        )

    def blocks(
        self, block_scores: int, windowed: bool = False, rows: int | None = None
    ) -> list[QueryBlock]:
        """Blocks of query_chunk queries, shrunk for long key ranges so that one block's score map
        stays near `block_scores` entries per head (bounded transient memory), or of `rows` queries
        (at most query_chunk) whatever their keys. Term b at explicit positions gathers a
        d_head-wide key per pair, so its blocks hold d_head times fewer pairs. `windowed`: each
        block skips the keys before its window (O(L·W) work for a window W)."""
        if not self.query_chunk:
            return [self.block(0, self.n_queries, windowed)]
        if self.rel_keys is not None and not self.consecutive:
            block_scores //= self.rel_keys.shape[-1]
        window = self.visibility.window if windowed else None
        blocks, i0 = [], 0
        while i0 < self.n_queries:
            keys = self.n_mem + i0 + self.query_chunk if self.causal else self.n_keys
            if window is not None:
                keys = min(keys, window + self.query_chunk)
            size = rows or max(MIN_BLOCK, block_scores // keys)
            if window is not None and not rows:  # n rows read at most n + W - 1 keys
                size = max(size, _rows_within(block_scores, window))
            i1 = min(i0 + min(self.query_chunk, size), self.n_queries)
            blocks.append(self.block(i0, i1, windowed))
            i0 = i1
        return blocks

    def key_tiles(self, block: QueryBlock, width: int) -> list[QueryBlock]:
        """The block's keys in tiles of `width` or more (as even as they come), each a QueryBlock of
        the same queries; no sinks (consecutive positions only). With width >= the block's queries
        every query sees a key of every tile: causal rows see the last tile's first key, windowed
        rows the first tile's last one."""
        n_tiles = max(1, block.width // width)
        edges = [block.k0 + block.width * t // n_tiles for t in range(n_tiles + 1)]
        return [self._block(block.i0, block.i1, a, b) for a, b in zip(edges, edges[1:])]

    def aligned_key_tiles(self, block: QueryBlock, width: int) -> list[QueryBlock]:
        """The block's keys cut at the multiples of `width` (key indices; no sinks): the tiles of
        blocks that share keys line up, so that a tile's key gradients can be summed over the blocks
        in one buffer."""
        edges = [
            block.k0,
            *range((block.k0 // width + 1) * width, block.n_keys, width),
            block.n_keys,
        ]
        return [self._block(block.i0, block.i1, a, b) for a, b in zip(edges, edges[1:])]

    def score_inputs(self, q_position: Tensor | None) -> ScoreInputs:
        """This call's per-call tensors with the kernels' position query (term b's keys only with
        it)."""
        return self.inputs._replace(
            q_position=q_position, rel_keys=self.rel_keys if q_position is not None else None
        )

    def block_inputs(self, block: QueryBlock, inputs: ScoreInputs) -> ScoreInputs:
        """The block's slices (views) of each input; None stays None."""
        return ScoreInputs(
            _narrow(inputs.q_position, 2, block.rows),
            _narrow(inputs.rel_keys, 1, block.rel_cols),
            _narrow(inputs.term_d, 1, block.distance_cols),
            _narrow(inputs.distance_scores, 1, block.distance_cols),
            _narrow(inputs.log_decay, 2, slice(0, max(block.n_keys, self.n_mem + block.i1))),
            _narrow(inputs.query_scale, 2, block.rows),
        )

    def additive_terms(
        self,
        block: QueryBlock,
        inputs: ScoreInputs,
        q_content: Tensor | None = None,
        k: Tensor | None = None,
        pair_bias: bool = True,
    ) -> dict[str, Tensor]:
        """Each additive score term of the block as it enters the sum, [B or 1, H, L_b, K_b]: 'b'
        (from the position query, which carries the query scale λ already), 'd' and 'bias' (per
        distance, or FIRE per pair) and 'decay' (FoX), each times λ, and 'cope' (from the content
        query, λ included). `inputs` are the block's slices (block_inputs), passed in so that
        backward can rebuild them; q_content [B, H, L_b, dh] and k [B, H, K_b, dh] (no sinks) only
        for CoPE (without them, no 'cope'); without `pair_bias`, no query-dependent bias (its caller
        adds it: block_maps.MaterialisedMaps)."""
        terms = {}
        if inputs.rel_keys is not None and inputs.q_position is not None:
            terms["b"] = self.term_b(block, inputs.q_position, inputs.rel_keys)
        if inputs.term_d is not None:
            terms["d"] = self.per_key(block, inputs.term_d)[None]
        if inputs.distance_scores is not None:
            terms["bias"] = self.per_key(block, inputs.distance_scores)[None]
        # (the bias is a curve or a pair bias, never both)
        elif self.pair_bias is not None and pair_bias:
            terms["bias"] = self.pair_bias_scores(block)
        if inputs.log_decay is not None:
            rows = slice(self.n_mem + block.i0, self.n_mem + block.i1)
            terms["decay"] = self.decay.block_scores(
                inputs.log_decay,
                rows,
                slice(block.k0, block.n_keys),
                torch.promote_types(self.dtype, torch.float32),
            )
        if inputs.query_scale is not None:
            terms = {
                name: t if name == "b" else t * inputs.query_scale for name, t in terms.items()
            }
        if self.contextual is not None and q_content is not None:
            terms["cope"] = self.contextual.scores(q_content, k, self.scale, self.visible(block))
        return terms

    def per_key(self, block: QueryBlock, values: Tensor) -> Tensor:
        """[..., n] values per distance (the block's columns, block_inputs) -> [..., L_b, K_b]: the
        value at each (query, key) pair's distance."""
        if self.consecutive:
            return toeplitz(values, block.i1 - block.i0, block.width)
        return values[..., self.distance_index[block.rows, block.k0 : block.n_keys]]

    def term_b(self, block: QueryBlock, q_position: Tensor, rel_keys: Tensor) -> Tensor:
        """(q + v)·s·W_R R at each pair's distance: q_position [B, H, L_b, dh] and rel_keys [H, n,
        dh] (the block's columns) -> [B, H, L_b, K_b]."""
        if self.consecutive:  # one product per distance, laid out per key by a strided view
            # (B, H, L_b, n) -> (B, H, L_b, K_b)
            return rel_shift(q_position @ rel_keys.transpose(1, 2), block.width)
        # (H, L_b, K_b, dh)
        pairs = rel_keys[:, self.distance_index[block.rows, block.k0 : block.n_keys]]
        return torch.einsum("bhld,hlkd->bhlk", q_position, pairs)

    def pair_bias_scores(self, block: QueryBlock) -> Tensor:
        """s_B·B_h(i', j) of the query-dependent bias: [1, H, L_b, K_b]. Where positions are
        consecutive and every query of the block is within the scheme's distance-only range, one
        curve over the block's L_b + K_b - 1 distances replaces the evaluation at every (i, j)
        pair."""
        if self.pair_bias_on_curve(block):
            # the block's queries against keys k0 .. are the same distances as from q_offset - k0
            # against 0 ..
            q_offset, lq = self.n_mem + block.i0, block.i1 - block.i0
            distances = descending_distances(
                q_offset - block.k0, lq, block.width, self.query_positions.device
            )
            scores = toeplitz(self.pair_bias.curve(distances), lq, block.width)
        else:
            scores = self.pair_bias.bias(
                self.query_positions[block.rows], self.key_positions[block.k0 : block.n_keys]
            )
        return scores[None] * self.bias_scale

    def pair_bias_on_curve(self, block: QueryBlock) -> bool:
        """Whether the query-dependent bias is a curve over the distance for every query of the
        block."""
        last_query = self.n_mem + block.i1 - 1
        # (strictly: see attention.py)
        return self.consecutive and last_query < self.pair_bias_curve_until


def _rows_within(block_scores: int, window: int) -> int:
    """The most rows n whose windowed block, n x (n + W - 1), holds at most block_scores entries."""
    n = int((math.sqrt((window - 1) ** 2 + 4 * block_scores) - (window - 1)) / 2)
    while n * (n + window - 1) > block_scores:  # (the square root's rounding)
        n -= 1
    return n


def sum_terms(terms: dict[str, Tensor]) -> Tensor | None:
    """The score map: the terms summed in their order (None: no term). The one sum of the package's
    score terms; every backend but FlexAttention's point-wise twin (flex.py) and the strided
    per-distance layout (block_maps.StridedMaps: term b and the curves added per distance, before
    the layout) reaches it."""
    return functools.reduce(operator.add, terms.values()) if terms else None
