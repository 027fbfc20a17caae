"""KERPLE (Chi et al. 2022): conditionally positive definite kernels of the distance r = |i - j|."""

from __future__ import annotations

import torch
from torch import nn

from relpos_ablate.model.position.base import BiasScheme

MIN_PARAM = 0.01  # a, p are kept >= 0.01 (the paper's clamp) so the kernels stay well defined


class _Kerple(BiasScheme):
    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        self.a = nn.Parameter(torch.rand(n_heads))  # (H,) ~ U(0, 1)
        self.p = nn.Parameter(torch.rand(n_heads) * 2)  # (H,) ~ U(0, 2)

    def params(self):
        return self.a.clamp(min=MIN_PARAM)[:, None], self.p.clamp(min=MIN_PARAM)[:, None]


class KerpleLogBias(_Kerple):
    """B_h = -p_h · log(1 + a_h · r)."""

    def curve(self, distances):
        a, p = self.params()
        r = distances.abs().to(self.a.dtype)[None]
        return -p * torch.log1p(a * r)


class KerplePowerBias(_Kerple):
    """B_h = -a_h · r^p_h with 0 < p_h <= 2."""

    def params(self):
        a, p = super().params()
        return a, p.clamp(max=2.0)

    def curve(self, distances):
        a, p = self.params()
        r = distances.abs().to(self.a.dtype)[None]
        # r^p as exp(p·log r) only where r > 0: at r = 0 the gradient w.r.t. p would be 0·log 0 = nan
        power = torch.where(r > 0, r.clamp(min=1.0) ** p, torch.zeros_like(r))
        return -a * power
