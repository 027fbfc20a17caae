"""The one interface every bias-type encoding implements, and building one from its registered name.

The names live in relpos_ablate/config/registry/builtins.py (torch-free, so configs validate without
torch): a built-in is one "module:Class" line there, a scheme of your own one
`@register_bias("name")` line. Formulas, sign conventions and defaults of every scheme:
docs/schemes/distance-biases.md#bias-types.

Distances are i - j everywhere (query minus key: "how far back the key is"; negative = a future key,
seen only when attention is bidirectional). Schemes defined the other way (T5) convert at their
edge.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from relpos_ablate.config.attention import AttentionConfig
from relpos_ablate.config.registry import bias_class
from relpos_ablate.model.core.shift import descending_distances, toeplitz
from relpos_ablate.model.core.terms import HandGradient, ScoreTerm


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
            "relpos_ablate.model.schemes.BiasScheme"
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

    #: the forms it supplies, in the planner's vocabulary (relpos_ablate/planner.py), read off the
    #: class: `key_offsets` where it has a linear slope, `band` where it saturates,
    #: `query_position` where it is not a function of the distance alone
    forms: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = {
            "key_offsets": cls.linear_slope is not BiasScheme.linear_slope,
            "band": cls.saturation is not BiasScheme.saturation,
            "query_position": not cls.distance_only,
        }
        cls.forms = frozenset(form for form, on in declared.items() if on)

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

    def point_curve(self):
        """`curve` in closed form for compiled FlexAttention: a function (head, r) -> B_head(r) of
        scalar tensors in pointwise ops, r = |i - j| (an integer tensor), its parameters read once
        here; or None, and the kernel reads the [H, n] table, one gather per pair. Give one where a
        few operations per pair are cheaper than that gather (ALiBi, KERPLE); a sum over many terms
        per pair is not (Sandwich: d_head/2 cosines). It must equal `curve` at every distance:
        tests/model/test_attention_flex.py checks it with the table replaced by NaN."""
        return None

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

    def hand_gradient(self, query_positions: Tensor, key_positions: Tensor, grad: bool = False):
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


class QueryPositionBias(ScoreTerm):
    """A bias that reads the query position besides the distance (FIRE), as a score term
    (core/terms.py): s_B·B_h(i', j) at the call's positions. Where positions are consecutive and
    every query of a block is within the scheme's distance-only range (below `curve_until`), one
    curve over the block's distances replaces the evaluation at every pair."""

    name = "bias"
    forms = frozenset({"query_position"})
    # compiled FlexAttention's gradient of FIRE's first layer's bias differed from the block
    # kernel's by up to 0.08 in 13 of 32 entries on CUDA (torch 2.11; the forward matched)
    point_gradient_trusted = False

    def __init__(self, scheme: BiasScheme, bias_scale: float):
        self.scheme, self.bias_scale = scheme, bias_scale
        self.curve_until = scheme.distance_only_until()

    def parameters(self):
        return self.scheme.parameters()

    def on_curve(self, call, block) -> bool:
        """Whether the bias is a curve over the distance for every query of the block (strictly
        below curve_until: a query there would send part of the gradient to the threshold)."""
        return call.consecutive and call.n_mem + block.i1 - 1 < self.curve_until

    def block(self, call, block, q=None, k=None) -> Tensor:
        if self.on_curve(call, block):
            # the block's queries against keys k0 .. are the same distances as from q_offset - k0
            # against 0 ..
            q_offset, lq = call.n_mem + block.i0, block.i1 - block.i0
            distances = descending_distances(
                q_offset - block.k0, lq, block.width, call.query_positions.device
            )
            scores = toeplitz(self.scheme.curve(distances), lq, block.width)
        else:
            scores = self.scheme.bias(
                call.query_positions[block.rows], call.key_positions[block.k0 : block.n_keys]
            )
        return scores[None] * self.bias_scale

    def hand_gradient(self, call, trained: bool) -> HandGradient | None:
        pairs = self.scheme.hand_gradient(call.query_positions, call.key_positions, trained)
        return None if pairs is None else _PairsGradient(self, pairs)

    def point(self, call, compiled: bool):
        scheme, scale = self.scheme, self.bias_scale
        if not scheme.pointwise:
            return None
        if compiled:
            score = scheme.compiled_pair_score(
                call.query_positions,
                call.key_positions,
                None if call.drawn_distances else call.distances,
            )
            return lambda b, h, q_idx, kv_idx, t: score(h, q_idx, kv_idx, t) * scale
        queries, keys = call.query_positions, call.key_positions
        return lambda b, h, q_idx, kv_idx, t: (
            scheme.eager_pair_score(queries[q_idx], keys[kv_idx], h) * scale
        )


class _PairsGradient(HandGradient):
    """The bias of every pair and its gradient by hand (BiasScheme.hand_gradient:
    fire_pairs.FIREPairs); blocks on the curve by autograd through the curve."""

    def __init__(self, term: QueryPositionBias, pairs):
        self.term, self.pairs = term, pairs

    def block(self, call, block, q, k, backward=False):
        if self.term.on_curve(call, block):
            with torch.no_grad():
                return self.term.block(call, block), None
        keys = slice(block.k0, block.n_keys)
        bias, tile = (
            self.pairs.block(block.rows, keys)
            if backward
            else (self.pairs.values(block.rows, keys), None)
        )
        scale = self.term.bias_scale
        return (bias if scale == 1.0 else bias.mul_(scale))[None], tile

    def backward(self, call, block, state, grad, grads, param_grads, q, grad_q):
        wanted = [(g, p) for g, p in zip(param_grads, self.term.parameters()) if g is not None]
        if not wanted:
            return None
        if state is None:  # on the curve: autograd through it
            with torch.enable_grad():
                bias = self.term.block(call, block)
            shared = grad.sum(0, keepdim=True)  # (1, H, L_b, K_b): the batch's sum
            params = [p for _, p in wanted]
            for (target, _), g in zip(
                wanted, torch.autograd.grad(bias, params, shared, allow_unused=True)
            ):
                if g is not None:
                    target.add_(g)
        elif self.pairs.trained:
            grad_bias = torch.sum(grad, 0)  # (H, L_b, K_b), a new tensor: the batch's sum
            if self.term.bias_scale != 1.0:
                grad_bias.mul_(self.term.bias_scale)
            self.pairs.add_gradient(state, grad_bias)
        return None

    def finish(self, param_grads):
        params = list(self.term.parameters())
        trained = [(g, p) for g, p in zip(param_grads, params) if g is not None and p.requires_grad]
        if not trained:
            return
        for (target, _), g in zip(trained, self.pairs.parameter_gradients([p for _, p in trained])):
            if g is not None:
                target.add_(g)


def bias_schemes(model: nn.Module) -> list[BiasScheme]:
    """Every bias scheme inside `model`, each once (one shared by all layers is one module): the one
    walk the model's init, the optimizer's groups and the after-step range restoration take."""
    return [module for module in model.modules() if isinstance(module, BiasScheme)]
