"""FlexAttention path (CUDA; compiled on CPU in the tests): the same scores as the block kernel, as
a `score_mod` + `block_mask`.

score_mod reads per-distance tensors at the pair's column t in the descending-distance order
(shift.py), t = (L - 1 - q_idx) + kv_idx for consecutive positions, d_max - (pos(q_idx) -
pos(kv_idx)) at explicit ones: distance_scores [H, n] (term d without b, a bias of distance alone;
term d its own [H, n] next to a term), the query scale [B or 1, H or 1, L], and each score term's
point form (ScoreTerm.point: a cumulative decay's two reads, a bias's MLP evaluated per pair):
memory O(L·d) for all of them. A bias of distance alone with a closed form
(BiasScheme.point_curve) is computed from the pair's |i - j| and a few values per head instead of
gathered from its table. Term b is the exception: (q + v)·s·W_R R is
precomputed for every query and distance, a [B, H, L, M + 2L - 1] tensor (O(L²): 8.6 GB at B = 1,
H = 8, L = 16384 in bf16, as much as the scores themselves; a product of d_head numbers per pair has
no pointwise form, and its bilinear form through the sinusoid's angle sums costs d_model / d_head
times the q·kᵀ work); backend 'blocks' keeps it O(L·d). A term without a point form is precomputed
as its [B or 1, H, L, K] map. The block mask is the
call's Visibility (causal, window) and, per row, key padding and each query's own document over
packed documents (blocks of padding or between two documents are skipped), with the learned sink
slots (the first n_sinks keys) visible to every query and free of position. A term that reads
content does not run here (dispatch.py). On CPU FlexAttention has no backward: forward only.

Compilation: `dynamic=False` (torch 2.13's CPU code generation of FlexAttention fails with dynamic
shapes), so every new shape of q, k (batch, L, M + L) compiles once more, as does every new
score_mod structure, dtype and autocast state; dynamo runs a function eagerly past its recompile
limit (8 by default), which for FlexAttention means the full score matrix: the first compiled call
raises the limit to RECOMPILE_LIMIT. A repeated shape does not recompile, nor does a new call of the
same scheme (tests/model/test_compiled_flex.py).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from relpos_ablate.model.core.call import AttentionCall, Visibility
from relpos_ablate.model.core.terms import needs_gradient

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


#: the last per-row block mask: (documents, padding, visibility, queries, sinks, mask); the layers
#: of one forward share their tensors, so its mask is built once per forward, not once per layer
_last_rows: list = [None]


def _row_mask(
    visibility: Visibility,
    n_queries: int,
    n_sinks: int,
    documents: Tensor | None,
    padding: Tensor | None,
):
    """The block mask of a call whose visibility differs per row: the Visibility, a query's own
    document (packed documents [B, K]) and no padded key (key padding [B, K], True = padded), so
    that the blocks no query of a row reaches (another document, padding) are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (visibility, n_queries, n_sinks)
    last = _last_rows[0]
    if last is not None and last[0] is documents and last[1] is padding and last[2:5] == key:
        return last[5]
    n_mem = visibility.n_mem
    rows = (documents if documents is not None else padding).shape[0]

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx counts the sinks first
        j = torch.clamp(kv_idx - n_sinks, min=0)
        seen = visibility(q_idx, j) & (kv_idx >= n_sinks)
        if documents is not None:
            seen = seen & (documents[b, n_mem + q_idx] == documents[b, j])
        if padding is not None:
            seen = seen & ~padding[b, j]
        return (kv_idx < n_sinks) | seen

    any_row = documents if documents is not None else padding
    mask = create_block_mask(
        mask_mod, rows, None, n_queries, n_sinks + n_mem + n_queries, device=str(any_row.device)
    )
    _last_rows[0] = (documents, padding, *key, mask)
    return mask


def min_head_dim(device_type: str) -> int:
    """The compiled kernel's least head width on a device: 16 on CUDA (torch's lowering: "embedding
    dimension of the query, key, and value must be at least 16"; seen with torch 2.11), none on
    CPU."""
    return 16 if device_type == "cuda" else 1


def untrusted_gradient(call: AttentionCall) -> bool:
    """Whether the call would differentiate a term through compiled FlexAttention's score_mod where
    the term says its point form's gradient is not trusted (ScoreTerm.point_gradient_trusted):
    'auto' sends such calls to the other kernels; a pinned 'flex' refuses them."""
    return any(not term.point_gradient_trusted and needs_gradient(term) for term in call.terms)


def compiles(q: Tensor) -> bool:
    """Whether FlexAttention runs compiled: on CUDA; elsewhere eagerly (torch 2.13's CPU code
    generation has no backward; tests/model/test_compiled_flex.py compiles it on CPU for the
    forward)."""
    return q.is_cuda


