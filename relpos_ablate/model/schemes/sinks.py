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

from relpos_ablate.model.core.parts import Part


class Sinks(Part):
    """Keys and values [H, S, dh] per layer (S = `sinks`), init N(0, 0.02)."""

    attribute = "sinks"

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.keys = nn.Parameter(torch.randn(n_heads, config.sinks, d_head) * 0.02)
        self.values = nn.Parameter(torch.randn(n_heads, config.sinks, d_head) * 0.02)

    def sink_slots(self) -> tuple[Tensor, Tensor]:
        return self.keys, self.values
