"""MLA's decoupled rotary position embedding (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1.3): the
positions of a head's score are carried by a part of q and k of their own, rotated by RoPE, while
the rest (the content part) carries none; the rotary key is one key shared by every head:

    q_{t,h} = [q^C_{t,h} ‖ RoPE(q^R_{t,h})],   k_{j,h} = [k^C_{j,h} ‖ RoPE(W^KR x_j)]
    score = (q^C·k^C + q^R·k^R) / √d_h

Here a head of width d_h is split: its last r = `qk_rope_dim` channels are the rotary part (q's its
own per head, from the query projection; k's the shared W^KR x, W^KR: d_model × r, no bias), the
first d_h - r the content part; the scale stays 1/√d_h of the whole head (DeepSeek's 1/√(d_h +
d_h^R) of its concatenation). The key projection's last r channels per head are unused (their
weights get a zero gradient). RoPE's frequencies over r: θ_p = rope_base^(-2p/r), rotate-half pairs
(rope.py's `rotate`), at the positions the encodings read. Where DeepSeek compresses keys and values
through a latent (MLA's KV compression), nothing here does: only the decoupled rotary part is
built. docs/schemes/attention-plumbing.md#mla-decoupled-rope.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.parts import Part, Where
from relpos_ablate.model.schemes.rope import call_length, rotate


class DecoupledRotary(Part):
    """W^KR of one layer (`key_proj`) and the rotary width r."""

    attribute = "mla"
    stage = 1.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.width, self.base = config.qk_rope_dim, config.rope_base
        self.key_proj = nn.Linear(d_model, self.width, bias=False)

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        r, place, scaling = self.width, at.placement, at.rope_scaling
        n = call_length(place.key_positions, scaling)  # one length for q and k (dynamic NTK)
        content_q, rotary_q = q[..., :-r], q[..., -r:]
        rotary_q = rotate(rotary_q, place.query_positions, r, self.base, scaling=scaling, length=n)
        # (B, K, r) -> (B, 1, K, r): one key for every head
        shared = self.key_proj(at.keys_input.to(self.key_proj.weight.dtype)).to(k.dtype)[:, None]
        shared = rotate(shared, place.key_positions, r, self.base, scaling=scaling, length=n)
        return (
            torch.cat([content_q, rotary_q], -1),
            torch.cat([k[..., :-r], shared.expand(-1, k.shape[1], -1, -1)], -1),
        )
