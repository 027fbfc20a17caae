"""KERPLE (Chi et al. 2022): conditionally positive definite kernels of the distance r = |i - j|."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from relpos_ablate.model.core.bias import BiasScheme

MIN_PARAM = 0.01  # a, p are kept >= 0.01 (the paper's clamp) so the kernels stay well defined


class _Kerple(BiasScheme):
    """a ~ U(0, 1), p ~ U(0, 2) per head, kept in [MIN_PARAM, max_p] by clamping the stored values
    in place after every optimizer step, as the authors' code does before every forward
    (chijames/KERPLE, megatron/mpu/layers.py: `self.bias_p.data =
    self.bias_p.data.clamp(min=self.eps)`). A value put back on the floor keeps its gradient;
    clamping only inside forward would give a value below the floor a zero gradient for good."""

    max_p: ClassVar[float] = math.inf

    def __init__(self, n_heads, config):
        super().__init__(n_heads, config)
        self.a = nn.Parameter(torch.rand(n_heads).clamp(min=MIN_PARAM))  # (H,) ~ U(0, 1), in range
        # (H,) ~ U(0, 2)
        self.p = nn.Parameter((torch.rand(n_heads) * 2).clamp(min=MIN_PARAM, max=self.max_p))

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.a.clamp_(min=MIN_PARAM)
        self.p.clamp_(min=MIN_PARAM, max=self.max_p)

    def params(self):
        """a, p as [H, 1]; the clamp is a guard for loops that skip after_optimizer_step (in range
        it passes the gradient unchanged)."""
        return self.a.clamp(min=MIN_PARAM)[:, None], self.p.clamp(min=MIN_PARAM, max=self.max_p)[
            :, None
        ]


class KerpleLogBias(_Kerple):
    """B_h = -p_h · log(1 + a_h · r)."""

    def curve(self, distances):
        a, p = self.params()
        r = distances.abs().to(self.a.dtype)[None]
        return -p * torch.log1p(a * r)

    def point_curve(self):
        a, p = (x[:, 0] for x in self.params())
        return lambda head, r: -p[head] * torch.log1p(a[head] * r)


class KerplePowerBias(_Kerple):
    """B_h = -a_h · r^p_h with 0 < p_h <= 2."""

    max_p = 2.0

    def curve(self, distances):
        a, p = self.params()
        r = distances.abs().to(self.a.dtype)[None]
        # r^p as exp(p·log r) only where r > 0: at r = 0 the gradient w.r.t. p would be 0·log 0 =
        # nan
        power = torch.where(r > 0, r.clamp(min=1.0) ** p, torch.zeros_like(r))
        return -a * power

    def point_curve(self):
        a, p = (x[:, 0] for x in self.params())
        # r >= 1 in the power (as in `curve`): no log 0 in the gradient at r = 0
        return lambda head, r: -a[head] * torch.where(r > 0, r.clamp(min=1) ** p[head], 0.0)
