"""How the block kernel (blockwise.py) hands a query block's additive map to a fused attention
kernel, and takes the map's gradient back onto the tensors it was built from.

The CPU flash kernel (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward) adds an
`attn_mask` to each tile of scores it computes, reading the mask through its strides (any row
stride, unit column stride). So a map that is a function of the distance need not exist as an [L_b,
K_b] tensor:
- `StridedMaps`, consecutive positions: the mask's -inf (causal, window) is a function of the
  distance too and joins the curve (`AttentionCall.hidden_distances`). Without term b, with the
  block's queries taken in reverse order, entry (r, j) of the map is curve[t0 + r + j]: a Hankel
  view of the per-distance curve (strides 1, 1), O(H·n) memory and no pass over the map. With term
  b, the product (q + v)·s·W_R R over the block's L_b + K_b - 1 distances, the curve added by the
  product itself (one more channel: 1 against the curve), laid out per key by rel_shift's view
  (strides m - 1, 1). Gradients are reduced by hand: along the map's anti-diagonals onto the curve,
  and through the per-distance layout onto (q + v) and W_R R (the strided maps' backward,
  blockwise._strided_backward, computes dS in that layout).
- `MaterialisedMaps`: everything else (key padding, explicit positions, FIRE past its threshold,
  FoX's decay, the query scale, sink columns): `sum_terms` of `AttentionCall.additive_terms` per
  block (the one sum of the terms), masked, and its gradient by autograd through a rebuild of the
  block's map, but for the terms that give their gradient by hand (FoX's decay: fox.py; CoPE:
  cope.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.kernels.call import AttentionCall, QueryBlock, ScoreInputs, sum_terms
from relpos_ablate.model.kernels.shift import antidiagonal_sums, rel_shift


def block_maps(call: AttentionCall, inputs: ScoreInputs) -> StridedMaps | MaterialisedMaps:
    """The layout of this call's maps: strided views when they depend on the distance alone."""
    per_distance = inputs.distance_scores is not None or inputs.rel_keys is not None
    strided = (
        per_distance
        and call.consecutive
        and call.key_padding_mask is None
        and not call.n_sinks
        and call.pair_bias is None
        and call.contextual is None
        and inputs.log_decay is None
        and inputs.query_scale is None
    )
    return StridedMaps(call, inputs) if strided else MaterialisedMaps(call, inputs)


# How the kernel walks a call (docs/performance.md). Each backward tile holds [B, H, L_b, K_t]
# buffers (probabilities, dS, the map and its gradient) of `tile_scores` entries per head: half as
# many as the keys have numbers (K·d_head / 2), so that the kernel's transients stay O(L·d) like
# FlashAttention's (peak memory at most 2x attention without positions at L = 1024 and 4096), in few
# tiles: on a loaded machine every tensor op costs a thread barrier, and a few thousand of them cost
# more than the products. The CPU flash kernel pays per call for packing its keys, so forward blocks
# keep query_chunk queries where the map is a view (256: within ~20% of one causal call; 16 cost
# ~4x), and a built map may be 4 times larger in forward (which keeps no gradients).
FORWARD_TILES = 4
# Term b: a tile's product covers L_b + K_t - 1 distances, so its tiles are long and have few
# queries: 64, and in backward 128 where that leaves tiles of at least TERM_B_WIDE_TILE keys (half
# the passes over dK and dV; at L = 1024 the 64 rows waste less on the L_b - 1 distances past the
# keys). Its backward holds two tile-sized buffers (the per-distance scores, then dS in place; the
# content scores, then dP), as many as the generic loop's probabilities and dS.
TERM_B_ROWS = (64, 128)
TERM_B_WIDE_TILE = 1024
HANKEL_ROWS = 128  # queries per backward block of the Hankel view (no product over distances)
MIN_TILE_SCORES = 4096


