"""FlexAttention path (CUDA): the same scores as the block kernel, as a `score_mod` + `block_mask`.

score_mod reads per-distance tensors by the descending-distance column t = (L - 1 - q_idx) + kv_idx
(see shift.py): distance_scores [H, n] (term d without b, distance-only biases), and for term b the
precomputed [B, H, L, n] product (q + v)·W_R R. A bias that depends on the query position (FIRE) is
precomputed as [H, L, K]; FoX's decay is Λ_i' - Λ_j read from Λ [B, H, K] (restarted at the first query,
in fp32 like the authors' kernel); the query scale multiplies what does not come from the (scaled)
queries. At explicit positions (call.distance_index) the call's whole additive map [B or 1, H, L, K] is
precomputed and read per pair. The block mask is the call's Visibility (causal, window), with the learned
sink slots (the first n_sinks keys) visible to every query and free of position; key padding is applied
in score_mod. CoPE does not run here (dispatch.py). On CPU, FlexAttention has no backward; there it is
used for forward parity tests only.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from relpos_ablate.model.call import AttentionCall, Visibility


@functools.cache
def _kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.lru_cache(maxsize=32)
def _block_mask(visibility: Visibility, n_queries: int, n_sinks: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    if not visibility.causal:
        return None

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx counts the sinks first
        return (kv_idx < n_sinks) | visibility(q_idx, kv_idx - n_sinks)

    return create_block_mask(mask_mod, None, None, n_queries, n_sinks + visibility.n_mem + n_queries, device=device)


def flex_attend(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None,
                *, compiled: bool) -> Tensor:
    """softmax(s·q_content·kᵀ + terms b, d, the bias and FoX's decay, masked)·v with FlexAttention:
    [B, H, L, dh]."""
    n_queries, padding = call.n_queries, call.key_padding_mask
    score_mod = _per_distance_mod(call, q_position) if call.consecutive else _per_pair_mod(call, q_position)
    if padding is not None:
        score_mod = _padded(score_mod, padding)
    if call.n_sinks:
        score_mod = _after_sinks(score_mod, call.n_sinks)
    block_mask = _block_mask(call.visibility, n_queries, call.n_sinks, str(q_content.device))
    return _kernel(compiled)(q_content, k, v, score_mod=score_mod, block_mask=block_mask, scale=call.scale)


def _padded(score_mod, padding: Tensor):
    """score_mod that also hides padded keys ([B, K], True = padded)."""

    def padded_mod(score, b, h, q_idx, kv_idx):
        return torch.where(padding[b, kv_idx], float("-inf"), score_mod(score, b, h, q_idx, kv_idx))

    return padded_mod


def _after_sinks(score_mod, n_sinks: int):
    """score_mod over [sinks; keys]: the sinks keep their content score, key kv_idx - n_sinks gets score_mod's."""

    def sink_mod(score, b, h, q_idx, kv_idx):
        key = torch.clamp(kv_idx - n_sinks, min=0)  # both branches are evaluated: keep the index in range
        return torch.where(kv_idx < n_sinks, score, score_mod(score, b, h, q_idx, key))

    return sink_mod


def _per_distance_mod(call: AttentionCall, q_position: Tensor | None):
    """score_mod reading per-distance tensors at column t = (L - 1 - q_idx) + kv_idx (consecutive positions)."""
    n_queries, n_mem = call.n_queries, call.n_mem
    term_b = None if q_position is None else q_position @ call.rel_keys.transpose(1, 2)  # (B, H, L, K + L - 1)
    distance_scores = call.distance_scores
    pair_bias = None if call.pair_bias is None else call.pair_bias_scores(call.all_queries)[0]  # (H, L, K)
    decay = None if call.log_decay is None else (call.log_decay - call.log_decay[..., n_mem, None]).to(call.dtype)
    scale = None if call.query_scale is None else call.query_scale[..., 0]  # (B or 1, H or 1, L)

    def score_mod(score, b, h, q_idx, kv_idx):
        t = n_queries - 1 - q_idx + kv_idx
        if term_b is not None:
            score = score + term_b[b, h, q_idx, t]
        unscaled = []  # what does not come from the queries
        if distance_scores is not None:
            unscaled.append(distance_scores[h, t])
        if pair_bias is not None:
            unscaled.append(pair_bias[h, q_idx, kv_idx])
        if decay is not None:  # FoX: D = Λ_i' - Λ_j (Λ restarted at the first query)
            unscaled.append(decay[b, h, n_mem + q_idx] - decay[b, h, kv_idx])
        if unscaled and scale is not None:
            per_query = scale[b if scale.shape[0] > 1 else 0, h if scale.shape[1] > 1 else 0, q_idx]
            unscaled = [functools.reduce(operator.add, unscaled) * per_query]
        for added in unscaled:
            score = score + added
        return score

    return score_mod


def _per_pair_mod(call: AttentionCall, q_position: Tensor | None):
    """score_mod reading the whole additive map, precomputed at explicit positions."""
    additive = call.additive_scores(call.all_queries, call.score_inputs(q_position))
    if additive is None:
        return lambda score, b, h, q_idx, kv_idx: score
    batched = additive.shape[0] > 1  # (B or 1, H, L, K)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + additive[b if batched else 0, h, q_idx, kv_idx]

    return score_mod
