"""The band kernel: a per-distance map that is constant from a distance D on, with its map only
within D.

Where every per-distance input (term b's keys s·W_R R_d, term d, the bias's curve) is the same at
each distance d >= D (`AttentionCall.saturation`: a clamp of R, a table's end, a bias's last bucket:
its `band` form), a query's scores at those distances differ from s·q·kᵀ by one constant per query
(term b: (q + v)·s·W_R R_D; the curve: its value at D), which the softmax ignores. With the
per-distance inputs shifted by their value at D (`banded`: by autograd, outside the kernel, so their
gradients reach the unshifted ones) the map is 0 from D on, and the call splits into
- the far pairs, i' - j >= D: s·q·kᵀ alone, i.e. causal attention of each query against the keys at
  least D behind it (`far_parts`): one call of the CPU flash kernel, two with memory keys that every
  query sees at D or more;
- the band, 0 <= i' - j < D: the block kernel (blockwise.py) on the shifted map with window D.
BlockwiseBiasedAttention merges the far pairs into the band's output by their log-sum-exp
(`add_far`), and its backward hands them to the flash kernel's backward with the merged output and
log-sum-exp (`far_backward`): the gradients of q, k and v are then those of the whole softmax, and
the shifted map, 0 there, has none.

A score term may have no per-distance input but a band of its own (a count clamped at its largest
value: once a query's count has passed it, every key further back scores one constant per query).
How far back that happens is the data's: `with_term_band` asks each term of a call for its band
width (ScoreTerm.band_width) and sets the widest as the call's saturation; the block kernel then
builds the term's map minus that constant within D only.

The far pairs cost what causal attention without positions costs; the band L·D map entries.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from relpos_ablate import planner
from relpos_ablate.model.core.call import AttentionCall
from relpos_ablate.model.core.geometry import Visibility


def takes(call: AttentionCall, q_content: Tensor, dropout_p: float) -> bool:
    """Whether the band kernel can take a call whose forms allow it (planner.band): CPU (the flash
    kernel's own entry points), no attention dropout, a saturation distance D (of the per-distance
    inputs, or of the terms' band forms: `with_term_band`), and at least 2·D keys."""
    saturation = call.saturation
    return (
        saturation is not None
        and q_content.device.type == "cpu"
        and dropout_p == 0.0
        and call.far_from is None
        and call.n_keys >= 2 * saturation
    )


# its host syncs would break a compiled graph once per block: one break around it instead
@torch.compiler.disable
def with_term_band(
    call: AttentionCall, q_content: Tensor, k: Tensor, dropout_p: float
) -> AttentionCall:
    """A call of terms alone with the band their data allow (each term's `band_width` form: the
    widest) as its saturation, where the band kernel could take it: the call itself otherwise."""
    if (
        not call.terms
        or q_content.device.type != "cpu"
        or dropout_p > 0.0
        or call.far_from is not None
        or not planner.band(call.plan)
    ):
        return call
    widths = [term.band_width(call, q_content, k) for term in call.terms]
    if any(width is None for width in widths):
        return call
    return dataclasses.replace(call, band=(max(widths), None))


def banded(call: AttentionCall) -> AttentionCall:
    """The call with its per-distance inputs shifted by their value at distance `saturation` (0 from
    there on), its window the band, and `far_from` set (module docstring)."""
    d = call.saturation
    column = call.n_keys - 1 - d  # distance d's column in the descending layout (K - 1 .. -(L - 1))
    shifted = {
        name: t - t.narrow(1, column, 1)
        for name, t in (("rel_keys", call.rel_keys), ("distance_scores", call.distance_scores))
        if t is not None
    }
    window = Visibility(call.n_mem, causal=True, window=d)
    return dataclasses.replace(
        call, visibility=window, inputs=call.inputs._replace(**shifted), band=(d, d)
    )


class FarPart(NamedTuple):
    """Queries `rows` against keys `keys` (kernel indices), causal (top-left: row r sees keys up to
    r) or all."""

    rows: slice
    keys: slice
    causal: bool


def far_parts(call: AttentionCall) -> list[FarPart]:
    """The pairs at i' - j >= far_from as flash-kernel calls. Query i (key index M + i) sees keys j
    <= i + e with e = M - D: with e >= 0, the first e keys are seen by every query and keys e .. e +
    L - 1 form a causal square; with e < 0, queries -e .. L - 1 against keys 0 .. L + e - 1 form
    one."""
    e, lq = call.n_mem - call.far_from, call.n_queries
    if e >= 0:
        square = [FarPart(slice(0, lq), slice(e, e + lq), True)]
        return ([FarPart(slice(0, lq), slice(0, e), False)] if e > 0 else []) + square
    return [FarPart(slice(-e, lq), slice(0, lq + e), True)] if lq + e > 0 else []


def add_far(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge the far pairs into the band's `out` [B, H, L, dh] and `lse` [B, H, L, 1], in place."""
    for part in far_parts(call):
        out_f, lse_f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, part.rows],
            k[:, :, part.keys],
            v[:, :, part.keys],
            0.0,
            part.causal,
            scale=call.scale,
        )
        lse_f = lse_f[..., None]
        lse_b = lse[:, :, part.rows]
        merged = torch.logaddexp(lse_b, lse_f)
        out[:, :, part.rows] = (
            out[:, :, part.rows] * (lse_b - merged).exp() + out_f * (lse_f - merged).exp()
        )
        lse[:, :, part.rows] = merged


def far_backward(
    call: AttentionCall,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_q: Tensor,
    grad_k: Tensor,
    grad_v: Tensor,
) -> None:
    """Add the far pairs' gradients of q, k and v (from the merged out and lse [B, H, L, 1]) in
    place."""
    for part in far_parts(call):
        rows, keys = part.rows, part.keys
        g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, rows],
            lse[:, :, rows, 0],
            0.0,
            part.causal,
            scale=call.scale,
        )
        grad_q[:, :, rows] += g_q
        grad_k[:, :, keys] += g_k
        grad_v[:, :, keys] += g_v
