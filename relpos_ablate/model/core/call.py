"""One attention call as the kernels see it: its geometry and its terms.

Notation as in attention.py: L queries, M memory keys, K = M + L keys; query i sits at key index
i' = M + i; a query block covers queries i0 .. i1 - 1.

`AttentionCall` is everything a kernel needs besides the folded queries, keys and values: which
keys each query sees (`Visibility` + key padding), where queries and keys sit (`Placement`:
placement.py, which says why visibility stays by index while encodings read positions), the
per-distance tensors of Transformer-XL's terms b and d and of a bias of distance alone
(`ScoreInputs`), and every other scheme as a score term with all of its forms in its own file
(`terms`: core/terms.py). `additive_terms` builds each additive term of a block and `sum_terms`
adds them: the one sum every dense path uses; `per_key` and `term_b` lay the per-distance tensors
out per key (strided views at consecutive positions, gathered at explicit ones), so a scheme that
moves tokens sets positions and every backend follows. A per-query multiplier of the whole score
(`query_scale`), learned sink slots in front of the kernels' keys (`n_sinks`, `with_sinks`), and
blocks that skip the keys before their window (`block(..., windowed=True)`, `QueryBlock.k0`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from relpos_ablate import planner
from relpos_ablate.model.core.geometry import (
    BlockView,
    QueryBlock,
    Visibility,
    per_row,
    rows_within,
)
from relpos_ablate.model.core.placement import Placement
from relpos_ablate.model.core.shift import rel_shift, toeplitz
from relpos_ablate.model.core.terms import ScoreTerm

MIN_BLOCK = 16  # fewest queries in a block when long key ranges shrink the blocks


class ScoreInputs(NamedTuple):
    """The per-call tensors of terms b and d and of a bias of distance alone (None: not used by
    this call). The call holds them (`AttentionCall.inputs`) and every kernel reads them from here;
    the block kernel passes them to autograd explicitly, so that its backward can rebuild a block's
    map and differentiate it."""

    # [B, H, L, dh] term b's query: (q + v)·λ on the kernels, q·λ on the explicit path
    q_position: Tensor | None = None
    rel_keys: Tensor | None = None  # [H, n, dh] s·W_R R_d per distance (term b's keys)
    # [H, n] s·v·W_R R_d where term d is its own term (explicit path; kernels fold it)
    term_d: Tensor | None = None
    # [H, n] scores of distance alone (the bias; the kernels add term d without b)
    distance_scores: Tensor | None = None
    # [H] m_h where distance_scores is -m_h·(i' - j) on causal pairs (a key offset: low_rank.py)
    distance_slope: Tensor | None = None
    # [B or 1, H or 1, L, 1] λ: temperature × log_{L_train}(n) per query
    query_scale: Tensor | None = None


def _narrow(t: Tensor | None, dim: int, cols: slice) -> Tensor | None:
    return None if t is None else t.narrow(dim, cols.start, cols.stop - cols.start)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call: its geometry and its terms (see the module docstring)."""

    visibility: Visibility
    n_queries: int  # L
    placement: Placement
    scale: float  # s: the scale of terms a-d
    dtype: torch.dtype = torch.float32  # the kernels' dtype (a term may keep its own, e.g. float64)
    # learned sink slots at the front of the kernels' keys and values (no position)
    n_sinks: int = 0
    query_chunk: int = 0  # queries per block (0: one block)
    # the per-call tensors of terms b, d and the distance curve (term b's query: added by a kernel)
    inputs: ScoreInputs = ScoreInputs()
    # every other additive term, each in its scheme's file with all of its forms (core/terms.py)
    terms: tuple[ScoreTerm, ...] = ()
    # (head, |i - j|) -> the distance scores in closed form (BiasScheme.point_curve), or None
    distance_point: Callable[[Tensor, Tensor], Tensor] | None = None
    # every per-distance input is the same at each distance >= saturation (a clamp of R, the bias's
    # last bucket; a term's band width), else None; far_from: the band kernel's call (band.py), the
    # pairs at i' - j >= far_from left to the causal flash kernel on s·q·kᵀ alone
    band: tuple[int | None, int | None] = (None, None)

    # the placement's and the carrier's tensors by name (read-only)
    query_positions = property(lambda self: self.placement.query_positions)
    key_positions = property(lambda self: self.placement.key_positions)
    distances = property(lambda self: self.placement.distances)
    distance_index = property(lambda self: self.placement.distance_index)
    drawn_distances = property(lambda self: self.placement.drawn_distances)
    key_padding_mask = property(lambda self: self.placement.key_padding_mask)
    document_ids = property(lambda self: self.placement.document_ids)
    rel_keys = property(lambda self: self.inputs.rel_keys)
    distance_scores = property(lambda self: self.inputs.distance_scores)
    query_scale = property(lambda self: self.inputs.query_scale)
    saturation = property(lambda self: self.band[0])
    far_from = property(lambda self: self.band[1])

    n_mem = property(lambda self: self.visibility.n_mem)
    n_keys = property(lambda self: self.n_mem + self.n_queries)
    causal = property(lambda self: self.visibility.causal)

    @property
    def consecutive(self) -> bool:
        """Positions 0 .. K - 1: the per-distance tensors are laid out per key by strided views."""
        return self.distance_index is None

    @property
    def masked_per_row(self) -> bool:
        """Whether visibility differs per row (padding, documents): masks [B, 1, L_b, K_b]."""
        return self.key_padding_mask is not None or self.document_ids is not None

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole stream at consecutive positions, with no drawn distances, window,
        key padding, documents, sinks, query scale or term d of its own (what the low-rank and band
        kernels need besides the forms of the call's terms)."""
        inputs = self.inputs
        return (
            self.causal
            and self.consecutive
            and not self.drawn_distances
            and self.visibility.window is None
            and not self.masked_per_row
            and not self.n_sinks
            and inputs.query_scale is None
            and inputs.term_d is None
        )

    @property
    def per_distance(self) -> bool:
        """Whether anything per distance is added to s·q_content·kᵀ (term b, d, the curve)."""
        inputs = self.inputs
        return any(t is not None for t in (inputs.rel_keys, inputs.term_d, inputs.distance_scores))

    @property
    def has_additive(self) -> bool:
        """Whether anything is added to s·q_content·kᵀ (otherwise plain SDPA can do it all)."""
        return self.per_distance or bool(self.terms)

    @property
    def plan(self) -> planner.Plan:
        """What the kernel planner (planner.py) reads of the call's forms (not cached:
        functools.cached_property's lock on Python 3.11 breaks torch.compile's graph)."""
        inputs = self.inputs
        curve = None
        if inputs.distance_scores is not None or inputs.term_d is not None:
            slope = inputs.distance_slope is not None and inputs.term_d is None
            curve = frozenset({"key_offsets"}) if slope else frozenset()
        return planner.Plan(
            plain_causal=self.plain_causal,
            product=inputs.rel_keys is not None,
            curve=curve,
            saturates=self.saturation is not None and self.per_distance,
            terms=tuple(term.forms for term in self.terms),
        )

    def with_geometry(self, **fields) -> AttentionCall:
        """The call with fields of its placement replaced (e.g. key_padding_mask)."""
        return dataclasses.replace(self, placement=self.placement._replace(**fields))

    def with_term_tensors(self, tensors: list[Tensor | None]) -> AttentionCall:
        """The call with its terms on `tensors` (term_tensors' order); itself if its own."""
        if all(a is b for a, b in zip(tensors, self.term_tensors(), strict=True)):
            return self
        terms, at = [], 0
        for term in self.terms:
            n = len(term.tensors)
            terms.append(term.with_tensors(tuple(tensors[at : at + n])) if n else term)
            at += n
        return dataclasses.replace(self, terms=tuple(terms))

    def term_tensors(self) -> list[Tensor]:
        """Every term's per-call tensors, in order."""
        return [t for term in self.terms for t in term.tensors]

    def term_parameters(self) -> list[Tensor]:
        """Every module parameter the terms' forms read, in order."""
        return [p for term in self.terms for p in term.parameters()]

    def hidden_distances(self, like: Tensor) -> Tensor:
        """[n] additive mask per distance of the call, 0 where a key at that distance is visible and
        -inf where not, in like's dtype and device: with consecutive positions visibility is a
        function of the distance."""
        hidden = ~self.visibility.at_distance(self.distances)
        return torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(
            hidden, float("-inf")
        )

    def visible(self, block: QueryBlock) -> Tensor:
        """Bool [L_b, K_b], or [B, 1, L_b, K_b] with key padding or documents: may query i see key
        j (sinks not included)."""
        device = self.query_positions.device
        rows = torch.arange(block.i0, block.i1, device=device)
        seen = self.visibility(
            rows[:, None], torch.arange(block.k0, block.n_keys, device=device)[None, :]
        )
        keys = slice(block.k0, block.n_keys)
        return per_row(seen, self.key_padding_mask, self.document_ids, self.n_mem, block.rows, keys)

    def causal_diagonal(self, block: QueryBlock) -> int | None:
        """d where the block's visibility is causal without key padding or documents: row r sees no
        key past column r + d, and every other key it does not see lies before its window (None
        otherwise)."""
        if not self.visibility.causal or self.masked_per_row:
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
                size = max(size, rows_within(block_scores, window))
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
        it; the curve's slope, the low-rank kernel's form, left out)."""
        return self.inputs._replace(
            q_position=q_position,
            rel_keys=self.rel_keys if q_position is not None else None,
            distance_slope=None,
        )

    def block_inputs(self, block: QueryBlock, inputs: ScoreInputs) -> ScoreInputs:
        """The block's slices (views) of each input; None stays None."""
        return ScoreInputs(
            _narrow(inputs.q_position, 2, block.rows),
            _narrow(inputs.rel_keys, 1, block.rel_cols),
            _narrow(inputs.term_d, 1, block.distance_cols),
            _narrow(inputs.distance_scores, 1, block.distance_cols),
            inputs.distance_slope,
            _narrow(inputs.query_scale, 2, block.rows),
        )

    def additive_terms(
        self,
        block: QueryBlock,
        inputs: ScoreInputs,
        q_content: Tensor | None = None,
        k: Tensor | None = None,
        terms: tuple[ScoreTerm, ...] | None = None,
    ) -> dict[str, Tensor]:
        """Each additive score term of the block as it enters the sum, [B or 1, H, L_b, K_b]: 'b',
        'd' and 'bias' (per distance), then each of `terms` (default: the call's) by its dense form,
        each but b times λ where it is `scaled`. `inputs`: the block's slices (block_inputs), passed
        in so that backward can rebuild them; q_content [B, H, L_b, dh] and k [B, H, K_b, dh] (no
        sinks) for the terms that read content (without them, those are left out)."""
        scale, out = inputs.query_scale, {}

        def scaled(t: Tensor) -> Tensor:  # times λ (term b's query carries it already)
            return t if scale is None else t * scale

        if inputs.rel_keys is not None and inputs.q_position is not None:
            out["b"] = self.term_b(block, inputs.q_position, inputs.rel_keys)
        if inputs.term_d is not None:
            out["d"] = scaled(self.per_key(block, inputs.term_d)[None])
        if inputs.distance_scores is not None:
            out["bias"] = scaled(self.per_key(block, inputs.distance_scores)[None])
        for term in self.terms if terms is None else terms:
            if term.reads_content and q_content is None:
                continue
            map_ = term.block(self, block, q_content, k)
            out[term.name] = scaled(map_) if term.scaled else map_
        return out

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


def sum_terms(terms: dict[str, Tensor]) -> Tensor | None:
    """The score map: the terms summed in their order (None: no term). The one sum of the package's
    score terms; every backend but FlexAttention's point-wise twin (flex.py) and the strided
    per-distance layout (block_maps.StridedMaps: term b and the curves added per distance, before
    the layout) reaches it."""
    return functools.reduce(operator.add, terms.values()) if terms else None
