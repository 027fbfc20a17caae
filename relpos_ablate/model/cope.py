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
row of keys before the softmax (a cumulative sum over keys): CoPE runs on the explicit path or SDPA per
query block, storing O(B·H·L·K) gates and positions for backward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ContextualPositions(nn.Module):
    """The table e [p_max, d_head] and the CoPE scores of a block of queries."""

    def __init__(self, n_positions: int, d_head: int):
        super().__init__()
        self.embeddings = nn.Parameter(torch.zeros(n_positions, d_head))  # (p_max, dh), zeros as the authors

    def positions(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> Tensor:
        """p_ij = Σ_{t >= j, t seen} σ(s·q_i·k_t), clamped to p_max - 1: q [B, H, L, dh], k [B, H, K, dh]
        -> [B, H, L, K]."""
        logits = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
        # counted in at least fp32: a bf16 sum of a hundred gates would be off by a quarter of a position
        gates = torch.sigmoid(logits * scale) * visible  # (B, H, L, K); unseen keys count 0
        counted = gates.flip(-1).cumsum(-1).flip(-1)  # from key j to the last key (later ones are unseen: 0)
        return counted.clamp(max=self.embeddings.shape[0] - 1)

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
