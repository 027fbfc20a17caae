"""Bias computed by a small MLP: FIRE (Li et al. 2023) and x-transformers' dynamic position bias."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.bias import BiasScheme
from relpos_ablate.model.schemes.fire_pairs import FIREPairs
from relpos_ablate.model.schemes.piecewise import pieces, relu_mlp


class FIREBias(BiasScheme):
    """B_h(i, j) = MLP(ψ(i - j) / ψ(max(i, L)))_h with ψ(x) = log(c·|x| + 1), MLP 1 -> 32 -> H.

    c (init 0.1) and the threshold L (init 512) are learned. The normaliser depends on the query
    position i, so FIRE is not a function of i - j alone once i > L. Bidirectionally the distance
    keeps its sign (ψ is made odd), so keys before and after the query get different biases.
    `bias` and `curve` evaluate the MLP as the piecewise-linear function it is (piecewise.py);
    FlexAttention's `pair_score` unit by unit.
    """

    distance_only = False
    pointwise = True

    def __init__(self, n_heads, config, hidden: int = 32):
        super().__init__(n_heads, config)
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.c = nn.Parameter(torch.tensor(0.1))
        self.threshold = nn.Parameter(torch.tensor(512.0))

    def distance_only_until(self) -> float:
        """Queries at positions <= L share the normaliser ψ(L): for them B is a curve over i - j."""
        return float(self.threshold.detach().abs())

    def psi(self, x: Tensor) -> Tensor:
        return x.sign() * torch.log1p(self.c.abs() * x.abs())

    def normalised(self, distances: Tensor, q_pos: Tensor) -> Tensor:
        return self.psi(distances) / self.psi(torch.maximum(q_pos, self.threshold.abs()))

    def bias(self, q_pos, k_pos):
        # (H, Lq, K)
        return relu_mlp(self.mlp[0], self.mlp[2], self._pair_input(q_pos[:, None], k_pos[None, :]))

    def pair_score(self, q_pos, k_pos, head):
        """The MLP unit by unit on scalars (FlexAttention's score_mod evaluates it per pair: no [H,
        Lq, K] map; compiled, score_mod takes pointwise ops only)."""
        x = self._pair_input(q_pos, k_pos)
        first, _, second = self.mlp
        out = second.bias[head]
        for unit in range(first.out_features):
            out = out + second.weight[head, unit] * torch.relu(
                first.weight[unit, 0] * x + first.bias[unit]
            )
        return out

    def compiled_pair_score(self, query_positions, key_positions, distances):
        """The MLP as the piecewise-linear function it is (piecewise.py), from tables each read once
        per pair: x = ψ(d)[t]·(1 / ψ(max(i, L)))[q_idx], its interval by comparisons with the
        breakpoints (no gradient), then α[h, interval] + β[h, interval]·x. Compiled FlexAttention
        (inductor, torch 2.11) cannot differentiate a tensor read more than once in a score_mod,
        which the unit-by-unit `pair_score` does with the layers' weights (FIRE failed to compile on
        CUDA). Drawn distances: `pair_score`."""
        if distances is None:
            return super().compiled_pair_score(query_positions, key_positions, distances)
        breakpoints, alpha, beta = pieces(self.mlp[0], self.mlp[2])
        # (H, U + 1): the open intervals
        alpha, beta = (alpha[:, ::2].contiguous(), beta[:, ::2].contiguous())
        q = query_positions.to(self.c.dtype)
        inverse_norm = 1.0 / self.psi(torch.maximum(q, self.threshold.abs()))  # (L,)
        psi = self.psi(distances.to(self.c.dtype))  # (n,)

        def score(head, q_idx, kv_idx, t):
            x = psi[t] * inverse_norm[q_idx]
            # #breakpoints < x
            below = sum((x > breakpoints[unit]).to(torch.int64) for unit in range(len(breakpoints)))
            return alpha[head, below] + beta[head, below] * x

        return score

    def eager_pair_score(self, q_pos, k_pos, head):
        """The MLP as one product over the hidden units, for eager FlexAttention: traced ~14x faster
        than the units one by one (a 32-unit MLP score_mod's first eager call: 0.29 s against 4.1 s
        at H = 2, L = 64 on CPU)."""
        first, _, second = self.mlp
        hidden = torch.relu(first.weight[:, 0] * self._pair_input(q_pos, k_pos) + first.bias)
        return second.bias[head] + hidden @ second.weight[head]

    def _pair_input(self, q_pos, k_pos):
        """ψ(i - j) / ψ(max(i, L)), broadcast over q_pos and k_pos."""
        q = q_pos.to(self.c.dtype)
        return self.normalised(q - k_pos.to(self.c.dtype), q)

    def hand_gradient(
        self, query_positions: Tensor, key_positions: Tensor, grad: bool = False
    ) -> FIREPairs:
        """The bias at every pair of these positions with its gradient by hand, for the block kernel
        (fire_pairs.py)."""
        return FIREPairs(self, query_positions, key_positions, grad)

    def curve(self, distances, query_position: float | None = None):
        """Bias at distances for a query at `query_position` (default: the threshold L, where the
        normaliser stops changing for shorter contexts)."""
        d = distances.to(self.c.dtype)
        q = (
            self.threshold.abs()
            if query_position is None
            else torch.tensor(query_position, dtype=d.dtype)
        )
        return relu_mlp(self.mlp[0], self.mlp[2], self.normalised(d, q))  # (H, n)


class DynamicBias(BiasScheme):
    """An MLP from the signed log-distance sign(d)·log(1 + |d|) to one bias per head."""

    def __init__(self, n_heads, config, hidden: int = 32):
        super().__init__(n_heads, config)
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.SiLU(), nn.Linear(hidden, n_heads))

    def curve(self, distances):
        d = distances.to(self.mlp[0].weight.dtype)
        x = d.sign() * torch.log1p(d.abs())
        return self.mlp(x[:, None]).T  # (H, n)
