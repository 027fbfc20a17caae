"""RelPosAttention: Transformer-XL's four score terms, any bias-type encoding, RoPE — one module.

For query i (absolute position M + i in the key sequence, M = memory length) and key j, with
distance d = M + i - j (query minus key) and s = 1/sqrt(d_head) (score_scale='sqrt_d'):

    score_ij = s·[ (a) q_i·k_j + (b) q_i·W_R R_d + (c) u·k_j + (d) v·W_R R_d ] + s_B·B_h(i, j)

s_B = s when bias_scaled else 1. Only enabled terms are computed. The fast path folds what the term
set allows: (q + u)·k is one product for a+c, (q + v)·W_R R one for b+d; term d alone and every
distance-only bias are one per-head curve over distances, laid out as a Toeplitz map. Queries are
processed in blocks; a causal block only sees keys up to its last query, and the block's additive
map (terms b, d, bias, mask) goes to `F.scaled_dot_product_attention` together with (q + u) and k.
The mask is applied after every term and the bias are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from relpos_ablate.config.base import ConfigError
from relpos_ablate.config.model import AttentionConfig
from relpos_ablate.model.kernels import Block, block_inputs, blockwise_biased_attention, common_dtype, masked_softmax
from relpos_ablate.model.position import BiasScheme, build_bias, rope_rotate, sinusoid
from relpos_ablate.model.shift import rel_shift, toeplitz


def init_vector(n_heads: int, d_head: int) -> nn.Parameter:
    """A per-head vector such as u or v, N(0, 0.02) as in Transformer-XL."""
    return nn.Parameter(torch.randn(n_heads, d_head) * 0.02)


# Score entries per head in one query block (see _blocks): blocks whose maps are stored for backward
# can be large; blocks rebuilt in backward are kept small, as their transients are the peak memory.
STORED_BLOCK_SCORES = 256 * 1024
REBUILT_BLOCK_SCORES = 64 * 1024
MIN_BLOCK = 16


@dataclass
class _Layout:
    """Per-call geometry and the per-distance tensors shared by all query blocks."""

    n_queries: int  # L
    n_mem: int  # M
    r: Tensor | None  # (H, n, dh): W_R R for descending distances K-1 .. -(L-1), scaled by s; term b
    curve: Tensor | None  # (H, n): term d plus distance-only bias, scaled, per descending distance
    distance_only_until: float = float("inf")  # a query-dependent bias is a curve up to this position
    clamp_len: int | None = None  # this call's clamp of R (None: the config's)

    @property
    def n_keys(self) -> int:
        return self.n_mem + self.n_queries


@dataclass
class _Plan:
    """The attention's geometry as BlockwiseBiasedAttention sees it (see kernels.BlockPlan)."""

    attn: "RelPosAttention"
    lay: _Layout
    blocks: list[Block]
    window: int | None
    padding: Tensor | None

    @property
    def scale(self) -> float:
        return self.attn.scale

    def visible(self, blk: Block) -> Tensor:
        return self.attn._visible(self.lay, blk.i0, blk.i1, blk.n_keys, self.window, self.padding)

    def bias(self, blk: Block, qb: Tensor | None, r: Tensor | None, curve: Tensor | None) -> Tensor:
        return self.attn._block_bias(self.lay, blk.i0, blk.i1, blk.n_keys, qb, r, curve)


