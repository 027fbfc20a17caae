"""Block-wise attention with an additive map: FlashAttention's memory, the map rebuilt in backward.

`F.scaled_dot_product_attention` with a learned additive mask falls back to its math kernel, which
keeps the [B, H, L, K] probabilities for backward: at L = 4096 that is ~10x the memory of attention
without positions. `BlockwiseBiasedAttention` keeps what FlashAttention keeps (q, k, v, the output,
the row log-sum-exp: O(L·d)) plus the tensors the map is built from.

Forward: per query block, the map as block_maps.py lays it out (a strided view of per-distance
tensors where the map depends on the distance alone, else materialised) and one call of the CPU
flash kernel, which adds it to each tile of scores and never writes scores or probabilities out
(other devices: the same in tensor ops). Backward: per block, scores and map rebuilt and
FlashAttention-2's gradients in five products (P = exp(s·q·kᵀ + map - lse); dV = Pᵀ·dO; dS = P ∘
(dO·Vᵀ - rowsum(dO ∘ O)); dQ = s·dS·K;
dK = s·dSᵀ·Q), dS then reduced onto the map's inputs (block_maps.py); maps of the distance
(block_maps.StridedMaps) have a loop of their own (`block_maps.strided_backward`: fewer passes over
each tile, dK and dV summed per range of keys). A map whose inputs need no gradient (a fixed curve)
leaves dQ, dK, dV to the CPU flash kernel's own backward. A band call (`far_from` set: band.py)
computes its band here and adds the pairs beyond it from the causal flash kernel, forward and
backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos_ablate.model.core.call import AttentionCall, QueryBlock, ScoreInputs
from relpos_ablate.model.kernels import band
from relpos_ablate.model.kernels.block_maps import (
    LOG2_E,
    StridedMaps,
    accumulate,
    flip_rows,
    strided_backward,
)
from relpos_ablate.model.kernels.materialised_maps import MaterialisedMaps


def masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over the visible keys; a query that sees no key gets probabilities 0 (not NaN, as
    SDPA and FlexAttention do) and passes no gradient back."""
    sees_none = ~visible.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if not sees_none.any():  # (the usual case: two passes over the map fewer)
        return scores.softmax(dim=-1)
    return scores.masked_fill(sees_none, 0.0).softmax(dim=-1).masked_fill(sees_none, 0.0)


def _fused(q: Tensor) -> bool:
    """Whether the CPU flash kernel takes these blocks (it runs on CPU tensors only)."""
    return q.device.type == "cpu"


def _probabilities(q: Tensor, k: Tensor, mask: Tensor, lse: Tensor, scale: float) -> Tensor:
    """exp(s·q·kᵀ + mask - lse) in one [B, H, L_b, K_b] buffer: the mask minus the row log-sum-exp
    written once, the product added onto it (lse [B, H, L_b, 1])."""
    b, h, lq, dh = q.shape
    # written into a row-major buffer: from the strided views of block_maps.py alone, broadcasting
    # would lay the result out column by column
    scores = torch.sub(mask, lse, out=q.new_empty(b, h, lq, k.shape[2]))
    scores.view(b * h, lq, -1).baddbmm_(
        q.reshape(b * h, lq, dh), k.transpose(-1, -2).reshape(b * h, dh, -1), alpha=scale
    )
    # as 2^(x·log2 e): torch's exp takes a slow path below about -87 (4-10x slower there, and a
    # cumulative decay puts most of a row there), its exp2 does not
    return torch.exp2(scores.mul_(LOG2_E), out=scores)


