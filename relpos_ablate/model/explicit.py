"""The materialised path of RelPosAttention (`backend: explicit`, `need_weights`, Shaw value embeddings):
every score of the equation summed into one [B, H, L, K] map, the softmax over it, then the values.

Slow and memory-hungry by design: the readable reference the fast kernels (dispatch.py) are tested
against, and the only path that returns probabilities or adds Shaw et al.'s value term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.call import AttentionCall, AttentionOptions
from relpos_ablate.model.kernels import masked_softmax
from relpos_ablate.model.shift import rel_shift

if TYPE_CHECKING:
    from relpos_ablate.model.attention import RelPosAttention


def explicit_attention(attn: RelPosAttention, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall,
                       options: AttentionOptions) -> tuple[Tensor, Tensor]:
    """(output [B, H, L, dh], probabilities [B, H, L, K] of the stream's keys: with sinks a row sums to 1
    minus the sinks' share)."""
    b, h, lq, _ = q.shape
    scores = sum(attn.scores(q, k, call).values()).expand(b, h, lq, call.n_keys)  # terms broadcast: (B, H, L, K)
    visible = call.visible(call.all_queries)
    if attn.sinks is not None:  # the slots' logits in front: (B, H, L, S + K)
        scores = torch.cat([attn.sinks.logits(attn.folded_queries(q, call)[0], call.scale), scores], dim=-1)
        visible = call.with_sinks(visible, True)
    with_sinks = masked_softmax(scores, visible)
    probs = with_sinks[..., call.n_sinks:]
    if options.statistics is not None:
        options.statistics.add(call.view(call.all_queries), probs)
    dropped = F.dropout(with_sinks, attn.dropout, attn.training)
    out = dropped[..., call.n_sinks:] @ v
    if attn.sinks is not None:
        out = out + dropped[..., : call.n_sinks] @ attn.sinks.values.to(out.dtype)
    if attn.value_table is not None:
        out = out + shaw_values(attn, dropped[..., call.n_sinks:], call, options.clamp_len)
    return out, probs


def shaw_values(attn: RelPosAttention, probs: Tensor, call: AttentionCall, clamp_len: int | None) -> Tensor:
    """Shaw et al. value term Σ_j p_ij a^V_{clip(i'-j)}, clipped as the keys are: probabilities
    regrouped by distance (the inverse of rel_shift), then one product with the table; at explicit
    positions, the table's row gathered per pair. [B, H, L, K] -> [B, H, L, dh]."""
    clamp = clamp_len if clamp_len is not None else attn.config.clamp_len
    values = attn.value_table[attn.table_row(call.distances, clamp)]  # (n, dh)
    if not call.consecutive:
        return torch.einsum("bhlk,lkd->bhld", probs, values[call.distance_index])  # (L, K, dh) per pair
    b, h, lq, n_keys = probs.shape
    per_distance = probs.new_zeros(b, h, lq, lq + n_keys - 1)  # (B, H, L, n)
    rel_shift(per_distance, n_keys).copy_(probs)  # column t of row r <- key j = t - (L - 1 - r)
    return per_distance @ values  # (B, H, L, n) @ (n, dh)
