"""FoX (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate"): a data-dependent decay.

Every head has a forget gate per token, f_t = σ(w·x_t + b) from the layer's input x_t, and the score of
query i for key j gets D_ij = Σ_{l=j+1..i} log f_l = Λ_i - Λ_j, Λ_t = Σ_{l<=t} log f_l (a cumulative sum,
O(L) memory). The key's own gate is left out, the query's counted; D_ii = 0; D is not scaled by 1/√d.
A constant gate e^(-m) gives ALiBi's -m·(i - j): FoX is data-dependent ALiBi. docs/formulas.md#fox.

With memory the sum runs over [memory; x], the gates recomputed from the memory's layer inputs, as keys
and values are. Padded keys get log f = 0 (they neither decay nor count). Λ is summed in float64: its
magnitude grows with the context, so the kernels form each block's differences D_ij in float64 before casting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ForgetGate(nn.Module):
    """f_t = σ(w_h·x_t + b_h) per head h; init w ~ N(0, 0.02), b = 0 as the authors' code (f ≈ 1/2)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.proj = nn.Linear(d_model, n_heads, bias=True)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def log_gates(self, keys_input: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """log f_t [B, H, K] in fp32 (at least) from the keys' layer inputs [B, K, d_model]; 0 at padded keys."""
        logits = self.proj(keys_input)  # (B, K, H)
        log_f = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        if key_padding_mask is not None:
            log_f = log_f.masked_fill(key_padding_mask[..., None], 0.0)
        return log_f.transpose(1, 2)  # (B, H, K)

    def log_decay(self, keys_input: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Λ_j = Σ_{l<=j} log f_l over the key frame: [B, H, K] float64."""
        return self.log_gates(keys_input, key_padding_mask).double().cumsum(-1)


def decay_map(log_decay: Tensor, n_mem: int) -> Tensor:
    """D_ij = Λ_i' - Λ_j for every query i (key index i' = M + i) and key j: [B, H, L, K] float64."""
    return log_decay[..., n_mem:, None] - log_decay[..., None, :]
