"""Which kernel computes an attention call (the explicit path lives in attention.py: `scores`).

`attend(call, q_content, k, v, q_position, config, dropout_p)` -> out [B, H, L, dh], where
q_content = q + u (terms a, c) and q_position = q + v (terms b, d; None without term b):
- nothing beyond causal attention: one SDPA call (flash kernels);
- FlexAttention (flex.py) for backend 'flex', and 'auto' on CUDA without attention dropout;
- the block kernel that rebuilds each block's map in backward (blockwise.py) for backend 'blocks', and
  'auto' without attention dropout unless the maps fit in max_stored_scores_mb (default 0: never);
- else SDPA per query block, each with its additive map (stored for backward);
- with statistics to collect (evaluation diagnostics), explicit probabilities per query block, each
  block's handed to the statistics before it is multiplied by v (no fused kernel has them);
- CoPE (call.contextual) never on FlexAttention: its positions need each block's whole score rows before
  the softmax (the block kernel builds its blocks with whole rows of keys).
k and v start with the call's learned sink slots (call.n_sinks; none: plain keys).
A new kernel is one function of (call, q_content, k, v, q_position) and one branch in `attend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from relpos_ablate.config.model import AttentionConfig
from relpos_ablate.model.kernels.call import AttentionCall, sum_terms
from relpos_ablate.model.kernels.geometry import StatisticsSink
from relpos_ablate.model.kernels.blockwise import BlockwiseBiasedAttention, masked_softmax

# Score entries per head in one query block whose map is stored for backward (the block kernel sizes its
# own blocks: block_maps.py)
STORED_BLOCK_SCORES = 256 * 1024


def attend(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None,
           config: AttentionConfig, dropout_p: float, statistics: StatisticsSink | None = None) -> Tensor:
    """[B, H, L, dh] attention output by the kernel the config and the call select (module docstring)."""
    # the call's tensors are in the kernels' dtype (call.dtype, autocast's under autocast); so are the queries,
    # keys and values from here. FoX's Λ stays float64 (AttentionCall.decay)
    dtype = call.dtype
    q_content, k, v, q_position = (None if t is None else t.to(dtype) for t in (q_content, k, v, q_position))
    if statistics is not None:
        return _observed(call, q_content, k, v, q_position, dropout_p, statistics)
    flex = config.backend == "flex" or (config.backend == "auto" and q_content.is_cuda and dropout_p == 0.0)
    if flex and call.contextual is None:
        from relpos_ablate.model.kernels.flex import flex_attend

        return flex_attend(call, q_content, k, v, q_position, compiled=q_content.is_cuda)
    if not call.has_additive:
        if call.key_padding_mask is None and call.visibility.window is None and not call.n_sinks:
            return _plain(call, q_content, k, v, dropout_p)
    elif dropout_p == 0.0 and _rebuild_in_backward(call, q_content, config):
        return _blockwise(call, *_widened(call, q_content, k, v, q_position)).to(dtype)
    return _stored(call, q_content, k, v, q_position, dropout_p)


def _rebuild_in_backward(call: AttentionCall, q_content: Tensor, config: AttentionConfig) -> bool:
    """Always for backend 'blocks'; for 'auto' unless training would store score maps no larger than
    max_stored_scores_mb."""
    if config.backend != "auto":
        return config.backend == "blocks"
    if not torch.is_grad_enabled():
        return True  # nothing is stored without backward
    lq = call.n_queries
    per_head = lq * call.n_mem + lq * (lq + 1) // 2 if call.causal else lq * call.n_keys
    stored = q_content.shape[0] * q_content.shape[1] * per_head * q_content.element_size()
    return stored > config.max_stored_scores_mb * 2**20


def _plain(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    """No additive map: one SDPA call (flash kernels); causal with memory is lower-right aligned."""
    if not call.causal:
        return F.scaled_dot_product_attention(q_content, k, v, dropout_p=dropout_p, scale=call.scale)
    if call.n_mem == 0:
        return F.scaled_dot_product_attention(q_content, k, v, is_causal=True, dropout_p=dropout_p, scale=call.scale)
    mask = causal_lower_right(call.n_queries, call.n_keys)
    return F.scaled_dot_product_attention(q_content, k, v, attn_mask=mask, dropout_p=dropout_p, scale=call.scale)


# The block kernel (BlockwiseBiasedAttention: O(L·d) memory). torch.compile (train.compile) does not trace into
# it: its Python loop over blocks and tiles, the strides of its views and the host checks of its masks would
# break the graph in every block; one break around it leaves the rest of the layer compiled
_blockwise = torch.compiler.disable(BlockwiseBiasedAttention.apply)


def _widened(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None) -> list:
    """The block kernel's arguments after the call: q_content, k, v, the score inputs and the parameters the
    maps read. bf16/fp16 are widened to fp32, so that scores and softmax statistics stay in fp32 as
    FlashAttention keeps them (FoX's float64 Λ is left as it is)."""
    wide = torch.promote_types(q_content.dtype, torch.float32)
    widen = [t.to(wide) for t in (q_content, k, v)]
    inputs = [t if t is None or t.dtype == torch.float64 else t.to(wide) for t in call.score_inputs(q_position)]
    params = [p for scheme in (call.pair_bias, call.contextual) if scheme is not None for p in scheme.parameters()]
    return [*widen, *inputs, *params]


def _stored(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None,
            dropout_p: float) -> Tensor:
    """SDPA per query block (skipping the keys outside its windows), with the block's additive map and
    mask as one float mask."""
    inputs, outs = call.score_inputs(q_position), []
    for blk in call.blocks(STORED_BLOCK_SCORES, windowed=True):
        visible = call.with_sinks(call.visible(blk), True)
        q_b, k_b = q_content[:, :, blk.rows], k[:, :, blk.keys]  # k_b: (B, H, S + K_b, dh)
        additive = sum_terms(call.additive_terms(blk, call.block_inputs(blk, inputs), q_b, k_b[:, :, blk.n_sinks:]))
        if additive is not None:
            additive = call.with_sinks(additive, 0.0).to(q_content.dtype).masked_fill(~visible, float("-inf"))
        outs.append(F.scaled_dot_product_attention(
            q_b, k_b, v[:, :, blk.keys], attn_mask=visible if additive is None else additive,
            dropout_p=dropout_p, scale=call.scale,
        ))
    return torch.cat(outs, dim=2)  # (B, H, L, dh)


def _observed(call: AttentionCall, q_content: Tensor, k: Tensor, v: Tensor, q_position: Tensor | None,
              dropout_p: float, statistics: StatisticsSink) -> Tensor:
    """Probabilities per query block, handed to `statistics` (the stream's keys, sinks left out) before
    the product with v."""
    inputs, outs = call.score_inputs(q_position), []
    for blk in call.blocks(STORED_BLOCK_SCORES):
        q_b, k_b, v_b = q_content[:, :, blk.rows], k[:, :, blk.keys], v[:, :, blk.keys]
        scores = (q_b @ k_b.transpose(-1, -2)).mul_(call.scale)  # (B, H, L_b, S + K_b)
        additive = sum_terms(call.additive_terms(blk, call.block_inputs(blk, inputs), q_b, k_b[:, :, blk.n_sinks:]))
        if additive is not None:
            scores = scores.add_(call.with_sinks(additive, 0.0))
        probs = masked_softmax(scores, call.with_sinks(call.visible(blk), True))
        statistics.add(call.view(blk), probs[..., blk.n_sinks:])
        outs.append((F.dropout(probs, dropout_p) if dropout_p else probs) @ v_b)
    return torch.cat(outs, dim=2)  # (B, H, L, dh)
