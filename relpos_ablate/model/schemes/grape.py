"""GRAPE ("Group Representational Position Encoding", arXiv 2512.07805): its two additive forms,
each a score term. Causal attention only. docs/schemes/attention-plumbing.md#grape.

GRAPE-A (§4.1, Eq. 4.6; `grape: a`): a linear decay per head whose slope is gated by the query and
the key,

    B_ij = -|d_ij|·ω_h·[λ_q(q_i) + λ_k(k_j)],   ω_h = softplus(ω̃_h)·β_h,
    λ_q(q_i) = softplus(v̂_h·q_i / √d_h),   λ_k(k_j) = softplus(û_h·k_j / √d_h),

with d_ij the pair's distance as the call places it (i' - j at consecutive positions, pos_i -
pos_j at explicit ones, the drawn distance where distances are drawn: what ALiBi reads), β_h the
ALiBi slopes, û, v̂ the unit vectors of learned u_h, v_h ∈ R^{d_h} (init N(0, 1/√d_h), normalised
with eps 1e-6) and ω̃_h initialised at softplus⁻¹(1), so that ω_h = β_h at init. `grape_gates`: qk
(GRAPE-A-QK, both gates), q or k (one of them), none (no gate: B_ij = -|d_ij|·ω_h, ALiBi with a
learned slope, equal to it at init). As the authors' code (model/llama-mha-grape-a-*.py): the gates
read q and k as the attention's dot product does (here the kernels' content query, λ included, and
the keys, rotated where RoPE is on; the authors have QK-RMSNorm and no RoPE); the code clamps the
distance at 0 and we take |d| as ALiBi does (equal on causal pairs at increasing positions). The
term reads q and k over whole rows (form `content`); its gradient, into q, k, u, v and ω̃, is
autograd's through `block` (explicit and per-block SDPA kernels).

GRAPE-AP (§5, Eq. 5.1-5.2; `grape: ap`): a path sum whose edges depend on the query's endpoint,

    e(t, ℓ) = α_h·log σ(⟨p_t, R_ℓ p̂_ℓ⟩ / d_p),   B(t, j) = Σ_{ℓ=j+1..t} e(t, ℓ),

p_t = W_p x_t per head (d_p = `grape_ap_dim`, init N(0, 0.5/√d_model), no bias) from the keys'
layer inputs [memory; x]; p̂ = p / rms(p) (no weight, torch's default eps, as the authors'
F.rms_norm); R_ℓ turns every rotate-half pair (p_k, p_{k+d_p/2}) by the angle -ℓ (RoPE with base 1
and the authors' sign: y1 = x1 cos ℓ + x2 sin ℓ, y2 = x2 cos ℓ - x1 sin ℓ) at the key's position ℓ;
α_h the ALiBi slopes, fixed. As the authors' code (model/llama-mha-grape-ap-v1.py) the query side
reads the RAW p_t, where the paper's text normalises both, and divides by d_p, not √d_p. The key's
own edge is left out, the query's counted: B(t, t) = 0. The sum runs over key indices, as FoX's;
padded keys have no edge. Every edge is <= 0, so `path_sum` accumulates from the query backwards
without cancellation: the near keys, the ones with weight, are sums of few edges, and fp32 (at
least) suffices where FoX's difference Λ_i - Λ_j needs float64. Endpoint-independent edges e(t, ℓ) =
log f_ℓ give FoX, constant ones -β_h give ALiBi (App. C). No content read: every kernel takes it
through `block`, differentiated by autograd (p crosses the block kernel's boundary as a tensor).

Both maps are added after the scale 1/√d_h of q·k, not multiplied by it, and multiplied by the
query scale λ (`scaled`, as ALiBi's bias and FoX: a temperature scales the whole logit; λ = 1 in the
presets). Sources: the paper's §4-5 and App. C; the authors' code,
github.com/model-architectures/GRAPE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.model.core.terms import ScoreTerm, TermScheme
from relpos_ablate.model.documents import document_positions
from relpos_ablate.model.schemes.alibi import alibi_slopes

GATES = ("qk", "q", "k", "none")
DIRECTION_EPS = 1e-6  # F.normalize's eps on u and v, as the authors


def path_sum(edges: Tensor, query_index: Tensor, key_index: Tensor) -> Tensor:
    """B(t, j) = Σ_{ℓ=j+1..t} e(t, ℓ) for each query t and key j: edges [B or 1, H, L_b, K] (entry
    (r, c) = e(t_r, ℓ_c)), query_index [L_b] (each query's key index t), key_index [K] (consecutive
    key indices) -> [B or 1, H, L_b, K], 0 where j >= t. Summed from the query backwards (a reversed
    cumulative sum), never as a difference of two long sums."""
    beyond = key_index[None, :] > query_index[:, None]  # (L_b, K): past the query, off its path
    from_edge = edges.masked_fill(beyond, 0.0).flip(-1).cumsum(-1).flip(-1)  # Σ_{ℓ' >= ℓ}
    return F.pad(from_edge[..., 1:], (0, 1))  # Σ_{ℓ' > j}: the key's own edge left out


def _causal_only(config) -> None:
    if not config.causal:
        raise ValueError("grape: causal attention only (its bias sums the keys before a query)")


class GrapeA(TermScheme):
    """ω̃_h [H] and the gate directions u_h (keys), v_h (queries) [H, d_h] of `grape_gates`."""

    attribute = "grape_a"

    @classmethod
    def build(cls, d_model, n_heads, d_head, config) -> GrapeA:
        _causal_only(config)
        return cls(n_heads, d_head, config.grape_gates)

    def __init__(self, n_heads: int, d_head: int, gates: str = "qk"):
        super().__init__()
        if gates not in GATES:
            raise ValueError(f"grape_gates: {gates!r} is not one of {', '.join(GATES)}")
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)
        # softplus⁻¹(1): ω_h = β_h at init
        self.omega_raw = nn.Parameter(torch.full((n_heads,), math.log(math.expm1(1.0))))
        self.query_gate_v = _direction(n_heads, d_head) if gates in ("qk", "q") else None
        self.key_gate_u = _direction(n_heads, d_head) if gates in ("qk", "k") else None

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> GrapeATerm:
        return GrapeATerm(self)

    def slope(self, dtype: torch.dtype) -> Tensor:
        """ω_h = softplus(ω̃_h)·β_h: [H]."""
        return F.softplus(self.omega_raw.to(dtype)) * self.slopes.to(dtype)

    def rate(self, q: Tensor, k: Tensor, dtype: torch.dtype) -> Tensor | None:
        """λ_q(q_i) + λ_k(k_j) of the gates there are: q [B, H, L_b, dh], k [B, H, K_b, dh] -> [B,
        H, L_b or 1, K_b or 1]; None: no gate."""
        rate = None
        if self.query_gate_v is not None:
            rate = _gate(q, self.query_gate_v, dtype)[..., :, None]  # (B, H, L_b, 1)
        if self.key_gate_u is not None:
            key = _gate(k, self.key_gate_u, dtype)[..., None, :]  # (B, H, 1, K_b)
            rate = key if rate is None else rate + key
        return rate


def _direction(n_heads: int, d_head: int) -> nn.Parameter:
    """u or v [H, d_h], N(0, 1/√d_h) as the authors (only its direction is read)."""
    return nn.Parameter(torch.randn(n_heads, d_head) / math.sqrt(d_head))


def _gate(x: Tensor, direction: Tensor, dtype: torch.dtype) -> Tensor:
    """softplus(ŵ_h·x / √d_h): x [B, H, N, dh], direction [H, dh] -> [B, H, N] in dtype."""
    unit = F.normalize(direction.to(dtype), dim=-1, eps=DIRECTION_EPS)
    return F.softplus(torch.einsum("bhnd,hd->bhn", x.to(dtype), unit) / math.sqrt(x.shape[-1]))


class GrapeATerm(ScoreTerm):
    """B_ij = -|d_ij|·ω_h·[λ_q(q_i) + λ_k(k_j)] of a block (module docstring), in at least fp32:
    it reads the block's content queries and keys, its gradient by autograd."""

    name = "grape_a"
    forms = frozenset({"content"})

    def __init__(self, scheme: GrapeA):
        self.scheme = scheme

    def parameters(self):
        return self.scheme.parameters()

    def block(self, call, block, q=None, k=None) -> Tensor:
        dtype = torch.promote_types(call.dtype, torch.float32)
        # each pair's distance as the call places it (the same column ALiBi's curve reads)
        distance = call.per_key(block, call.distances[block.distance_cols].to(dtype)).abs()
        decay = -distance * self.scheme.slope(dtype)[:, None, None]  # (H, L_b, K_b)
        rate = self.scheme.rate(q, k, dtype)
        return decay[None] if rate is None else decay * rate