def flex_attend(
    call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None
) -> Tensor:
    """softmax(s·q_content·kᵀ + terms b, d, the curve and the score terms, masked)·v with
    FlexAttention: [B, H, L, dh]."""
    n_queries, padding, compiled = call.n_queries, call.key_padding_mask, compiles(q_content)
    least = min_head_dim(q_content.device.type)
    if compiled and min(q_content.shape[-1], v.shape[-1]) < least:
        raise ValueError(
            f"model.attention.backend: 'flex' on {q_content.device.type} needs d_head >= {least} "
            f"(compiled FlexAttention); got {q_content.shape[-1]}; use 'auto' or 'blocks'"
        )
    if compiled and untrusted_gradient(call):
        names = [t.name for t in call.terms if not t.point_gradient_trusted]
        raise ValueError(
            f"model.attention.backend: 'flex' on {q_content.device.type} cannot train the score "
            f"term {names[0]!r} (its compiled gradient is not trusted, flex.untrusted_gradient); "
            f"use 'auto' or 'blocks'"
        )
    score_mod = _per_distance_mod(call, q_position, compiled)
    if call.n_sinks:
        score_mod = _after_sinks(score_mod, call.n_sinks)
    block_mask = (
        _row_mask(call.visibility, n_queries, call.n_sinks, call.document_ids, padding)
        if call.masked_per_row
        else _block_mask(call.visibility, n_queries, call.n_sinks, str(q_content.device))
    )
    # inside a compiled forward (train.compile) the enclosing compilation compiles FlexAttention;
    # calling torch.compile there breaks the graph (Lightning replaces torch.compile with a
    # wrapper that dynamo does not trace): tests/model/test_compiled_flex.py
    kernel = _kernel(False) if torch.compiler.is_compiling() else _kernel(compiled)
    return kernel(
        q_content,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=call.scale,
        kernel_options=kernel_options(compiled),
    )


def kernel_options(compiled: bool) -> dict | None:
    """The Triton kernel wherever gradients are taken: FlexAttention's FLASH backend (FA4, CuTe-DSL)
    has no backward for captured tensors that require grad (the tables, slopes and term tensors
    score_mod reads), so a training call never leaves the choice to AUTO's heuristics (torch 2.13's
    AUTO never picks FLASH; a later one might). Only where torch knows the option (2.11 on)."""
    wanted = compiled and torch.is_grad_enabled() and _knows_backend()
    return {"BACKEND": "TRITON"} if wanted else None


@functools.cache
def _knows_backend() -> bool:
    from torch.nn.attention import flex_attention

    options = getattr(flex_attention, "FlexKernelOptions", None)
    return options is not None and "BACKEND" in getattr(options, "__annotations__", {})


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
    ones, and each term's point form (its dense map of the whole call where it has none)."""
    n_queries, n_distances = call.n_queries, call.distances.numel()
    # the one O(L²) tensor of this path: (q + v)·s·W_R R for every query and distance, [B, H, L, M +
    # 2L - 1]
    term_b = None if q_position is None else q_position @ call.rel_keys.transpose(1, 2)
    term_d, distance_scores = call.inputs.term_d, call.distance_scores
    # the scores of distance alone in closed form at the pair's |i - j| (not a gathered table)
    closed_form, n_mem = call.distance_point, call.n_mem
    points = []  # (the term's point form, whether λ multiplies it)
    for term in call.terms:
        point = term.point(call, compiled)
        if point is None:  # its [B or 1, H, L, K] map, precomputed
            dense = term.block(call, call.all_queries)
            point = functools.partial(_read, dense)
        points.append((point, term.scaled))
    scale = None if call.query_scale is None else call.query_scale[..., 0]  # (B or 1, H or 1, L)
    largest = int(call.distances[0]) if not call.consecutive else 0
    query_positions, key_positions = call.query_positions, call.key_positions

    def distance(q_idx, kv_idx):  # |i - j| at the pair's positions
        if call.consecutive:
            return torch.abs(n_mem + q_idx - kv_idx)
        return torch.abs(query_positions[q_idx] - key_positions[kv_idx])

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
        scaled, unscaled = [], []  # what λ multiplies (all that does not come from the queries)
        if term_d is not None:
            scaled.append(term_d[h, t])
        if closed_form is not None:
            scaled.append(closed_form(h, distance(q_idx, kv_idx)))
        elif distance_scores is not None:
            scaled.append(distance_scores[h, t])
        for point, by_query in points:
            (scaled if by_query else unscaled).append(point(b, h, q_idx, kv_idx, t))
        if scaled and scale is not None:
            per_query = scale[b if scale.shape[0] > 1 else 0, h if scale.shape[1] > 1 else 0, q_idx]
            scaled = [functools.reduce(operator.add, scaled) * per_query]
        for added in scaled + unscaled:
            score = score + added
        return score

    return score_mod


def _read(dense: Tensor, b, h, q_idx, kv_idx, t) -> Tensor:
    """A precomputed [B or 1, H, L, K] map at one pair."""
    return dense[b if dense.shape[0] > 1 else 0, h, q_idx, kv_idx]
