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

from relpos_ablate.model.core.terms import HandGradient, ScoreTerm, TermScheme


class ForgetGate(TermScheme):
    """f_t = σ(w_h·x_t + b_h) per head h; init w ~ N(0, 0.02), b = 0 as the authors' code (f ≈
    1/2)."""

    attribute = "forget_gate"

    @classmethod
    def build(cls, d_model, n_heads, d_head, config) -> ForgetGate:
        return cls(d_model, n_heads)

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

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None = None) -> ForgetTerm:
        """This forward's score term D_ij from the keys' layer inputs [B, K, d_model]."""
        return ForgetTerm((self.log_decay(keys_input, key_padding_mask),))


class ForgetTerm(ScoreTerm):
    """D_ij = Λ_i' - Λ_j (i', j key indices) in every form the kernels ask for (core/terms.py).
    tensors: (Λ [B, H, K] float64,)."""

    name = "decay"
    forms = frozenset({"key_offsets", "hand"})

    def __init__(self, tensors: tuple[Tensor]):
        self.tensors = tensors

    def with_tensors(self, tensors: tuple[Tensor, ...]) -> ForgetTerm:
        return ForgetTerm(tensors)

    def block(self, call, block, q=None, k=None) -> Tensor:
        """D for the block's queries (key indices M + i0 .. M + i1 - 1) against keys k0 .. in at
        least fp32: the difference is taken in float64 and then cast: |Λ| grows with the context,
        and a difference of two large fp32 numbers would lose the near keys' decays
        (docs/schemes/data-dependent.md#fox)."""
        (cumulative,) = self.tensors
        query = cumulative[..., call.n_mem + block.i0 : call.n_mem + block.i1, None]
        key = cumulative[..., None, block.k0 : block.n_keys]
        dtype = torch.promote_types(call.dtype, torch.float32)
        if torch.is_grad_enabled() and cumulative.requires_grad:
            return (query - key).to(dtype)  # the difference in float64, under autograd
        # without autograd in one pass: computed in float64, written in dtype
        return torch.sub(
            query, key, out=cumulative.new_empty((*query.shape[:-1], key.shape[-1]), dtype=dtype)
        )

    def hand_gradient(self, call, trained: bool) -> HandGradient:
        return _ForgetGradient(self)

    def key_offsets(self, call) -> Tensor:
        """e_j = -Λ_j: D_ij = e_j - e_i'."""
        return -self.tensors[0]

    def point(self, call, compiled: bool):
        """D of one pair, Λ restarted at the first query in at least fp32 (as the authors' kernel;
        in bf16 a Λ of 100 would be off by 0.25), the queries' [B, H, L] and the keys' [B, H, K]
        in two tensors, each read once (inductor: "multiple indexing operations on the same tensor
        that requires gradients in a score_mod function is not currently supported", on CUDA,
        torch 2.11)."""
        (cumulative,) = self.tensors
        wide = torch.promote_types(call.dtype, torch.float32)
        n_mem = call.n_mem
        query_decay, key_decay = (
            (cumulative[..., start:] - cumulative[..., n_mem, None]).to(wide)
            for start in (n_mem, 0)
        )
        return lambda b, h, q_idx, kv_idx, t: query_decay[b, h, q_idx] - key_decay[b, h, kv_idx]


class _ForgetGradient(HandGradient):
    """∂/∂Λ of Σ grad ∘ D for a block: Λ_i' gets the row sums, Λ_j minus the column sums."""

    def __init__(self, term: ForgetTerm):
        self.term = term

    def block(self, call, block, q, k, backward=False):
        with torch.no_grad():
            return self.term.block(call, block), None

    def backward(self, call, block, state, grad, grads, param_grads, q, grad_q):
        if grads[0] is not None:
            grads[0][..., call.n_mem + block.i0 : call.n_mem + block.i1] += grad.sum(-1)
            grads[0][..., block.k0 : block.n_keys] -= grad.sum(-2)
        return None


ForgetGate.Term = ForgetTerm
