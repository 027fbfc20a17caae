"""RelPosAttention: Transformer-XL's four score terms, any bias-type encoding, RoPE — one module.

Notation: B batch, H heads, dh head width, L queries (this segment), M memory keys, K = M + L keys.
Query i sits at key index i' = M + i; key j; d = i' - j is the distance (query minus key); n = K +
L - 1 distances occur, kept in descending order (shift.py). s = 1/sqrt(dh) (score_scale 'sqrt_d',
'log_n', 'ssmax', else 1), s_B = s when bias_scaled else 1. The score of query i for key j is

    score_ij = λ_hi·( s·[ (a) q_i·k_j + (b) q_i·W_R R_d + (c) u·k_j + (d) v·W_R R_d ]
                      + s_B·B_h(i', j) + D_ij (FoX) ) + s·q̃_i·e[p_ij] (CoPE)

followed by the mask (applied after everything is summed) and a softmax over keys and the learned
sink slots (sinks.py). λ is 1 unless score_scale is log_n or ssmax or the temperature is learned
(temperature.py); q̃_i is the kernels' content query λ·(q_i + u). RoPE and its variants rotate q and
k first (position/rope.py). Only enabled terms are computed. `scores` is this equation term by term
(need_weights, score_terms, Shaw values, backend='explicit'). The fast kernels (dispatch.py) fold
what the term set allows: (q + u)·k is one product for a + c, (q + v)·W_R R one for b + d; term d
alone and every distance-only bias are one per-head curve over distances, laid out as a Toeplitz
map. `forward` reads: project -> per-distance tensors -> pick a kernel -> out.

Positions: the encodings read where queries and keys sit, by default their key indices (query i at
M + i). Explicit positions (`AttentionOptions.positions`, e.g. randomized ones) replace them for
RoPE, the bias and terms b/d, which then see d = pos(i) - pos(j); explicit distances
(`AttentionOptions.distances`, Ruoss et al.'s randomized relative encodings) give the bias and terms
b/d the drawn d_(i'-j) instead. The mask stays by index (call.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.config.model import (
    LENGTH_AWARE_SCALES,
    AttentionConfig,
    check_widths,
    rope_scaling_conflict,
    rotary_width,
    rotating_pairs,
)
from relpos_ablate.model.chunks import Chunks
from relpos_ablate.model.cope import ContextualPositions
from relpos_ablate.model.dape import DataAdaptive
from relpos_ablate.model.fox import ForgetGate
from relpos_ablate.model.kernels.call import (
    AttentionCall,
    AttentionOptions,
    QueryBlock,
    ScoreInputs,
    SharedParameters,
    Visibility,
    place,
    sum_terms,
)
from relpos_ablate.model.kernels.dispatch import STORED_BLOCK_SCORES, attend
from relpos_ablate.model.kernels.explicit import explicit_attention
from relpos_ablate.model.path import PathTransforms
from relpos_ablate.model.position import RopeScaling, build_bias, rotate_queries_keys, sinusoid
from relpos_ablate.model.position.tables import table_row, table_rows
from relpos_ablate.model.sinks import Sinks
from relpos_ablate.model.stick_breaking import stick_breaking
from relpos_ablate.model.temperature import Temperature, tuned_temperature

# the score terms as the module docstring sums them
TERM_ORDER = ("a", "b", "c", "d", "bias", "decay", "cope")


def init_vector(n_heads: int, d_head: int) -> nn.Parameter:
    """A per-head vector such as u or v, N(0, 0.02) as in Transformer-XL."""
    return nn.Parameter(torch.randn(n_heads, d_head) * 0.02)


class RelPosAttention(nn.Module):
    """Multi-head attention over [memory; input] with relative positions chosen by `config`.

    `shared` passes parameters a model shares across its layers; without it the layer owns u, v and
    its bias scheme.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head: int,
        config: AttentionConfig | None = None,
        *,
        dropout: float = 0.0,
        shared: SharedParameters | None = None,
    ):
        super().__init__()
        self.config = config = config or AttentionConfig()
        shared = shared or SharedParameters()
        check_widths(config, d_model, d_head)
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.dropout = dropout
        self.scale = d_head**-0.5 if config.score_scale != "none" else 1.0
        self.bias_scale = self.scale if config.bias_scaled else 1.0
        inner = n_heads * d_head
        # Only what a score term reads is built (terms c, d alone read neither q nor k): DDP with
        # its default find_unused_parameters=False stops at a parameter that gets no gradient.
        self.q_net = nn.Linear(d_model, inner, bias=False) if config.reads_queries else None
        # [W_k;] W_v
        self.kv_net = nn.Linear(d_model, (2 if config.reads_keys else 1) * inner, bias=False)
        self.out_net = nn.Linear(inner, d_model, bias=False)
        # W_R (paper's W_{k,R})
        self.r_net = nn.Linear(d_model, inner, bias=False) if config.uses_r else None
        rows = table_rows(config.clamp_len, config.causal) if config.rel == "learned" else 0
        self.r_table = (
            nn.Parameter(torch.randn(rows, d_model) * 0.02) if rows and config.uses_r else None
        )
        self.value_table = (
            nn.Parameter(torch.randn(rows, d_head) * 0.02) if config.shaw_values else None
        )
        u, v = shared.content_bias_u, shared.position_bias_v
        self.content_bias_u = (
            (u if u is not None else init_vector(n_heads, d_head)) if "c" in config.terms else None
        )
        self.position_bias_v = (
            (v if v is not None else init_vector(n_heads, d_head)) if "d" in config.terms else None
        )
        self.bias_scheme = (
            shared.bias_scheme
            if shared.bias_scheme is not None
            else build_bias(config, n_heads, d_head)
        )
        self.forget_gate = ForgetGate(d_model, n_heads) if config.forget_gate else None
        self.contextual = (
            ContextualPositions(config.cope_positions, d_head) if config.cope_positions else None
        )
        self.sinks = Sinks(n_heads, config.sinks, d_head) if config.sinks else None
        scaled = config.score_scale in LENGTH_AWARE_SCALES or config.learned_temperature
        self.temperature = Temperature(n_heads, config) if scaled else None
        self.path = PathTransforms(d_model, n_heads, d_head) if config.path else None
        self.dape = (
            DataAdaptive(n_heads, config.dape, config.dape_width, config.dape_kernel)
            if config.dape != "none"
            else None
        )
        self.register_load_state_dict_pre_hook(_without_unread_projections)

    # ------------------------------------------------------------------ per-distance tensors
    def table_row(self, distances: Tensor, clamp: int) -> Tensor:
        """Rows of the learned R (and Shaw value) table for distances [n], clipped at clamp <=
        clamp_len."""
        if clamp > self.config.clamp_len:
            raise ValueError(
                f"clamp_len: {clamp} exceeds the learned table (rel='learned', "
                f"clamp_len={self.config.clamp_len})"
            )
        return table_row(distances, clamp, self.config.clamp_len, self.config.causal)

    def relative_vectors(self, distances: Tensor, clamp_len: int | None = None) -> Tensor:
        """R_d for distances [n] -> [n, d_model]; distances beyond clamp_len share R_clamp."""
        clamp = clamp_len if clamp_len is not None else self.config.clamp_len
        if self.config.rel == "learned":
            return self.r_table[self.table_row(distances, clamp)]
        d = distances if clamp is None else distances.clamp(-clamp, clamp)
        return sinusoid(d, self.d_model).to(self.out_net.weight.dtype)

    def projected_relative(
        self, distances: Tensor, clamp_len: int | None = None, scale: float = 1.0
    ) -> Tensor:
        """scale·W_R R_d per head: [n] -> [H, n, dh], a view of the [n, H·dh] product (the scale
        multiplies W_R, not the product: one [n, H·dh] tensor in memory, and its transposed view is
        what the kernels' products read)."""
        # (n, H·dh)
        r = F.linear(self.relative_vectors(distances, clamp_len), self.r_net.weight * scale)
        return r.view(-1, self.n_heads, self.d_head).transpose(0, 1)  # (n, H, dh) -> (H, n, dh)

    def _term_d(self, rel_keys: Tensor) -> Tensor:
        """v·(s·W_R R_d) per head and distance: rel_keys [H, n, dh] -> [H, n]."""
        return torch.einsum("hd,hnd->hn", self.position_bias_v, rel_keys)

    def bias_curve(
        self, distances: Tensor, source: str = "bias", clamp_len: int | None = None
    ) -> Tensor:
        """Additive score per head at distances i - j: [n] -> [H, n].

        source='bias': the bias-type encoding (as added to the scores); source='d': term d, s·v·W_R
        R_d.
        """
        distances = torch.as_tensor(distances, device=self.out_net.weight.device)
        if source == "bias":
            if self.bias_scheme is None:
                raise ValueError(
                    "this attention has no bias (bias='none'); try source='d' for term d"
                )
            return self.bias_scheme.curve(distances) * self.bias_scale
        if source == "d":
            if self.position_bias_v is None:
                raise ValueError(
                    f"term d is off (terms={self.config.terms!r}); no v·W_R R curve to show"
                )
            return self._term_d(self.projected_relative(distances, clamp_len, self.scale))
        raise ValueError(f"source: {source!r} is not allowed; choose 'bias' or 'd'")

    def _placement(
        self, x: Tensor, keys_input: Tensor, options: AttentionOptions
    ) -> tuple[Visibility, dict]:
        """Which keys each query sees (the config's window and the call's, the narrower), where
        queries and keys sit (call.place: what RoPE reads before the call is built) and FoX's Λ from
        the keys' layer inputs [memory; x] (before the projections, so that autograd sums the
        input's gradient in the same order as ever: a table computed before and after the call was
        built once is the same to the bit)."""
        cfg = self.config
        if options.window is not None and not cfg.causal:
            raise ValueError("window (same_length) applies to causal attention only")
        windows = [w for w in (cfg.window, options.window) if w is not None]
        window = min(windows) if windows else None  # (min's default= breaks torch.compile's graph)
        lq = x.shape[1]
        visibility = Visibility(keys_input.shape[1] - lq, cfg.causal, window)
        placed = place(visibility, lq, options.positions, x.device, options.distances)
        if self.forget_gate is not None:
            placed["log_decay"] = self.forget_gate.log_decay(keys_input, options.key_padding_mask)
        return visibility, placed

    def _call(
        self,
        x: Tensor,
        options: AttentionOptions,
        visibility: Visibility,
        placed: dict,
        dtype: torch.dtype | None = None,
    ) -> AttentionCall:
        """The call, built once: its geometry and positions (`placed`, FoX's Λ with them), what the
        other data-dependent schemes read (CoPE's table, the sinks, the query scale) and the
        per-distance tensors every query block reads. dtype: the fast kernels' (their per-distance
        tensors and query scale are cast to it, and term b's keys left out where no kernel reads
        them); None: the explicit path's (everything in its own dtype)."""
        cfg, lq, padding = self.config, x.shape[1], options.key_padding_mask
        query_scale = None
        if self.temperature is not None:
            # n: the keys each query sees by index (padding excluded), learned sinks included
            seen = (
                _visible_counts(visibility, lq, padding, x.device) + cfg.sinks
                if self.temperature.counts_keys
                else None
            )
            query_scale = self.temperature.query_scale(seen, lq, dtype or x.dtype, x.device)
        placed = dict(placed)
        log_decay = placed.pop("log_decay", None)
        tensors, pair_bias = self._per_distance(visibility, lq, placed, options.clamp_len, dtype)
        inputs = ScoreInputs(**tensors, log_decay=log_decay, query_scale=query_scale)
        return AttentionCall(
            visibility,
            lq,
            self.scale,
            **placed,
            key_padding_mask=padding,
            query_chunk=cfg.query_chunk,
            n_sinks=cfg.sinks,
            dtype=dtype or x.dtype,
            inputs=inputs,
            bias_scale=self.bias_scale,
            decay=self.forget_gate,
            contextual=self.contextual,
            **pair_bias,
        )

    def _per_distance(
        self,
        visibility: Visibility,
        n_queries: int,
        placed: dict,
        clamp_len: int | None,
        dtype: torch.dtype | None,
    ) -> tuple[dict, dict]:
        """The tensors every query block reads — s·W_R R_d (term b's keys), term d, the scores of
        distance alone (a distance-only bias; on the kernels with term d without b) — and a
        query-dependent bias (pair_bias: the scheme, its curve's end)."""
        # (n,) descending
        terms, scheme, distances = (self.config.terms, self.bias_scheme, placed["distances"])
        rel_keys = term_d = distance_scores = pair_bias = None
        if self.config.uses_r:
            rel_keys = self.projected_relative(distances, clamp_len, self.scale)  # (H, n, dh)
            # its own term on the explicit path; on the kernels only without b (with b it rides on
            # the position query q + v), and then added to the bias's curve where there is one
            if "d" in terms and (dtype is None or "b" not in terms):
                term_d = self._term_d(rel_keys)
        if scheme is not None and not scheme.distance_only and placed.get("drawn_distances"):
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
            or (placed["distance_index"] is None and n_keys - 1 < scheme.distance_only_until())
        )
        if curve:
            distance_scores = scheme.curve(distances) * self.bias_scale  # (H, n)
        elif scheme is not None:
            pair_bias = scheme
        # a bias linear in the distance with nothing folded into its curve: the low-rank kernel's
        # slope
        linear = (
            scheme.linear_slope()
            if curve and dtype is not None and term_d is None and not placed.get("drawn_distances")
            else None
        )
        # the kernels: one curve per distance
        if dtype is not None and term_d is not None and pair_bias is None:
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
        saturation = max(ends) if ends and None not in ends and pair_bias is None else None
        return (
            dict(rel_keys=rel_keys, term_d=term_d, distance_scores=distance_scores),
            dict(
                pair_bias=pair_bias,
                linear_bias=None if linear is None else linear * self.bias_scale,
                pair_bias_curve_until=scheme.distance_only_until()
                if pair_bias is not None
                else float("inf"),
                saturation=saturation,
            ),
        )

    def kernel_call(
        self, x: Tensor, mems: Tensor | None = None, options: AttentionOptions | None = None
    ) -> tuple[AttentionCall, Tensor, Tensor | None]:
        """What a forward on the fast kernels hands them: (the call, the content queries q + u, the
        position queries q + v or None), for tools and tests that drive a kernel directly."""
        options = options or AttentionOptions()
        keys_input = (
            x if mems is None or mems.shape[1] == 0 else torch.cat([mems.to(x.dtype), x], dim=1)
        )
        visibility, placed = self._placement(x, keys_input, options)
        q, k, v = self._project(x, keys_input, placed, options.rope_scaling)
        call = self._call(
            x, options, visibility, placed, _kernel_dtype(q, k, v, self.out_net.weight)
        )
        return (call, *self.folded_queries(q, call))

    # ------------------------------------------------------------------ the equation
    def _project(
        self,
        x: Tensor,
        keys_input: Tensor,
        placed: dict,
        rope_scaling: RopeScaling | None,
        tuned_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, L, dh] from x; k, v [B, H, K, dh] from keys_input = [mems; x]; RoPE rotates q
        and k, then Llama 4's temperature tuning scales q (at tuned_positions [B, L], else the
        queries' positions). A query or key that no enabled term reads is not projected: zeros stand
        in (they add 0 to every score)."""
        b, lq, _ = x.shape
        # (B, K, 2 or 1, H, dh)
        kv = self.kv_net(keys_input).view(b, keys_input.shape[1], -1, self.n_heads, self.d_head)
        # contiguous once, so that the key prefix each query block reads is a view, not a copy
        *k, v = kv.permute(2, 0, 3, 1, 4).contiguous()  # [k,] v: (B, H, K, dh)
        k = k[0] if k else torch.zeros_like(v)
        # (B, L, H, dh) -> (B, H, L, dh)
        q = (
            v.new_zeros(b, self.n_heads, lq, self.d_head)
            if self.q_net is None
            else self.q_net(x).view(b, lq, self.n_heads, self.d_head).transpose(1, 2)
        )
        conflict = None if rope_scaling is None else rope_scaling_conflict(self.config)
        if conflict:
            raise ValueError(f"rope_scaling: {rope_scaling.kind} {conflict}")
        if self.config.absolute == "rope":
            cfg = self.config
            d_rot = rotary_width(cfg, self.d_head)
            q, k = rotate_queries_keys(
                q,
                k,
                placed["query_positions"],
                placed["key_positions"],
                d_rot,
                cfg.rope_base,
                rope_scaling,
                cfg.xpos_scale_base,
                rotating_pairs(cfg, d_rot),
            )
        if self.config.temperature_tuning:
            # (B or 1, L)
            at = placed["query_positions"][None] if tuned_positions is None else tuned_positions
            # (B, H, L, dh) × (B, 1, L, 1)
            q = q * tuned_temperature(at, self.config).to(q.dtype)[:, None, :, None]
        return q, k, v

    def scores(
        self,
        q: Tensor,
        k: Tensor,
        call: AttentionCall,
        block: QueryBlock | None = None,
        product: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The module docstring's equation, term by term, for the block's queries and keys (default:
        the whole call): each enabled term of 'a', 'b', 'c', 'd', 'bias', 'decay' (FoX), 'cope',
        scaled as it enters the sum, broadcastable to [B, H, L_b, K_b] (sinks: explicit.py).
        product: PaTH's q·k through its transforms for the block's queries and every key, [B, H,
        L_b, K], in place of term a's q·k."""
        blk = block or call.all_queries
        terms, s, rows, keys = self.config.terms, self.scale, blk.rows, slice(blk.k0, blk.n_keys)
        q_b, k_b = q[:, :, rows], k[:, :, keys]
        k_t = k_b.transpose(-1, -2)  # (B, H, dh, K_b)
        scale = None if call.query_scale is None else call.query_scale[:, :, rows]  # λ
        out = {}
        if "a" in terms:  # s·q_i·k_j: (B, H, L_b, K_b)
            out["a"] = (q_b * s) @ k_t if product is None else product[..., keys] * s
        if "c" in terms:
            out["c"] = (self.content_bias_u[None, :, None] * s) @ k_t  # s·u·k_j: (B, H, 1, K_b)
        if scale is not None:
            out = {name: t * scale for name, t in out.items()}
        # the additive terms (b: s·q_i·W_R R_d, d: s·v·W_R R_d, the bias, FoX's decay, CoPE), as
        # every kernel builds them: term b's query is λ·q (not q + v: d is its own term here) the
        # block's rows only
        q_position = None if "b" not in terms else q_b if scale is None else q_b * scale
        q_content = (
            self.folded_queries(q, call)[0][:, :, rows] if self.contextual is not None else None
        )
        inputs = call.block_inputs(blk, call.inputs)._replace(q_position=q_position)
        out.update(call.additive_terms(blk, inputs, q_content, k_b))
        # the equation's order: a, b, c, d, ...
        return {name: out[name] for name in TERM_ORDER if name in out}

    def score_sum(self, maps: dict[str, Tensor], visible: Tensor) -> Tensor:
        """The scores of the equation: the terms summed, or with DAPE X + B + f([X; B]) (X: every
        term but the bias B)."""
        if self.dape is None:
            return sum_terms(maps)
        other = sum_terms({name: t for name, t in maps.items() if name != "bias"})
        return self.dape(other, maps["bias"], visible)

    def folded_queries(self, q: Tensor, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        """The fast kernels' queries: content q + u (terms a, c) and position q + v (terms b, d;
        None without term b, when term d is a curve in call.distance_scores), times the query
        scale."""
        terms, u, v = self.config.terms, self.content_bias_u, self.position_bias_v
        if "a" in terms:
            q_content = q + u[:, None] if u is not None else q  # (B, H, L, dh) + (H, 1, dh)
        elif u is not None:
            # a stride-0 query keeps SDPA off its flash kernel
            q_content = u[None, :, None].expand_as(q).contiguous()
        else:
            q_content = torch.zeros_like(q)
        q_position = (q + v[:, None] if v is not None else q) if "b" in terms else None
        if call.query_scale is not None:
            q_content = q_content * call.query_scale
            q_position = None if q_position is None else q_position * call.query_scale
        return q_content, q_position

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        mems: Tensor | None = None,
        options: AttentionOptions | None = None,
        *,
        need_weights: bool = False,
        tuned_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x [B, L, d_model], mems [B, M, d_model] -> (out [B, L, d_model], probs [B, H, L, M + L]
        or None).

        mems is what this same layer received as input x for the previous M tokens (TransformerLM
        keeps it); no gradient flows into it. options: this call's clamp_len, window, key padding.
        A chunked layer runs its chunks as the rows of one call (chunks.py), with tuned_positions
        [B·n, C] the positions temperature tuning reads (None: where the encodings place the
        queries).
        """
        options = options or AttentionOptions()
        mems = None if mems is None or mems.shape[1] == 0 else mems.detach()
        if self.config.chunk is not None and tuned_positions is None:  # memory is not seen
            chunks = Chunks(self.config.chunk, x.shape[1], 0 if mems is None else mems.shape[1])
            out, probs = self(
                chunks.split(x),
                None,
                chunks.options(options),
                need_weights=need_weights,
                tuned_positions=chunks.query_positions(x),
            )
            return chunks.merge(out), None if probs is None else chunks.scatter(probs)
        keys_input = x if mems is None else torch.cat([mems.to(x.dtype), x], dim=1)  # (B, M + L, D)
        visibility, placed = self._placement(x, keys_input, options)
        q, k, v = self._project(x, keys_input, placed, options.rope_scaling, tuned_positions)
        dropout_p = self.dropout if self.training else 0.0
        cfg = self.config
        whole = need_weights or self.value_table is not None or cfg.backend == "explicit"
        if whole or cfg.needs_scores:
            call = self._call(x, options, visibility, placed)
            product = (
                None
                if self.path is None
                else self.path.logits(q, k, keys_input, options.key_padding_mask)
            )
            out, probs = self._explicit(q, k, v, call, options, dropout_p, product, whole)
        else:
            call = self._call(
                x, options, visibility, placed, _kernel_dtype(q, k, v, self.out_net.weight)
            )
            q_content, q_position = self.folded_queries(q, call)
            if self.sinks is not None:
                k, v = self.sinks.prepend(k, v)
            out, probs = (
                attend(
                    call, q_content, k, v, q_position, self.config, dropout_p, options.statistics
                ),
                None,
            )
        b, _, lq, _ = out.shape
        # (B, H, L, dh) -> (B, L, H·dh)
        out = out.transpose(1, 2).reshape(b, lq, self.n_heads * self.d_head)
        return self.out_net(out), probs if need_weights else None

    def _explicit(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        call: AttentionCall,
        options: AttentionOptions,
        dropout_p: float,
        product: Tensor | None = None,
        whole: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """The materialised path (explicit.py) on this layer's summed scores, sinks and Shaw value
        rows: for the whole call at once (`whole`: probabilities returned), else per query block
        (the schemes that read the scores: probabilities None). DAPE v2 reads neighbouring keys: its
        blocks keep whole rows of keys."""
        sinks, values = self.sinks, None
        if self.value_table is not None:
            clamp = options.clamp_len if options.clamp_len is not None else self.config.clamp_len
            values = self.value_table[self.table_row(call.distances, clamp)]  # (n, dh)
        if whole:
            blocks = [call.all_queries]
        elif self.dape is not None and self.dape.reach:
            blocks = [
                call.block(b.i0, b.i1, whole_rows=True) for b in call.blocks(STORED_BLOCK_SCORES)
            ]
        else:
            blocks = call.blocks(STORED_BLOCK_SCORES, windowed=True)
        normaliser = stick_breaking if self.config.normaliser == "stick_breaking" else None
        q_content = self.folded_queries(q, call)[0] if sinks is not None else None
        # PaTH's product split into the blocks' rows at once: slicing it per block would give each
        # block's backward a zero-filled gradient of the whole [B, H, L, K] product (O(L³) work over
        # the blocks)
        products = (
            [None] * len(blocks)
            if product is None
            else product.split([b.i1 - b.i0 for b in blocks], dim=2)
        )
        outs, probs = [], None
        for blk, block_product in zip(blocks, products):
            scores = self.score_sum(self.scores(q, k, call, blk, block_product), call.visible(blk))
            out, probs = explicit_attention(
                scores,
                v[:, :, blk.k0 : blk.n_keys],
                call,
                blk,
                dropout_p=dropout_p,
                statistics=options.statistics,
                sink_logits=None
                if sinks is None
                else sinks.logits(q_content[:, :, blk.rows], call.scale),
                sink_values=None if sinks is None else sinks.values,
                value_rows=values,
                normaliser=normaliser,
            )
            outs.append(out)
        return torch.cat(outs, dim=2), probs if whole else None

    @torch.no_grad()
    def score_terms(
        self, x: Tensor, mems: Tensor | None = None, options: AttentionOptions | None = None
    ) -> dict[str, Tensor]:
        """Each enabled term of 'a', 'b', 'c', 'd', 'bias', 'decay', 'cope' as its own [B, H, L, M +
        L] map, scaled as it enters the scores, plus 'visible' (bool [L, M + L], or [B, 1, L, M + L]
        with key padding)."""
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
                "visible": visible if options.key_padding_mask is not None else visible[0, 0],
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
        visibility, placed = self._placement(x, keys_input, options)
        q, k, _ = self._project(x, keys_input, placed, options.rope_scaling, tuned_positions)
        call = self._call(x, options, visibility, placed)
        shape = (q.shape[0], self.n_heads, call.n_queries, call.n_keys)
        product = (
            None
            if self.path is None
            else self.path.logits(q, k, keys_input, options.key_padding_mask)
        )
        maps = {
            name: t.expand(shape).contiguous()
            for name, t in self.scores(q, k, call, product=product).items()
        }
        return {**maps, "visible": call.visible(call.all_queries)}


def _kernel_dtype(*tensors: Tensor) -> torch.dtype:
    """One dtype for the fast kernels: autocast's where it is on (q + u is fp32 there, as u is,
    while k is bf16), else the widest of the tensors. FoX's Λ stays float64: each block forms D_ij =
    Λ_i - Λ_j in float64 before the cast (AttentionCall.decay)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def _visible_counts(
    visibility: Visibility, n_queries: int, padding: Tensor | None, device
) -> Tensor:
    """The keys each query sees by index ([L], or [B, 1, L] with key padding: padded keys not
    counted)."""
    rows = torch.arange(n_queries, device=device)
    seen = visibility(
        rows[:, None], torch.arange(visibility.n_mem + n_queries, device=rows.device)[None, :]
    )
    if padding is None:
        return seen.sum(-1)
    return (seen[None, None] & ~padding[:, None, None, :]).sum(-1)


def _without_unread_projections(
    attn: RelPosAttention, state_dict: dict, prefix: str, *args
) -> None:
    """Loads checkpoints written while every attention built q_net and both halves of kv_net: the
    weights no enabled term read (q_net without terms a and b, W_k without a and c) are dropped.
    They never changed the output, so the loaded model computes what the saved one did."""
    if attn.q_net is None:
        state_dict.pop(prefix + "q_net.weight", None)
    kv, rows = state_dict.get(prefix + "kv_net.weight"), attn.kv_net.weight.shape[0]
    if kv is not None and kv.shape[0] == 2 * rows and not attn.config.reads_keys:
        state_dict[prefix + "kv_net.weight"] = kv[rows:]  # [W_k; W_v] -> W_v
