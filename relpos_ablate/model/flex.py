"""FlexAttention path (CUDA): the same scores as the block kernel, as a `score_mod` + `block_mask`.

score_mod reads per-distance tensors by the descending-distance column t = (L - 1 - q_idx) + kv_idx
(see shift.py): distance_scores [H, n] (term d without b, distance-only biases), and for term b the
precomputed [B, H, L, n] product (q + v)·W_R R. A bias that depends on the query position (FIRE) is
precomputed as [H, L, K]. At explicit positions (call.distance_index) the call's whole additive map
[B or 1, H, L, K] is precomputed and read per pair. The block mask is the call's Visibility (causal,
window); key padding is applied in score_mod. On CPU, FlexAttention has no backward; there it is used
for forward parity tests only.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from relpos_ablate.model.call import AttentionCall, Visibility


@functools.cache
def _kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.lru_cache(maxsize=32)
def _block_mask(visibility: Visibility, n_queries: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    if not visibility.causal:
        return None
    return create_block_mask(lambda b, h, q_idx, kv_idx: visibility(q_idx, kv_idx), None, None, n_queries,
                             visibility.n_mem + n_queries, device=device)


def flex_attend(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None,
                *, compiled: bool) -> Tensor:
    """softmax(s·q_content·kᵀ + terms b, d and the bias, masked)·v with FlexAttention: [B, H, L, dh]."""
    n_queries, padding = call.n_queries, call.key_padding_mask
    score_mod = _per_distance_mod(call, q_position) if call.consecutive else _per_pair_mod(call, q_position)
    if padding is not None:
        score_mod = _padded(score_mod, padding)
    block_mask = _block_mask(call.visibility, n_queries, str(q_content.device))
    return _kernel(compiled)(q_content, k, v, score_mod=score_mod, block_mask=block_mask, scale=call.scale)


def _padded(score_mod, padding: Tensor):
    """score_mod that also hides padded keys ([B, K], True = padded)."""

    def padded_mod(score, b, h, q_idx, kv_idx):
        return torch.where(padding[b, kv_idx], float("-inf"), score_mod(score, b, h, q_idx, kv_idx))

    return padded_mod


def _per_distance_mod(call: AttentionCall, q_position: Tensor | None):
    """score_mod reading per-distance tensors at column t = (L - 1 - q_idx) + kv_idx (consecutive positions)."""
    n_queries = call.n_queries
    term_b = None if q_position is None else q_position @ call.rel_keys.transpose(1, 2)  # (B, H, L, K + L - 1)
    distance_scores = call.distance_scores
    pair_bias = None if call.pair_bias is None else call.pair_bias_scores(call.all_queries)[0]  # (H, L, K)

    def score_mod(score, b, h, q_idx, kv_idx):
        t = n_queries - 1 - q_idx + kv_idx
        if term_b is not None:
            score = score + term_b[b, h, q_idx, t]
        if distance_scores is not None:
            score = score + distance_scores[h, t]
        if pair_bias is not None:
            score = score + pair_bias[h, q_idx, kv_idx]
        return score

    return score_mod


def _per_pair_mod(call: AttentionCall, q_position: Tensor | None):
    """score_mod reading the whole additive map, precomputed at explicit positions."""
    additive = call.additive_scores(call.all_queries, q_position, call.rel_keys, call.distance_scores)
    if additive is None:
        return lambda score, b, h, q_idx, kv_idx: score
    batched = additive.shape[0] > 1  # (B or 1, H, L, K)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + additive[b if batched else 0, h, q_idx, kv_idx]

    return score_mod
