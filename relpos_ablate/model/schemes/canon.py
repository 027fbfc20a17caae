"""Canon layers (Allen-Zhu 2025, "Physics of Language Models: Part 4.1"): a causal depthwise
convolution over the last k tokens, added residually, here at the paper's point A (the attention's
input, after the pre-norm):

    x_t ← x_t + Σ_{s=0..k-1} w_s ∘ x_{t-s}

w_s [d_model] learned, no bias (PhysicsLM4's canon_helper; PyTorch's default Conv1d
initialisation, so a Canon layer is not the identity at the start), k = `canon_width` (the paper's
4). The convolution runs over the layer's keys' input [memory; x], so with memory the segment's
first tokens see the previous segment's last k - 1 tokens, as in one long pass; only the memory's
own first k - 1 tokens (whose predecessors left the memory) see zeros before them, as the stream's
first tokens do. Over packed documents the taps stop at the document's first token.
docs/schemes/attention-plumbing.md#canon-layers.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.model.core.parts import Part
from relpos_ablate.model.documents import causal_conv


class Canon(Part):
    """The convolution of one layer (`conv`: depthwise, `canon_width` taps)."""

    attribute = "canon"

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.width = config.canon_width
        self.conv = nn.Conv1d(d_model, d_model, self.width, groups=d_model, bias=False)

    def keys_input(self, keys_input: Tensor, n_mem: int, documents: Tensor | None) -> Tensor:
        weight = self.conv.weight.to(keys_input.dtype)  # (D, 1, k): tap s is weight[..., k-1-s]
        if documents is None:
            # (B, K, D) -> (B, D, k - 1 + K): zeros before the first token
            padded = F.pad(keys_input.transpose(1, 2), (self.width - 1, 0))
            return keys_input + F.conv1d(padded, weight, groups=weight.shape[0]).transpose(1, 2)
        # packed documents: tap s reads x_{t-s} only inside t's document
        return keys_input + causal_conv(keys_input, weight, documents)
