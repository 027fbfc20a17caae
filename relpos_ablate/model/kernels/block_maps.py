"""How the block kernel (blockwise.py) hands a query block's additive map to a fused attention kernel, and
takes the map's gradient back onto the tensors it was built from.

The CPU flash kernel (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward) adds an
`attn_mask` to each tile of scores it computes, reading the mask through its strides (any row stride, unit
column stride). So a map that is a function of the distance need not exist as an [L_b, K_b] tensor:
- `StridedMaps`, consecutive positions: the mask's -inf (causal, window) is a function of the distance too
  and joins the curve (`AttentionCall.hidden_distances`). Without term b, with the block's queries taken in
  reverse order, entry (r, j) of the map is curve[t0 + r + j]: a Hankel view of the per-distance curve
  (strides 1, 1), O(H·n) memory and no pass over the map. With term b, the product (q + v)·s·W_R R over the
  block's L_b + K_b - 1 distances with the curve added per distance, laid out per key by rel_shift's view
  (strides n - 1, 1). Gradients are reduced by hand: along the map's anti-diagonals onto the curve, and
  through the per-distance layout onto (q + v) and W_R R.
- `MaterialisedMaps`: everything else (key padding, explicit positions, FIRE past its threshold, FoX's
  decay, the query scale, sink columns): `sum_terms` of `AttentionCall.additive_terms` per block (the one sum of the
  terms), masked, and its gradient by autograd through a rebuild of the block's map, but for the terms that
  give their gradient by hand (FoX's decay: fox.py; CoPE: cope.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.kernels.call import AttentionCall, QueryBlock, ScoreInputs, sum_terms


def block_maps(call: AttentionCall, inputs: ScoreInputs) -> "StridedMaps | MaterialisedMaps":
    """The layout of this call's maps: strided views when they depend on the distance alone."""
    per_distance = inputs.distance_scores is not None or inputs.rel_keys is not None
    strided = (per_distance and call.consecutive and call.key_padding_mask is None and not call.n_sinks
               and call.pair_bias is None and call.contextual is None and inputs.log_decay is None
               and inputs.query_scale is None)
    return StridedMaps(call, inputs) if strided else MaterialisedMaps(call, inputs)


# How the kernel walks a call (README "Speed and memory"). Each backward tile holds [B, H, L_b, K_t] buffers
# (probabilities, dS, the map and its gradient) of `tile_scores` entries per head: half as many as the keys
# have numbers (K·d_head / 2), so that the kernel's transients stay O(L·d) like FlashAttention's (peak memory
# at most 2x attention without positions at L = 1024 and 4096), in few tiles: on a loaded machine every
# tensor op costs a thread barrier, and a few thousand of them cost more than the products. The CPU flash
# kernel pays per call for packing its keys, so forward blocks keep query_chunk queries where the map is a
# view (256: within ~20% of one causal call; 16 cost ~4x), and a built map may be 4 times larger in forward
# (which keeps no gradients).
FORWARD_TILES = 4
MIN_TILE_SCORES = 4096


