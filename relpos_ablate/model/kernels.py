"""Block-wise attention with an additive bias that is rebuilt, not stored, for backward.

`F.scaled_dot_product_attention` with a learned additive mask falls back to its math kernel, which
keeps the [B, H, L, K] probabilities for backward: at L = 4096 that is ~10x the memory of attention
without positions. `BlockwiseBiasedAttention` keeps what FlashAttention keeps (q, k, v, the output,
the row log-sum-exp: O(L·d)) plus the per-distance tensors the bias is built from, walks the query
blocks again in backward, and rebuilds each block's scores and bias there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Block:
    """Queries i0..i1-1 against keys 0..n_keys-1; r_cols / curve_cols: the columns of the
    per-distance tensors this block reads."""

    i0: int
    i1: int
    n_keys: int
    r_cols: slice
    curve_cols: slice


class BlockPlan(Protocol):
    """What the attention module tells the kernel: the blocks, their masks and how to build a bias."""

    blocks: Sequence[Block]
    scale: float

    def visible(self, block: Block) -> Tensor:
        """Bool [L_b, K_b] or [B, 1, L_b, K_b]."""

    def bias(self, block: Block, qb: Tensor | None, r: Tensor | None, curve: Tensor | None) -> Tensor:
        """Additive scores [B or 1, H, L_b, K_b] from the block's slices of qb, r and curve."""


def common_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype the given tensors (None skipped) promote to."""
    dtypes = [t.dtype for t in tensors if t is not None]
    return functools.reduce(torch.promote_types, dtypes)


def _slice(t: Tensor | None, dim: int, cols: slice) -> Tensor | None:
    return None if t is None else t.narrow(dim, cols.start, cols.stop - cols.start)


def block_inputs(block: Block, qb: Tensor | None, r: Tensor | None, curve: Tensor | None):
    """The parts of the position query [B, H, L, dh] and the per-distance tensors r [H, n, dh] and
    curve [H, n] that `block` reads (None stays None)."""
    return _slice(qb, 2, slice(block.i0, block.i1)), _slice(r, 1, block.r_cols), _slice(curve, 1, block.curve_cols)


def _probabilities(plan: BlockPlan, block: Block, qc: Tensor, k: Tensor, bias: Tensor, lse: Tensor | None = None):
    """Softmax of scale·qc·kᵀ + bias over visible keys, computed in place in one [B, H, L_b, K_b] buffer.
    Returns (probs, lse) with lse the row log-sum-exp [B, H, L_b, 1]."""
    scores = qc @ k.transpose(-1, -2)
    scores.mul_(plan.scale).add_(bias).masked_fill_(~plan.visible(block), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        # a query that sees no key has lse = -inf: 0 instead makes its probabilities exp(-inf) = 0, not NaN
        lse.masked_fill_(lse == float("-inf"), 0.0)
    return scores.sub_(lse).exp_(), lse


def masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over the visible keys; a query that sees no key gets probabilities 0 (not NaN, as
    SDPA and FlexAttention do) and passes no gradient back."""
    sees_none = ~visible.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(sees_none, 0.0)
    return scores.softmax(dim=-1).masked_fill(sees_none, 0.0)