class GrapeAP(TermScheme):
    """W_p [H·d_p, d_model] and the fixed head scales α_h (the ALiBi slopes)."""

    attribute = "grape_ap"

    @classmethod
    def build(cls, d_model, n_heads, d_head, config) -> GrapeAP:
        _causal_only(config)
        return cls(d_model, n_heads, config.grape_ap_dim)

    def __init__(self, d_model: int, n_heads: int, d_probe: int = 8):
        super().__init__()
        if d_probe < 2 or d_probe % 2:
            raise ValueError(f"grape_ap_dim: {d_probe} must be even and >= 2 (R_ℓ turns pairs)")
        self.n_heads = n_heads
        # a bare parameter, not a Linear: the LM's init of every Linear (N(0, 0.02)) leaves it at
        # the authors' N(0, 0.5/√d_model)
        self.probe_weight = nn.Parameter(
            torch.randn(n_heads * d_probe, d_model) * (0.5 / math.sqrt(d_model))
        )
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> GrapeAPTerm:
        """The term on the probes p [B, H, K, d_p] (at least fp32) of the keys' layer inputs."""
        probes = F.linear(keys_input, self.probe_weight)  # (B, K, H·d_p)
        b, n_keys, _ = probes.shape
        probes = probes.view(b, n_keys, self.n_heads, -1).transpose(1, 2)  # (B, H, K, d_p)
        return GrapeAPTerm((probes.to(torch.promote_types(probes.dtype, torch.float32)),), self)


