"""QK-norm: each head's query and key normalised before the scores, with a learned scale.

- `qk_norm: rms` (Qwen3's q_norm/k_norm; OLMo-2 normalises the whole projection, width H·dh,
  instead of each head): q ← g_q ∘ q/√(mean_c q_c² + ε), k likewise with g_k, ε = 1e-6; g_q, g_k
  [dh] learned, shared by the heads, initialised at 1.
- `qk_norm: l2` (an L2 norm with a learned scale, as Henry et al. 2020's QKNorm and nGPT; Llama 4's
  `L2Norm` is the RMS form above without a scale): q ← g_{q,h}·q/max(‖q‖, ε), k likewise with
  g_{k,h}; g [H] learned per head, initialised at √dh so that the logit s·q·k = cos(q, k)·√dh starts
  as for an RMS-normed pair.

`qk_norm_order`: before_rope (stage 0, OLMo-2 and Qwen3) or after_rope (stage 2: the rotated q and
k normalised; RoPE keeps norms, so only the rms form's per-channel scale tells them apart). The
norms are taken in float32 at least. With memory the keys of the memory's tokens are projected and
normalised again each forward from the memory's layer inputs, as every key is: the same values as
when those tokens were queries' keys. docs/schemes/attention-plumbing.md#qk-norm.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.parts import Part, Where

EPS = 1e-6


class QKNorm(Part):
    """The learned scales of one layer: `query_scale`, `key_scale` ([dh] for rms, [H] for l2)."""

    attribute = "qk_norm"

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.kind = config.qk_norm
        self.stage = 0.0 if config.qk_norm_order == "before_rope" else 2.0
        shape, start = ((d_head,), 1.0) if self.kind == "rms" else ((n_heads,), math.sqrt(d_head))
        self.query_scale = nn.Parameter(torch.full(shape, start))
        self.key_scale = nn.Parameter(torch.full(shape, start))

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        return normalise(q, self.query_scale, self.kind), normalise(k, self.key_scale, self.kind)


def normalise(x: Tensor, scale: Tensor, kind: str) -> Tensor:
    """x [B, H, n, dh] normalised along dh and scaled (rms: scale [dh]; l2: scale [H])."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "rms":
        out = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + EPS) * scale
    else:
        out = wide / wide.norm(dim=-1, keepdim=True).clamp(min=EPS) * scale[:, None, None]
    return out.to(x.dtype)