def tile_scores(call: AttentionCall, d_head: int) -> int:
    """Score entries per head of a backward tile."""
    return max(MIN_TILE_SCORES, call.n_keys * d_head // 2)


class _Layout:
    # [B, H, L_b, K_b]-sized tensors a backward tile holds besides the probabilities and dS
    buffers = 1
    # queries per backward block, its keys in tiles (0: blocks shrink with their keys, one tile
    # each)
    rows = 0
    # queries per forward block, at most query_chunk (0: blocks shrink with their keys)
    forward_rows = 0
    forward_tiles = False  # forward splits a block's keys into tiles (term b's product per tile)

    def forward_blocks(self, call: AttentionCall, d_head: int) -> list[list[QueryBlock]]:
        """The query blocks of forward, each as its key tiles (merged by their log-sum-exp)."""
        scores = FORWARD_TILES * tile_scores(call, d_head)
        if not self.forward_rows:  # the map is built per block: its size bounds the block
            return [[blk] for blk in call.blocks(scores, windowed=True)]
        blocks = call.blocks(
            scores, windowed=True, rows=min(call.query_chunk or call.n_queries, self.forward_rows)
        )
        if not self.forward_tiles:  # a view: the whole block in one call
            return [[blk] for blk in blocks]
        return [
            call.key_tiles(blk, max(lq, scores // lq - lq))
            for blk in blocks
            for lq in [blk.i1 - blk.i0]
        ]

    def backward_blocks(self, call: AttentionCall, d_head: int) -> list[list[QueryBlock]]:
        """The query blocks of backward, each as its key tiles."""
        scores = tile_scores(call, d_head) * 2 // (2 + self.buffers)
        if not self.rows:
            return [[blk] for blk in call.blocks(scores, windowed=True)]
        blocks = call.blocks(scores, windowed=True, rows=self.rows)
        return [
            call.key_tiles(blk, max(lq, scores // lq)) for blk in blocks for lq in [blk.i1 - blk.i0]
        ]

    def key_tiles(self, call: AttentionCall, d_head: int) -> list[tuple[slice, list[QueryBlock]]]:
        """Backward's tiles by keys, where blocks have `rows` queries: (a range of keys, the tiles
        of every query block in it), so that dK and dV of the range are summed in place in one
        buffer."""
        return self._by_keys(call, tile_scores(call, d_head) * 2 // (2 + self.buffers))

    def _by_keys(self, call: AttentionCall, scores: int) -> list[tuple[slice, list[QueryBlock]]]:
        """Blocks of `rows` queries cut into tiles at the multiples of a width (tiles of about
        `scores` entries per head), grouped by that range of keys."""
        width = max(self.rows, scores // self.rows)
        groups: dict[int, list[QueryBlock]] = {}
        for blk in call.blocks(scores, windowed=True, rows=self.rows):
            for tile in call.aligned_key_tiles(blk, width):
                groups.setdefault(tile.k0 // width, []).append(tile)
        return [
            (slice(g * width, min((g + 1) * width, call.n_keys)), tiles)
            for g, tiles in sorted(groups.items())
        ]


def _columns(t: Tensor, cols: slice) -> Tensor:
    return t.narrow(-2 if t.dim() == 3 else -1, cols.start, cols.stop - cols.start)


class StridedMaps(_Layout):
    """Maps of distance-only scores and term b as views of per-distance tensors (module docstring).

    `reversed`: the block's queries are taken last to first (the Hankel layout, used without term
    b). Backward is its own loop (blockwise._strided_backward), built on `per_distance` and
    `add_term_b_gradients` with term b, on `mask` and `add_curve_gradient` without."""

    def __init__(self, call: AttentionCall, inputs: ScoreInputs):
        self.call, self.inputs = call, inputs
        hidden = call.hidden_distances(
            inputs.rel_keys if inputs.rel_keys is not None else inputs.distance_scores
        )
        self.curve = (
            hidden
            if inputs.distance_scores is None
            else (inputs.distance_scores + hidden).contiguous()
        )
        self.reversed = inputs.rel_keys is None
        self.forward_tiles = not self.reversed
        if self.reversed:
            self.rows, self.forward_rows = HANKEL_ROWS, call.n_queries
        else:
            wide = (
                tile_scores(call, inputs.q_position.shape[-1]) // TERM_B_ROWS[1] >= TERM_B_WIDE_TILE
            )
            self.rows, self.forward_rows = TERM_B_ROWS[wide], TERM_B_ROWS[0]
        self._scratch: Tensor | None = None
        self._operands: tuple[Tensor, Tensor] | None = None

    def forward_blocks(self, call: AttentionCall, d_head: int) -> list[list[QueryBlock]]:
        return self._reserved(super().forward_blocks(call, d_head))

    def key_tiles(self, call: AttentionCall, d_head: int) -> list[tuple[slice, list[QueryBlock]]]:
        groups = self._by_keys(call, tile_scores(call, d_head))
        self._reserved([tiles for _, tiles in groups])
        return groups

    def _reserved(self, blocks: list[list[QueryBlock]]) -> list[list[QueryBlock]]:
        """The blocks, with term b's buffer allocated at once for the largest of them (a buffer
        grown block by block is a fresh allocation each time, its pages faulted in again: forward's
        products at L = 4096 took 207 ms so, 177 ms allocated once, in blocks of 256 queries)."""
        if not self.reversed:
            size = max(
                (t.i1 - t.i0) * (t.distance_cols.stop - t.distance_cols.start)
                for tiles in blocks
                for t in tiles
            )
            size *= self.inputs.q_position.shape[0] * self.inputs.q_position.shape[1]
            if self._scratch is None or self._scratch.numel() < size:
                self._scratch = self.inputs.q_position.new_empty(size)
        return blocks

    def mask(
        self, block: QueryBlock, q_content: Tensor | None = None, k: Tensor | None = None
    ) -> Tensor:
        """The block's map with -inf where a key is hidden: [1 or B, H, L_b, K_b], a view (with term
        b, of a buffer the next call of `mask` overwrites)."""
        lq, width, cols = block.i1 - block.i0, block.width, block.distance_cols
        if self.reversed:  # entry (r, j) is the curve at column t0 + r + j
            heads, n = self.curve.shape
            return self.curve.as_strided(
                (1, heads, lq, width), (0, n, 1, 1), self.curve.storage_offset() + cols.start
            )
        # forward: both operands for the whole call, each block reads its slices
        if self._operands is None:
            self._operands = (
                self.term_b_queries(slice(None)),
                self.term_b_keys(slice(0, self.curve.shape[-1])),
            )
        queries, keys = self._operands
        return rel_shift(
            self.per_distance(
                block, queries[:, :, block.rows], _columns(keys, block.distance_cols)
            ),
            width,
        )

    def term_b_queries(self, rows: slice, minus_lse: Tensor | None = None) -> Tensor:
        """[B, H, L_b, dh + 1 or 2]: the position query of the rows, with channels [-lse,] 1
        (term_b_keys)."""
        q_position = self.inputs.q_position[:, :, rows]
        extra = [] if minus_lse is None else [minus_lse]
        return torch.cat(
            [q_position, *extra, q_position.new_ones(*q_position.shape[:-1], 1)], dim=-1
        )

    def term_b_keys(self, cols: slice, lse: bool = False) -> Tensor:
        """[H, m, dh + 1 or 2]: s·W_R R at the distance columns, with channels [1,] curve: against
        term_b_queries, the product is term b plus the curve (its -inf included) [minus lse], with
        no pass of its own over the scores."""
        rel_keys = _columns(self.inputs.rel_keys, cols)
        curve = _columns(self.curve, cols).expand(rel_keys.shape[:-1])[..., None]
        extra = [torch.ones_like(curve)] if lse else []
        return torch.cat([rel_keys, *extra, curve], dim=-1)

    def per_distance(
        self, block: QueryBlock, queries: Tensor, keys: Tensor, scale: float = 1.0
    ) -> Tensor:
        """scale·queries·keysᵀ for the block's queries [B, H, L_b, e] and distances [H, m, e] (m =
        L_b + K_b - 1): [B, H, L_b, m], in a buffer the next block reuses; one product per batch
        row, W_R R read once per head and row."""
        batch, heads, lq = queries.shape[:3]
        m = keys.shape[1]
        size = batch * heads * lq * m
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = queries.new_empty(size)
        out = self._scratch[:size].view(batch, heads, lq, m)
        keys = keys.transpose(1, 2)  # (H, e, m)
        with torch.no_grad():  # (the block kernel differentiates it by hand)
            for b in range(batch):
                torch.baddbmm(out[b], queries[b], keys, beta=0, alpha=scale, out=out[b])
        return out

    def add_term_b_gradients(
        self, block: QueryBlock, grad_per_distance: Tensor, grads: ScoreInputs
    ) -> None:
        """Add the gradient of the block's per-distance scores [B, H, L_b, m] (per_distance's
        layout, zero outside each row's keys) onto grads' q_position, rel_keys and distance_scores
        (None: not wanted)."""
        cols = block.distance_cols
        if grads.distance_scores is not None:
            _columns(grads.distance_scores, cols).add_(grad_per_distance.sum((0, 2)))
        q_position = self.inputs.q_position[:, :, block.rows]  # (B, H, L_b, dh)
        if grads.rel_keys is not None:  # Σ_b dSᵀ·q_position, one (H, m, dh) product per batch row
            total = grad_per_distance[0].transpose(1, 2) @ q_position[0]
            for b in range(1, q_position.shape[0]):
                total.baddbmm_(grad_per_distance[b].transpose(1, 2), q_position[b])
            _columns(grads.rel_keys, cols).add_(total)
        if grads.q_position is not None:
            keys = _columns(self.inputs.rel_keys, cols)
            for b in range(q_position.shape[0]):
                grads.q_position[b, :, block.rows] += grad_per_distance[b] @ keys

    def add_curve_gradient(
        self, block: QueryBlock, grad_scores: Tensor, grads: ScoreInputs
    ) -> None:
        """Add the gradient of the Hankel view's map, grad_scores [B, H, L_b, K_b] (rows in the
        order of `mask`), onto the curve's (None: not wanted)."""
        if grads.distance_scores is not None:
            _columns(grads.distance_scores, block.distance_cols).add_(
                antidiagonal_sums(grad_scores)
            )


# backward blocks of 256 queries: FIRE 220 -> 197 ms at L = 1024 and 2.34 -> 2.22 s at 4096, FoX on
# this kernel 1.84 -> 1.58 s at 4096, against 64 (one layer step; 512 and 1024 alike). Tiles are
# then at least 256 keys wide, above tile_scores at L = 1024 (FIRE's peak memory 1.55x / 1.14x
# attention without positions at 1024 / 4096); twice or four times wider tiles gained nothing
MATERIALISED_ROWS = 256


class MaterialisedMaps(_Layout):
    """Each block's map as a tensor: the sum of `call.additive_terms`, the sink columns in front,
    -inf where hidden.

    Backward splits a block's keys into tiles, but for sinks (in front of the first tile only) and
    CoPE (whose positions count over a query's whole row)."""

    reversed = False
    buffers = 3  # the map, the mask, and what autograd keeps to differentiate the map

    def __init__(self, call: AttentionCall, inputs: ScoreInputs):
        self.call, self.inputs = call, inputs
        self.rows = 0 if call.n_sinks or call.contextual is not None else MATERIALISED_ROWS
        # FIRE past its threshold: its pairs' bias and gradient by hand (fire_pairs.py), where it is
        # the last term of the sum (no FoX decay after it, no query scale on it, no CoPE)
        self.by_hand = (
            call.pair_bias is not None
            and inputs.query_scale is None
            and inputs.log_decay is None
            and call.contextual is None
        )
        self._pairs = None

    def pairs(self, grad: bool = False):
        """The call's query-dependent bias with its gradient by hand (BiasScheme.by_hand), made at
        first use; `grad`: its parameters get gradients (backward; made again if the first use had
        none)."""
        grad = grad and any(p.requires_grad for p in self.call.pair_bias.parameters())
        if self._pairs is None or (grad and not self._pairs.trained):
            self._pairs = self.call.pair_bias.by_hand(
                self.call.query_positions, self.call.key_positions, grad
            )
        return self._pairs

    def _pair_map(self, block: QueryBlock, grad: bool = False):
        """(the block's query-dependent bias [1, H, L_b, K_b] times s_B, what its gradient reads
        (`grad`: backward; forward: None)), where it is taken by hand (else None)."""
        if not self.by_hand or self.call.pair_bias_on_curve(block) or self.pairs(grad) is None:
            return None
        keys = slice(block.k0, block.n_keys)
        bias, tile = (
            self.pairs(grad).block(block.rows, keys)
            if grad
            else (self.pairs().values(block.rows, keys), None)
        )
        return (bias if self.call.bias_scale == 1.0 else bias.mul_(self.call.bias_scale))[
            None
        ], tile

    @staticmethod
    def _plus(additive: Tensor | None, bias: Tensor) -> Tensor:
        """additive + bias (bias last, as sum_terms adds it) in a new tensor or in bias."""
        if additive is None:
            return bias
        return bias.add_(additive) if additive.shape == bias.shape else additive + bias

    def mask(
        self, block: QueryBlock, q_content: Tensor | None = None, k: Tensor | None = None
    ) -> Tensor:
        """[B or 1, H, L_b, S + K_b]; q_content [B, H, L_b, dh] and the block's keys k [B, H, K_b,
        dh] (no sinks) for CoPE."""
        pair = self._pair_map(block)
        additive = sum_terms(
            self.call.additive_terms(
                block, self.call.block_inputs(block, self.inputs), pair_bias=pair is None
            )
        )
        if pair is not None:
            additive = self._plus(additive, pair[0])
        if self.call.contextual is not None:
            cope, _ = self.call.contextual.block_scores(
                q_content,
                k,
                self.call.scale,
                self.call.visible(block),
                shifted=self.call.far_from is not None,
                diagonal=self.call.causal_diagonal(block),
            )
            additive = cope if additive is None else cope.add_(additive)
        return self._masked(block, additive, own=True)

    def _masked(self, block: QueryBlock, additive: Tensor, own: bool) -> Tensor:
        """`own`: the map is this call's to overwrite (no other tensor or autograd reads it)."""
        visible = self.call.visible(block)
        if not visible.all():  # causal: only tiles on the diagonal hide keys
            hidden = ~visible
            # in place, from the first key any row hides (causal: the diagonal's)
            if own and visible.dim() == 2:
                first = int(hidden.any(0).to(torch.uint8).argmax())
                # as an added [L_b, K_b] map of 0 and -inf: ~3x faster than masked_fill_
                # broadcasting the bool mask over batch and heads (B = 2, H = 8, 256 x 402: 0.36
                # against 0.98 ms)
                minus_inf = torch.zeros(
                    hidden[:, first:].shape, dtype=additive.dtype, device=additive.device
                )
                additive[..., first:].add_(minus_inf.masked_fill_(hidden[:, first:], float("-inf")))
            else:  # (key padding broadcasts a shared map over the batch)
                additive = additive.masked_fill(hidden, float("-inf"))
        # sinks carry no position: 0
        return F.pad(additive, (block.n_sinks, 0)) if block.n_sinks else additive

    def rebuilt(
        self,
        block: QueryBlock,
        grads: ScoreInputs,
        params: list[Tensor],
        param_grads: list[Tensor | None],
        content: tuple[Tensor, Tensor, Tensor] | None = None,
    ):
        """(the block's mask, a function adding the gradient of a map gradient [B, H, L_b, S + K_b]
        onto `grads` and `param_grads`): the map rebuilt under autograd from leaves, FoX's decay and
        CoPE's scores differentiated by hand. `content` for CoPE: (q_content rows, their gradient,
        the block's keys without sinks); the gates' gradient is added to the map gradient itself
        (the kernel's dS: it then reaches q and k through the products that carry s·q·kᵀ's)."""
        call = self.call
        block_grads = call.block_inputs(block, grads)
        pair = self._pair_map(block, grad=True)
        with torch.enable_grad():
            leaves = ScoreInputs(
                *(
                    None
                    if t is None
                    else t.detach().requires_grad_(g is not None and name != "log_decay")
                    for name, t, g in zip(
                        ScoreInputs._fields, call.block_inputs(block, self.inputs), block_grads
                    )
                )
            )
            rest = sum_terms(call.additive_terms(block, leaves, pair_bias=pair is None))
        wanted = [
            (view, leaf)
            for view, leaf in zip(block_grads, leaves)
            if view is not None and leaf.requires_grad
        ]
        if pair is None:  # (by hand, the parameters get theirs from `finish`)
            wanted += [
                (g, p)
                for g, p in zip(param_grads, params)
                if g is not None and not _is_table(call, p)
            ]
        cope = state = None
        if call.contextual is not None:
            cope, state = call.contextual.block_scores(
                content[0],
                content[2],
                call.scale,
                call.visible(block),
                shifted=call.far_from is not None,
                diagonal=call.causal_diagonal(block),
            )

        def add_gradients(grad_scores: Tensor) -> None:
            stream = grad_scores[..., block.n_sinks :]  # sinks have no map
            if grads.log_decay is not None:
                self._decay_gradient(block, stream, grads.log_decay)
            if (
                pair is not None
                and self.pairs().trained
                and any(g is not None for g in param_grads)
            ):
                grad_bias = torch.sum(stream, 0)  # (H, L_b, K_b), a new tensor: the batch's sum
                self.pairs().add_gradient(
                    pair[1],
                    grad_bias if call.bias_scale == 1.0 else grad_bias.mul_(call.bias_scale),
                )
            if rest is not None and wanted:
                # a map shared by the batch ([1, H, ...]) receives the batch's summed gradient
                shared = (
                    stream.sum(0, keepdim=True) if rest.shape[0] == 1 < stream.shape[0] else stream
                )
                for (target, _), g in zip(
                    wanted,
                    torch.autograd.grad(rest, [t for _, t in wanted], shared, allow_unused=True),
                ):
                    if g is not None:
                        target.add_(g)
            if state is not None:
                grad_logits, grad_q, grad_table = call.contextual.block_backward(
                    state, stream, content[0], call.scale, shifted=call.far_from is not None
                )
                content[1].add_(grad_q)
                for target, p in zip(param_grads, params):
                    if target is not None and _is_table(call, p):
                        target.add_(grad_table)
                stream.add_(grad_logits)  # last: the map's other gradients read dS without it

        additive = rest.detach() if rest is not None else None
        if pair is not None:
            additive = self._plus(additive, pair[0])
        if cope is not None:
            additive = cope if additive is None else cope.add_(additive)
        return self._masked(block, additive, own=not wanted or pair is not None), add_gradients

    def finish(self, params: list[Tensor], param_grads: list[Tensor | None]) -> None:
        """Add the parameters' gradients that the tiles summed by hand (FIRE's pairs) onto
        param_grads."""
        if self._pairs is None:
            return
        trained = [(g, p) for g, p in zip(param_grads, params) if g is not None and p.requires_grad]
        if not trained:
            return
        for (target, _), g in zip(
            trained, self._pairs.parameter_gradients([p for _, p in trained])
        ):
            if g is not None:
                target.add_(g)

    def _decay_gradient(
        self, block: QueryBlock, grad_scores: Tensor, grad_log_decay: Tensor
    ) -> None:
        """FoX's term (times the query scale, if any) differentiated by its own hand (fox.py) from
        the map's gradient [B, H, L_b, K_b]."""
        scale = self.inputs.query_scale
        grad_decay = grad_scores if scale is None else grad_scores * scale[:, :, block.rows]
        self.call.decay.block_gradient(
            grad_decay,
            grad_log_decay,
            slice(self.call.n_mem + block.i0, self.call.n_mem + block.i1),
            slice(block.k0, block.n_keys),
        )


def _is_table(call: AttentionCall, parameter: Tensor) -> bool:
    """Whether `parameter` is one CoPE's block_backward differentiates (its table)."""
    return call.contextual is not None and any(parameter is p for p in call.contextual.parameters())
