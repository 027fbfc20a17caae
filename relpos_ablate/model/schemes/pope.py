"""PoPE (Gopalakrishnan et al. 2025, "Decoupling the 'What' and 'Where' With Polar Coordinate
Positional Embeddings", arXiv 2509.10534): every channel c of a head's query and key is a complex
number whose magnitude is the content, softplus(x_c), and whose phase is the position alone,
position·θ_c (the key's shifted by a learned δ_{h,c} with `pope_phase_bias`). The score is the real
part of their product:

    q̃_i·k̃_j = Σ_c softplus(q_ic)·softplus(k_jc)·cos((i - j)·θ_c - δ_{h,c}),   θ_c = base^(-c/d_h)

with d_h frequencies (c = 0 .. d_h - 1, step 1/d_h; RoPE has d_h/2 at step 2/d_h), base =
`rope_base`. RoPE's polar form has the content's own phase inside the cosine, entangling what and
where; PoPE's has none. As x-transformers' `PolarEmbedding` and `apply_polar_pos_emb` compute it:
q̃ = [μ cos φ ‖ μ sin φ] (width 2·d_h, the halves concatenated), the phase bias on the key side only,
clamped to [-2π, 0], initialised at 0; the score scale stays 1/√d_h of the original width; v keeps
width d_h. Angles in float64, magnitudes in float32 at least. Positions are those the encodings read
(explicit or randomized ones included). docs/schemes/attention-plumbing.md#pope.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.model.core.parts import Part, Where


class PolarPositions(Part):
    """PoPE of one layer: the frequencies and, with `pope_phase_bias`, δ [H, d_h]."""

    attribute = "pope"
    stage = 1.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.base, self.d_head = config.rope_base, d_head
        self.phase_bias = (
            nn.Parameter(torch.zeros(n_heads, d_head)) if config.pope_phase_bias else None
        )

    def frequencies(self, device=None) -> Tensor:
        """θ_c = base^(-c/d_h), c = 0 .. d_h - 1: [d_h] float64."""
        c = torch.arange(self.d_head, dtype=torch.float64, device=device)
        return self.base ** (-c / self.d_head)

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        """q [B, H, L, d_h], k [B, H, K, d_h] -> [B, H, L, 2·d_h], [B, H, K, 2·d_h]."""
        theta = self.frequencies(q.device)
        # (L, dh), (K, dh); per row (B, 1, L or K, dh) over packed documents
        query_phase = at.placement.query_positions.double()[..., None] * theta
        key_phase = at.placement.key_positions.double()[..., None] * theta
        if self.phase_bias is not None:
            # (H, K, dh): δ on the keys' side, as the authors' reference code
            key_phase = key_phase + self.phase_bias.double().clamp(-2 * math.pi, 0.0)[:, None]
        return polar(q, query_phase), polar(k, key_phase)


def polar(x: Tensor, phase: Tensor) -> Tensor:
    """[softplus(x)·cos φ ‖ softplus(x)·sin φ]: x [B, H, n, d], φ [n, d], [H, n, d] or [B, 1 or
    H, n, d] float64."""
    magnitude = F.softplus(x.to(torch.promote_types(x.dtype, torch.float32)))
    cos, sin = phase.cos().to(magnitude.dtype), phase.sin().to(magnitude.dtype)
    return torch.cat([magnitude * cos, magnitude * sin], dim=-1).to(x.dtype)
