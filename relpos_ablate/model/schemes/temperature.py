"""Length-aware softmax scaling and a learned temperature: one multiplier per query (and head) of
the whole score.

- `score_scale: log_n` (scalable softmax, Nakanishi 2025; log-n attention): a query that sees n keys
  has its score multiplied by log(n)/log(L_train), so the largest weight does not fade as n grows
  beyond the training length. n counts the keys the query sees by index (causal: M + i + 1; a window
  caps it;
  padded keys do not count; learned sinks do), never the padded batch length.
- `score_scale: ssmax` (SSMax, Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"): the
  multiplier is s_h·log(n) with s_h learned per head (and layer), z -> softmax((s·log n)·z) as the
  paper writes it. The paper gives no initial value in the text found here (its Figure 1 uses s =
  0.43 for an illustration); s_h starts at 1/log(L_train), where SSMax equals log_n, so a query that
  sees L_train keys starts at the plain softmax.
- `learned_temperature`: τ_h = exp(t_h) per head, t_h initialised at 0.
Both multiply every term and the bias (a softmax temperature: an ALiBi slope is scaled too).
docs/schemes/windows-sinks-temperature.md#length-aware-scaling.
- `temperature_tuning` (Llama 4, Hugging Face modeling_llama4.py): the query alone, after RoPE,
  times 1 + a·log(floor((p + 1)/f) + 1) at its position p (a = temperature_scale 0.1, f =
  temperature_floor_scale 8192), so terms a and b only; 1 below position f - 1.
  docs/schemes/windows-sinks-temperature.md#temperature-tuning.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_ablate.config import ConfigError
from relpos_ablate.config.attention import LENGTH_AWARE_SCALES, AttentionConfig
from relpos_ablate.model.core.parts import Part, Where


class Temperature(nn.Module):
    """The per-query multiplier [B or 1, H or 1, L, 1] of one call's scores."""

    def __init__(self, n_heads: int, config: AttentionConfig):
        super().__init__()
        self.log_n_length = (
            config.log_n_length if config.score_scale in LENGTH_AWARE_SCALES else None
        )
        if self.log_n_length == 0:
            raise ConfigError(
                "log_n_length",
                f"score_scale {config.score_scale} needs the training attention length "
                "L_train (run configs fill it in; set it for a model of your own)",
            )
        # (H,): t_h
        self.log_tau = nn.Parameter(torch.zeros(n_heads)) if config.learned_temperature else None
        # (H,): s_h
        self.ssmax_scale = (
            nn.Parameter(torch.full((n_heads,), 1 / math.log(self.log_n_length)))
            if config.score_scale == "ssmax"
            else None
        )

    @property
    def counts_keys(self) -> bool:
        """Whether `query_scale` needs the number of keys each query sees (log-n scaling)."""
        return self.log_n_length is not None

    def query_scale(
        self, seen: Tensor | None, n_queries: int, dtype: torch.dtype, device=None
    ) -> Tensor:
        """[B or 1, H or 1, L, 1] in `dtype`: log(n_i)/log(L_train) (log_n) or s_h·log(n_i) (ssmax),
        and/or τ_h. seen: the keys each query sees ([L] or [B, 1, L], sinks included), needed when
        `counts_keys`."""
        scale = torch.ones(1, 1, n_queries, 1, dtype=torch.float64, device=device)
        if self.log_n_length is not None:
            log_n = seen.clamp(min=1).double().log().reshape(-1, 1, n_queries, 1)
            scale = log_n / math.log(self.log_n_length) if self.ssmax_scale is None else log_n
        scale = scale.to(dtype)
        if self.ssmax_scale is not None:
            scale = scale * self.ssmax_scale.to(dtype)[None, :, None, None]  # (B or 1, H, L, 1)
        if self.log_tau is not None:
            scale = scale * self.log_tau.exp().to(dtype)[None, :, None, None]  # (B or 1, H, L, 1)
        return scale


def tuned_temperature(positions: Tensor, config: AttentionConfig) -> Tensor:
    """Llama 4's query multiplier at `positions` (any shape), in float32 or wider."""
    p = (
        positions.to(torch.promote_types(positions.dtype, torch.float32))
        if positions.is_floating_point()
        else positions.double()
    )
    return (
        torch.log(torch.floor((p + 1.0) / config.temperature_floor_scale) + 1.0)
        * config.temperature_scale
        + 1.0
    )


class TemperatureTuning(Part):
    """Llama 4's temperature tuning as a q transform after RoPE (stage 3): q times
    `tuned_temperature` at the positions the encodings place the queries at (or a chunked layer's
    own, Where.tuned_positions)."""

    stage = 3.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, config: AttentionConfig):
        super().__init__()
        self.config = config

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        # (B or 1, L)
        positions = (
            at.placement.query_positions[None] if at.tuned_positions is None else at.tuned_positions
        )
        # (B, H, L, dh) × (B, 1, L, 1)
        return q * tuned_temperature(positions, self.config).to(q.dtype)[:, None, :, None], k
