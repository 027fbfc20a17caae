"""How one forward of RelPosAttention becomes an `AttentionCall` (core/call.py): where queries and
keys sit, the per-distance tensors every query block reads (terms b and d, a bias of distance
alone), the query scale and the score terms (core/terms.py) in the order of the sum. Also the maps
of every term for inspection (`score_terms`). A mixin of RelPosAttention (attention.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from relpos_ablate.model.chunks import Chunks
from relpos_ablate.model.core.bias import BiasScheme, QueryPositionBias
from relpos_ablate.model.core.call import AttentionCall, ScoreInputs
from relpos_ablate.model.core.geometry import Visibility, per_row
from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.core.placement import Placement, place
from relpos_ablate.model.core.terms import ScoreTerm


class CallBuilder:
    """The call of a forward, built once (see the module docstring)."""

    def locate(
        self, x: Tensor, keys_input: Tensor, options: AttentionOptions
    ) -> tuple[Visibility, Placement, tuple[ScoreTerm, ...]]:
        """Which keys each query sees (the config's window and the call's, the narrower), where
        queries and keys sit (call.place: what RoPE reads before the call is built) and the score
        terms read from the keys' layer inputs [memory; x] (FoX's, before the projections, so that
        autograd sums the input's gradient in the same order as ever: a table computed before and
        after the call was built once is the same to the bit)."""
        cfg = self.config
        if options.window is not None and not cfg.causal:
            raise ValueError("window (same_length) applies to causal attention only")
        windows = [w for w in (cfg.window, options.window) if w is not None]
        window = min(windows) if windows else None  # (min's default= breaks torch.compile's graph)
        lq = x.shape[1]
        visibility = Visibility(keys_input.shape[1] - lq, cfg.causal, window)
        placement = place(visibility, lq, options.positions, x.device, options.distances)
        placement = placement._replace(
            key_padding_mask=options.key_padding_mask, document_ids=options.document_ids
        )
        terms = tuple(
            term
            for name in self.term_schemes
            if (term := getattr(self, name).term(keys_input, options.key_padding_mask)) is not None
        )
        return visibility, placement, terms

    def build_call(
        self,
        x: Tensor,
        options: AttentionOptions,
        visibility: Visibility,
        placement: Placement,
        input_terms: tuple[ScoreTerm, ...],
        dtype: torch.dtype | None = None,
    ) -> AttentionCall:
        """The call, built once: its geometry and positions, the per-distance tensors every query
        block reads, the query scale and the score terms in the equation's order (a bias that reads
        the query position, the terms read from the keys' layer inputs, CoPE). dtype: the fast
        kernels' (their per-distance tensors and query scale are cast to it, and term b's keys left
        out where no kernel reads them); None: the explicit path's (everything in its own dtype)."""
        cfg, lq, padding = self.config, x.shape[1], options.key_padding_mask
        query_scale = None
        if self.temperature is not None:
            # n: the keys each query sees by index (padding excluded), learned sinks included
            seen = (
                _visible_counts(visibility, lq, padding, options.document_ids, x.device)
                + self.n_sinks
                if self.temperature.counts_keys
                else None
            )
            query_scale = self.temperature.query_scale(seen, lq, dtype or x.dtype, x.device)
        tensors, query_position_bias, saturation, distance_point = self.per_distance_inputs(
            visibility, lq, placement, options.clamp_len, dtype
        )
        terms = (
            *(
                []
                if query_position_bias is None
                else [QueryPositionBias(query_position_bias, self.bias_scale)]
            ),
            *input_terms,
        )
        return AttentionCall(
            visibility,
            lq,
            placement,
            self.scale,
            dtype=dtype or x.dtype,
            n_sinks=self.n_sinks,
            query_chunk=cfg.query_chunk,
            inputs=ScoreInputs(**tensors, query_scale=query_scale),
            terms=terms,
            distance_point=distance_point,
            band=(None if terms else saturation, None),
        )

    def per_distance_inputs(
        self,
        visibility: Visibility,
        n_queries: int,
        placement: Placement,
        clamp_len: int | None,
        dtype: torch.dtype | None,
    ) -> tuple[dict, BiasScheme | None, int | None, Callable | None]:
        """The tensors every query block reads — s·W_R R_d (term b's keys), term d, the scores of
        distance alone (a distance-only bias; on the kernels with term d without b) and their slope
        where they are linear in the distance —, a bias that reads the query position (FIRE) where
        it is not a curve for this call, the distance from which every per-distance input is
        constant, and the scores of distance alone in closed form (FlexAttention's; None where
        term d is folded into them or the scheme has none)."""
        # (n,) descending
        terms, scheme, distances = (self.config.terms, self.bias_scheme, placement.distances)
        drawn = placement.drawn_distances
        rel_keys = term_d = distance_scores = query_position_bias = None
        if self.config.uses_r:
            rel_keys = self.projected_relative(distances, clamp_len, self.scale)  # (H, n, dh)
            # its own term on the explicit path; on the kernels only without b (with b it rides on
            # the position query q + v), and then added to the bias's curve where there is one
            if "d" in terms and (dtype is None or "b" not in terms):
                term_d = self._term_d(rel_keys)
        if scheme is not None and not scheme.distance_only and drawn:
            # its query position has no meaning where distances are drawn per offset
            raise ValueError(
                f"model.attention.randomized_draw: {self.config.bias!r} reads the query position "
                "besides the distance; per_layer draws distances only (use shared_positions)"
            )
        # a query-dependent bias (FIRE) is a curve over distances too while every query of the call
        # is within its distance-only range (consecutive positions: the query positions are M .. K -
        # 1); strictly below its end, where a query at the end would send part of the gradient to it
        # (FIRE's max(i, L))
        n_keys = visibility.n_mem + n_queries
        curve = scheme is not None and (
            scheme.distance_only
            or (placement.distance_index is None and n_keys - 1 < scheme.distance_only_until())
        )
        if curve:
            distance_scores = scheme.curve(distances) * self.bias_scale  # (H, n)
        elif scheme is not None:
            query_position_bias = scheme
        # a bias with nothing folded into its curve: the low-rank kernel's slope where it is linear
        # in the distance, FlexAttention's closed form where it has one
        alone = curve and dtype is not None and term_d is None and not drawn
        slope = scheme.linear_slope() if alone else None
        point = scheme.point_curve() if alone else None
        if point is not None and self.bias_scale != 1.0:
            point = functools.partial(_scaled, point, self.bias_scale)
        # the kernels: one curve per distance
        if dtype is not None and term_d is not None and query_position_bias is None:
            distance_scores, term_d = (
                term_d if distance_scores is None else term_d + distance_scores,
                None,
            )
        # the fast kernels: their dtype; term b's keys only where term b reads them
        if dtype is not None:
            rel_keys = rel_keys.to(dtype) if rel_keys is not None and "b" in terms else None
            distance_scores = None if distance_scores is None else distance_scores.to(dtype)
            term_d = None if term_d is None else term_d.to(dtype)
        # the distance from which every per-distance input is constant (a clamp of R, the bias's
        # saturation)
        ends = (
            [clamp_len if clamp_len is not None else self.config.clamp_len]
            if self.config.uses_r
            else []
        ) + ([scheme.saturation()] if curve else [])
        saturation = (
            max(ends) if ends and None not in ends and query_position_bias is None else None
        )
        tensors = dict(
            rel_keys=rel_keys,
            term_d=term_d,
            distance_scores=distance_scores,
            distance_slope=None if slope is None else slope * self.bias_scale,
        )
        return tensors, query_position_bias, saturation, point

    def kernel_call(
        self, x: Tensor, mems: Tensor | None = None, options: AttentionOptions | None = None
    ) -> tuple[AttentionCall, Tensor, Tensor | None]:
        """What a forward on the fast kernels hands them: (the call, the content queries q + u, the
        position queries q + v or None), for tools and tests that drive a kernel directly."""
        options = options or AttentionOptions()
        keys_input = (
            x if mems is None or mems.shape[1] == 0 else torch.cat([mems.to(x.dtype), x], dim=1)
        )
        visibility, placement, input_terms = self.locate(x, keys_input, options)
        q, k, v = self._project(x, keys_input, placement, options.rope_scaling)
        call = self.build_call(
            x,
            options,
            visibility,
            placement,
            input_terms,
            kernel_dtype(q, k, v, self.out_net.weight),
        )
        return (call, *self.folded_queries(q, call))

    @torch.no_grad()
    def score_terms(
        self, x: Tensor, mems: Tensor | None = None, options: AttentionOptions | None = None
    ) -> dict[str, Tensor]:
        """Each enabled term of 'a', 'b', 'c', 'd', 'bias' and each score term by its name ('decay',
        'cope', ...) as its own [B, H, L, M + L] map, scaled as it enters the scores, plus 'visible'
        (bool [L, M + L], or [B, 1, L, M + L] with key padding)."""
        options = options or AttentionOptions()
        # per chunk, as forward computes them; nothing outside the chunks
        if self.config.chunk is not None:
            chunks = Chunks(
                self.config.chunk,
                x.shape[1],
                0 if mems is None or mems.shape[1] == 0 else mems.shape[1],
            )
            maps = self._score_terms(
                chunks.split(x), None, chunks.options(options), chunks.query_positions(x)
            )
            visible = maps.pop("visible")
            visible = chunks.scatter(
                visible.expand(x.shape[0] * chunks.count, 1, *visible.shape[-2:]), fill=False
            )
            return {
                # (B·n, 1, C, C) -> (B, 1, L, M + L)
                **{name: chunks.scatter(t) for name, t in maps.items()},
                "visible": visible
                if options.key_padding_mask is not None or options.document_ids is not None
                else visible[0, 0],
            }
        return self._score_terms(x, mems, options)

    def _score_terms(
        self,
        x: Tensor,
        mems: Tensor | None,
        options: AttentionOptions,
        tuned_positions: Tensor | None = None,
    ) -> dict[str, Tensor]:
        keys_input = (
            x if mems is None or mems.shape[1] == 0 else torch.cat([mems.to(x.dtype), x], dim=1)
        )
        visibility, placement, input_terms = self.locate(x, keys_input, options)
        q, k, _ = self._project(x, keys_input, placement, options.rope_scaling, tuned_positions)
        call = self.build_call(x, options, visibility, placement, input_terms)
        shape = (q.shape[0], self.n_heads, call.n_queries, call.n_keys)
        product = (
            None
            if self.path is None
            else self.path.logits(q, k, keys_input, options.key_padding_mask, options.document_ids)
        )
        maps = {
            name: t.expand(shape).contiguous()
            for name, t in self.scores(q, k, call, product=product).items()
        }
        return {**maps, "visible": call.visible(call.all_queries)}


def kernel_dtype(*tensors: Tensor) -> torch.dtype:
    """One dtype for the fast kernels: autocast's where it is on (q + u is fp32 there, as u is,
    while k is bf16), else the widest of the tensors. A term may keep its own (FoX's Λ stays
    float64: each block forms D_ij = Λ_i - Λ_j in float64 before the cast, fox.ForgetTerm)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def _visible_counts(
    visibility: Visibility,
    n_queries: int,
    padding: Tensor | None,
    documents: Tensor | None,
    device,
) -> Tensor:
    """The keys each query sees by index ([L], or [B, 1, L] with key padding or documents: padded
    keys and other documents' keys not counted)."""
    rows = torch.arange(n_queries, device=device)
    keys = visibility.n_mem + n_queries
    seen = visibility(rows[:, None], torch.arange(keys, device=rows.device)[None, :])
    return per_row(
        seen, padding, documents, visibility.n_mem, slice(0, n_queries), slice(0, keys)
    ).sum(-1)


def _scaled(point: Callable, scale: float, head: Tensor, r: Tensor) -> Tensor:
    return point(head, r) * scale
