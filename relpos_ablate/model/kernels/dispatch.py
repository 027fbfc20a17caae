"""Which kernel computes an attention call (the explicit path lives in attention.py: `scores`).

`attend(call, q_content, k, v, q_position, config, dropout_p)` -> out [B, H, L, dh], where
q_content = q + u (terms a, c) and q_position = q + v (terms b, d; None without term b):
- nothing beyond causal attention: one SDPA call (flash kernels);
- FlexAttention (flex.py) for backend 'flex', and 'auto' on CUDA without attention dropout for heads
  of at least 16 channels (its compiled kernel's least), unless a term whose point form's gradient
  is not trusted needs one (flex.untrusted_gradient);
- on CPU, a map that is a key offset (every term's `key_offsets` form) on the low-rank kernel
  (low_rank.py), and one that is constant from a distance on (a clamp, a bias's last bucket, every
  term's `band_width` form) on the band kernel (band.py), where calibration finds them fastest;
- the block kernel that rebuilds each block's map in backward (blockwise.py) for backend 'blocks',
  and 'auto' without attention dropout unless the maps fit in max_stored_scores_mb (default 0:
  never);
- else SDPA per query block, each with its additive map (stored for backward);
- with statistics to collect (evaluation diagnostics), explicit probabilities per query block, each
  block's handed to the statistics before it is multiplied by v (no fused kernel has them);
- a term that reads content (its map needs each block's whole score rows before the softmax) never
  on FlexAttention (the block kernel builds its blocks with whole rows of keys).
k and v start with the call's learned sink slots (call.n_sinks; none: plain keys).
A new kernel is one function of (call, q_content, k, v, q_position) and one branch in `attend`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from relpos_ablate import planner
from relpos_ablate.model.core.call import AttentionCall, ScoreInputs, sum_terms
from relpos_ablate.model.core.geometry import StatisticsSink
from relpos_ablate.model.core.terms import needs_gradient
from relpos_ablate.model.kernels import band, calibration, flex, low_rank
from relpos_ablate.model.kernels.blockwise import BlockwiseBiasedAttention, masked_softmax


class KernelChoice(Protocol):
    """What the attention's configuration says of the kernels (AttentionConfig has both)."""

    backend: str  # auto, sdpa, blocks, flex, low_rank, band (explicit never reaches here)
    max_stored_scores_mb: float  # training on SDPA per block stores at most this much of maps


# Score entries per head in one query block whose map is stored for backward (the block kernel sizes
# its own blocks: block_maps.py)
STORED_BLOCK_SCORES = 256 * 1024


def attend(
    call: AttentionCall,
    q_content: Tensor,
    k: Tensor,
    v: Tensor,
    q_position: Tensor | None,
    config: KernelChoice,
    dropout_p: float,
    statistics: StatisticsSink | None = None,
    path: str | None = None,
) -> Tensor:
    """[B, H, L, dh] attention output by the kernel the config and the call select (module
    docstring); path: one of `candidates` (calibration times each so)."""
    # the call's tensors are in the kernels' dtype (call.dtype, autocast's under autocast); so are
    # the queries, keys and values from here (a term may keep its own, e.g. float64)
    dtype = call.dtype
    q_content, k, v, q_position = (
        None if t is None else t.to(dtype) for t in (q_content, k, v, q_position)
    )
    if statistics is not None:
        return _observed(call, q_content, k, v, q_position, dropout_p, statistics)
    if prefers_flex(call, q_content, q_position, config, dropout_p, q_content.is_cuda):
        return flex.flex_attend(call, q_content, k, v, q_position)
    if not call.has_additive:  # a mask, no map: plain SDPA, or SDPA per block with its mask
        if one_sdpa_call(call):
            return _plain(call, q_content, k, v, dropout_p)
        return _stored(call, q_content, k, v, q_position, dropout_p)
    if path is None and config.backend in ("auto", "band"):
        # the band the terms' data allow
        call = band.with_term_band(call, q_content, k, dropout_p)
    offsets = _low_rank_plan(call, q_content, dropout_p) if path in (None, "low_rank") else None
    paths = [path] if path else _candidates(call, q_content, config, dropout_p, offsets)
    path = (
        paths[0]
        if len(paths) == 1 or not calibration.enabled()
        else _calibrated(call, q_content, k, v, q_position, config, dropout_p, paths)
    )
    if path == "low_rank":
        return low_rank.attend_low_rank(call, q_content, k, v, *offsets)
    if path in ("blocks", "band"):
        call = band.banded(call) if path == "band" else call
        return _blockwise(call, *_widened(call, q_content, k, v, q_position)).to(call.dtype)
    return _stored(call, q_content, k, v, q_position, dropout_p)