def turn(x: Tensor, angles: Tensor) -> Tensor:
    """R_ℓ x: every rotate-half pair (x_k, x_{k+d/2}) of x [..., K, d] turned by -angles [K] (or
    [B, 1, K]: per row) (the authors' apply_rotary_emb with base 1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = angles.cos()[..., None], angles.sin()[..., None]  # (..., K, 1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class GrapeAPTerm(ScoreTerm):
    """B(t, j) = Σ_{ℓ=j+1..t} e(t, ℓ) of a block (module docstring). tensors: (p [B, H, K, d_p],).

    A block whose keys stop before its queries (a backward tile) still sums each query's path to
    the query: its edges are built over keys k0 .. the block's last query."""

    name = "grape_ap"
    forms = frozenset()

    def __init__(self, tensors: tuple[Tensor], scheme: GrapeAP):
        self.tensors, self.scheme = tensors, scheme

    def with_tensors(self, tensors: tuple[Tensor, ...]) -> GrapeAPTerm:
        return GrapeAPTerm(tensors, self.scheme)

    def edges(self, call, block) -> Tensor:
        """e(t, ℓ) for the block's queries t and keys ℓ = k0 .. its last query: [B, H, L_b, K_row],
        0 at padded keys."""
        (probes,) = self.tensors
        n_mem, d_probe = call.n_mem, probes.shape[-1]
        keys = slice(block.k0, max(block.n_keys, n_mem + block.i1))
        unit = F.rms_norm(probes[:, :, keys], (d_probe,))  # p̂_ℓ
        # R_ℓ p̂_ℓ at the key's position (in its document, packed: [B, 1, K_row])
        at = (
            call.key_positions[keys]
            if call.document_ids is None
            else document_positions(call.document_ids)[:, None, keys]
        )
        turned = turn(unit, at.to(probes.dtype))
        query = probes[:, :, n_mem + block.i0 : n_mem + block.i1]  # raw p_t, as the authors
        overlap = query @ turned.transpose(-1, -2) / d_probe  # (B, H, L_b, K_row)
        edges = F.logsigmoid(overlap) * self.scheme.slopes.to(probes.dtype)[:, None, None]
        if call.key_padding_mask is not None:
            edges = edges.masked_fill(call.key_padding_mask[:, None, None, keys], 0.0)
        return edges

    def block(self, call, block, q=None, k=None) -> Tensor:
        edges = self.edges(call, block)
        device = edges.device
        queries = torch.arange(call.n_mem + block.i0, call.n_mem + block.i1, device=device)
        keys = torch.arange(block.k0, block.k0 + edges.shape[-1], device=device)
        return path_sum(edges, queries, keys)[..., : block.width]


GrapeA.Term = GrapeATerm
GrapeAP.Term = GrapeAPTerm
