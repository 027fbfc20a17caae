"""Sandwich (Chi et al. 2023): the inner product of two sinusoidal position vectors as a per-head
bias."""

from __future__ import annotations

import torch

from relpos_ablate.model.core.bias import BiasScheme

BASE = 10000.0


class SandwichBias(BiasScheme):
    """B_h(r) = [Σ_{k=1..d/2} cos(r·10000^(-2k/d)) - d/2] / (8h/H), r = |i - j|, d = d_head, h = 1
    .. H.

    The sum is p_i·p_j of d-wide sinusoids, a function of r alone: 0 at r = 0, below 0 elsewhere,
    decaying about logarithmically (not monotonically) for 1 << r << 10^4; head h divides it by 8h/H
    (NeMo's `sandwich`; docs/schemes/distance-biases.md#sandwich). No parameters; not scaled by s.
    No closed form for FlexAttention (`point_curve`): d/2 cosines per pair cost more than reading
    the table.
    """

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        divisor = 8 * torch.arange(1, n_heads + 1) / n_heads  # (H,): 8h/H
        self.register_buffer("divisor", divisor, persistent=False)

    def curve(self, distances):
        if self.d_head is None:
            raise ValueError(
                "sandwich reads the head width: build it with build_bias(config, n_heads, d_head)"
            )
        # (d/2,)
        k = torch.arange(1, self.d_head // 2 + 1, dtype=torch.float64, device=distances.device)
        # (n, d/2)
        angles = distances.abs().to(torch.float64)[:, None] * BASE ** (-2 * k / self.d_head)[None]
        # (n,): p_i·p_j - d/2
        inner = (angles.cos().sum(-1) - self.d_head / 2).to(self.divisor.dtype)
        return inner[None] / self.divisor[:, None]  # (H, n)