def _attend_block(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """(out [B, H, L_b, dh], lse [B, H, L_b, 1]) of softmax(s·q·kᵀ + mask)·v; a query whose keys are
    all -inf gets output 0 and lse 0."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse[..., None]
    scores = (q @ k.transpose(-1, -2)).mul_(scale).add_(mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    lse.masked_fill_(lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0, not NaN
    return scores.sub_(lse).exp_() @ v, lse


def _merged(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(out, lse) of a block from those of its key tiles: lse = log Σ e^lse_t, out = Σ e^(lse_t -
    lse)·out_t (every query sees a key of every tile: call.key_tiles)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([lse_t for _, lse_t in parts]), dim=0)
    out = sum(out_t * (lse_t - lse).exp() for out_t, lse_t in parts)
    return out, lse


class BlockwiseBiasedAttention(torch.autograd.Function):
    """out = softmax(s·q_content·kᵀ + map, masked)·v, block by block (see module docstring).

    The map of each block is built from the score inputs (ScoreInputs: q_position, rel_keys,
    distance_scores, query_scale) and the call's terms, whose tensors follow the inputs
    (call.term_tensors), then the module parameters the terms read directly (call.term_parameters);
    they get gradients through a rebuild of each block's map under autograd, or from the terms' hand
    forms. Autocast
    is off inside, so that forward and the rebuild in backward compute the same thing in the inputs'
    dtype. k and v start with the call's sink slots.
    """

    @staticmethod
    def forward(
        ctx,
        call: AttentionCall,
        q_content: Tensor,
        k: Tensor,
        v: Tensor,
        *tensors: Tensor | None,
    ):
        inputs = ScoreInputs(*tensors[:N_INPUTS])
        n_terms = len(call.term_tensors())
        term_tensors = tensors[N_INPUTS : N_INPUTS + n_terms]
        params = tensors[N_INPUTS + n_terms :]
        call = call.with_term_tensors(list(term_tensors))
        b, h, lq, d_head = q_content.shape
        out = v.new_empty(b, h, lq, v.shape[-1])
        lse = q_content.new_empty(b, h, lq, 1)
        with torch.autocast(q_content.device.type, enabled=False):
            maps = block_maps(call, inputs)
            for tiles in maps.forward_blocks(call, d_head):
                rows = tiles[0].rows
                q_b = flip_rows(q_content[:, :, rows], maps.reversed)
                out_b, lse_b = _merged(
                    [
                        _attend_block(
                            q_b,
                            k[:, :, t.keys],
                            v[:, :, t.keys],
                            maps.additive_map(t, q_b, k[:, :, _stream(t)]),
                            call.scale,
                        )
                        for t in tiles
                    ]
                )
                out[:, :, rows], lse[:, :, rows] = (
                    flip_rows(out_b, maps.reversed),
                    flip_rows(lse_b, maps.reversed),
                )
            # the pairs the band leaves to the causal flash kernel (band.py)
            if call.far_from is not None:
                band.add_far(call, q_content, k, v, out, lse)
        ctx.call, ctx.params = call, params
        ctx.save_for_backward(q_content, k, v, *inputs, *term_tensors, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return (None, *_backward(ctx, grad_out))


N_INPUTS = len(ScoreInputs._fields)


def block_maps(call: AttentionCall, inputs: ScoreInputs) -> StridedMaps | MaterialisedMaps:
    """The layout of this call's maps: strided views when they depend on the distance alone."""
    per_distance = inputs.distance_scores is not None or inputs.rel_keys is not None
    strided = (
        per_distance
        and call.consecutive
        and not call.masked_per_row
        and not call.n_sinks
        and not call.terms
        and inputs.query_scale is None
    )
    return StridedMaps(call, inputs) if strided else MaterialisedMaps(call, inputs)


def _stream(block: QueryBlock) -> slice:
    """The block's keys of the stream among the kernels' keys (after the sinks)."""
    return slice(block.n_sinks + block.k0, block.n_sinks + block.n_keys)


def _add_product(target: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """target += alpha·a @ b for [B, H, ., .] tensors (target often a slice along dim 2, which
    baddbmm_ would update one matrix at a time)."""
    target.add_(a @ b, alpha=alpha)


def _backward(ctx, grad_out: Tensor):
    """Gradients of q_content, k, v, the score inputs and the params, block by block, tile by
    tile."""
    # forward's inputs: call, q_content, k, v, score inputs, the terms' tensors, params
    call = ctx.call
    q_content, k, v, *saved, out, lse = ctx.saved_tensors
    inputs, d_head = ScoreInputs(*saved[:N_INPUTS]), q_content.shape[-1]
    term_tensors = saved[N_INPUTS:]  # (the call's terms hold them too)
    first_term, first_param = 4 + N_INPUTS, 4 + N_INPUTS + len(term_tensors)
    grad_q, grad_k, grad_v = (t.new_zeros(t.shape) for t in (q_content, k, v))
    grads = ScoreInputs(
        *(
            None if t is None or not need else torch.zeros_like(t)
            for t, need in zip(inputs, ctx.needs_input_grad[4:first_term])
        )
    )
    term_grads = [
        torch.zeros_like(t) if need else None
        for t, need in zip(term_tensors, ctx.needs_input_grad[first_term:first_param])
    ]
    param_grads = [
        torch.zeros_like(p) if need else None
        for p, need in zip(ctx.params, ctx.needs_input_grad[first_param:])
    ]
    if call.far_from is not None:
        band.far_backward(call, grad_out, q_content, k, v, out, lse, grad_q, grad_k, grad_v)
    maps = block_maps(call, inputs)
    flip = maps.reversed
    if _fused(q_content) and all(g is None for g in (*grads, *term_grads, *param_grads)):
        # the fused backward does it all
        for blk in (t for tiles in maps.forward_blocks(call, d_head) for t in tiles):
            rows, keys = blk.rows, blk.keys
            grads_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                flip_rows(grad_out[:, :, rows], flip),
                flip_rows(q_content[:, :, rows], flip),
                k[:, :, keys],
                v[:, :, keys],
                flip_rows(out[:, :, rows], flip),
                flip_rows(lse[:, :, rows, 0], flip),
                0.0,
                False,
                attn_mask=maps.additive_map(blk),
                scale=call.scale,
            )
            grad_q[:, :, rows] += flip_rows(grads_b[0], flip)
            grad_k[:, :, keys] += grads_b[1]
            grad_v[:, :, keys] += grads_b[2]
        return (grad_q, grad_k, grad_v, *grads, *term_grads, *param_grads)
    # -rowsum(dP ∘ P) = -rowsum(dO ∘ O)
    minus_delta = (grad_out * out).sum(dim=-1, keepdim=True).neg_()
    # dP - delta as one product: [dO, -delta]·[V, 1]ᵀ
    v_ones = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    if isinstance(maps, StridedMaps):
        strided_backward(
            maps,
            call,
            grad_out,
            q_content,
            k,
            v_ones,
            lse,
            minus_delta,
            grad_q,
            grad_k,
            grad_v,
            grads,
        )
        return (grad_q, grad_k, grad_v, *grads, *term_grads, *param_grads)
    # q and grad_out come in the projections' (B, L, H, dh) layout: copied once here, where each
    # tile's products would copy their rows (a query-position bias at L = 4096: 448 copies, 29 ms);
    # not in forward or above, where the copy of q would be kept beside its original (peak memory
    # +0.1x for every scheme on this kernel, a learned R table's 1.99x at 4096)
    q_content, grad_out = q_content.contiguous(), grad_out.contiguous()
    # materialised maps (rows in order): by ranges of keys, dK and dV summed in one contiguous
    # buffer per range (as strided_backward); sinks and content terms (rows = 0) by query blocks,
    # each its tiles
    groups = (
        maps.key_tiles(call, d_head)
        if maps.rows
        else [(None, tiles) for tiles in maps.backward_blocks(call, d_head)]
    )
    batch, heads = q_content.shape[:2]
    for key_range, tiles in groups:
        if key_range is not None:
            grad_k_g, grad_v_g = (
                q_content.new_zeros(batch * heads, key_range.stop - key_range.start, d_head)
                for _ in range(2)
            )
        for tile in tiles:
            rows, keys = tile.rows, tile.keys
            q_b, go, lse_b, minus_delta_b = (
                t[:, :, rows] for t in (q_content, grad_out, lse, minus_delta)
            )
            grad_q_b = grad_q[:, :, rows]
            content = (q_content[:, :, rows], grad_q_b, k[:, :, _stream(tile)])
            mask, add_map_gradient = maps.rebuilt(tile, grads, term_grads, param_grads, content)
            with torch.no_grad():
                k_t, v_t = k[:, :, keys], v[:, :, keys]
                probs = _probabilities(q_b, k_t, mask, lse_b, call.scale)
                if key_range is not None:
                    cols = slice(tile.k0 - key_range.start, tile.n_keys - key_range.start)
                    # dV += Pᵀ·dO
                    accumulate(
                        grad_v_g, cols, probs.flatten(0, 1).transpose(1, 2), go.flatten(0, 1)
                    )
                else:
                    grad_v_t = (
                        grad_v[:, :, keys] if isinstance(keys, slice) else torch.zeros_like(v_t)
                    )
                    _add_product(grad_v_t, probs.transpose(-1, -2), go)
                go_delta = torch.cat([go, minus_delta_b], dim=-1).flatten(0, 1)
                # dO·Vᵀ - delta
                grad_probs = torch.bmm(go_delta, v_ones[:, :, keys].flatten(0, 1).transpose(1, 2))
                grad_scores = probs.mul_(grad_probs.view_as(probs))  # dS = P ∘ (dP - delta)
                add_map_gradient(grad_scores)  # (a term that reads s·q·kᵀ adds to dS)
                _add_product(grad_q_b, grad_scores, k_t, alpha=call.scale)
                if key_range is not None:
                    accumulate(
                        grad_k_g,
                        cols,
                        grad_scores.flatten(0, 1).transpose(1, 2),
                        q_b.flatten(0, 1),
                        alpha=call.scale,
                    )
                    continue
                grad_k_t = grad_k[:, :, keys] if isinstance(keys, slice) else torch.zeros_like(k_t)
                _add_product(grad_k_t, grad_scores.transpose(-1, -2), q_b, alpha=call.scale)
                # sinks in front of skipped keys: two ranges, a copy
                if not isinstance(keys, slice):
                    grad_k[:, :, keys] += grad_k_t
                    grad_v[:, :, keys] += grad_v_t
        if key_range is not None:
            grad_k[:, :, key_range] += grad_k_g.view_as(grad_k[:, :, key_range])
            grad_v[:, :, key_range] += grad_v_g.view_as(grad_v[:, :, key_range])
    maps.finish(param_grads)
    return (grad_q, grad_k, grad_v, *grads, *term_grads, *param_grads)
