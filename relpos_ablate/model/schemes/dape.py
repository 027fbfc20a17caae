"""DAPE (Zheng et al., NeurIPS 2024, "Data-Adaptive Positional Encoding for Length Extrapolation")
and DAPE v2 (Zheng et al. 2024, "DAPE V2: Process Attention Score as Feature Map for Length
Extrapolation").

A bias-type encoding B adjusted by a small network f of the attention scores and the bias, the heads
as channels:

    score_ij = X_ij + B_ij + f([X; B])_ij     X: every other term as it enters the sum, [B, H, L, K]

- v1 (`dape: v1`): f is a per-pair MLP over the 2H channels, 2H -> width -> H with a LeakyReLU (the
  authors' code: `nn.Linear(2H, mlp_width)`, `nn.LeakyReLU()`, `nn.Linear(mlp_width, H)`; mlp_width
  32).
- v2 (`dape: v2`): f is two 1×k convolutions along the keys (2H -> width -> H, a LeakyReLU between,
  zero padding k//2 at the ends of the map), over [X; B] with every entry a query does not see set
  to 0 first (the authors' code applies `torch.tril` to the causal map; here the call's visibility,
  so memory, windows and padded keys are zeros too); k = 3.

f mixes heads and, in v2, neighbouring keys, so it needs the materialised scores: DAPE runs on the
explicit and per-block paths (backends auto, sdpa, explicit), never on the block kernel or
FlexAttention. docs/schemes/score-readers.md#dape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DataAdaptive(nn.Module):
    """f of DAPE (v1: per-pair MLP) or DAPE v2 (1×k convolutions along the keys)."""

    def __init__(self, n_heads: int, version: str, width: int, kernel: int):
        super().__init__()
        self.version, self.kernel = version, kernel
        if version == "v1":
            self.net = nn.Sequential(
                nn.Linear(2 * n_heads, width), nn.LeakyReLU(), nn.Linear(width, n_heads)
            )
        else:
            pad = (0, kernel // 2)
            self.net = nn.Sequential(
                nn.Conv2d(2 * n_heads, width, (1, kernel), padding=pad),
                nn.LeakyReLU(),
                nn.Conv2d(width, n_heads, (1, kernel), padding=pad),
            )

    @property
    def reach(self) -> int:
        """How many keys to each side an entry of f reads (v2: two convolutions; v1: none)."""
        return 0 if self.version == "v1" else 2 * (self.kernel // 2)

    def forward(self, other: Tensor, bias: Tensor, visible: Tensor) -> Tensor:
        """X + B + f([X; B]): other (X) and bias (B) broadcastable to [B, H, L_b, K_b], whole rows
        of keys for v2; visible bool [L_b, K_b] or [B, 1, L_b, K_b]."""
        other, bias = torch.broadcast_tensors(other, bias)
        features = torch.cat([other, bias], dim=1)  # (B, 2H, L_b, K_b)
        weight = self.net[0].weight
        if self.version == "v1":
            adjust = self.net(features.permute(0, 2, 3, 1).to(weight.dtype)).permute(0, 3, 1, 2)
        else:
            adjust = self.net(features.masked_fill(~visible, 0.0).to(weight.dtype))
        return other + bias + adjust.to(other.dtype)