class BlockwiseBiasedAttention(torch.autograd.Function):
    """out = softmax(scale·qc·kᵀ + bias, masked)·v, block by block (see module docstring).

    `params` are module parameters the plan's bias reads directly (FIRE's MLP); they get gradients
    through a rebuild of each block's bias under autograd.
    """

    @staticmethod
    def forward(ctx, plan: BlockPlan, qc: Tensor, k: Tensor, v: Tensor, qb: Tensor | None, r: Tensor | None,
                curve: Tensor | None, *params: Tensor):
        with torch.autocast(qc.device.type, enabled=False):  # backward rebuilds in the inputs' dtype: so does forward
            return BlockwiseBiasedAttention._forward(ctx, plan, qc, k, v, qb, r, curve, *params)

    @staticmethod
    def _forward(ctx, plan, qc, k, v, qb, r, curve, *params):
        b, h, lq, _ = qc.shape
        out = v.new_empty(b, h, lq, v.shape[-1])
        lse = qc.new_empty(b, h, lq, 1)
        for blk in plan.blocks:
            rows = slice(blk.i0, blk.i1)
            bias = plan.bias(blk, *block_inputs(blk, qb, r, curve))
            probs, lse[:, :, rows] = _probabilities(plan, blk, qc[:, :, rows], k[:, :, : blk.n_keys], bias)
            out[:, :, rows] = probs @ v[:, :, : blk.n_keys]
        ctx.plan, ctx.params = plan, params
        ctx.save_for_backward(qc, k, v, qb, r, curve, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return BlockwiseBiasedAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        plan = ctx.plan
        qc, k, v, qb, r, curve, out, lse = ctx.saved_tensors
        need_qb, need_r, need_curve = ctx.needs_input_grad[4:7]
        need_params = ctx.needs_input_grad[7:]
        grad_qc, grad_k, grad_v = torch.zeros_like(qc), torch.zeros_like(k), torch.zeros_like(v)
        grads = {name: None if t is None or not need else torch.zeros_like(t)
                 for name, t, need in (("qb", qb, need_qb), ("r", r, need_r), ("curve", curve, need_curve))}
        grad_params = [torch.zeros_like(p) if need else None for p, need in zip(ctx.params, need_params)]
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dP ∘ P) = rowsum(dO ∘ O)
        for blk in plan.blocks:
            rows, keys = slice(blk.i0, blk.i1), slice(0, blk.n_keys)
            inputs = {"qb": (_slice(qb, 2, rows), 2, rows), "r": (_slice(r, 1, blk.r_cols), 1, blk.r_cols),
                      "curve": (_slice(curve, 1, blk.curve_cols), 1, blk.curve_cols)}
            with torch.enable_grad():
                leaves = {n: None if t is None else t.detach().requires_grad_(grads[n] is not None)
                          for n, (t, _, _) in inputs.items()}
                bias = plan.bias(blk, leaves["qb"], leaves["r"], leaves["curve"])
            with torch.no_grad():
                qc_b, k_b, v_b, go = qc[:, :, rows], k[:, :, keys], v[:, :, keys], grad_out[:, :, rows]
                probs, _ = _probabilities(plan, blk, qc_b, k_b, bias.detach(), lse[:, :, rows])
                grad_v[:, :, keys] += probs.transpose(-1, -2) @ go
                grad_scores = probs.mul_((go @ v_b.transpose(-1, -2)).sub_(delta[:, :, rows]))  # P ∘ (dP - delta)
                grad_qc[:, :, rows] += (grad_scores @ k_b).mul_(plan.scale)
                grad_k[:, :, keys] += (grad_scores.transpose(-1, -2) @ qc_b).mul_(plan.scale)
            wanted = [(n, leaves[n]) for n in leaves if grads[n] is not None]
            wanted += [(i, p) for i, p in enumerate(ctx.params) if grad_params[i] is not None]
            if not wanted:
                continue
            reduced = grad_scores.sum(0, keepdim=True) if bias.shape[0] == 1 < grad_scores.shape[0] else grad_scores
            block_grads = torch.autograd.grad(bias, [t for _, t in wanted], reduced, allow_unused=True)
            for (name, _), g in zip(wanted, block_grads):
                if g is None:
                    continue
                if isinstance(name, int):
                    grad_params[name] += g
                else:
                    _, dim, cols = inputs[name]
                    grads[name].narrow(dim, cols.start, cols.stop - cols.start).add_(g)
        return (None, grad_qc, grad_k, grad_v, grads["qb"], grads["r"], grads["curve"], *grad_params)


def blockwise_biased_attention(plan: BlockPlan, qc: Tensor, k: Tensor, v: Tensor, qb: Tensor | None,
                               r: Tensor | None, curve: Tensor | None, params: Sequence[Tensor] = ()) -> Tensor:
    """[B, H, L, dh] attention output; see BlockwiseBiasedAttention."""
    return BlockwiseBiasedAttention.apply(plan, qc, k, v, qb, r, curve, *params)