class RelPosAttention(nn.Module):
    """Multi-head attention over [memory; input] with relative positions chosen by `config`.

    Parameters shared across layers (u, v, a bias module) may be passed in; otherwise the layer owns them.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head: int,
        config: AttentionConfig | None = None,
        *,
        dropout: float = 0.0,
        content_bias_u: nn.Parameter | None = None,
        position_bias_v: nn.Parameter | None = None,
        bias_module: BiasScheme | None = None,
    ):
        super().__init__()
        self.config = config = config or AttentionConfig()
        if config.absolute == "rope" and d_head % 2:
            raise ConfigError("d_head", f"rope needs an even d_head (got {d_head})")
        if config.uses_r and config.rel == "sinusoid" and d_model % 2:
            raise ConfigError("d_model", f"sinusoid R needs an even d_model (got {d_model})")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.dropout = dropout
        self.scale = d_head**-0.5 if config.score_scale == "sqrt_d" else 1.0
        self.bias_scale = self.scale if config.bias_scaled else 1.0
        inner = n_heads * d_head
        self.q_net = nn.Linear(d_model, inner, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * inner, bias=False)
        self.out_net = nn.Linear(inner, d_model, bias=False)
        self.r_net = nn.Linear(d_model, inner, bias=False) if config.uses_r else None  # W_R (paper's W_{k,R})
        learned_rows = None
        if config.rel == "learned" and (config.uses_r or config.shaw_values):
            learned_rows = config.clamp_len + 1 if config.causal else 2 * config.clamp_len + 1
        self.r_table = nn.Parameter(torch.randn(learned_rows, d_model) * 0.02) if learned_rows and config.uses_r else None
        self.value_table = nn.Parameter(torch.randn(learned_rows, d_head) * 0.02) if config.shaw_values else None
        self.content_bias_u = (content_bias_u if content_bias_u is not None else init_vector(n_heads, d_head)) \
            if "c" in config.terms else None
        self.position_bias_v = (position_bias_v if position_bias_v is not None else init_vector(n_heads, d_head)) \
            if "d" in config.terms else None
        self.bias = bias_module if bias_module is not None else build_bias(config, n_heads)

    # ------------------------------------------------------------------ positions
    def _learned_index(self, distances: Tensor, clamp: int) -> Tensor:
        if clamp > self.config.clamp_len:
            raise ValueError(
                f"clamp_len: {clamp} exceeds the learned table (rel='learned', clamp_len={self.config.clamp_len})"
            )
        if self.config.causal:
            return distances.clamp(0, clamp)
        return distances.clamp(-clamp, clamp) + self.config.clamp_len

    def relative_vectors(self, distances: Tensor, clamp_len: int | None = None) -> Tensor:
        """R_d for distances [n] -> [n, d_model]; distances beyond clamp_len share R_clamp."""
        clamp = clamp_len if clamp_len is not None else self.config.clamp_len
        if self.config.rel == "learned":
            return self.r_table[self._learned_index(distances, clamp)]
        d = distances if clamp is None else distances.clamp(-clamp, clamp)
        return sinusoid(d, self.d_model).to(self.q_net.weight.dtype)

    def projected_relative(self, distances: Tensor, clamp_len: int | None = None) -> Tensor:
        """W_R R_d per head: [n] -> [H, n, dh]."""
        r = self.r_net(self.relative_vectors(distances, clamp_len))
        return r.view(-1, self.n_heads, self.d_head).transpose(0, 1)

    def bias_curve(self, distances: Tensor, source: str = "bias", clamp_len: int | None = None) -> Tensor:
        """Additive score per head at distances i - j: [n] -> [H, n].

        source='bias': the bias-type encoding (as added to the scores); source='d': term d, s·v·W_R R_d.
        """
        distances = torch.as_tensor(distances, device=self.q_net.weight.device)
        if source == "bias":
            if self.bias is None:
                raise ValueError("this attention has no bias (bias='none'); try source='d' for term d")
            return self.bias.curve(distances) * self.bias_scale
        if source == "d":
            if self.position_bias_v is None:
                raise ValueError(f"term d is off (terms={self.config.terms!r}); no v·W_R R curve to show")
            r = self.projected_relative(distances, clamp_len)
            return torch.einsum("hd,hnd->hn", self.position_bias_v, r) * self.scale
        raise ValueError(f"source: {source!r} is not allowed; choose 'bias' or 'd'")

    def _layout(self, n_queries: int, n_mem: int, clamp_len: int | None, device) -> _Layout:
        terms = self.config.terms
        n_keys = n_mem + n_queries
        distances = torch.arange(n_keys - 1, -n_queries, -1, device=device)  # descending: K-1 .. -(L-1)
        r = curve = None
        if self.config.uses_r:
            # contiguous once: every query block multiplies by a slice of it
            r = (self.projected_relative(distances, clamp_len) * self.scale).contiguous()  # (H, n, dh)
            if "d" in terms and "b" not in terms:
                curve = torch.einsum("hd,hnd->hn", self.position_bias_v, r)
        if self.bias is not None and self.bias.distance_only:
            scheme = self.bias.curve(distances) * self.bias_scale
            curve = scheme if curve is None else curve + scheme
        until = self.bias.distance_only_until() if self.bias is not None else float("inf")
        return _Layout(n_queries, n_mem, r if "b" in terms else None, curve, until, clamp_len)

    # ------------------------------------------------------------------ blocks
    def _visible(self, lay: _Layout, i0: int, i1: int, n_keys: int, window: int | None, padding: Tensor | None):
        """Bool [L_b, K_b] (or [B, 1, L_b, K_b] with padding): may query i see key j."""
        device = self.q_net.weight.device
        q_pos = torch.arange(lay.n_mem + i0, lay.n_mem + i1, device=device)
        dist = q_pos[:, None] - torch.arange(n_keys, device=device)[None, :]
        visible = torch.ones_like(dist, dtype=torch.bool)
        if self.config.causal:
            visible = dist >= 0
            if window is not None:
                visible = visible & (dist < window)
        if padding is not None:
            visible = visible[None, None] & ~padding[:, None, None, :n_keys]
        return visible

    def _block(self, lay: _Layout, i0: int, i1: int) -> Block:
        """Geometry of the query block i0..i1: its keys and the per-distance columns it reads."""
        lq = i1 - i0
        n_keys = lay.n_mem + i1 if self.config.causal else lay.n_keys
        t0 = lay.n_queries - i1  # column of this block's largest distance in the descending layout
        n_r = lq + n_keys - 1 if not self.config.causal else min(n_keys + 1, lq + n_keys - 1)
        return Block(i0, i1, n_keys, slice(t0, t0 + n_r), slice(t0, t0 + lq + n_keys - 1))

    def _blocks(self, lay: _Layout, block_scores: int) -> list[Block]:
        """Query blocks of query_chunk queries, shrunk for long key ranges so that one block's score
        map stays near `block_scores` entries per head (bounded transient memory)."""
        chunk = self.config.query_chunk or lay.n_queries
        blocks, i0 = [], 0
        while i0 < lay.n_queries:
            if self.config.query_chunk:
                keys = lay.n_mem + i0 + chunk if self.config.causal else lay.n_keys
                size = max(MIN_BLOCK, min(chunk, block_scores // keys))
            else:
                size = chunk
            i1 = min(i0 + size, lay.n_queries)
            blocks.append(self._block(lay, i0, i1))
            i0 = i1
        return blocks

    def _block_bias(self, lay: _Layout, i0: int, i1: int, n_keys: int, qb: Tensor | None, r: Tensor | None,
                    curve: Tensor | None) -> Tensor | None:
        """Additive scores of terms b, d and the bias for queries i0..i1-1 and keys 0..n_keys-1:
        [B or 1, H, L_b, K_b], or None when there is none. qb is the block's position query, r and
        curve the block's slices (see _block): passed in so that backward can rebuild this."""
        lq = i1 - i0
        total = None
        if r is not None:
            total = rel_shift(qb @ r.transpose(1, 2), n_keys)  # (B, H, L_b, n) -> (B, H, L_b, K_b)
        if curve is not None:
            bias = toeplitz(curve, lq, n_keys)[None]  # (1, H, L_b, K_b)
            total = bias if total is None else total + bias
        if self.bias is not None and not self.bias.distance_only:
            total = self._query_dependent_bias(lay, i0, i1, n_keys) if total is None else \
                total + self._query_dependent_bias(lay, i0, i1, n_keys)
        return total

    def _query_dependent_bias(self, lay: _Layout, i0: int, i1: int, n_keys: int) -> Tensor:
        """[1, H, L_b, K_b] of a bias that depends on the query position (FIRE). Where every query of
        the block is within the scheme's distance-only range, one curve over the block's distances
        (L_b + K_b - 1 values) replaces the evaluation at every (i, j) pair."""
        device = self.q_net.weight.device
        last_query = lay.n_mem + i1 - 1
        if last_query <= lay.distance_only_until:
            distances = torch.arange(last_query, last_query - (i1 - i0 + n_keys - 1), -1, device=device)
            return toeplitz(self.bias.curve(distances), i1 - i0, n_keys)[None] * self.bias_scale
        q_pos = torch.arange(lay.n_mem + i0, lay.n_mem + i1, device=device)
        return self.bias.bias(q_pos, torch.arange(n_keys, device=device))[None] * self.bias_scale

    def _queries(self, q: Tensor) -> tuple[Tensor, Tensor | None]:
        """Content query (terms a, c folded: q + u) and position query (terms b, d folded: q + v)."""
        terms = self.config.terms
        u, v = self.content_bias_u, self.position_bias_v
        if "a" in terms:
            qc = q + u[:, None] if u is not None else q
        elif u is not None:
            qc = u[None, :, None].expand_as(q).contiguous()  # a stride-0 query keeps SDPA off its flash kernel
        else:
            qc = torch.zeros_like(q)
        qb = None
        if "b" in terms:
            qb = q + v[:, None] if v is not None else q
        return qc, qb

    # ------------------------------------------------------------------ forward
    def _project(self, x: Tensor, mems: Tensor | None):
        n_mem = 0 if mems is None else mems.shape[1]
        cat = x if mems is None or n_mem == 0 else torch.cat([mems.to(x.dtype), x], dim=1)  # (B, K, D)
        b, lq, _ = x.shape
        q = self.q_net(x).view(b, lq, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, L, dh)
        kv = self.kv_net(cat).view(b, cat.shape[1], 2, self.n_heads, self.d_head)
        # contiguous once, so that the key prefix each query block reads is a view, not a copy
        k, v = kv.permute(2, 0, 3, 1, 4).contiguous()  # 2 x (B, H, K, dh)
        if self.config.absolute == "rope":
            positions = torch.arange(cat.shape[1], device=x.device)
            q = rope_rotate(q, positions[n_mem:], self.config.rope_base)
            k = rope_rotate(k, positions, self.config.rope_base)
        return q, k, v, n_mem

    def forward(
        self,
        x: Tensor,
        mems: Tensor | None = None,
        *,
        need_weights: bool = False,
        key_padding_mask: Tensor | None = None,
        clamp_len: int | None = None,
        window: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x [B, L, d_model], mems [B, M, d_model] (no gradient flows into them) ->
        (out [B, L, d_model], probs [B, H, L, M + L] or None).

        key_padding_mask [B, M + L] is True at keys to ignore. clamp_len overrides the config's for
        this call (evaluation). window (causal only): each query sees at most the `window` most recent
        keys, itself included (Transformer-XL's same_length uses the memory length).
        """
        if window is not None and not self.config.causal:
            raise ValueError("window (same_length) applies to causal attention only")
        if mems is not None:
            mems = mems.detach()
        q, k, v, n_mem = self._project(x, mems)
        lay = self._layout(x.shape[1], n_mem, clamp_len, x.device)
        qc, qb = self._queries(q)
        if not need_weights:  # under autocast, u and v (fp32) promote q + u while k stays bf16: one dtype for the kernels
            dtype = common_dtype(qc, k, v, qb, lay.r, lay.curve)
            qc, k, v, qb = (None if t is None else t.to(dtype) for t in (qc, k, v, qb))
            lay.r, lay.curve = (None if t is None else t.to(dtype) for t in (lay.r, lay.curve))
        explicit = need_weights or self.value_table is not None or self.config.backend == "explicit"
        if not explicit and self._use_flex(x):
            out, probs = self._attend_flex(lay, qc, qb, k, v, window, key_padding_mask), None
        elif explicit:
            out, probs = self._attend_explicit(lay, qc, qb, k, v, window, key_padding_mask)
            probs = probs if need_weights else None
        else:
            out, probs = self._attend_blocks(lay, qc, qb, k, v, window, key_padding_mask), None
        b, _, lq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, lq, self.n_heads * self.d_head)
        return self.out_net(out), probs

    def _attend_blocks(self, lay, qc, qb, k, v, window, padding) -> Tensor:
        """Attention in query blocks. No additive map: one SDPA call. Otherwise SDPA per block with
        the block's map (stored for backward), or BlockwiseBiasedAttention, which rebuilds the maps in
        backward and keeps O(L·d) (see _rebuild_in_backward; never with attention dropout)."""
        p = self.dropout if self.training else 0.0
        position_dependent = self.bias is not None and not self.bias.distance_only
        has_bias = qb is not None or lay.curve is not None or position_dependent
        if not has_bias and padding is None and window is None:
            return self._attend_plain(lay, qc, k, v, p)
        rebuild = has_bias and p == 0.0 and self._rebuild_in_backward(lay, qc)
        blocks = self._blocks(lay, REBUILT_BLOCK_SCORES if rebuild else STORED_BLOCK_SCORES)
        plan = _Plan(self, lay, blocks, window, padding)
        if rebuild:
            params = list(self.bias.parameters()) if position_dependent else []
            # bf16/fp16 inputs: the kernel keeps scores and softmax statistics in fp32, as FlashAttention does
            wide = torch.promote_types(qc.dtype, torch.float32)
            qc_, k_, v_, qb_, r_, curve_ = (None if t is None else t.to(wide) for t in (qc, k, v, qb, lay.r, lay.curve))
            return blockwise_biased_attention(plan, qc_, k_, v_, qb_, r_, curve_, params).to(qc.dtype)
        outs = []
        for blk in plan.blocks:
            rows = slice(blk.i0, blk.i1)
            mask = plan.visible(blk)
            if has_bias:
                mask = plan.bias(blk, *block_inputs(blk, qb, lay.r, lay.curve)).to(qc.dtype).masked_fill(~mask, float("-inf"))
            outs.append(F.scaled_dot_product_attention(
                qc[:, :, rows], k[:, :, : blk.n_keys], v[:, :, : blk.n_keys], attn_mask=mask, dropout_p=p,
                scale=self.scale,
            ))
        return torch.cat(outs, dim=2)

    def _rebuild_in_backward(self, lay: _Layout, qc: Tensor) -> bool:
        """Use BlockwiseBiasedAttention? Always for backend='blocks'; for 'auto' only when training
        would otherwise store score maps larger than max_stored_scores_mb."""
        if self.config.backend != "auto":
            return self.config.backend == "blocks"
        if not torch.is_grad_enabled():
            return False
        lq = lay.n_queries
        per_head = lq * lay.n_mem + lq * (lq + 1) // 2 if self.config.causal else lq * lay.n_keys
        return qc.shape[0] * qc.shape[1] * per_head * qc.element_size() > self.config.max_stored_scores_mb * 2**20

    def _attend_plain(self, lay, qc, k, v, p) -> Tensor:
        """No additive map: one SDPA call (flash kernels); causal with memory is lower-right aligned."""
        if not self.config.causal:
            return F.scaled_dot_product_attention(qc, k, v, dropout_p=p, scale=self.scale)
        if lay.n_mem == 0:
            return F.scaled_dot_product_attention(qc, k, v, is_causal=True, dropout_p=p, scale=self.scale)
        mask = causal_lower_right(lay.n_queries, lay.n_keys)
        return F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, dropout_p=p, scale=self.scale)

    def _use_flex(self, x: Tensor) -> bool:
        """FlexAttention for backend='flex', and for 'auto' on CUDA without attention dropout."""
        if self.config.backend == "flex":
            return True
        return self.config.backend == "auto" and x.is_cuda and not (self.training and self.dropout > 0)

    def _attend_flex(self, lay, qc, qb, k, v, window, padding) -> Tensor:
        """FlexAttention (compiled on CUDA); see flex.py. Term b is precomputed per distance."""
        from relpos_ablate.model.flex import flex_attend

        term_b = None if qb is None else qb @ lay.r.transpose(1, 2)  # (B, H, L, K + L - 1)
        query_bias = None
        if self.bias is not None and not self.bias.distance_only:
            query_bias = self._query_dependent_bias(lay, 0, lay.n_queries, lay.n_keys)[0]  # (H, L, K)
        return flex_attend(
            qc, k, v, scale=self.scale, n_mem=lay.n_mem, causal=self.config.causal, window=window,
            term_b=term_b, curve=lay.curve, query_bias=query_bias, padding=padding, compiled=qc.is_cuda,
        )

    def _attend_explicit(self, lay, qc, qb, k, v, window, padding):
        """Materialised scores and probabilities (for need_weights, Shaw values, or backend='explicit')."""
        scores = (qc * self.scale) @ k.transpose(-1, -2)  # (B, H, L, K)
        blk = self._block(lay, 0, lay.n_queries)
        add = self._block_bias(lay, 0, lay.n_queries, lay.n_keys, *block_inputs(blk, qb, lay.r, lay.curve))
        if add is not None:
            scores = scores + add
        visible = self._visible(lay, 0, lay.n_queries, lay.n_keys, window, padding)
        probs = masked_softmax(scores, visible)
        dropped = F.dropout(probs, self.dropout, self.training)
        out = dropped @ v
        if self.value_table is not None:
            out = out + self._shaw_values(dropped, lay)
        return out, probs

    def _shaw_values(self, probs: Tensor, lay: _Layout) -> Tensor:
        """Shaw et al. value term Σ_j p_ij a^V_{clip(i-j)}: probabilities regrouped by distance
        (the inverse of rel_shift), then one product with the table. [B, H, L, K] -> [B, H, L, dh]."""
        b, h, lq, n_keys = probs.shape
        n = lq + n_keys - 1
        per_distance = probs.new_zeros(b, h, lq, n)
        rel_shift(per_distance, n_keys).copy_(probs)  # column t of row r <- key j = t - (L - 1 - r)
        distances = torch.arange(n_keys - 1, -lq, -1, device=probs.device)
        clamp = self.config.clamp_len if lay.clamp_len is None else lay.clamp_len  # the keys' clamp
        table = self.value_table[self._learned_index(distances, clamp)]  # (n, dh)
        return per_distance @ table

    # ------------------------------------------------------------------ inspection
    @torch.no_grad()
    def score_terms(
        self, x: Tensor, mems: Tensor | None = None, *, clamp_len: int | None = None, window: int | None = None,
    ) -> dict[str, Tensor]:
        """Each enabled term (a, b, c, d) and the bias as its own [B, H, L, M + L] map, scaled as it
        enters the scores, plus 'visible' (bool mask). Inspection only: computes every map explicitly."""
        q, k, _, n_mem = self._project(x, mems)
        b, h, lq, _ = q.shape
        n_keys = n_mem + lq
        lay = _Layout(lq, n_mem, None, None)
        distances = torch.arange(n_keys - 1, -lq, -1, device=x.device)
        terms = self.config.terms
        out: dict[str, Tensor] = {}
        if "a" in terms:
            out["a"] = (q * self.scale) @ k.transpose(-1, -2)
        if "c" in terms:
            out["c"] = ((self.content_bias_u[None, :, None] * self.scale) @ k.transpose(-1, -2)).expand(b, h, lq, n_keys)
        if self.config.uses_r:
            r = self.projected_relative(distances, clamp_len) * self.scale
            if "b" in terms:
                out["b"] = rel_shift(q @ r.transpose(1, 2), n_keys)
            if "d" in terms:
                curve = torch.einsum("hd,hnd->hn", self.position_bias_v, r)
                out["d"] = toeplitz(curve, lq, n_keys)[None].expand(b, h, lq, n_keys)
        if self.bias is not None:
            positions = torch.arange(n_keys, device=x.device)
            out["bias"] = (self.bias.bias(positions[n_mem:], positions) * self.bias_scale)[None].expand(b, h, lq, n_keys)
        visible = self._visible(lay, 0, lq, n_keys, window, None)
        out["visible"] = visible
        return {name: t.contiguous() for name, t in out.items()}
