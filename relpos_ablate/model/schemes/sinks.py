"""Learned attention sinks: K key/value slots per layer and head that every query sees besides its
keys.

Attention-sink studies (Xiao et al. 2024, StreamingLLM; registers, Darcet et al. 2024) show that
models park surplus attention on a few tokens; learned slots give them a place that is not a token
of the stream. A slot has no position: its score is the content score s·q·k_sink of the kernels'
query (q + u with term c), no term b/d, no bias, no FoX decay, no CoPE count, not rotated by RoPE
(so under RoPE the rotated query meets an unrotated slot); every query sees every slot whatever its
window; memory holds stream tokens only, so mem_len does not count the slots.
docs/schemes/windows-sinks-temperature.md#sinks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Sinks(nn.Module):
    """Keys and values [H, S, dh] per layer, init N(0, 0.02)."""

    def __init__(self, n_heads: int, n_sinks: int, d_head: int):
        super().__init__()
        self.keys = nn.Parameter(torch.randn(n_heads, n_sinks, d_head) * 0.02)
        self.values = nn.Parameter(torch.randn(n_heads, n_sinks, d_head) * 0.02)

    def prepend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """[B, H, K, dh] keys and values -> [B, H, S + K, dh], the slots first."""
        b = k.shape[0]
        return (
            torch.cat([self.keys.to(k.dtype).expand(b, -1, -1, -1), k], dim=2),
            torch.cat([self.values.to(v.dtype).expand(b, -1, -1, -1), v], dim=2),
        )

    def logits(self, q_content: Tensor, scale: float) -> Tensor:
        """s·q_content·k_sink: [B, H, L, dh] -> [B, H, L, S]."""
        return (q_content @ self.keys.to(q_content.dtype).transpose(-1, -2)) * scale
