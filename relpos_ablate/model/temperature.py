"""Length-aware softmax scaling and a learned temperature: one multiplier per query (and head) of the whole score.

- `score_scale: log_n` (scalable softmax, Nakanishi 2025; log-n attention): a query that sees n keys has
  its score multiplied by log(n)/log(L_train), so the largest weight does not fade as n grows beyond the
  training length. n counts the keys the query sees by index (causal: M + i + 1; a window caps it;
  padded keys do not count; learned sinks do), never the padded batch length.
- `learned_temperature`: τ_h = exp(t_h) per head, t_h initialised at 0.
Both multiply every term and the bias (a softmax temperature: an ALiBi slope is scaled too).
docs/formulas.md#length-aware-scaling.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_ablate.config import ConfigError
from relpos_ablate.config.model import AttentionConfig
from relpos_ablate.model.call import AttentionCall


class Temperature(nn.Module):
    """The per-query multiplier [B or 1, H or 1, L, 1] of one call's scores."""

    def __init__(self, n_heads: int, config: AttentionConfig):
        super().__init__()
        self.log_n_length = config.log_n_length if config.score_scale == "log_n" else None
        if self.log_n_length == 0:
            raise ConfigError("log_n_length", "score_scale log_n needs the training attention length L_train "
                              "(run configs fill it in; set it for a model of your own)")
        self.log_tau = nn.Parameter(torch.zeros(n_heads)) if config.learned_temperature else None  # (H,): t_h

    def query_scale(self, call: AttentionCall, dtype: torch.dtype) -> Tensor:
        """[B or 1, H or 1, L, 1] in `dtype`: log(n_i)/log(L_train) and/or τ_h."""
        device, lq = call.query_positions.device, call.n_queries
        scale = torch.ones(1, 1, lq, 1, dtype=torch.float64, device=device)
        if self.log_n_length is not None:
            seen = call.visible(call.all_queries).sum(-1) + call.n_sinks  # (L,) or (B, 1, L): keys each query sees
            scale = (seen.clamp(min=1).double().log() / math.log(self.log_n_length)).reshape(-1, 1, lq, 1)
        scale = scale.to(dtype)
        if self.log_tau is not None:
            scale = scale * self.log_tau.exp().to(dtype)[None, :, None, None]  # (B or 1, H, L, 1)
        return scale