def prefers_flex(
    call: AttentionCall,
    q_content: Tensor,
    q_position: Tensor | None,
    config: KernelChoice,
    dropout_p: float,
    cuda: bool,
) -> bool:
    """Whether the call goes to FlexAttention: pinned, or under 'auto' on CUDA where compiled
    FlexAttention takes it — heads of at least 16 channels, every term's gradient trusted, and no
    term b, which it would hold as a [B, H, L, M + 2L - 1] tensor (flex.py) where the block kernel
    keeps it O(L·d) — and the call is not one SDPA call (NoPE, RoPE: SDPA's flash kernel), and the
    planner gives it the call's forms."""
    on_flex = config.backend == "flex" or (
        config.backend == "auto"
        and cuda
        and dropout_p == 0.0
        and not one_sdpa_call(call)
        and q_content.shape[-1] >= flex.min_head_dim("cuda")
        and not flex.untrusted_gradient(call)
        and q_position is None
    )
    return on_flex and planner.flex(call.plan)


def one_sdpa_call(call: AttentionCall) -> bool:
    """Nothing added to the scores and nothing masked but causality: one SDPA call takes it."""
    return (
        not call.has_additive
        and not call.masked_per_row
        and call.visibility.window is None
        and not call.n_sinks
    )


def candidates(
    call: AttentionCall, q_content: Tensor, config: KernelChoice, dropout_p: float
) -> list[str]:
    """The kernels that may compute this call, the fixed order's choice first: 'low_rank' (every
    term a key offset; low_rank.py), 'band' (a map constant from a distance on: its band
    on the block kernel, the rest on the causal flash kernel; band.py), 'blocks' (the block kernel:
    no attention dropout) and 'sdpa' (SDPA per query block with its map: stored for backward, so in
    training only while the maps fit max_stored_scores_mb). A pinned backend is the only candidate
    where it can take the call; low_rank and band otherwise leave it to the block kernel (its
    results are the same, by rounding)."""
    return _candidates(
        call, q_content, config, dropout_p, _low_rank_plan(call, q_content, dropout_p)
    )


def _candidates(
    call: AttentionCall,
    q_content: Tensor,
    config: KernelChoice,
    dropout_p: float,
    plan: tuple[Tensor, int] | None,
) -> list[str]:
    """`candidates`, given the low-rank kernel's plan (`_low_rank_plan`: computed once a
    forward); the kernels the forms of the call allow (relpos_ablate/planner.py), where their own
    data allow."""
    forms = call.plan
    if (
        config.backend == "sdpa"
        or (config.backend == "blocks" and dropout_p > 0.0)
        or not planner.blocks(forms)
    ):
        return ["sdpa"]
    rebuild = "blocks" if dropout_p == 0.0 else "sdpa"
    banded = planner.band(forms) and band.takes(call, q_content, dropout_p)
    if config.backend in ("blocks", "low_rank", "band"):
        pinned = (config.backend == "low_rank" and plan is not None) or (
            config.backend == "band" and banded
        )
        return [config.backend] if pinned else [rebuild]
    if dropout_p > 0.0:
        return ["sdpa"]
    paths = (["low_rank"] if plan is not None else []) + (["band"] if banded else [])
    if _stores_too_much(call, q_content, config):
        return [*paths, "blocks"]
    # storing the maps is allowed: in training it is the fixed order's choice
    # (max_stored_scores_mb's promise)
    return [*paths, "sdpa", "blocks"] if torch.is_grad_enabled() else [*paths, "blocks", "sdpa"]


