"""Parameter-free sinusoids: Transformer-XL's R_{i-j} and Vaswani's absolute positions (RoPE:
rope.py)."""

from __future__ import annotations

import torch
from torch import Tensor


def inverse_frequencies(dim: int, base: float = 10000.0, device=None) -> Tensor:
    """1 / base^(2k/dim) for k = 0 .. dim/2 - 1: [dim/2]."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))


def sinusoid(positions: Tensor, dim: int) -> Tensor:
    """[..., n] positions -> [..., n, dim] = cat(sin(pos·inv_freq), cos(pos·inv_freq)) (halves,
    not interleaved)."""
    angles = positions.to(torch.float64)[..., None] * inverse_frequencies(
        dim, device=positions.device
    )
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
