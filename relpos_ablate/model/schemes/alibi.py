"""ALiBi (Press et al. 2022): a fixed (or learned) linear penalty per head, B_h = -m_h·|i - j|."""

from __future__ import annotations

import math

import torch
from torch import nn

from relpos_ablate.model.core.bias import BiasScheme


def alibi_slopes(n_heads: int) -> list[float]:
    """The paper's slopes: 2^(-8h/n) for n a power of two; otherwise the slopes of the nearest
    lower power of two p, then every other slope of the 2p set, first n - p of them."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if math.log2(n_heads).is_integer():
        return geometric(n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    return geometric(p) + geometric(2 * p)[0::2][: n_heads - p]


class ALiBiBias(BiasScheme):
    """Fixed slopes; no parameters. Symmetric -m·|i - j| when bidirectional."""

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        # (H,)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)

    def slope(self):
        return self.slopes

    def linear_slope(self):
        return self.slope() if self.causal else None

    def curve(self, distances):
        return -self.slope()[:, None] * distances.abs().to(self.slopes.dtype)[None]

    def point_curve(self):
        slope = self.slope()
        return lambda head, r: -slope[head] * r


class LearnedALiBiBias(ALiBiBias):
    """Slopes learned through log m_h, initialised at the fixed slopes (stays positive)."""

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        self.log_slopes = nn.Parameter(self.slopes.log().clone())

    def slope(self):
        return self.log_slopes.exp()