def _low_rank_plan(
    call: AttentionCall, q_content: Tensor, dropout_p: float
) -> tuple[Tensor, int] | None:
    """The low-rank kernel's key offsets and query block for this call, computed once a forward;
    None where it cannot take the call."""
    if dropout_p > 0.0 or q_content.device.type != "cpu" or not planner.low_rank(call.plan):
        return None
    offsets = low_rank.key_offsets(call)
    block = None if offsets is None else low_rank.block_size(offsets, call.n_queries)
    return None if block is None else (offsets, block)


def _stores_too_much(call: AttentionCall, q_content: Tensor, config: KernelChoice) -> bool:
    """Whether training on SDPA per block would store score maps beyond max_stored_scores_mb (never
    without autograd: nothing is stored)."""
    if not torch.is_grad_enabled():
        return False
    lq = call.n_queries
    per_head = lq * call.n_mem + lq * (lq + 1) // 2 if call.causal else lq * call.n_keys
    stored = q_content.shape[0] * q_content.shape[1] * per_head * q_content.element_size()
    return stored > config.max_stored_scores_mb * 2**20


def call_key(call: AttentionCall, q_content: Tensor, dropout_p: float) -> str:
    """The calibration key: scheme class, shape bucket, device, dtype, train/eval
    (calibration.py)."""
    inputs = call.inputs
    # a tensor autograd differentiates is its own class: the block kernel's backward is the fused
    # one only where no map input needs a gradient (a fixed slope: yes; a learned one: no)
    terms = [
        name + ("'" if t.requires_grad else "")
        for name, t in zip(inputs._fields, inputs)
        if t is not None and name != "q_position"
    ]
    terms += [term.name + ("'" if needs_gradient(term) else "") for term in call.terms]
    terms += [
        name
        for name, on in (
            ("window", call.visibility.window),
            ("padding", call.key_padding_mask is not None),
            ("documents", call.document_ids is not None),
            ("sinks", call.n_sinks),
            ("positions", not call.consecutive),
            ("causal", call.causal),
            ("dropout", dropout_p > 0.0),
        )
        if on
    ]
    b, h, lq, dh = q_content.shape
    # the band kernel's cost grows with its band (the saturation distance)
    band_width = f" S{calibration.bucket(call.saturation)}" if call.saturation is not None else ""
    return (
        f"{q_content.device.type}/{str(call.dtype).removeprefix('torch.')}/"
        f"{'train' if torch.is_grad_enabled() else 'eval'}/{'+'.join(terms)}/"
        f"B{b} H{h} d{dh} L{calibration.bucket(lq)} M{calibration.bucket(call.n_mem)}{band_width}"
    )


@torch.compiler.disable
def _calibrated(
    call: AttentionCall,
    q_content: Tensor,
    k: Tensor,
    v: Tensor,
    q_position: Tensor | None,
    config: KernelChoice,
    dropout_p: float,
    paths: list[str],
) -> str:
    """The measured choice among `paths` (calibration.CALIBRATION), timed on detached copies of this
    call's tensors: autograd.grad of their own graph, so no parameter's .grad and no graph of the
    model is touched."""
    grad = torch.is_grad_enabled()

    # detached, differentiated as the original would be
    def leaf(t: Tensor | None) -> Tensor | None:
        return (
            None
            if t is None
            else t.detach().requires_grad_(grad and t.requires_grad and t.is_floating_point())
        )

    copies = [leaf(t) for t in (q_content, k, v, q_position)]
    inputs = ScoreInputs(*map(leaf, call.inputs))
    tensors = [leaf(t) for t in call.term_tensors()]
    copy = dataclasses.replace(call, inputs=inputs).with_term_tensors(tensors)
    leaves = [t for t in (*copies, *inputs, *tensors) if t is not None and t.requires_grad]

    def run(path: str) -> None:
        out = attend(copy, *copies, config, dropout_p, path=path)
        if leaves:
            torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)

    return calibration.CALIBRATION.choose(call_key(call, q_content, dropout_p), paths, run)