def tile_scores(call: AttentionCall, d_head: int) -> int:
    """Score entries per head of a backward tile."""
    return max(MIN_TILE_SCORES, call.n_keys * d_head // 2)


class _Layout:
    buffers = 1  # [B, H, L_b, K_b]-sized tensors a backward tile holds besides the probabilities and dS
    rows = 0  # queries per backward block, its keys in tiles (0: blocks shrink with their keys, one tile each)
    forward_rows = False  # forward blocks of query_chunk queries (else they shrink with their keys)
    forward_tiles = False  # forward splits a block's keys into tiles (term b's product per tile)

    def forward_blocks(self, call: AttentionCall, d_head: int) -> list[list[QueryBlock]]:
        """The query blocks of forward, each as its key tiles (merged by their log-sum-exp)."""
        scores = FORWARD_TILES * tile_scores(call, d_head)
        if not self.forward_rows:  # the map is built per block: its size bounds the block
            return [[blk] for blk in call.blocks(scores, windowed=True)]
        blocks = call.blocks(scores, windowed=True, rows=call.query_chunk or call.n_queries)
        if not self.forward_tiles:  # a view: the whole block in one call
            return [[blk] for blk in blocks]
        return [call.key_tiles(blk, max(lq, scores // lq - lq)) for blk in blocks for lq in [blk.i1 - blk.i0]]

    def backward_blocks(self, call: AttentionCall, d_head: int) -> list[list[QueryBlock]]:
        """The query blocks of backward, each as its key tiles."""
        scores = tile_scores(call, d_head) * 2 // (2 + self.buffers)
        if not self.rows:
            return [[blk] for blk in call.blocks(scores, windowed=True)]
        blocks = call.blocks(scores, windowed=True, rows=self.rows)
        return [call.key_tiles(blk, max(lq, scores // lq)) for blk in blocks for lq in [blk.i1 - blk.i0]]


def _columns(t: Tensor, cols: slice) -> Tensor:
    return t.narrow(-2 if t.dim() == 3 else -1, cols.start, cols.stop - cols.start)


class StridedMaps(_Layout):
    """Maps of distance-only scores and term b as views of per-distance tensors (module docstring).

    `reversed`: the block's queries are taken last to first (the Hankel layout, used without term b)."""

    def __init__(self, call: AttentionCall, inputs: ScoreInputs):
        self.call, self.inputs = call, inputs
        hidden = call.hidden_distances(inputs.rel_keys if inputs.rel_keys is not None else inputs.distance_scores)
        self.curve = hidden if inputs.distance_scores is None else (inputs.distance_scores + hidden).contiguous()
        self.reversed = inputs.rel_keys is None
        # term b: its gradient per distance is a third buffer; its product per tile covers L_b + K_t - 1
        # distances, so its tiles are long and have few queries
        self.buffers, self.rows, self.forward_tiles = (0, 128, False) if self.reversed else (1, 64, True)
        self.forward_rows = True

    def mask(self, block: QueryBlock, q_content: Tensor | None = None, k: Tensor | None = None) -> Tensor:
        """The block's map with -inf where a key is hidden: [1 or B, H, L_b, K_b], a view."""
        lq, width, cols = block.i1 - block.i0, block.width, block.distance_cols
        if self.reversed:  # entry (r, j) is the curve at column t0 + r + j
            heads, n = self.curve.shape
            return self.curve.as_strided((1, heads, lq, width), (0, n, 1, 1), self.curve.storage_offset() + cols.start)
        product = self._term_b(block)  # (H, B, L_b, m), m = L_b + K_b - 1 distances
        curve = _columns(self.curve, cols)  # the curve (and the -inf) per distance, for every query and batch row
        product += curve.view(curve.shape[0], 1, 1, -1) if curve.dim() == 2 else curve
        return _per_key(product, width)

    def _term_b(self, block: QueryBlock) -> Tensor:
        """(q + v)·s·W_R R for the block's queries and distances: [H, B, L_b, m] (the batch folded into the
        rows of one product per head, so that W_R R is read once)."""
        q_position = self._queries(block)  # (H, B·L_b, dh)
        product = q_position @ _columns(self.inputs.rel_keys, block.distance_cols).transpose(1, 2)  # (H, B·L_b, m)
        return product.view(q_position.shape[0], -1, block.i1 - block.i0, product.shape[-1])

    def _queries(self, block: QueryBlock) -> Tensor:
        q_position = self.inputs.q_position[:, :, block.rows]  # (B, H, L_b, dh)
        return q_position.transpose(0, 1).reshape(q_position.shape[1], -1, q_position.shape[-1])

    def rebuilt(self, block: QueryBlock, grads: ScoreInputs, params: list[Tensor], param_grads: list[Tensor | None],
                content: tuple[Tensor, Tensor, Tensor, Tensor] | None = None):
        """(the block's mask, a function adding a map gradient onto `grads`); no parameters nor content read."""
        return self.mask(block), lambda grad_scores: self._backward(block, grad_scores, grads)

    def _backward(self, block: QueryBlock, grad_scores: Tensor, grads: ScoreInputs) -> None:
        """Add the block's map gradient grad_scores [B, H, L_b, K_b] (rows in the order of `mask`) onto the
        whole-call gradients in `grads` (None: not wanted)."""
        cols = block.distance_cols
        if self.reversed:
            if grads.distance_scores is not None:
                _columns(grads.distance_scores, cols).add_(_antidiagonal_sums(grad_scores))
            return
        lq, width = block.i1 - block.i0, block.width
        heads, batch = grad_scores.shape[1], grad_scores.shape[0]
        per_distance = grad_scores.new_zeros(heads, batch, lq, lq + width - 1)  # (H, B, L_b, m)
        _per_key(per_distance, width).copy_(grad_scores)  # key j of row r -> distance column L_b - 1 - r + j
        if grads.distance_scores is not None:
            _columns(grads.distance_scores, cols).add_(per_distance.sum((1, 2)))
        folded = per_distance.view(heads, batch * lq, -1)  # (H, B·L_b, m)
        if grads.rel_keys is not None:
            _columns(grads.rel_keys, cols).add_(folded.transpose(1, 2) @ self._queries(block))  # (H, m, dh)
        if grads.q_position is not None:
            grad_q = (folded @ _columns(self.inputs.rel_keys, cols)).view(heads, batch, lq, -1)  # (H, B, L_b, dh)
            grads.q_position[:, :, block.rows] += grad_q.transpose(0, 1)


def _per_key(per_distance: Tensor, width: int) -> Tensor:
    """[H, B, L_b, m] per distance -> [B, H, L_b, K_b] per key, a view: entry (r, j) is column
    L_b - 1 - r + j (rel_shift's layout, exact with m = L_b + K_b - 1 columns)."""
    heads, batch, lq, m = per_distance.shape
    stride_h, stride_b = per_distance.stride()[:2]
    return per_distance.as_strided((batch, heads, lq, width), (stride_b, stride_h, m - 1, 1),
                                   per_distance.storage_offset() + lq - 1)


def _antidiagonal_sums(grad: Tensor) -> Tensor:
    """[B, H, L_b, K_b] -> [H, L_b + K_b - 1]: entry t sums grad[:, :, r, j] over the batch and r + j = t (the Hankel
    layout's columns): the batch summed straight into a buffer whose row r starts t = r columns in (zeros only in the
    bands outside the rows), then the rows summed (a tile of 128 x 1024, B = 2, H = 8: 0.65 ms against 0.90 ms for
    a zero buffer and the batch summed apart; the same sums, bit for bit)."""
    heads, lq, width = grad.shape[1:]
    m = lq + width - 1
    buffer = grad.new_empty(heads, lq, m)
    buffer[:, :, :lq - 1].zero_()  # row r's columns before r
    buffer[:, :, width:].zero_()  # and from r + K_b on (the rows' own columns overwrite the rest below)
    torch.sum(grad, dim=0, out=buffer.as_strided((heads, lq, width), (lq * m, m + 1, 1)))
    return buffer.sum(1)


class MaterialisedMaps(_Layout):
    """Each block's map as a tensor: the sum of `call.additive_terms`, the sink columns in front, -inf where hidden.

    Backward splits a block's keys into tiles, but for sinks (in front of the first tile only) and CoPE (whose
    positions count over a query's whole row)."""

    reversed = False
    buffers = 3  # the map, the mask, and what autograd keeps to differentiate the map

    def __init__(self, call: AttentionCall, inputs: ScoreInputs):
        self.call, self.inputs = call, inputs
        # backward blocks of 256 queries: FIRE 220 -> 197 ms at L = 1024 and 2.34 -> 2.22 s at 4096, FoX on this
        # kernel 1.84 -> 1.58 s at 4096, against 64 (one layer step, Intel Xeon, 2026-12-04; 512 and 1024 alike).
        # Tiles are then at least 256 keys wide, above tile_scores at L = 1024 (FIRE's peak memory 1.55x / 1.14x
        # attention without positions at 1024 / 4096); twice or four times wider tiles gained nothing
        self.rows = 0 if call.n_sinks or call.contextual is not None else 256

    def mask(self, block: QueryBlock, q_content: Tensor | None = None, k: Tensor | None = None) -> Tensor:
        """[B or 1, H, L_b, S + K_b]; q_content [B, H, L_b, dh] and the block's keys k [B, H, K_b, dh] (no
        sinks) for CoPE."""
        additive = sum_terms(self.call.additive_terms(block, self.call.block_inputs(block, self.inputs)))
        if self.call.contextual is not None:
            cope, _ = self.call.contextual.block_scores(q_content, k, self.call.scale, self.call.visible(block),
                                                        shifted=self.call.far_from is not None)
            additive = cope if additive is None else cope.add_(additive)
        return self._masked(block, additive, own=True)

    def _masked(self, block: QueryBlock, additive: Tensor, own: bool) -> Tensor:
        """`own`: the map is this call's to overwrite (no other tensor or autograd reads it)."""
        visible = self.call.visible(block)
        if not visible.all():  # causal: only tiles on the diagonal hide keys
            in_place = own and visible.dim() == 2  # (key padding broadcasts a shared map over the batch)
            additive = (additive.masked_fill_ if in_place else additive.masked_fill)(~visible, float("-inf"))
        return F.pad(additive, (block.n_sinks, 0)) if block.n_sinks else additive  # sinks carry no position: 0

    def rebuilt(self, block: QueryBlock, grads: ScoreInputs, params: list[Tensor], param_grads: list[Tensor | None],
                content: tuple[Tensor, Tensor, Tensor] | None = None):
        """(the block's mask, a function adding the gradient of a map gradient [B, H, L_b, S + K_b] onto
        `grads` and `param_grads`): the map rebuilt under autograd from leaves, FoX's decay and CoPE's scores
        differentiated by hand. `content` for CoPE: (q_content rows, their gradient, the block's keys without
        sinks); the gates' gradient is added to the map gradient itself (the kernel's dS: it then reaches q
        and k through the products that carry s·q·kᵀ's)."""
        call = self.call
        block_grads = call.block_inputs(block, grads)
        with torch.enable_grad():
            leaves = ScoreInputs(*(None if t is None else t.detach().requires_grad_(g is not None and name != "log_decay")
                                   for name, t, g in zip(ScoreInputs._fields, call.block_inputs(block, self.inputs),
                                                         block_grads)))
            rest = sum_terms(call.additive_terms(block, leaves))
        wanted = [(view, leaf) for view, leaf in zip(block_grads, leaves) if view is not None and leaf.requires_grad]
        wanted += [(g, p) for g, p in zip(param_grads, params) if g is not None and not _is_table(call, p)]
        cope = state = None
        if call.contextual is not None:
            cope, state = call.contextual.block_scores(content[0], content[2], call.scale, call.visible(block),
                                                       shifted=call.far_from is not None)

        def add_gradients(grad_scores: Tensor) -> None:
            stream = grad_scores[..., block.n_sinks:]  # sinks have no map
            if grads.log_decay is not None:
                self._decay_gradient(block, stream, grads.log_decay)
            if rest is not None and wanted:
                # a map shared by the batch ([1, H, ...]) receives the batch's summed gradient
                shared = stream.sum(0, keepdim=True) if rest.shape[0] == 1 < stream.shape[0] else stream
                for (target, _), g in zip(wanted, torch.autograd.grad(rest, [t for _, t in wanted], shared,
                                                                       allow_unused=True)):
                    if g is not None:
                        target.add_(g)
            if state is not None:
                grad_logits, grad_q, grad_table = call.contextual.block_backward(state, stream, content[0], call.scale,
                                                                                 shifted=call.far_from is not None)
                content[1].add_(grad_q)
                for target, p in zip(param_grads, params):
                    if target is not None and _is_table(call, p):
                        target.add_(grad_table)
                stream.add_(grad_logits)  # last: the map's other gradients read dS without it

        additive = rest.detach() if rest is not None else None
        if cope is not None:
            additive = cope if additive is None else cope.add_(additive)
        return self._masked(block, additive, own=not wanted), add_gradients

    def _decay_gradient(self, block: QueryBlock, grad_scores: Tensor, grad_log_decay: Tensor) -> None:
        """FoX's term (times the query scale, if any) differentiated by its own hand (fox.py) from the
        map's gradient [B, H, L_b, K_b]."""
        scale = self.inputs.query_scale
        grad_decay = grad_scores if scale is None else grad_scores * scale[:, :, block.rows]
        self.call.decay.block_gradient(grad_decay, grad_log_decay, slice(self.call.n_mem + block.i0,
                                                                         self.call.n_mem + block.i1),
                                       slice(block.k0, block.n_keys))


def _is_table(call: AttentionCall, parameter: Tensor) -> bool:
    """Whether `parameter` is one CoPE's block_backward differentiates (its table)."""
    return call.contextual is not None and any(parameter is p for p in call.contextual.parameters())
