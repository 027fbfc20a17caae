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
  `strided_backward` below, computes dS in that layout).
- `MaterialisedMaps` (materialised_maps.py): everything else (key padding, explicit positions,
  the call's score terms, the query scale, sink columns): `sum_terms` of
  `AttentionCall.additive_terms` per block (the one sum of the terms), masked, and its gradient by
  autograd through a rebuild of the block's map, but for the terms that give their gradient by hand
  (ScoreTerm.hand_gradient).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos_ablate.model.core.call import AttentionCall, QueryBlock, ScoreInputs
from relpos_ablate.model.core.shift import antidiagonal_sums, outside_keys, rel_shift

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


LOG2_E = 1 / math.log(2)


def flip_rows(t: Tensor, flipped: bool) -> Tensor:
    return t.flip(2) if flipped else t


def accumulate(target: Tensor, cols: slice, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """target[:, cols] += alpha·a @ b: in place in the product where cols are all of target's
    rows."""
    if cols.start == 0 and cols.stop == target.shape[1]:
        target.baddbmm_(a, b, alpha=alpha)
    else:
        target[:, cols] += torch.bmm(a, b).mul_(alpha) if alpha != 1.0 else torch.bmm(a, b)


class BlockLayout:
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


def columns(t: Tensor, cols: slice) -> Tensor:
    return t.narrow(-2 if t.dim() == 3 else -1, cols.start, cols.stop - cols.start)


class StridedMaps(BlockLayout):
    """Maps of distance-only scores and term b as views of per-distance tensors (module docstring).

    `reversed`: the block's queries are taken last to first (the Hankel layout, used without term
    b). Backward is its own loop (`strided_backward`), built on `per_distance` and
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

    def additive_map(
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
            self.per_distance(block, queries[:, :, block.rows], columns(keys, block.distance_cols)),
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
        rel_keys = columns(self.inputs.rel_keys, cols)
        curve = columns(self.curve, cols).expand(rel_keys.shape[:-1])[..., None]
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
            columns(grads.distance_scores, cols).add_(grad_per_distance.sum((0, 2)))
        q_position = self.inputs.q_position[:, :, block.rows]  # (B, H, L_b, dh)
        if grads.rel_keys is not None:  # Σ_b dSᵀ·q_position, one (H, m, dh) product per batch row
            total = grad_per_distance[0].transpose(1, 2) @ q_position[0]
            for b in range(1, q_position.shape[0]):
                total.baddbmm_(grad_per_distance[b].transpose(1, 2), q_position[b])
            columns(grads.rel_keys, cols).add_(total)
        if grads.q_position is not None:
            keys = columns(self.inputs.rel_keys, cols)
            for b in range(q_position.shape[0]):
                grads.q_position[b, :, block.rows] += grad_per_distance[b] @ keys

    def add_curve_gradient(
        self, block: QueryBlock, grad_scores: Tensor, grads: ScoreInputs
    ) -> None:
        """Add the gradient of the Hankel view's map, grad_scores [B, H, L_b, K_b] (rows in the
        order of `mask`), onto the curve's (None: not wanted)."""
        if grads.distance_scores is not None:
            columns(grads.distance_scores, block.distance_cols).add_(antidiagonal_sums(grad_scores))


def strided_backward(
    maps: StridedMaps,
    call: AttentionCall,
    grad_out: Tensor,
    q_content: Tensor,
    k: Tensor,
    v_ones: Tensor,
    lse: Tensor,
    minus_delta: Tensor,
    grad_q: Tensor,
    grad_k: Tensor,
    grad_v: Tensor,
    grads: ScoreInputs,
) -> None:
    """The five products per tile for maps of the distance (block_maps.StridedMaps), in two
    tile-sized buffers and with c·(map + s·q·kᵀ - lse) (c = log2 e) written in one pass: with term
    b, the per-distance product with the curve and -lse as channels, the content product added
    through the per-key view; on the Hankel view of a curve, map - lse written from the view, s·q·kᵀ
    added in place by the product, times c. Then exp2 in place (P), dV = Pᵀ·dO, dP = dO·Vᵀ - delta
    as one product ([dO, -delta]·[V, 1]) in the second buffer, dS = P ∘ dP in place: with term b
    already in the per-distance layout its gradients read, once the columns outside each row's keys
    are zeroed; on the Hankel view summed along its anti-diagonals. dK and dV are summed per range
    of keys in one contiguous buffer (1.1 ms a tile against 1.5 ms for a product added to a slice of
    grad_k: B = 2, H = 8, 128 x 1024)."""
    d_head, scale, flip = q_content.shape[-1], call.scale, maps.reversed
    batch, heads = q_content.shape[:2]
    groups = maps.key_tiles(call, d_head)
    size = max((t.i1 - t.i0) * t.width for _, tiles in groups for t in tiles) * batch * heads
    scratch = q_content.new_empty((2 if flip else 1) * size)
    for keys, tiles in groups:
        grad_k_g, grad_v_g = (
            q_content.new_zeros(batch * heads, keys.stop - keys.start, d_head) for _ in range(2)
        )
        for tile in tiles:
            rows, lq, width = tile.rows, tile.i1 - tile.i0, tile.width
            q_b, go, minus_delta_b, lse_b = (
                flip_rows(t[:, :, rows], flip) for t in (q_content, grad_out, minus_delta, lse)
            )
            go_delta = torch.cat([go, minus_delta_b], dim=-1).flatten(0, 1)
            k_t = k[:, :, tile.keys].flatten(0, 1)
            n = batch * heads * lq * width
            product = scratch[:n].view(-1, lq, width)
            if flip:  # c·(map - lse) from the curve's view, the product added in place
                probs = torch.sub(
                    maps.additive_map(tile),
                    lse_b,
                    out=scratch[size : size + n].view(batch, heads, lq, width),
                )
                # (c applied last, as the generic loop does: folded into the product as beta and
                # alpha it rounds once more, 1.09e-5 against 8.9e-6 for one gradient of test_band's
                # xl_d_and_t5, whose limit is 1e-5)
                probs = (
                    probs.flatten(0, 1)
                    .baddbmm_(q_b.flatten(0, 1), k_t.transpose(1, 2), alpha=scale)
                    .mul_(LOG2_E)
                )
            else:
                queries = maps.term_b_queries(rows, lse_b.neg())
                per_distance = maps.per_distance(
                    tile, queries, maps.term_b_keys(tile.distance_cols, lse=True), LOG2_E
                )
                # (B·H, L_b, K_t), a view of (B, H, L_b, m)
                probs = rel_shift(per_distance, width).flatten(0, 1)
                torch.baddbmm(
                    product,
                    q_b.flatten(0, 1),
                    k_t.transpose(1, 2),
                    beta=0,
                    alpha=scale * LOG2_E,
                    out=product,
                )
                probs.add_(product)
            probs.exp2_()
            cols = slice(tile.k0 - keys.start, tile.n_keys - keys.start)
            accumulate(grad_v_g, cols, probs.transpose(1, 2), go.flatten(0, 1))  # dV += Pᵀ·dO
            # dO·Vᵀ - delta
            grad_probs = torch.baddbmm(
                product,
                go_delta,
                v_ones[:, :, tile.keys].flatten(0, 1).transpose(1, 2),
                beta=0,
                out=product,
            )
            grad_scores = probs.mul_(grad_probs)  # dS = P ∘ (dP - delta)
            if flip:
                maps.add_curve_gradient(tile, grad_scores.view(batch, heads, lq, width), grads)
            else:
                before, after = outside_keys(per_distance)
                per_distance[..., : lq - 1].masked_fill_(before, 0.0)
                per_distance[..., per_distance.shape[-1] - lq + 1 :].masked_fill_(after, 0.0)
                maps.add_term_b_gradients(tile, per_distance, grads)
            grad_q[:, :, rows] += flip_rows(
                (grad_scores @ k_t).view(batch, heads, lq, d_head).mul_(scale), flip
            )
            accumulate(grad_k_g, cols, grad_scores.transpose(1, 2), q_b.flatten(0, 1), alpha=scale)
        grad_k[:, :, keys] += grad_k_g.view_as(grad_k[:, :, keys])
        grad_v[:, :, keys] += grad_v_g.view_as(grad_v[:, :, keys])
