"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv
2505.06708): the output of each head multiplied by a sigmoid gate of the layer's input, after the
attention and before the output projection (their position G1, the one they recommend):

    Y' = Y ⊙ σ(X W_θ)

X the attention's input (after the pre-norm), Y the heads' output [B, L, H, dh]. `output_gate:
elementwise` gives one gate per head channel (W_θ: d_model × H·dh), `headwise` one scalar per head
(d_model × H). W_θ has no bias and PyTorch's default Linear initialisation (their gate is an
extension of the query projection). docs/schemes/attention-plumbing.md#output-gate.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.parts import Part


class OutputGate(Part):
    """W_θ of one layer (`proj`)."""

    attribute = "output_gate"

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.width = d_head if config.output_gate == "elementwise" else 1
        self.proj = nn.Linear(d_model, n_heads * self.width, bias=False)

    def output(self, out: Tensor, x: Tensor) -> Tensor:
        b, lq, _ = x.shape
        # (B, L, H·w) -> (B, H, L, w): w = dh or 1
        gate = self.proj(x).view(b, lq, -1, self.width).transpose(1, 2)
        return out * torch.sigmoid(gate).to(out.dtype)
