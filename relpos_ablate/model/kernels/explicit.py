"""The materialised path of RelPosAttention (`backend: explicit`, `need_weights`, values per
distance, and per query block for the schemes that need the scores themselves: a normaliser of its
own, a logit product, a transform of the summed scores): every score of the equation summed into one
[B, H, L_b, K_b] map, the normaliser over it (softmax, or a scheme's own), then the values.

Slow and memory-hungry by design: the readable reference the fast kernels (dispatch.py) are tested
against, and the only path that returns probabilities or adds values per distance. A function
of tensors: the attention computes its equation (RelPosAttention.scores) and hands the summed map
down with the values and the call; this module knows nothing of the module that computed them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.core.call import AttentionCall, QueryBlock
from relpos_ablate.model.core.geometry import StatisticsSink
from relpos_ablate.model.core.shift import rel_shift
from relpos_ablate.model.kernels.blockwise import masked_softmax

#: (scores [B, H, L_b, K_b], visible, own [L_b, K_b]) -> weights: the normaliser seam (default:
#: softmax)
Normaliser = Callable[[Tensor, Tensor, Tensor], Tensor]


def explicit_attention(
    scores: Tensor,
    v: Tensor,
    call: AttentionCall,
    block: QueryBlock | None = None,
    *,
    dropout_p: float = 0.0,
    statistics: StatisticsSink | None = None,
    sink_logits: Tensor | None = None,
    sink_values: Tensor | None = None,
    value_rows: Tensor | None = None,
    normaliser: Normaliser | None = None,
) -> tuple[Tensor, Tensor]:
    """(output [B, H, L_b, dh], probabilities [B, H, L_b, K_b] of the stream's keys: with sinks a
    row sums to 1 minus the sinks' share) of the block's queries (default: the whole call).

    scores: every score of the equation summed, broadcastable to [B, H, L_b, K_b]; v [B, H, K_b,
    dh], the block's keys' values; the learned sinks' logits [B, H, L_b, S] and values [H, S, dh];
    value_rows [n, dh]: a value a^V at each of the call's distances (whole call only).
    normaliser: what turns the scores into weights, (scores, visible, own) -> weights, own True at
    each query's own key (default: the softmax over the visible keys; a scheme of its own replaces
    it)."""
    blk = block or call.all_queries
    b, h = v.shape[:2]
    scores = scores.expand(b, h, blk.i1 - blk.i0, blk.width)  # terms broadcast: (B, H, L_b, K_b)
    visible = call.visible(blk)
    view = call.view(blk)
    if normaliser is not None:
        own = view.query_index[:, None] == view.key_index[None, :]  # (L_b, K_b)
        with_sinks = normaliser(scores, visible, own)
    else:
        if sink_logits is not None:  # the slots' logits in front: (B, H, L_b, S + K_b)
            scores = torch.cat([sink_logits, scores], dim=-1)
            visible = call.with_sinks(visible, True)
        with_sinks = masked_softmax(scores, visible)
    n_sinks = call.n_sinks if sink_logits is not None else 0
    probs = with_sinks[..., n_sinks:]
    if statistics is not None:
        statistics.add(view, probs)
    dropped = F.dropout(with_sinks, dropout_p) if dropout_p else with_sinks
    out = dropped[..., n_sinks:] @ v
    if sink_values is not None:
        out = out + dropped[..., :n_sinks] @ sink_values.to(out.dtype)
    if value_rows is not None:
        out = out + distance_values(dropped[..., n_sinks:], value_rows, call)
    return out, probs


def distance_values(probs: Tensor, values: Tensor, call: AttentionCall) -> Tensor:
    """The value term of each distance, Σ_j p_ij a^V_{d(i, j)}: values [n, dh] per distance of the
    call (clipped as the keys are), probabilities regrouped by distance (the inverse of rel_shift),
    then one product; at explicit positions, the row gathered per pair. [B, H, L, K] -> [B, H, L,
    dh]."""
    if not call.consecutive:
        # (L, K, dh) per pair
        return torch.einsum("bhlk,lkd->bhld", probs, values[call.distance_index])
    b, h, lq, n_keys = probs.shape
    per_distance = probs.new_zeros(b, h, lq, lq + n_keys - 1)  # (B, H, L, n)
    rel_shift(per_distance, n_keys).copy_(probs)  # column t of row r <- key j = t - (L - 1 - r)
    return per_distance @ values  # (B, H, L, n) @ (n, dh)
