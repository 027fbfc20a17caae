"""CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's Important").

Query i gates every key it sees, g_ij = σ(s·q_i·k_j), and counts backwards: the contextual position of
key j is p_ij = Σ_{t=j..i} g_it over the keys t the query sees (keys it does not see count 0), so
p_ii = g_ii ∈ (0, 1) and p = i - j + 1 when every gate is 1. p is clamped to p_max - 1 and read from a
learned table e [p_max, d_head] by linear interpolation between ⌊p⌋ and ⌈p⌉; the score gets
s·q_i·e[p_ij]. As the authors' code (facebookresearch/RAM, projects/cope, default options): gates from
the scaled content logits, the position logit scaled by s like q·k, e shared by a layer's heads and
initialised at 0. docs/formulas.md#cope.

Here q is the content query the kernels use (q + u with term c, times the query scale when there is
one), so the gates read the content score as it enters the softmax. The gates need each query's whole
row of keys before the softmax (a cumulative sum over keys): the kernels run it on whole rows of keys per
query block. `scores` is the formula under autograd (explicit path, SDPA per block); the block kernel
(kernels/blockwise.py) calls `block_scores` and `block_backward`, the same scores and their gradient by hand, so that
nothing of a block is kept for backward and the gates' gradient joins the attention's own dS (the gates read
the same product s·q·kᵀ).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class BlockPositions(NamedTuple):
    """What block_backward needs of a block's forward: the gates, the unclamped counts, ⌊p⌋, the fraction and
    the table's step e[n + 1] - e[n] read at ⌊p⌋ (all [B, H, L_b, K_b])."""

    gates: Tensor
    counted: Tensor
    below: Tensor
    weight: Tensor
    step: Tensor


class ContextualPositions(nn.Module):
    """The table e [p_max, d_head] and the CoPE scores of a block of queries."""

    def __init__(self, n_positions: int, d_head: int):
        super().__init__()
        self.embeddings = nn.Parameter(torch.zeros(n_positions, d_head))  # (p_max, dh), zeros as the authors

    @staticmethod
    def gates_and_counts(q: Tensor, k: Tensor, scale: float, visible: Tensor) -> tuple[Tensor, Tensor]:
        """g_ij = σ(s·q_i·k_j) (0 for unseen keys) and Σ_{t >= j} g_it, unclamped: q [B, H, L, dh],
        k [B, H, K, dh] -> two [B, H, L, K]."""
        logits = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
        # counted in at least fp32: a bf16 sum of a hundred gates would be off by a quarter of a position
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            gates = torch.sigmoid(logits * scale) * visible  # (B, H, L, K); unseen keys count 0
            return gates, gates.flip(-1).cumsum(-1).flip(-1)  # from key j to the last key (later ones: 0)
        # no graph (the block kernel's forward): the same in the product's own buffer, per block on a hot path
        gates = torch.sigmoid_(logits.mul_(scale)).masked_fill_(~visible, 0.0)
        return gates, gates.flip(-1).cumsum_(-1).flip(-1)

    def positions(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> Tensor:
        """p_ij = Σ_{t >= j, t seen} σ(s·q_i·k_t), clamped to p_max - 1: [B, H, L, K]."""
        return self.gates_and_counts(q, k, scale, visible)[1].clamp(max=self.embeddings.shape[0] - 1)

    def scores(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> Tensor:
        """s·q_i·e[p_ij], e interpolated between ⌊p⌋ and ⌈p⌉: [B, H, L, K] (geometry.ContextualScores: a
        block's queries, the kernels' content query, and its keys, without sinks)."""
        p = self.positions(q, k, scale, visible)
        per_position = (q @ self.embeddings.to(q.dtype).T) * scale  # (B, H, L, p_max): s·q_i·e[n]
        below = p.floor()
        weight = p - below  # the gradient reaches the gates through this weight
        low = per_position.gather(-1, below.long())
        high = per_position.gather(-1, p.ceil().long())
        return high * weight + low * (1 - weight)

    def block_scores(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> tuple[Tensor, BlockPositions]:
        """`scores` without autograd, as s·q·e[⌊p⌋] + (p - ⌊p⌋)·s·q·(e[⌊p⌋ + 1] - e[⌊p⌋]) (one index for both
        reads), and what its backward needs."""
        wide = torch.promote_types(q.dtype, torch.float32)
        gates, counted = self.gates_and_counts(q, k, scale, visible)  # (B, H, L_b, K_b)
        p = counted.clamp(max=self.embeddings.shape[0] - 1)
        below = p.floor()
        weight = p.sub_(below)
        below = below.long()
        per_position = (q @ self.embeddings.to(q.dtype).T).to(wide).mul_(scale)  # (B, H, L_b, p_max)
        steps = torch.nn.functional.pad(per_position.diff(dim=-1), (0, 1))  # e[n + 1] - e[n]; 0 after the last
        step = steps.gather(-1, below)
        return per_position.gather(-1, below).addcmul_(weight, step), BlockPositions(gates, counted, below, weight, step)

    def block_backward(self, state: BlockPositions, grad: Tensor, q: Tensor, scale: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """The gradient of the scores' sum against grad [B, H, L_b, K_b]: (its part through the gates, to add to
        the gradient of the product s·q·kᵀ, i.e. dS, divided by s; q's gradient through the table; the
        table's gradient)."""
        n_positions = self.embeddings.shape[0]
        grad_above = grad * state.weight  # to s·q·e[⌊p⌋ + 1]
        grad_per_position = torch.zeros(*grad.shape[:-1], n_positions, dtype=grad.dtype, device=grad.device)
        grad_per_position.scatter_add_(-1, state.below, grad - grad_above)
        grad_per_position.scatter_add_(-1, (state.below + 1).clamp_(max=n_positions - 1), grad_above)
        # through the fraction: p = counted clamped at p_max - 1, passing where counted <= p_max - 1 (torch.clamp)
        grad_counted = torch.where(state.counted <= n_positions - 1, state.step, 0.0).mul_(grad)
        grad_gates = grad_counted.cumsum_(-1)  # counted_j = Σ_{t >= j} gates_t: gates_t collects Σ_{j <= t}
        grad_logits = grad_gates.mul_(state.gates).mul_(1 - state.gates)  # σ' = σ(1 - σ); hidden keys have σ = 0
        grad_per_position.mul_(scale)
        grad_q = grad_per_position @ self.embeddings.to(grad.dtype)
        grad_table = torch.einsum("bhlp,bhld->pd", grad_per_position, q.to(grad.dtype))
        return grad_logits, grad_q, grad_table
