"""Biases that are a key's offset up to a per-query constant ride on SDPA's flash kernel: no score map.

ALiBi's -m·(i' - j) is m·j - m·i', and FoX's D_ij = Λ_i' - Λ_j is (-Λ_j) - (-Λ_i'): both are e_j - e_i'
with a key offset e (ALiBi, learned ALiBi: e_j = s_B·m_h·j; FoX: e_j = -Λ_j; both: the sum). The softmax
ignores the per-query constant -e_i', so the scores are s·q_i·k_j + e_j, which SDPA computes with one more
channel: q gets a channel of ones, k the channel e_j / s (v a channel of zeros: the CPU kernel wants one
head width), each padded with zeros to EXTRA channels. Causal only (bidirectional ALiBi's |i - j| is not of this form).

Rounding: e grows with the context (m·j up to m·K; Λ without bound), and a score s·q·k + e_j in fp32 carries
an error of about 2^-24·|e_j|. So the queries go in blocks, and each block's keys get e_j - e_c, c the block's
middle query: the keys a query of the block attends to most (its near ones) then carry offsets of at most
half the block's spread, the far ones large negative offsets whose weights are below fp32's resolution anyway.
The differences are taken in float64 and cast to fp32 once. `block_size` picks the largest block (a power of
two) whose offsets spread over at most SPREAD_LIMIT; a call that needs blocks below MIN_BLOCK (a gate near 0,
a slope grown large) is not taken here (None: the caller takes another kernel).

Per block the keys before it (no mask) and its own keys (causal) are two flash calls merged by their
log-sum-exps; the blocks' own parts are one batched call. Backward calls the flash backward per part with
the merged output and log-sum-exp (each part's probabilities are then exact); the gradient of e is the key
channel's gradient times 1/s, minus its sum at each block's middle key c. CPU only (the CPU flash
kernel's ops); CUDA takes FlexAttention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos_ablate.model.kernels.call import AttentionCall

SPREAD_LIMIT = 128.0  # largest spread of e over one block's queries: offsets within ±64, fp32 rounding ≤ ~4e-6
MIN_BLOCK, MAX_BLOCK = 64, 1024
# channels added to the head (the offset's, then zeros, which add nothing to a product): at L = 4096 this kernel
# took 5-15% less time with heads of 72 channels than of 65 (AMD EPYC, torch 2.13, the CPU flash kernel's
# backward; benchmarks/results/compare_revisions_low_rank_width.md)
EXTRA = 8

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def key_offsets(call: AttentionCall) -> Tensor | None:
    """e [B or 1, H, K] float64 of a call whose every additive term is a key offset (ALiBi's s_B·m_h·j, FoX's
    -Λ_j), else None: causal, consecutive positions, no window, key padding, sinks, query scale, term b or d,
    query-dependent bias or CoPE."""
    inputs = call.inputs
    if not call.plain_causal or inputs.rel_keys is not None or (
            inputs.distance_scores is not None and call.linear_bias is None):
        return None
    if call.linear_bias is not None and bool((call.linear_bias < 0).any()):
        return None  # a slope below 0 (a scheme of your own) grows e toward the past: its far keys would round
    offsets = None
    if call.linear_bias is not None:
        keys = torch.arange(call.n_keys, dtype=torch.float64, device=call.linear_bias.device)
        offsets = (call.linear_bias.double()[:, None] * keys)[None]  # (1, H, K)
    if inputs.log_decay is not None:
        offsets = -inputs.log_decay if offsets is None else offsets - inputs.log_decay
    return offsets


def attend_low_rank(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block: int) -> Tensor:
    """The call on the low-rank kernel: q (the content query), k, v in fp32 at least (the offsets' rounding
    argument is fp32's), back in the call's dtype."""
    wide = torch.promote_types(q.dtype, torch.float32)
    out = KeyOffsetAttention.apply(q.to(wide), k.to(wide), v.to(wide), offsets, call.scale, block)
    return out.to(q.dtype)


def block_size(key_offsets: Tensor, n_queries: int) -> int | None:
    """The largest power-of-two query block (MIN_BLOCK .. MAX_BLOCK) whose offsets spread over at most
    SPREAD_LIMIT (e is non-decreasing: the spread of a block is e at its last query minus e at its first);
    None where even MIN_BLOCK spreads wider."""
    queries = key_offsets[..., key_offsets.shape[-1] - n_queries:].detach()
    size = MAX_BLOCK
    while size >= MIN_BLOCK:
        starts = queries[..., ::size]
        ends = queries[..., size - 1::size]
        last = queries[..., -1:] if n_queries % size else queries[..., :0]  # a short last block
        spread = torch.cat([ends - starts[..., :ends.shape[-1]], last - starts[..., ends.shape[-1]:]], dim=-1)
        if spread.numel() == 0 or float(spread.abs().max()) <= SPREAD_LIMIT:
            return min(size, max(n_queries, 1))
        size //= 2
    return None


class _Layout:
    """The blocks of one call: block b has queries i0 = b·size .. i1 and key index c of its middle query."""

    def __init__(self, n_queries: int, n_mem: int, size: int):
        self.n_queries, self.n_mem, self.size = n_queries, n_mem, size
        self.blocks = [(i0, min(i0 + size, n_queries)) for i0 in range(0, n_queries, size)]
        self.n_full = n_queries // size

    def centre(self, i0: int, i1: int) -> int:
        return self.n_mem + (i0 + i1 - 1) // 2

    def own_offsets(self, key_offsets: Tensor) -> Tensor:
        """[.., L] e_j - e_c for each query-key j against its own block's middle (the blocks' own keys)."""
        own = key_offsets[..., self.n_mem:]
        centres = torch.cat([own[..., (i0 + i1 - 1) // 2: (i0 + i1 - 1) // 2 + 1].expand(*own.shape[:-1], i1 - i0)
                             for i0, i1 in self.blocks], dim=-1)
        return own - centres


def _set_channel(k_aug: Tensor, keys: slice, offsets: Tensor, scale: float) -> None:
    """k_aug[..., keys, -EXTRA] = offsets / s (offsets: e differences in float64, cast once)."""
    k_aug[:, :, keys, -EXTRA] = (offsets / scale).to(k_aug.dtype)  # broadcasts over the batch where e is shared


def _own_blocks(layout: _Layout) -> list[tuple[slice, int]]:
    """(rows, n_blocks): the full blocks as one batched call, then a short last block on its own."""
    full = layout.n_full * layout.size
    parts = [(slice(0, full), layout.n_full)] if full else []
    return parts + ([(slice(full, layout.n_queries), 1)] if full < layout.n_queries else [])


def _past_parts(layout: _Layout, k_aug: Tensor, key_offsets: Tensor, scale: float):
    """(rows, k0, c) of each block with keys before it (k0 of them), the key channel set to e_j - e_c there."""
    for i0, i1 in layout.blocks:
        k0 = layout.n_mem + i0
        if k0:
            centre = layout.centre(i0, i1)
            _set_channel(k_aug, slice(0, k0), key_offsets[..., :k0] - key_offsets[..., centre: centre + 1], scale)
            yield slice(i0, i1), k0, centre


def _batched(t: Tensor, rows: slice, n_blocks: int) -> Tensor:
    """[B, H, n·S, w] rows -> [B, H·n, S, w]: one block per batch entry of the flash call."""
    part = t[:, :, rows]
    return part.reshape(part.shape[0], part.shape[1] * n_blocks, -1, part.shape[-1])


def _unbatched(t: Tensor, heads: int) -> Tensor:
    return t.reshape(t.shape[0], heads, -1, *t.shape[3:])


class KeyOffsetAttention(torch.autograd.Function):
    """softmax over causal keys of s·q·kᵀ + e_j, times v: q [B, H, L, dh], k, v [B, H, K, dh] (K = M + L: the
    queries are the last L keys), key_offsets e [B or 1, H, K] (float64, non-decreasing), block (block_size)
    -> [B, H, L, dh]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_offsets: Tensor, scale: float, block: int):
        b, h, lq, dh = q.shape
        n_mem = k.shape[2] - lq
        layout = _Layout(lq, n_mem, block)
        q_aug = torch.cat([q, q.new_ones(b, h, lq, 1), q.new_zeros(b, h, lq, EXTRA - 1)], dim=-1)
        k_aug = torch.cat([k, k.new_zeros(b, h, k.shape[2], EXTRA)], dim=-1)
        v_aug = torch.cat([v, v.new_zeros(b, h, v.shape[2], EXTRA)], dim=-1)
        out, lse = q_aug.new_empty(b, h, lq, dh + EXTRA), q.new_empty(b, h, lq)
        _set_channel(k_aug, slice(n_mem, None), layout.own_offsets(key_offsets), scale)
        own_keys = k_aug[:, :, n_mem:], v_aug[:, :, n_mem:]
        for rows, n in _own_blocks(layout):
            o, l = _forward(_batched(q_aug, rows, n), *(_batched(t, rows, n) for t in own_keys), 0.0, True, scale=scale)
            out[:, :, rows], lse[:, :, rows] = _unbatched(o, h), _unbatched(l, h)
        for rows, k0, _ in _past_parts(layout, k_aug, key_offsets, scale):
            past, past_lse = _forward(q_aug[:, :, rows], k_aug[:, :, :k0], v_aug[:, :, :k0], 0.0, False, scale=scale)
            own_lse = lse[:, :, rows]
            out[:, :, rows].lerp_(past, torch.sigmoid(past_lse - own_lse)[..., None])  # weights e^(l_part - l)
            own_lse.copy_(torch.logaddexp(past_lse, own_lse))
        ctx.save_for_backward(q_aug, k_aug, v_aug, key_offsets, out, lse)
        ctx.scale, ctx.block = scale, block
        return out[..., :dh]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q_aug, k_aug, v_aug, key_offsets, out, lse = ctx.saved_tensors
        scale, (b, h, lq, _) = ctx.scale, q_aug.shape
        n_mem = k_aug.shape[2] - lq
        layout = _Layout(lq, n_mem, ctx.block)
        grad_aug = torch.cat([grad_out, grad_out.new_zeros(b, h, lq, EXTRA)], dim=-1)
        dq, dk, dv = torch.empty_like(q_aug), torch.empty_like(k_aug), torch.empty_like(v_aug)
        dk[:, :, :n_mem], dv[:, :, :n_mem] = 0.0, 0.0  # memory keys: only the past parts reach them
        # ∂L/∂e: each part's key channel gradient / s at its keys, minus its sum at the block's middle key (the
        # offset e_j - e_c: mathematically the sum is 0, a softmax's rows summing to zero; kept, the slope's and
        # the gates' gradients sum (j - c)-weighted terms instead of j-weighted ones, far less cancellation)
        grad_offsets = torch.zeros(b, h, k_aug.shape[2], dtype=torch.float64, device=q_aug.device)
        _set_channel(k_aug, slice(n_mem, None), layout.own_offsets(key_offsets), scale)
        own_keys = k_aug[:, :, n_mem:], v_aug[:, :, n_mem:]
        for rows, n in _own_blocks(layout):
            gq, gk, gv = _backward(*(_batched(t, rows, n) for t in (grad_aug, q_aug)),
                                   *(_batched(t, rows, n) for t in own_keys),
                                   _batched(out, rows, n), _batched(lse[..., None], rows, n)[..., 0],
                                   0.0, True, scale=scale)
            keys = slice(n_mem + rows.start, n_mem + rows.stop)
            dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = (_unbatched(g, h) for g in (gq, gk, gv))
            channel = gk[..., -EXTRA].double().view(b, h, n, -1) / scale  # (B, H, n blocks, S)
            grad_offsets[..., keys] += channel.flatten(2)
            centres = [layout.centre(i0, i1) for i0, i1 in layout.blocks[rows.start // layout.size:][:n]]
            grad_offsets[..., centres] -= channel.sum(-1)
        for rows, k0, centre in _past_parts(layout, k_aug, key_offsets, scale):
            gq, gk, gv = _backward(grad_aug[:, :, rows], q_aug[:, :, rows], k_aug[:, :, :k0], v_aug[:, :, :k0],
                                   out[:, :, rows], lse[:, :, rows], 0.0, False, scale=scale)
            dq[:, :, rows] += gq
            dk[:, :, :k0] += gk
            dv[:, :, :k0] += gv
            channel = gk[..., -EXTRA].double() / scale
            grad_offsets[..., :k0] += channel
            grad_offsets[..., centre] -= channel.sum(-1)
        if not ctx.needs_input_grad[3]:
            grad_offsets = None
        elif key_offsets.shape[0] == 1 and b > 1:
            grad_offsets = grad_offsets.sum(0, keepdim=True)
        return dq[..., :-EXTRA], dk[..., :-EXTRA], dv[..., :-EXTRA], grad_offsets, None, None
