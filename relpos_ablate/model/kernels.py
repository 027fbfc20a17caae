"""Block-wise attention with an additive map that is rebuilt, not stored, for backward.

`F.scaled_dot_product_attention` with a learned additive mask falls back to its math kernel, which
keeps the [B, H, L, K] probabilities for backward: at L = 4096 that is ~10x the memory of attention
without positions. `BlockwiseBiasedAttention` keeps what FlashAttention keeps (q, k, v, the output,
the row log-sum-exp: O(L·d)) plus the per-distance tensors the map is built from, walks the query
blocks again in backward, and rebuilds each block's scores and map there.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from relpos_ablate.model.call import AttentionCall, QueryBlock, ScoreInputs


def masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over the visible keys; a query that sees no key gets probabilities 0 (not NaN, as
    SDPA and FlexAttention do) and passes no gradient back."""
    sees_none = ~visible.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if not sees_none.any():  # (the usual case: two passes over the map fewer)
        return scores.softmax(dim=-1)
    return scores.masked_fill(sees_none, 0.0).softmax(dim=-1).masked_fill(sees_none, 0.0)


def block_probabilities(call: AttentionCall, block: QueryBlock, q_content: Tensor, k: Tensor, additive: Tensor | None,
                        lse: Tensor | None = None):
    """Softmax of s·q_content·kᵀ + additive over visible keys (k: the block's sinks and keys), computed in
    place in one [B, H, L_b, S + K_b] buffer. Returns (probs, lse) with lse the row log-sum-exp [B, H, L_b, 1]."""
    scores = (q_content @ k.transpose(-1, -2)).mul_(call.scale)  # (B, H, L_b, dh) @ (B, H, dh, S + K_b)
    if additive is not None:
        scores.add_(call.with_sinks(additive, 0.0))
    scores.masked_fill_(~call.with_sinks(call.visible(block), True), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        # a query that sees no key has lse = -inf: 0 instead makes its probabilities exp(-inf) = 0, not NaN
        lse.masked_fill_(lse == float("-inf"), 0.0)
    return scores.sub_(lse).exp_(), lse


class BlockwiseBiasedAttention(torch.autograd.Function):
    """out = softmax(s·q_content·kᵀ + additive, masked)·v, block by block (see module docstring).

    The additive map of each block is `call.additive_scores` of the block's slices of the score inputs
    (ScoreInputs: q_position, rel_keys, distance_scores, log_decay, query_scale). `params` are module
    parameters it reads directly (FIRE's MLP); they get gradients through a rebuild of each block's map
    under autograd. Autocast is off inside, so that forward and the rebuild in backward compute the
    same thing in the inputs' dtype. k and v start with the call's sink slots.
    """

    @staticmethod
    def forward(ctx, call: AttentionCall, blocks: Sequence[QueryBlock], q_content: Tensor, k: Tensor, v: Tensor,
                *inputs_and_params: Tensor | None):
        inputs, params = ScoreInputs(*inputs_and_params[:N_INPUTS]), inputs_and_params[N_INPUTS:]
        b, h, lq, _ = q_content.shape
        out = v.new_empty(b, h, lq, v.shape[-1])
        lse = q_content.new_empty(b, h, lq, 1)
        with torch.autocast(q_content.device.type, enabled=False):
            for blk in blocks:
                additive = call.additive_scores(blk, call.block_inputs(blk, inputs))
                probs, lse[:, :, blk.rows] = block_probabilities(
                    call, blk, q_content[:, :, blk.rows], k[:, :, blk.keys], additive)
                out[:, :, blk.rows] = probs @ v[:, :, blk.keys]
        ctx.call, ctx.blocks, ctx.params = call, blocks, params
        ctx.save_for_backward(q_content, k, v, *inputs, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return (None, None, *_backward(ctx, grad_out))


N_INPUTS = len(ScoreInputs._fields)


def _backward(ctx, grad_out: Tensor):
    """Gradients of q_content, k, v, the score inputs and the params, block by block."""
    call, first_param = ctx.call, 5 + N_INPUTS  # forward's inputs: call, blocks, q_content, k, v, score inputs, params
    q_content, k, v, *position_inputs, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.zeros_like(q_content), torch.zeros_like(k), torch.zeros_like(v)
    position_grads = ScoreInputs(*(None if t is None or not need else torch.zeros_like(t)
                                   for t, need in zip(position_inputs, ctx.needs_input_grad[5:first_param])))
    param_grads = [torch.zeros_like(p) if need else None
                   for p, need in zip(ctx.params, ctx.needs_input_grad[first_param:])]
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dP ∘ P) = rowsum(dO ∘ O)
    for blk in ctx.blocks:
        rows, keys = blk.rows, blk.keys
        sliced = call.block_inputs(blk, ScoreInputs(*position_inputs))
        with torch.enable_grad():
            leaves = ScoreInputs(*(None if t is None else t.detach().requires_grad_(g is not None)
                                   for t, g in zip(sliced, position_grads)))
            additive = call.additive_scores(blk, leaves)
        with torch.no_grad():
            q_b, k_b, v_b, go = q_content[:, :, rows], k[:, :, keys], v[:, :, keys], grad_out[:, :, rows]
            detached = None if additive is None else additive.detach()
            probs, _ = block_probabilities(call, blk, q_b, k_b, detached, lse[:, :, rows])
            grad_v[:, :, keys] += probs.transpose(-1, -2) @ go  # (B, H, K_b, L_b) @ (B, H, L_b, dh)
            grad_scores = probs.mul_((go @ v_b.transpose(-1, -2)).sub_(delta[:, :, rows]))  # P ∘ (dP - delta)
            grad_q[:, :, rows] += (grad_scores @ k_b).mul_(call.scale)
            grad_k[:, :, keys] += (grad_scores.transpose(-1, -2) @ q_b).mul_(call.scale)
        grad_views = call.block_inputs(blk, position_grads)  # the block's places in the whole gradients
        wanted = [(view, leaf) for view, leaf in zip(grad_views, leaves) if view is not None]
        wanted += [(g, p) for g, p in zip(param_grads, ctx.params) if g is not None]
        if additive is None or not wanted:
            continue
        # a map shared by the batch ([1, H, ...]) receives the batch's summed gradient; sinks have no map
        grad_scores = grad_scores[..., blk.n_sinks:]
        reduced = grad_scores.sum(0, keepdim=True) if additive.shape[0] == 1 < grad_scores.shape[0] else grad_scores
        block_grads = torch.autograd.grad(additive, [t for _, t in wanted], reduced, allow_unused=True)
        for (target, _), g in zip(wanted, block_grads):
            if g is not None:
                target.add_(g)
    return (grad_q, grad_k, grad_v, *position_grads, *param_grads)
