"""Parameter-free sinusoids: Transformer-XL's R_{i-j}, Vaswani's absolute positions, and RoPE."""

from __future__ import annotations

import torch
from torch import Tensor


def inverse_frequencies(dim: int, base: float = 10000.0, device=None) -> Tensor:
    """1 / base^(2k/dim) for k = 0 .. dim/2 - 1: [dim/2]."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))


def sinusoid(positions: Tensor, dim: int) -> Tensor:
    """[n] positions -> [n, dim] = cat(sin(pos·inv_freq), cos(pos·inv_freq)) (halves, not interleaved)."""
    angles = positions.to(torch.float64)[:, None] * inverse_frequencies(dim, device=positions.device)[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rope_rotate(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate x [..., n, d] by its positions [n] (RoPE, rotate-half pairing of dims k and k + d/2)."""
    d = x.shape[-1]
    angles = positions.to(torch.float64)[:, None] * inverse_frequencies(d, base, device=x.device)[None]  # (n, d/2)
    cos = angles.cos().to(x.dtype).repeat(1, 2)  # (n, d)
    sin = angles.sin().to(x.dtype).repeat(1, 2)
    first, second = x[..., : d // 2], x[..., d // 2 :]
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin
