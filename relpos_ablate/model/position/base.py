"""The one interface every bias-type encoding implements, and building one from its registered name.

The names live in relpos_ablate/config/registry.py (torch-free, so configs validate without torch):
a built-in is one "module:Class" line there, a scheme of your own one `@register_bias("name")` line.
Formulas, sign conventions and defaults of every scheme: docs/schemes/distance-biases.md#bias-types.

Distances are i - j everywhere (query minus key: "how far back the key is"; negative = a future key,
seen only when attention is bidirectional). Schemes defined the other way (T5) convert at their
edge.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from relpos_ablate.config.model import AttentionConfig
from relpos_ablate.config.registry import bias_class


def build_bias(
    config: AttentionConfig, n_heads: int, d_head: int | None = None
) -> BiasScheme | None:
    """The bias module registered under `config.bias` (None for 'none'); d_head: the attention's
    head width, set on the scheme for those that read it (Sandwich)."""
    if config.bias == "none":
        return None
    cls = bias_class(config.bias)
    if not issubclass(cls, BiasScheme):
        raise TypeError(
            f"bias {config.bias!r}: {cls.__module__}.{cls.__qualname__} must subclass "
            "relpos_ablate.model.position.BiasScheme"
        )
    scheme = cls(n_heads, config)
    scheme.d_head = d_head
    return scheme


class BiasScheme(nn.Module):
    """An additive per-head score bias B_h(i, j).

    Subclasses implement `curve(distances) -> [H, n]` when the bias depends on i - j only (most do),
    or override `bias(q_pos, k_pos)` when it also depends on the query position (FIRE).
    """

    #: True when B depends on i - j alone; the attention then builds the [H, Lq, K] map from a
    #: curve.
    distance_only: ClassVar[bool] = True
    #: True when `pair_score` gives B of one pair in pointwise tensor ops (FlexAttention then
    #: evaluates it inside its kernel instead of reading a precomputed [H, Lq, K] map).
    pointwise: ClassVar[bool] = False

    def __init__(self, n_heads: int, config: AttentionConfig):
        super().__init__()
        self.n_heads = n_heads
        self.causal = config.causal
        self.d_head: int | None = None  # the attention's head width (build_bias sets it)

    def curve(self, distances: Tensor) -> Tensor:
        """Bias per head at the given distances i - j: [n] -> [H, n]."""
        raise NotImplementedError

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bias for every (query, key) pair: q_pos [Lq], k_pos [K] -> [H, Lq, K]."""
        dist = q_pos[:, None] - k_pos[None, :]  # (Lq, K)
        return self.curve(dist.flatten()).view(self.n_heads, *dist.shape)

    def pair_score(self, q_pos: Tensor, k_pos: Tensor, head: Tensor) -> Tensor:
        """B_head(q_pos, k_pos) for scalar tensors, in pointwise ops only (see `pointwise`)."""
        raise NotImplementedError

    def compiled_pair_score(
        self, query_positions: Tensor, key_positions: Tensor, distances: Tensor | None
    ):
        """Compiled FlexAttention's score of a pair, as a function (head, q_idx, kv_idx, t) -> B of
        tensors: the query's and key's indices into query_positions [L] and key_positions [K], and t
        the pair's column in `distances` [n] (the pair's q_pos - k_pos there; None where the
        distances are drawn, not the positions'). A scheme may precompute tables here (read once
        each in the score_mod: inductor differentiates no tensor read twice). Default: `pair_score`
        at the pair's positions."""
        return lambda head, q_idx, kv_idx, t: self.pair_score(
            query_positions[q_idx], key_positions[kv_idx], head
        )

    def eager_pair_score(self, q_pos: Tensor, k_pos: Tensor, head: Tensor) -> Tensor:
        """`pair_score` for FlexAttention in eager mode (CPU), which runs score_mod under vmap, so
        any tensor op may appear (a sum over a vector, a matrix product); compiled FlexAttention
        (CUDA) takes pointwise ops only and calls `pair_score`. Default: `pair_score`."""
        return self.pair_score(q_pos, k_pos, head)

    def linear_slope(self) -> Tensor | None:
        """[H] m_h where B_h = -m_h·(i - j) on causal pairs (i >= j), else None: such a bias is
        m_h·j up to a per-query constant, which the low-rank kernel (kernels/low_rank.py) adds as
        extra channels of the heads."""
        return None

    def saturation(self) -> int | None:
        """The distance D from which `curve` is constant on causal distances (every d >= D has the
        bias of D: a clamp, T5's last bucket), else None. Those pairs then differ from s·q·kᵀ by one
        constant per query, which the softmax ignores: the band kernel (kernels/band.py) leaves them
        to the causal flash kernel."""
        return None

    def distance_only_until(self) -> float:
        """Largest query position up to which B depends on i - j alone (there `curve` gives it)."""
        return float("inf")

    def by_hand(self, query_positions: Tensor, key_positions: Tensor, grad: bool = False):
        """An object giving the bias at every pair of these positions and taking its gradient by
        hand (fire_pairs.FIREPairs: block, add_gradient, parameter_gradients, trained), or None: the
        block kernel then differentiates `bias` by autograd. Only schemes that read the query
        position (not distance_only) need it."""
        return None

    def after_optimizer_step(self) -> None:
        """Called after every optimizer step (train/module.py, train/plain.py; a loop of your own
        should too): restore constraints on the parameters in place. Default: none."""

    def boundaries(self) -> list[float]:
        """Distances where the scheme changes regime (clamps, bucket edges): marked in bias
        plots."""
        return []


def bias_schemes(model: nn.Module) -> list[BiasScheme]:
    """Every bias scheme inside `model`, each once (one shared by all layers is one module): the one
    walk the model's init, the optimizer's groups and the after-step range restoration take."""
    return [module for module in model.modules() if isinstance(module, BiasScheme)]