def _plain(
    call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, dropout_p: float
) -> Tensor:
    """No additive map: one SDPA call (flash kernels); causal with memory is lower-right aligned."""
    if not call.causal:
        return F.scaled_dot_product_attention(
            q_content, k, v, dropout_p=dropout_p, scale=call.scale
        )
    if call.n_mem == 0:
        return F.scaled_dot_product_attention(
            q_content, k, v, is_causal=True, dropout_p=dropout_p, scale=call.scale
        )
    mask = causal_lower_right(call.n_queries, call.n_keys)
    return F.scaled_dot_product_attention(
        q_content, k, v, attn_mask=mask, dropout_p=dropout_p, scale=call.scale
    )


# The block kernel (BlockwiseBiasedAttention: O(L·d) memory). torch.compile (train.compile) does not
# trace into it: its Python loop over blocks and tiles, the strides of its views and the host checks
# of its masks would break the graph in every block; one break around it leaves the rest of the
# layer compiled
_blockwise = torch.compiler.disable(BlockwiseBiasedAttention.apply)


def _widened(
    call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None
) -> list:
    """The block kernel's arguments after the call: q_content, k, v, the score inputs, the terms'
    tensors and the parameters the terms read. bf16/fp16 are widened to fp32, so that scores and
    softmax statistics stay in fp32 as FlashAttention keeps them (float64 is left as it is)."""
    wide = torch.promote_types(q_content.dtype, torch.float32)
    widen = [t.to(wide) for t in (q_content, k, v)]
    inputs = [
        t if t is None or t.dtype == torch.float64 else t.to(wide)
        for t in (*call.score_inputs(q_position), *call.term_tensors())
    ]
    return [*widen, *inputs, *call.term_parameters()]


def _stored(
    call: AttentionCall,
    q_content: Tensor,
    k: Tensor,
    v: Tensor,
    q_position: Tensor | None,
    dropout_p: float,
) -> Tensor:
    """SDPA per query block (skipping the keys outside its windows), with the block's additive map
    and mask as one float mask."""
    inputs, outs = call.score_inputs(q_position), []
    for blk in call.blocks(STORED_BLOCK_SCORES, windowed=True):
        visible = call.with_sinks(call.visible(blk), True)
        q_b, k_b = q_content[:, :, blk.rows], k[:, :, blk.keys]  # k_b: (B, H, S + K_b, dh)
        additive = sum_terms(
            call.additive_terms(blk, call.block_inputs(blk, inputs), q_b, k_b[:, :, blk.n_sinks :])
        )
        if additive is not None:
            additive = (
                call.with_sinks(additive, 0.0)
                .to(q_content.dtype)
                .masked_fill(~visible, float("-inf"))
            )
        outs.append(
            F.scaled_dot_product_attention(
                q_b,
                k_b,
                v[:, :, blk.keys],
                attn_mask=visible if additive is None else additive,
                dropout_p=dropout_p,
                scale=call.scale,
            )
        )
    return torch.cat(outs, dim=2)  # (B, H, L, dh)


def _observed(
    call: AttentionCall,
    q_content: Tensor,
    k: Tensor,
    v: Tensor,
    q_position: Tensor | None,
    dropout_p: float,
    statistics: StatisticsSink,
) -> Tensor:
    """Probabilities per query block, handed to `statistics` (the stream's keys, sinks left out)
    before the product with v."""
    inputs, outs = call.score_inputs(q_position), []
    for blk in call.blocks(STORED_BLOCK_SCORES):
        q_b, k_b, v_b = q_content[:, :, blk.rows], k[:, :, blk.keys], v[:, :, blk.keys]
        scores = (q_b @ k_b.transpose(-1, -2)).mul_(call.scale)  # (B, H, L_b, S + K_b)
        additive = sum_terms(
            call.additive_terms(blk, call.block_inputs(blk, inputs), q_b, k_b[:, :, blk.n_sinks :])
        )
        if additive is not None:
            scores = scores.add_(call.with_sinks(additive, 0.0))
        probs = masked_softmax(scores, call.with_sinks(call.visible(blk), True))
        statistics.add(call.view(blk), probs[..., blk.n_sinks :])
        outs.append((F.dropout(probs, dropout_p) if dropout_p else probs) @ v_b)
    return torch.cat(outs, dim=2)  # (B, H, L, dh)
