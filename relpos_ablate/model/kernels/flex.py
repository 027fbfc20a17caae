"""FlexAttention path (CUDA; compiled on CPU in the tests): the same scores as the block kernel, as
a `score_mod` + `block_mask`.

score_mod reads per-distance tensors at the pair's column t in the descending-distance order
(shift.py):
t = (L - 1 - q_idx) + kv_idx for consecutive positions, d_max - (pos(q_idx) - pos(kv_idx)) at
explicit ones. It reads distance_scores [H, n] (term d without b, distance-only biases and FIRE
below its threshold; term d its own [H, n] next to FIRE past it),
FoX's Λ [B, H, K] (D = Λ_i' - Λ_j, restarted at the first query, in fp32 like the authors' kernel),
the query scale [B or 1, H or 1, L], and evaluates FIRE's MLP per pair
(`BiasScheme.compiled_pair_score` compiled: its piecewise-linear tables; `eager_pair_score` in eager
mode, under vmap): memory O(L·d) for all of them. Term b is the exception: (q + v)·s·W_R R is
precomputed for every query and distance, a [B, H, L, M + 2L - 1] tensor (O(L²): 8.6 GB at B = 1,
H = 8, L = 16384 in bf16, as much as the scores themselves; a product of d_head numbers per pair has
no pointwise form, and its bilinear form through the sinusoid's angle sums costs d_model / d_head
times the q·kᵀ work); backend 'blocks' keeps it O(L·d). A bias scheme of one's own that depends on
the query position (no pointwise `pair_score`) is precomputed as [H, L, K]. The block mask is the
call's Visibility (causal, window), with the learned sink slots (the first n_sinks keys) visible to
every query and free of position; key padding is applied in score_mod. CoPE does not run here
(dispatch.py). On CPU FlexAttention has no backward: forward only.

Compilation: `dynamic=False` (torch 2.13's CPU code generation of FlexAttention fails with dynamic
shapes), so every new shape of q, k (batch, L, M + L) compiles once more, as does every new
score_mod structure, dtype and autocast state; dynamo runs a function eagerly past its recompile
limit (8 by default), which for FlexAttention means the full score matrix: the first compiled call
raises the limit to RECOMPILE_LIMIT. A repeated shape does not recompile, nor does a new call of the
same scheme (tests/test_compiled_flex.py).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from relpos_ablate.model.kernels.call import AttentionCall, Visibility

#: The least recompile limit set for compiled FlexAttention: every score_mod structure, dtype,
#: autocast state and shape is one more compilation of the same function, and past torch's limit (8
#: by default) dynamo runs it eagerly: the full score matrix, 20-85x slower than compiled on a GPU
#: (benchmarks/gpu_check.py).
RECOMPILE_LIMIT = 256


@functools.cache
def _kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    config = torch._dynamo.config
    for name, least in (
        ("recompile_limit", RECOMPILE_LIMIT),
        ("cache_size_limit", RECOMPILE_LIMIT),
        ("accumulated_recompile_limit", 4 * RECOMPILE_LIMIT),
        ("accumulated_cache_size_limit", 4 * RECOMPILE_LIMIT),
    ):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) < least:
            setattr(config, name, least)  # raised, never lowered (a user's own larger limit stays)
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _block_mask(visibility: Visibility, n_queries: int, n_sinks: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    if not visibility.causal:
        return None

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx counts the sinks first
        return (kv_idx < n_sinks) | visibility(q_idx, kv_idx - n_sinks)

    return create_block_mask(
        mask_mod, None, None, n_queries, n_sinks + visibility.n_mem + n_queries, device=device
    )


def min_head_dim(device_type: str) -> int:
    """The compiled kernel's least head width on a device: 16 on CUDA (torch's lowering: "embedding
    dimension of the query, key, and value must be at least 16"; seen with torch 2.11), none on
    CPU."""
    return 16 if device_type == "cuda" else 1


def trains_pair_bias(call: AttentionCall) -> bool:
    """Whether the call would differentiate a query-dependent bias's parameters (FIRE's MLP, c, L)
    through compiled FlexAttention's score_mod, which is not trusted: on CUDA (torch 2.11) its
    gradient of FIRE's first layer's bias differed from the block kernel's by up to
    0.08 in 13 of 32 entries (the forward matched on CPU, compiled). 'auto' sends such calls to the
    other kernels; a pinned 'flex' refuses them."""
    return (
        call.pair_bias is not None
        and torch.is_grad_enabled()
        and any(p.requires_grad for p in call.pair_bias.parameters())
    )


def compiles(q: Tensor) -> bool:
    """Whether FlexAttention runs compiled: on CUDA; elsewhere eagerly (torch 2.13's CPU code
    generation has no backward; tests/test_compiled_flex.py compiles it on CPU for the forward)."""
    return q.is_cuda


def flex_attend(
    call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None
) -> Tensor:
    """softmax(s·q_content·kᵀ + terms b, d, the bias and FoX's decay, masked)·v with FlexAttention:
    [B, H, L, dh]."""
    n_queries, padding, compiled = call.n_queries, call.key_padding_mask, compiles(q_content)
    least = min_head_dim(q_content.device.type)
    if compiled and min(q_content.shape[-1], v.shape[-1]) < least:
        raise ValueError(
            f"model.attention.backend: 'flex' on {q_content.device.type} needs d_head >= {least} "
            f"(compiled FlexAttention); got {q_content.shape[-1]}; use 'auto' or 'blocks'"
        )
    if compiled and trains_pair_bias(call):
        raise ValueError(
            f"model.attention.backend: 'flex' on {q_content.device.type} cannot train a "
            f"query-dependent bias (fire: its compiled gradient is not trusted, "
            f"flex.trains_pair_bias); use 'auto' or 'blocks'"
        )
    score_mod = _per_distance_mod(call, q_position, compiled)
    if padding is not None:
        score_mod = _padded(score_mod, padding)
    if call.n_sinks:
        score_mod = _after_sinks(score_mod, call.n_sinks)
    block_mask = _block_mask(call.visibility, n_queries, call.n_sinks, str(q_content.device))
    return _kernel(compiled)(
        q_content, k, v, score_mod=score_mod, block_mask=block_mask, scale=call.scale
    )


def _padded(score_mod, padding: Tensor):
    """score_mod that also hides padded keys ([B, K], True = padded)."""

    def padded_mod(score, b, h, q_idx, kv_idx):
        return torch.where(padding[b, kv_idx], float("-inf"), score_mod(score, b, h, q_idx, kv_idx))

    return padded_mod


def _after_sinks(score_mod, n_sinks: int):
    """score_mod over [sinks; keys]: the sinks keep their content score, key kv_idx - n_sinks gets
    score_mod's."""

    def sink_mod(score, b, h, q_idx, kv_idx):
        # both branches are evaluated: keep the index in range
        key = torch.clamp(kv_idx - n_sinks, min=0)
        return torch.where(kv_idx < n_sinks, score, score_mod(score, b, h, q_idx, key))

    return sink_mod


def _per_distance_mod(call: AttentionCall, q_position: Tensor | None, compiled: bool):
    """score_mod reading per-distance tensors at column t of the pair's distance: t = (L - 1 -
    q_idx) + kv_idx for consecutive positions, d_max - (pos(q_idx) - pos(kv_idx)) at explicit
    ones."""
    n_queries, n_mem, n_distances = call.n_queries, call.n_mem, call.distances.numel()
    # the one O(L²) tensor of this path: (q + v)·s·W_R R for every query and distance, [B, H, L, M +
    # 2L - 1]
    term_b = None if q_position is None else q_position @ call.rel_keys.transpose(1, 2)
    term_d, distance_scores, scheme, pair_map = (
        call.inputs.term_d,
        call.distance_scores,
        call.pair_bias,
        None,
    )
    # a scheme of one's own: its [H, L, K] map, precomputed
    if scheme is not None and not scheme.pointwise:
        pair_map = scheme.bias(call.query_positions, call.key_positions) * call.bias_scale
    # Λ restarted at the first query, in at least fp32 (in bf16 a Λ of 100 would be off by 0.25)
    wide = torch.promote_types(call.dtype, torch.float32)
    # the queries' Λ [B, H, L] and the keys' [B, H, K] as two tensors: compiled FlexAttention cannot
    # differentiate two reads of one tensor (fox.point)
    decays = (
        None
        if call.log_decay is None
        else [
            (call.log_decay[..., start:] - call.log_decay[..., n_mem, None]).to(wide)
            for start in (n_mem, 0)
        ]
    )
    scale = None if call.query_scale is None else call.query_scale[..., 0]  # (B or 1, H or 1, L)
    largest = int(call.distances[0]) if not call.consecutive else 0
    query_positions, key_positions = call.query_positions, call.key_positions
    pair_score = None  # FIRE: its MLP per pair, (head, q_idx, kv_idx, t) -> B
    if scheme is not None and scheme.pointwise and compiled:
        pair_score = scheme.compiled_pair_score(
            query_positions, key_positions, None if call.drawn_distances else call.distances
        )
    elif scheme is not None and scheme.pointwise:

        def pair_score(head, q_idx, kv_idx, t):
            return scheme.eager_pair_score(query_positions[q_idx], key_positions[kv_idx], head)

    def column(q_idx, kv_idx):
        if call.consecutive:
            return n_queries - 1 - q_idx + kv_idx
        # pairs no query sees may fall outside the listed distances: clamped, the mask hides them
        return torch.clamp(
            largest - (query_positions[q_idx] - key_positions[kv_idx]), 0, n_distances - 1
        )

    def score_mod(score, b, h, q_idx, kv_idx):
        t = column(q_idx, kv_idx)
        if term_b is not None:
            score = score + term_b[b, h, q_idx, t]
        unscaled = []  # what does not come from the queries
        # term d without b next to a query-dependent bias (else in distance_scores)
        if term_d is not None:
            unscaled.append(term_d[h, t])
        if distance_scores is not None:
            unscaled.append(distance_scores[h, t])
        if pair_score is not None:  # FIRE evaluates its MLP here, per pair: no [H, L, K] map
            unscaled.append(pair_score(h, q_idx, kv_idx, t) * call.bias_scale)
        elif pair_map is not None:
            unscaled.append(pair_map[h, q_idx, kv_idx])
        if decays is not None:  # FoX's point-wise form (fox.py), Λ restarted at the first query
            unscaled.append(call.decay.point(*decays, b, h, q_idx, kv_idx))
        if unscaled and scale is not None:
            per_query = scale[b if scale.shape[0] > 1 else 0, h if scale.shape[1] > 1 else 0, q_idx]
            unscaled = [functools.reduce(operator.add, unscaled) * per_query]
        for added in unscaled:
            score = score + added
        return score

    return score_mod
