"""FlexAttention path (CUDA): the same scores as the block kernel, as a `score_mod` + causal `block_mask`.

score_mod reads per-distance tensors by the descending-distance column t = (L - 1 - q_idx) + kv_idx
(see shift.py): the curve [H, n] of term d and distance-only biases, and for term b the precomputed
[B, H, L, n] product (q + v)·W_R R. A bias that depends on the query position (FIRE) is precomputed
as [H, L, K]. On CPU, FlexAttention has no backward; there it is used for forward parity tests only.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.lru_cache(maxsize=32)
def _block_mask(n_queries: int, n_mem: int, causal: bool, window: int | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        distance = n_mem + q_idx - kv_idx
        ok = distance >= 0
        return ok & (distance < window) if window is not None else ok

    if not causal:
        return None
    return create_block_mask(visible, None, None, n_queries, n_mem + n_queries, device=device)


def flex_attend(qc: Tensor, k: Tensor, v: Tensor, *, scale: float, n_mem: int, causal: bool, window: int | None,
                term_b: Tensor | None, curve: Tensor | None, query_bias: Tensor | None,
                padding: Tensor | None, compiled: bool) -> Tensor:
    """softmax(scale·qc·kᵀ + term_b + curve + query_bias, masked)·v with FlexAttention: [B, H, L, dh]."""
    n_queries = qc.shape[2]

    def score_mod(score, b, h, q_idx, kv_idx):
        t = n_queries - 1 - q_idx + kv_idx
        if term_b is not None:
            score = score + term_b[b, h, q_idx, t]
        if curve is not None:
            score = score + curve[h, t]
        if query_bias is not None:
            score = score + query_bias[h, q_idx, kv_idx]
        if padding is not None:
            score = torch.where(padding[b, kv_idx], float("-inf"), score)
        return score

    block_mask = _block_mask(n_queries, n_mem, causal, window, str(qc.device))
    return _kernel(compiled)(qc, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
