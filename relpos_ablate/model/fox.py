"""FoX (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate"): a
data-dependent decay.

Every head has a forget gate per token, f_t = σ(w·x_t + b) from the layer's input x_t, and the score
of query i for key j gets D_ij = Σ_{l=j+1..i} log f_l = Λ_i - Λ_j, Λ_t = Σ_{l<=t} log f_l (a
cumulative sum, O(L) memory). The key's own gate is left out, the query's counted; D_ii = 0; D is
not scaled by 1/√d.
A constant gate e^(-m) gives ALiBi's -m·(i - j): FoX is data-dependent ALiBi.
docs/schemes/data-dependent.md#fox.

With memory the sum runs over [memory; x], the gates recomputed from the memory's layer inputs, as
keys and values are. Padded keys get log f = 0 (they neither decay nor count). Λ is summed in
float64: its magnitude grows with the context, so the kernels form each block's differences D_ij in
float64 before casting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ForgetGate(nn.Module):
    """f_t = σ(w_h·x_t + b_h) per head h; init w ~ N(0, 0.02), b = 0 as the authors' code (f ≈
    1/2)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.proj = nn.Linear(d_model, n_heads, bias=True)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def log_gates(self, keys_input: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """log f_t [B, H, K] in fp32 (at least) from the keys' layer inputs [B, K, d_model]; 0 at
        padded keys."""
        logits = self.proj(keys_input)  # (B, K, H)
        log_f = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        if key_padding_mask is not None:
            log_f = log_f.masked_fill(key_padding_mask[..., None], 0.0)
        return log_f.transpose(1, 2)  # (B, H, K)

    def log_decay(self, keys_input: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Λ_j = Σ_{l<=j} log f_l over the key frame: [B, H, K] float64."""
        return self.log_gates(keys_input, key_padding_mask).double().cumsum(-1)

    # The score term D_ij = Λ_i' - Λ_j, in the three forms the kernels ask for
    # (kernels/geometry.DecayScores)
    @staticmethod
    def block_scores(log_decay: Tensor, queries: slice, keys: slice, dtype: torch.dtype) -> Tensor:
        """D for the queries' key indices against the keys: [B, H, K] (float64) -> [B, H, L_b, K_b]
        in dtype. The difference is taken in float64 and then cast: |Λ| grows with the context, and
        a difference of two large fp32 numbers would lose the near keys' decays
        (docs/schemes/data-dependent.md#fox)."""
        query, key = log_decay[..., queries, None], log_decay[..., None, keys]
        if torch.is_grad_enabled() and log_decay.requires_grad:
            return (query - key).to(dtype)  # the difference in float64, under autograd
        # without autograd in one pass: computed in float64, written in dtype
        return torch.sub(
            query, key, out=log_decay.new_empty((*query.shape[:-1], key.shape[-1]), dtype=dtype)
        )

    @staticmethod
    def point(
        query_decay: Tensor, key_decay: Tensor, b: Tensor, h: Tensor, query: Tensor, key: Tensor
    ) -> Tensor:
        """D of one pair (FlexAttention's score_mod): Λ as the caller holds it (restarted, fp32),
        the queries' [B, H, L] and the keys' [B, H, K] in two tensors, each read once (inductor:
        "multiple indexing operations on the same tensor that requires gradients in a score_mod
        function is not currently supported", on CUDA, torch 2.11); query: the query's index, key:
        the key's."""
        return query_decay[b, h, query] - key_decay[b, h, key]

    @staticmethod
    def block_gradient(grad: Tensor, grad_log_decay: Tensor, queries: slice, keys: slice) -> None:
        """∂/∂Λ of Σ grad ∘ D for a block's grad [B, H, L_b, K_b]: Λ_i' gets the row sums, Λ_j minus
        the column sums (added onto grad_log_decay [B, H, K])."""
        grad_log_decay[..., queries] += grad.sum(-1)
        grad_log_decay[..., keys] -= grad.sum(-2)
