"""The one interface every bias-type encoding implements, and the registry that names them.

Distances are i - j everywhere (query minus key: "how far back the key is"; negative = a future key,
seen only when attention is bidirectional). Schemes defined the other way (T5) convert at their edge.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from relpos_ablate.config.model import AttentionConfig

BIAS_REGISTRY: dict[str, type["BiasScheme"]] = {}


def register(name: str):
    """Class decorator: `@register("t5")` makes the scheme available as `bias: t5`."""

    def add(cls: type[BiasScheme]) -> type[BiasScheme]:
        cls.name = name
        BIAS_REGISTRY[name] = cls
        return cls

    return add


def build_bias(config: AttentionConfig, n_heads: int) -> "BiasScheme | None":
    """The bias module named by `config.bias` (None for 'none')."""
    if config.bias == "none":
        return None
    return BIAS_REGISTRY[config.bias](n_heads, config)


class BiasScheme(nn.Module):
    """An additive per-head score bias B_h(i, j).

    Subclasses implement `curve(distances) -> [H, n]` when the bias depends on i - j only (most do),
    or override `bias(q_pos, k_pos)` when it also depends on the query position (FIRE).
    """

    name: ClassVar[str] = ""
    #: True when B depends on i - j alone; the attention then builds the [H, Lq, K] map from a curve.
    distance_only: ClassVar[bool] = True

    def __init__(self, n_heads: int, config: AttentionConfig):
        super().__init__()
        self.n_heads = n_heads
        self.causal = config.causal

    def curve(self, distances: Tensor) -> Tensor:
        """Bias per head at the given distances i - j: [n] -> [H, n]."""
        raise NotImplementedError

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bias for every (query, key) pair: q_pos [Lq], k_pos [K] -> [H, Lq, K]."""
        dist = q_pos[:, None] - k_pos[None, :]  # (Lq, K)
        return self.curve(dist.flatten()).view(self.n_heads, *dist.shape)

    def distance_only_until(self) -> float:
        """Largest query position up to which B depends on i - j alone (there `curve` gives it)."""
        return float("inf")

    def boundaries(self) -> list[float]:
        """Distances where the scheme changes regime (clamps, bucket edges): marked in bias plots."""
        return []
