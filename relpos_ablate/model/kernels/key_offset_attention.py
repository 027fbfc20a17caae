"""The low-rank kernel's autograd Function (low_rank.py says what it computes): the heads widened by
the key offsets' channels, one flash call per part of each query block, the parts merged by their
log-sum-exps, and the offsets' gradient from the added channels' gradients."""

from __future__ import annotations

import torch
from torch import Tensor

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


class QueryBlocks:
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


def _own_blocks(layout: QueryBlocks) -> list[tuple[slice, int]]:
    """(rows, n_blocks): the full blocks as one batched call, then a short last block on its own."""
    full = layout.n_full * layout.size
    parts = [(slice(0, full), layout.n_full)] if full else []
    return parts + ([(slice(full, layout.n_queries), 1)] if full < layout.n_queries else [])


def _past_parts(layout: QueryBlocks, k_aug: Tensor, key_offsets: Tensor, scale: float, lead: int):
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
        layout = QueryBlocks(lq, n_mem, block)
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
        layout = QueryBlocks(lq, n_mem, ctx.block)
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
