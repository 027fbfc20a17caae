"""Block-wise attention with an additive map: FlashAttention's memory, the map rebuilt in backward.

`F.scaled_dot_product_attention` with a learned additive mask falls back to its math kernel, which keeps
the [B, H, L, K] probabilities for backward: at L = 4096 that is ~10x the memory of attention without
positions. `BlockwiseBiasedAttention` keeps what FlashAttention keeps (q, k, v, the output, the row
log-sum-exp: O(L·d)) plus the tensors the map is built from.

Forward: per query block, the map as block_maps.py lays it out (a strided view of per-distance tensors
where the map depends on the distance alone, else materialised) and one call of the CPU flash kernel,
which adds it to each tile of scores and never writes scores or probabilities out (other devices: the
same in tensor ops). Backward: per block, scores and map rebuilt and FlashAttention-2's gradients in five
products (P = exp(s·q·kᵀ + map - lse); dV = Pᵀ·dO; dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O)); dQ = s·dS·K;
dK = s·dSᵀ·Q), dS then reduced onto the map's inputs (block_maps.py). A map whose inputs need no gradient
(fixed ALiBi, Sandwich) leaves dQ, dK, dV to the CPU flash kernel's own backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from relpos_ablate.model.block_maps import block_maps
from relpos_ablate.model.call import AttentionCall, ScoreInputs


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


def _probabilities(q_scaled: Tensor, k: Tensor, mask: Tensor, lse: Tensor) -> Tensor:
    """exp(s·q·kᵀ + mask - lse) in one [B, H, L_b, K_b] buffer: the mask minus the row log-sum-exp written
    once, the product added onto it (q_scaled = s·q; lse [B, H, L_b, 1])."""
    b, h, lq, dh = q_scaled.shape
    # written into a row-major buffer: from the strided views of block_maps.py alone, broadcasting would
    # lay the result out column by column
    scores = torch.sub(mask, lse, out=q_scaled.new_empty(b, h, lq, k.shape[2]))
    scores.view(b * h, lq, -1).baddbmm_(q_scaled.reshape(b * h, lq, dh), k.transpose(-1, -2).reshape(b * h, dh, -1))
    return scores.exp_()


def _attend_block(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, H, L_b, dh], lse [B, H, L_b, 1]) of softmax(s·q·kᵀ + mask)·v; a query whose keys are all
    -inf gets output 0 and lse 0."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                              scale=scale)
        return out, lse[..., None]
    scores = (q @ k.transpose(-1, -2)).mul_(scale).add_(mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    lse.masked_fill_(lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0, not NaN
    return scores.sub_(lse).exp_() @ v, lse


class BlockScores(NamedTuple):
    """Score entries per head in one query block (AttentionCall.blocks): `built` where the block's map or
    scores are written out (forward with a materialised map or term b, every backward block), `viewed`
    where the fused kernel reads the map as a view (it keeps its tiles in cache)."""

    built: int
    viewed: int


def _flip(t: Tensor, flipped: bool) -> Tensor:
    return t.flip(2) if flipped else t


class BlockwiseBiasedAttention(torch.autograd.Function):
    """out = softmax(s·q_content·kᵀ + map, masked)·v, block by block (see module docstring).

    The map of each block is built from the score inputs (ScoreInputs: q_position, rel_keys,
    distance_scores, log_decay, query_scale). `params` are module parameters it reads directly (FIRE's
    MLP); they get gradients through a rebuild of each block's map under autograd. Autocast is off inside,
    so that forward and the rebuild in backward compute the same thing in the inputs' dtype. k and v start
    with the call's sink slots.
    """

    @staticmethod
    def forward(ctx, call: AttentionCall, block_scores: BlockScores, q_content: Tensor, k: Tensor, v: Tensor,
                *inputs_and_params: Tensor | None):
        inputs, params = ScoreInputs(*inputs_and_params[:N_INPUTS]), inputs_and_params[N_INPUTS:]
        b, h, lq, _ = q_content.shape
        out = v.new_empty(b, h, lq, v.shape[-1])
        lse = q_content.new_empty(b, h, lq, 1)
        with torch.autocast(q_content.device.type, enabled=False):
            maps = block_maps(call, inputs)
            for blk in call.blocks(block_scores.viewed if maps.reversed else maps.block_scores(block_scores.built),
                                   windowed=True):
                q_b = _flip(q_content[:, :, blk.rows], maps.reversed)
                out_b, lse_b = _attend_block(q_b, k[:, :, blk.keys], v[:, :, blk.keys], maps.mask(blk), call.scale)
                out[:, :, blk.rows], lse[:, :, blk.rows] = _flip(out_b, maps.reversed), _flip(lse_b, maps.reversed)
        ctx.call, ctx.blocks, ctx.params = call, call.blocks(maps.block_scores(block_scores.built), windowed=True), params
        ctx.save_for_backward(q_content, k, v, *inputs, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return (None, None, *_backward(ctx, grad_out.contiguous()))


N_INPUTS = len(ScoreInputs._fields)


def _backward(ctx, grad_out: Tensor):
    """Gradients of q_content, k, v, the score inputs and the params, block by block."""
    call, first_param = ctx.call, 5 + N_INPUTS  # forward's inputs: call, block_scores, q_content, k, v, score inputs, params
    q_content, k, v, *score_inputs, out, lse = ctx.saved_tensors
    inputs = ScoreInputs(*score_inputs)
    grad_q, grad_k, grad_v = torch.zeros_like(q_content), torch.zeros_like(k), torch.zeros_like(v)
    grads = ScoreInputs(*(None if t is None or not need else torch.zeros_like(t)
                          for t, need in zip(inputs, ctx.needs_input_grad[5:first_param])))
    param_grads = [torch.zeros_like(p) if need else None for p, need in zip(ctx.params, ctx.needs_input_grad[first_param:])]
    maps = block_maps(call, inputs)
    if _fused(q_content) and all(g is None for g in (*grads, *param_grads)):
        for blk in ctx.blocks:  # nothing to reduce the map's gradient onto: the fused backward does it all
            rows, keys, flip = blk.rows, blk.keys, maps.reversed
            grads_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _flip(grad_out[:, :, rows], flip), _flip(q_content[:, :, rows], flip), k[:, :, keys], v[:, :, keys],
                _flip(out[:, :, rows], flip), _flip(lse[:, :, rows, 0], flip), 0.0, False, attn_mask=maps.mask(blk),
                scale=call.scale)
            grad_q[:, :, rows] += _flip(grads_b[0], flip)
            grad_k[:, :, keys] += grads_b[1]
            grad_v[:, :, keys] += grads_b[2]
        return (grad_q, grad_k, grad_v, *grads, *param_grads)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dP ∘ P) = rowsum(dO ∘ O)
    q_scaled = q_content * call.scale
    for blk in ctx.blocks:
        rows, keys, flip = blk.rows, blk.keys, maps.reversed
        mask, add_map_gradient = maps.rebuilt(blk, grads, ctx.params, param_grads)
        with torch.no_grad():
            q_b, go = _flip(q_scaled[:, :, rows], flip), _flip(grad_out[:, :, rows], flip)
            k_b, v_b = k[:, :, keys], v[:, :, keys]
            probs = _probabilities(q_b, k_b, mask, _flip(lse[:, :, rows], flip))
            grad_v[:, :, keys] += probs.transpose(-1, -2) @ go  # (B, H, K_b, L_b) @ (B, H, L_b, dh)
            grad_scores = probs.mul_((go @ v_b.transpose(-1, -2)).sub_(_flip(delta[:, :, rows], flip)))  # dS
            grad_q[:, :, rows] += _flip((grad_scores @ k_b).mul_(call.scale), flip)
            grad_k[:, :, keys] += grad_scores.transpose(-1, -2) @ q_b
            add_map_gradient(grad_scores)
    return (grad_q, grad_k, grad_v, *grads, *param_grads)
