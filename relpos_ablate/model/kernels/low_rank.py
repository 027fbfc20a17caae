"""Biases that are a key's offset up to a per-query constant ride on SDPA's flash kernel: no score
map.

ALiBi's -m·(i' - j) is m·j - m·i', and FoX's D_ij = Λ_i' - Λ_j is (-Λ_j) - (-Λ_i'): both are e_j -
e_i' with a key offset e (ALiBi, learned ALiBi: e_j = s_B·m_h·j; FoX: e_j = -Λ_j; both: the sum).
The scores s·q_i·k_j + e_j - e_i' are one product of wider heads: q gets the channels [1, -hi_i', 1,
-lo_i'], k [hi_j, 1, lo_j, 1] (hi + lo: e / s in two fp32 numbers), v zeros behind its own (the CPU
kernel wants one head width), each padded with zeros to a multiple of EXTRA channels. Causal only
(bidirectional ALiBi's |i - j| is not of this form).

Rounding: e grows with the context (m·j up to m·K; Λ without bound), and an fp32 sum that holds e_j
carries an error of about 2^-24·|e_j|. Where the CPU kernel sums a score's channels in their order
(`ordered_sums`: checked once a process against float64), those channels lead, so that hi_j - hi_i'
comes first, exact for the keys that matter (near ones: Sterbenz), then the small rest: one call
whatever the spread of e (rounding ~1e-6 at L = 4096 with ALiBi's slope 1/2 or FoX's gates).
Elsewhere they follow the head's own channels, the query's -hi, -lo are zeros (the softmax ignores
its constant) and the queries go in blocks: each block's keys get e_j - e_c, c the block's middle
query, so the keys a query of the block attends to most (its near ones) carry offsets of at most
half the block's spread, the far ones large negative offsets whose weights are below fp32's
resolution anyway. The differences are taken in float64. `block_size` picks the largest block (a
power of two) whose offsets spread over at most SPREAD_LIMIT; a call that needs blocks below
MIN_BLOCK (a gate near 0, a slope grown large) is not taken here (None: the caller takes another
kernel).

Per block the keys before it (no mask) and its own keys (causal) are two flash calls merged by their
log-sum-exps; the blocks' own parts are one batched call. Backward calls the flash backward per part
with the merged output and log-sum-exp (each part's probabilities are then exact). The gradient of
e_j is the column sum of dS at key j minus the row sum at query j, both from the flash backward's
gradients of the added channels (GRADIENT_BLOCKS below). CPU only (the CPU flash kernel's ops); CUDA
takes FlexAttention.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from relpos_ablate.model.kernels.call import AttentionCall

# largest spread of e over one block's queries: offsets within ±64, fp32 rounding ≤ ~4e-6
SPREAD_LIMIT = 128.0
MIN_BLOCK, MAX_BLOCK = 64, 1024
# channels added to the head: OFFSET in front (the offsets' hi and lo parts against ones), then,
# where e needs a gradient, one channel per gradient block (below), zeros up to a multiple of 8
# (they add nothing to a product). At L = 4096 heads of 72 channels took 5-15% less time than of 65
# on one processor (torch 2.13, the CPU flash kernel's backward;
# benchmarks/results/records/compare_revisions_low_rank_width.md); on another 65 .. 80 cost alike,
# ~15% above 64, and 88 or 96 ~40%
OFFSET, EXTRA = 4, 8
# e's gradient sums column and row sums of dS that cancel: the column sums are taken per block of
# queries (a channel of ones at its queries against keys of zeros: dk there is s·Σ_{i in block}
# dS_ij), each block's total moved to its middle query c (backward), so that rounding is weighted by
# j - c rather than by j. At most GRADIENT_BLOCKS (heads of <= 80 channels), of at least
# GRADIENT_ROWS queries; at L = 4096 the learned slopes' gradient then errs 1.1e-5 .. 1.4e-5 of its
# largest entry against float64 (3 seeds; 4 blocks: up to 4.3e-5)
GRADIENT_BLOCKS, GRADIENT_ROWS = 8, 256

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def key_offsets(call: AttentionCall) -> Tensor | None:
    """e [B or 1, H, K] float64 of a call whose every additive term is a key offset (ALiBi's
    s_B·m_h·j, FoX's -Λ_j), else None: causal, consecutive positions, no window, key padding, sinks,
    query scale, term b or d, query-dependent bias or CoPE."""
    inputs = call.inputs
    if (
        not call.plain_causal
        or inputs.rel_keys is not None
        or (inputs.distance_scores is not None and call.linear_bias is None)
    ):
        return None
    if call.linear_bias is not None and bool((call.linear_bias < 0).any()):
        # a slope below 0 (a scheme of your own) grows e toward the past: its far keys would round
        return None
    offsets = None
    if call.linear_bias is not None:
        keys = torch.arange(call.n_keys, dtype=torch.float64, device=call.linear_bias.device)
        offsets = (call.linear_bias.double()[:, None] * keys)[None]  # (1, H, K)
    if inputs.log_decay is not None:
        offsets = -inputs.log_decay if offsets is None else offsets - inputs.log_decay
    return offsets


def attend_low_rank(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block: int
) -> Tensor:
    """The call on the low-rank kernel: q (the content query), k, v in fp32 at least (the offsets'
    rounding argument is fp32's), back in the call's dtype."""
    wide = torch.promote_types(q.dtype, torch.float32)
    out = KeyOffsetAttention.apply(
        q.to(wide), k.to(wide), v.to(wide), offsets, call.scale, block, ordered_sums()
    )
    return out.to(q.dtype)


def block_size(key_offsets: Tensor, n_queries: int) -> int | None:
    """All queries in one block where the kernel sums channels in order (`ordered_sums`); else the
    largest power-of-two query block (MIN_BLOCK .. MAX_BLOCK) whose offsets spread over at most
    SPREAD_LIMIT (e is non-decreasing: the spread of a block is e at its last query minus e at its
    first), None where even MIN_BLOCK spreads wider."""
    if ordered_sums():
        return max(n_queries, 1)
    queries = key_offsets[..., key_offsets.shape[-1] - n_queries :].detach()
    size = MAX_BLOCK
    while size >= MIN_BLOCK:
        starts = queries[..., ::size]
        ends = queries[..., size - 1 :: size]
        last = queries[..., -1:] if n_queries % size else queries[..., :0]  # a short last block
        spread = torch.cat(
            [ends - starts[..., : ends.shape[-1]], last - starts[..., ends.shape[-1] :]], dim=-1
        )
        if spread.numel() == 0 or float(spread.abs().max()) <= SPREAD_LIMIT:
            return min(size, max(n_queries, 1))
        size //= 2
    return None


@torch.compiler.disable
@functools.cache
def ordered_sums() -> bool:
    """Whether this machine's CPU flash kernel sums a score's channels in their order, so that the
    leading hi_j - hi_i' cancel exactly: `matches_float64(True)`, once a process (~0.1 s). On the
    processors this project was developed on (docs/performance.md): True."""
    return matches_float64(True)


def matches_float64(ordered: bool) -> bool:
    """Whether the kernel in one block (with the queries' channels if `ordered`, else zeros there)
    matches float64 on two calls whose offsets climb in steps of 1000 every 100 keys (e / s up to
    ~10^5: a sum that holds one errs ~1e-4): 800 queries (the flash kernel's large query tiles) and
    100 after 300 memory keys (its small ones, and a past part); output within 1e-5, gradients
    within 1e-5 of their largest entry."""
    # whatever the caller's mode: the check differentiates
    with torch.inference_mode(False), torch.enable_grad():
        return _matches_float64(ordered)


def _matches_float64(ordered: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    for n_queries, n_mem in ((800, 0), (100, 300)):
        n_keys = n_mem + n_queries
        q, k, v = (
            torch.randn(1, 2, n, 64, generator=gen, dtype=torch.float64, requires_grad=True)
            for n in (n_queries, n_keys, n_keys)
        )
        offsets = (
            (1000.0 * torch.div(torch.arange(n_keys), 100, rounding_mode="floor"))
            .double()
            .expand(1, 2, -1)
        )
        got = KeyOffsetAttention.apply(
            *(t.float() for t in (q, k, v)), offsets, 0.125, n_queries, ordered
        )
        scores = (
            q @ k.transpose(-1, -2) * 0.125 + offsets[..., None, :] - offsets[..., n_mem:, None]
        )
        hidden = torch.arange(n_keys)[None, :] > n_mem + torch.arange(n_queries)[:, None]
        want = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
        grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
        errors = [(got.double() - want).detach().abs().max()]
        for a, b in zip(
            torch.autograd.grad(got, [q, k, v], grad.float()),
            torch.autograd.grad(want, [q, k, v], grad),
        ):
            errors.append(((a.double() - b).abs().max() / b.abs().max()).detach())
        if float(torch.stack(errors).max()) > 1e-5:
            return False
    return True


class _Layout:
    """The blocks of one call: block b has queries i0 = b·size .. i1 and key index c of its middle
    query."""

    def __init__(self, n_queries: int, n_mem: int, size: int):
        self.n_queries, self.n_mem, self.size = n_queries, n_mem, size
        self.blocks = [(i0, min(i0 + size, n_queries)) for i0 in range(0, n_queries, size)]
        self.n_full = n_queries // size

    def centre(self, i0: int, i1: int) -> int:
        return self.n_mem + (i0 + i1 - 1) // 2

    def own_offsets(self, key_offsets: Tensor) -> Tensor:
        """[.., L] e_j - e_c for each query-key j against its own block's middle (the blocks' own
        keys, and the queries' own offsets)."""
        own = key_offsets[..., self.n_mem :]
        centres = torch.cat(
            [
                own[..., (i0 + i1 - 1) // 2 : (i0 + i1 - 1) // 2 + 1].expand(
                    *own.shape[:-1], i1 - i0
                )
                for i0, i1 in self.blocks
            ],
            dim=-1,
        )
        return own - centres


def _split(offsets: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hi, lo): offsets / s (float64) as two tensors of dtype whose sum carries it (fp32: to ~2^-48
    of its size; float64: hi is all of it, lo 0)."""
    scaled = offsets / scale
    hi = scaled.to(dtype)
    return hi, (scaled - hi.double()).to(dtype)


def _set_keys(k_aug: Tensor, keys: slice, offsets: Tensor, scale: float, lead: int) -> None:
    """The key channels of `keys` (from `lead` on): hi and lo of offsets / s (e differences in
    float64), each against a 1."""
    hi, lo = _split(offsets, scale, k_aug.dtype)
    # broadcasts over the batch where e is shared
    k_aug[:, :, keys, lead], k_aug[:, :, keys, lead + 2] = (hi, lo)


def _lead(ordered: bool, head: int) -> int:
    """Where the OFFSET channels sit: in front where sums are in order (hi_j - hi_i' first), else
    behind the head's own (bounded by the block's spread; on a kernel that sums in order, met once,
    last, by the head's small sum: the blocks' measured rounding, benchmarks/low_rank_blocks.py)."""
    return 0 if ordered else head


def _augmented(t: Tensor, offsets: Tensor | None, back: int | Tensor, lead: int = 0) -> Tensor:
    """q and k: the OFFSET channels `offsets` at `lead` (in front of t or behind it), then `back`; v
    (offsets None): [t, back]. back: a number of zero channels (zeroed in place, not made as a
    tensor to be concatenated), or the channels themselves. Written into one new tensor."""
    n_back = back if isinstance(back, int) else back.shape[-1]
    n_offsets = 0 if offsets is None else OFFSET
    out = t.new_empty(*t.shape[:-1], t.shape[-1] + n_offsets + n_back)
    first = n_offsets if lead == 0 else 0  # where t goes
    out[..., first : first + t.shape[-1]] = t
    if offsets is not None:
        out[..., lead : lead + OFFSET] = offsets
    tail = out[..., t.shape[-1] + n_offsets :]
    if isinstance(back, int):
        tail.zero_()
    else:
        tail.copy_(back)
    return out


def _gradient_blocks(n_queries: int) -> list[tuple[int, int]]:
    """The query blocks (i0, i1) whose column sums of dS e's gradient takes one by one
    (GRADIENT_BLOCKS)."""
    n = max(1, min(GRADIENT_BLOCKS, -(-n_queries // GRADIENT_ROWS)))
    return [(n_queries * b // n, n_queries * (b + 1) // n) for b in range(n)]


def _own_blocks(layout: _Layout) -> list[tuple[slice, int]]:
    """(rows, n_blocks): the full blocks as one batched call, then a short last block on its own."""
    full = layout.n_full * layout.size
    parts = [(slice(0, full), layout.n_full)] if full else []
    return parts + ([(slice(full, layout.n_queries), 1)] if full < layout.n_queries else [])


def _past_parts(layout: _Layout, k_aug: Tensor, key_offsets: Tensor, scale: float, lead: int):
    """(rows, k0) of each block with keys before it (k0 of them), the key channels set to e_j - e_c
    there."""
    for i0, i1 in layout.blocks:
        k0 = layout.n_mem + i0
        if k0:
            centre = layout.centre(i0, i1)
            _set_keys(
                k_aug,
                slice(0, k0),
                key_offsets[..., :k0] - key_offsets[..., centre : centre + 1],
                scale,
                lead,
            )
            yield slice(i0, i1), k0


def _batched(t: Tensor, rows: slice, n_blocks: int) -> Tensor:
    """[B, H, n·S, w] rows -> [B, H·n, S, w]: one block per batch entry of the flash call."""
    part = t[:, :, rows]
    return part.reshape(part.shape[0], part.shape[1] * n_blocks, -1, part.shape[-1])


def _unbatched(t: Tensor, heads: int) -> Tensor:
    return t.reshape(t.shape[0], heads, -1, *t.shape[3:])


class KeyOffsetAttention(torch.autograd.Function):
    """softmax over causal keys of s·q·kᵀ + e_j - e_i', times v: q [B, H, L, dh], k, v [B, H, K, dh]
    (K = M + L: the queries are the last L keys), key_offsets e [B or 1, H, K] (float64,
    non-decreasing), block (block_size), ordered (ordered_sums: the queries' channels carry -e_i')
    -> [B, H, L, dh]."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_offsets: Tensor,
        scale: float,
        block: int,
        ordered: bool,
    ):
        b, h, lq, dh = q.shape
        n_mem = k.shape[2] - lq
        layout = _Layout(lq, n_mem, block)
        own_offsets = layout.own_offsets(key_offsets)  # (B or 1, H, L)
        sums = _gradient_blocks(lq) if ctx.needs_input_grad[3] else []
        width = -(-(OFFSET + len(sums)) // EXTRA) * EXTRA  # channels added
        q_front, q_back = q.new_zeros(b, h, lq, OFFSET), q.new_zeros(b, h, lq, width - OFFSET)
        q_front[..., 0::2] = 1.0
        if ordered:
            hi, lo = _split(own_offsets, scale, q.dtype)
            q_front[..., 1], q_front[..., 3] = -hi, -lo
        for n, (i0, i1) in enumerate(sums):
            q_back[:, :, i0:i1, n] = 1.0
        k_front = k.new_zeros(b, h, k.shape[2], OFFSET)
        k_front[..., 1::2] = 1.0
        lead = _lead(ordered, dh)
        q_aug, k_aug = (
            _augmented(q, q_front, q_back, lead),
            _augmented(k, k_front, width - OFFSET, lead),
        )
        v_aug = _augmented(v, None, width)
        _set_keys(k_aug, slice(n_mem, None), own_offsets, scale, lead)
        own_keys, own = (k_aug[:, :, n_mem:], v_aug[:, :, n_mem:]), _own_blocks(layout)
        if len(own) > 1:
            out, lse = q_aug.new_empty(b, h, lq, dh + width), q.new_empty(b, h, lq)
        for rows, n in own:
            o, o_lse = _forward(
                _batched(q_aug, rows, n),
                *(_batched(t, rows, n) for t in own_keys),
                0.0,
                True,
                scale=scale,
            )
            if len(own) == 1:  # one call holds every query (no copy)
                out, lse = _unbatched(o, h), _unbatched(o_lse, h)
            else:
                out[:, :, rows], lse[:, :, rows] = _unbatched(o, h), _unbatched(o_lse, h)
        for rows, k0 in _past_parts(layout, k_aug, key_offsets, scale, lead):
            past, past_lse = _forward(
                q_aug[:, :, rows], k_aug[:, :, :k0], v_aug[:, :, :k0], 0.0, False, scale=scale
            )
            own_lse = lse[:, :, rows]
            # weights e^(l_part - l)
            out[:, :, rows].lerp_(past, torch.sigmoid(past_lse - own_lse)[..., None])
            own_lse.copy_(torch.logaddexp(past_lse, own_lse))
        ctx.save_for_backward(q_aug, k_aug, v_aug, key_offsets, out, lse)
        ctx.scale, ctx.block, ctx.sums, ctx.lead = scale, block, sums, lead
        return out[..., :dh]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q_aug, k_aug, v_aug, key_offsets, out, lse = ctx.saved_tensors
        scale, sums, lead, (b, h, lq, dh) = ctx.scale, ctx.sums, ctx.lead, grad_out.shape
        n_mem = k_aug.shape[2] - lq
        layout = _Layout(lq, n_mem, ctx.block)
        grad_aug = _augmented(grad_out, None, v_aug.shape[-1] - dh)
        # ∂L/∂e_j = Σ_i dS_ij - Σ_k dS_jk (as a key, as a query): the column sums of each gradient
        # block at the keys, the row sums (the query channel's gradient) at the queries, and, at
        # each block's middle query c, its rows' total minus its columns' (the same entries of dS: 0
        # but for rounding). The slopes' and the gates' gradients then sum (j - c)- and (c -
        # i')-weighted terms instead of j- and i'-weighted ones: far less cancellation
        grad_offsets = torch.zeros(b, h, k_aug.shape[2], dtype=torch.float64, device=q_aug.device)
        # rows' minus columns'
        totals = torch.zeros(b, h, len(sums), dtype=torch.float64, device=q_aug.device)
        columns = slice(OFFSET + dh, OFFSET + dh + len(sums))

        def add_sums(rows: slice, keys: slice, gq: Tensor, gk: Tensor) -> None:
            if not sums:
                return
            per_block = gk[..., columns].double() / scale  # (B, H, keys, blocks)
            grad_offsets[..., keys] += per_block.sum(-1)
            totals.sub_(per_block.sum(-2))
            per_query = gq[..., lead + 1].double() / scale  # (B, H, rows)
            grad_offsets[..., n_mem + rows.start : n_mem + rows.stop] -= per_query
            for n, (i0, i1) in enumerate(sums):
                first, last = max(i0, rows.start), min(i1, rows.stop)
                if first < last:
                    totals[..., n] += per_query[..., first - rows.start : last - rows.start].sum(-1)

        _set_keys(k_aug, slice(n_mem, None), layout.own_offsets(key_offsets), scale, lead)
        own_keys, own = (k_aug[:, :, n_mem:], v_aug[:, :, n_mem:]), _own_blocks(layout)
        if n_mem or len(own) > 1:
            dq, dk, dv = torch.empty_like(q_aug), torch.empty_like(k_aug), torch.empty_like(v_aug)
            # memory keys: only the past parts reach them
            dk[:, :, :n_mem], dv[:, :, :n_mem] = (0.0, 0.0)
        for rows, n in own:
            grads = _backward(
                *(_batched(t, rows, n) for t in (grad_aug, q_aug)),
                *(_batched(t, rows, n) for t in own_keys),
                _batched(out, rows, n),
                _batched(lse[..., None], rows, n)[..., 0],
                0.0,
                True,
                scale=scale,
            )
            keys = slice(n_mem + rows.start, n_mem + rows.stop)
            if not n_mem and len(own) == 1:  # one call holds every query and key (no copy)
                dq, dk, dv = (_unbatched(g, h) for g in grads)
            else:
                dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = (_unbatched(g, h) for g in grads)
            add_sums(rows, keys, dq[:, :, rows], dk[:, :, keys])
        for rows, k0 in _past_parts(layout, k_aug, key_offsets, scale, lead):
            gq, gk, gv = _backward(
                grad_aug[:, :, rows],
                q_aug[:, :, rows],
                k_aug[:, :, :k0],
                v_aug[:, :, :k0],
                out[:, :, rows],
                lse[:, :, rows],
                0.0,
                False,
                scale=scale,
            )
            dq[:, :, rows] += gq
            dk[:, :, :k0] += gk
            dv[:, :, :k0] += gv
            add_sums(rows, slice(0, k0), gq, gk)
        if not ctx.needs_input_grad[3]:
            grad_offsets = None
        else:
            grad_offsets[..., [n_mem + (i0 + i1 - 1) // 2 for i0, i1 in sums]] += totals
            if key_offsets.shape[0] == 1 and b > 1:
                grad_offsets = grad_offsets.sum(0, keepdim=True)
        body = slice(OFFSET, OFFSET + dh) if lead == 0 else slice(0, dh)
        return dq[..., body], dk[..., body], dv[..., :dh], grad_offsets, None, None, None
