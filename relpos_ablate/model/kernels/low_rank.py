"""Biases that are a key's offset up to a per-query constant ride on SDPA's flash kernel: no score
map.

A linear bias -m·(i' - j) is m·j - m·i', and a cumulative decay D_ij = Λ_i' - Λ_j is
(-Λ_j) - (-Λ_i'): both are e_j - e_i' with a key offset e (the curve's slope form: e_j = s_B·m_h·j;
a term's `key_offsets` form: e_j = -Λ_j; several: the sum).
The scores s·q_i·k_j + e_j - e_i' are one product of wider heads: q gets the channels [1, -hi_i', 1,
-lo_i'], k [hi_j, 1, lo_j, 1] (hi + lo: e / s in two fp32 numbers), v zeros behind its own (the CPU
kernel wants one head width), each padded with zeros to a multiple of EXTRA channels. Causal only
(a bidirectional |i - j| is not of this form).

Rounding: e grows with the context (m·j up to m·K; Λ without bound), and an fp32 sum that holds e_j
carries an error of about 2^-24·|e_j|. Where the CPU kernel sums a score's channels in their order
(`ordered_sums`: checked once a process against float64), those channels lead, so that hi_j - hi_i'
comes first, exact for the keys that matter (near ones: Sterbenz), then the small rest: one call
whatever the spread of e (rounding ~1e-6 at L = 4096 with a slope of 1/2 or a decay's gates).
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

from relpos_ablate.model.core.call import AttentionCall
from relpos_ablate.model.kernels.key_offset_attention import KeyOffsetAttention

# largest spread of e over one block's queries: offsets within ±64, fp32 rounding ≤ ~4e-6
SPREAD_LIMIT = 128.0
MIN_BLOCK, MAX_BLOCK = 64, 1024


def key_offsets(call: AttentionCall) -> Tensor | None:
    """e [B or 1, H, K] float64 of a call whose every part is a key offset (planner.low_rank: the
    curve's slope form, s_B·m_h·j, and every term's `key_offsets` form), else None (a slope below
    0)."""
    slope = call.inputs.distance_slope
    if slope is not None and bool((slope < 0).any()):
        # a slope below 0 (a scheme of your own) grows e toward the past: its far keys would round
        return None
    offsets = None
    if slope is not None:
        keys = torch.arange(call.n_keys, dtype=torch.float64, device=slope.device)
        offsets = (slope.double()[:, None] * keys)[None]  # (1, H, K)
    for term in call.terms:
        term_offsets = term.key_offsets(call)
        offsets = term_offsets if offsets is None else offsets + term_offsets
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
