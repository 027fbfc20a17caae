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
k first (schemes/rope.py). Only enabled terms are computed. `scores` is this equation term by term
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

import torch
from torch import Tensor, nn

from relpos_ablate.config.attention import LENGTH_AWARE_SCALES, AttentionConfig
from relpos_ablate.config.registry import active_parts, part_class, term_class
from relpos_ablate.config.scheme_checks import check_widths, rope_scaling_conflict
from relpos_ablate.model.attention_call import CallBuilder, kernel_dtype
from relpos_ablate.model.chunks import Chunks
from relpos_ablate.model.core.call import AttentionCall, QueryBlock, sum_terms
from relpos_ablate.model.core.options import AttentionOptions, SharedParameters
from relpos_ablate.model.core.parts import Part, Slots, Where
from relpos_ablate.model.core.placement import Placement
from relpos_ablate.model.documents import document_positions, placed_per_row, with_documents
from relpos_ablate.model.kernels.dispatch import STORED_BLOCK_SCORES, attend
from relpos_ablate.model.kernels.explicit import explicit_attention
from relpos_ablate.model.schemes import RopeScaling, build_bias
from relpos_ablate.model.schemes.dape import DataAdaptive
from relpos_ablate.model.schemes.path import PathTransforms
from relpos_ablate.model.schemes.stick_breaking import stick_breaking
from relpos_ablate.model.schemes.tables import table_rows
from relpos_ablate.model.schemes.temperature import Temperature
from relpos_ablate.model.schemes.xl import RelativePositions

# the terms of Transformer-XL and the per-distance bias, as the module docstring sums them (the
# score terms follow in the call's order)
TERM_ORDER = ("a", "b", "c", "d", "bias")


def init_vector(n_heads: int, d_head: int) -> nn.Parameter:
    """A per-head vector such as u or v, N(0, 0.02) as in Transformer-XL."""
    return nn.Parameter(torch.randn(n_heads, d_head) * 0.02)


class RelPosAttention(RelativePositions, CallBuilder, nn.Module):
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
        # the parts (core/parts.py: RoPE, QK-norm, sinks, gates) and the score-term schemes (FoX,
        # CoPE, the sink logit, your own; parts too), each under its attribute, in the sum's order
        self.parts: list[str] = []
        self.term_schemes: list[str] = []
        for names, cls_of, kept in (
            (active_parts(config), part_class, self.parts),
            (config.active_terms, term_class, self.term_schemes),
        ):
            for name in names:
                cls = cls_of(name)
                kept.append(cls.attribute or name)
                setattr(self, kept[-1], cls.build(d_model, n_heads, d_head, config))
        slots = Slots.of(self._parts())
        self.n_sinks = 0 if slots is None else slots.keys.shape[1]
        scaled = config.score_scale in LENGTH_AWARE_SCALES or config.learned_temperature
        self.temperature = Temperature(n_heads, config) if scaled else None
        self.path = PathTransforms(d_model, n_heads, d_head) if config.path else None
        self.dape = (
            DataAdaptive(n_heads, config.dape, config.dape_width, config.dape_kernel)
            if config.dape != "none"
            else None
        )
        self.register_load_state_dict_pre_hook(_without_unread_projections)

    # ------------------------------------------------------------------ the equation
    def _project(
        self,
        x: Tensor,
        keys_input: Tensor,
        placement: Placement,
        rope_scaling: RopeScaling | None,
        tuned_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, L, dh] from x; k, v [B, H, K, dh] from keys_input = [mems; x]; then the parts'
        q/k transforms in the order of their stage: QK-norm before RoPE (0), RoPE's rotation (1),
        QK-norm after it (2), Llama 4's temperature tuning of q (3; at tuned_positions [B, L], else
        the queries' positions). A query or key that no enabled term reads is not projected: zeros
        stand in (they add 0 to every score)."""
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
        at = Where(placed_per_row(placement), rope_scaling, keys_input, tuned_positions)
        for part in sorted(self._parts(), key=lambda p: p.stage):  # RoPE is stage 1
            q, k = part.queries_keys(q, k, at)
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
        the whole call): each enabled term of 'a', 'b', 'c', 'd', 'bias', then each score term by
        its name ('decay': FoX, 'cope', your own), scaled as it enters the sum, broadcastable to [B,
        H, L_b, K_b] (sinks: explicit.py).
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
        # the additive terms (b: s·q_i·W_R R_d, d: s·v·W_R R_d, the bias, the score terms), as
        # every kernel builds them: term b's query is λ·q (not q + v: d is its own term here) the
        # block's rows only
        q_position = None if "b" not in terms else q_b if scale is None else q_b * scale
        q_content = (
            self.folded_queries(q, call)[0][:, :, rows]
            if any(t.reads_content for t in call.terms)
            else None
        )
        inputs = call.block_inputs(blk, call.inputs)._replace(q_position=q_position)
        out.update(call.additive_terms(blk, inputs, q_content, k_b))
        # the equation's order: a, b, c, d, ...
        order = (*TERM_ORDER, *(t.name for t in call.terms))
        return {name: out[name] for name in dict.fromkeys(order) if name in out}

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
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x [B, L, d_model], mems [B, M, d_model] -> (out [B, L, d_model], probs [B, H, L, M + L]
        or None).

        mems is what this same layer received as input x for the previous M tokens (TransformerLM
        keeps it); no gradient flows into it. options: this call's clamp_len, window, key padding.
        A chunked layer runs its chunks as the rows of one call (chunks.py), with tuned_positions
        [B·n, C] the positions temperature tuning reads (None: where the encodings place the
        queries). document_ids [B, L], or [B, M + L] with memory (its ids first), or
        options.document_ids: packed documents, a query seeing its own one's keys (documents.py).
        """
        options = options or AttentionOptions()
        mems = None if mems is None or mems.shape[1] == 0 else mems.detach()
        if document_ids is not None or options.document_ids is not None:
            options = with_documents(self.config, options, document_ids, x, mems)
            if tuned_positions is None:  # temperature tuning reads the place in the document
                tuned_positions = document_positions(options.document_ids)[:, -x.shape[1] :]
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
        for part in self._parts():  # Canon's convolution over [memory; x]
            changed = part.keys_input(
                keys_input, keys_input.shape[1] - x.shape[1], options.document_ids
            )
            if changed is not keys_input:
                keys_input, x = changed, changed[:, changed.shape[1] - x.shape[1] :]
        visibility, placement, input_terms = self.locate(x, keys_input, options)
        q, k, v = self._project(x, keys_input, placement, options.rope_scaling, tuned_positions)
        dropout_p = self.dropout if self.training else 0.0
        cfg = self.config
        whole = need_weights or self.value_table is not None or cfg.backend == "explicit"
        if whole or cfg.needs_scores:
            call = self.build_call(x, options, visibility, placement, input_terms)
            product = (
                None
                if self.path is None
                else self.path.logits(
                    q, k, keys_input, options.key_padding_mask, options.document_ids
                )
            )
            out, probs = self._explicit(q, k, v, call, options, dropout_p, product, whole)
        else:
            call = self.build_call(
                x,
                options,
                visibility,
                placement,
                input_terms,
                kernel_dtype(q, k, v, self.out_net.weight),
            )
            q_content, q_position = self.folded_queries(q, call)
            slots = Slots.of(self._parts())
            if slots is not None:
                k, v = slots.prepend(k, v)
            out, probs = (
                attend(
                    call, q_content, k, v, q_position, self.config, dropout_p, options.statistics
                ),
                None,
            )
        for part in self._parts():  # an output gate
            out = part.output(out, x)
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
        sinks, values = Slots.of(self._parts()), None
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

    def _parts(self) -> list[Part]:
        """Every part of this layer, the term schemes last."""
        return [getattr(self, name) for name in (*self.parts, *self.term_schemes)]


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
