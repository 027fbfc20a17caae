"""Rotary position embedding (RoPE, Su et al. 2021) and its variants: partial rotary, p-RoPE, xPos,
and the evaluation-time context extensions (position interpolation, NTK-aware base, YaRN).

Formulas, defaults and papers: docs/schemes/baselines.md#rope and the sections after it. Pairs are
(p, p + d_rot/2) of the first d_rot dimensions (rotate-half pairing); angles and scales are computed
in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from relpos_ablate.config.scheme_checks import rotary_width, rotating_pairs
from relpos_ablate.model.core.parts import Part, Where
from relpos_ablate.model.schemes.sinusoid import inverse_frequencies

XPOS_GAMMA = 0.4  # ζ_p = (2p/d + γ)/(1 + γ) (Sun et al. 2022, the authors' code)
# YaRN's ramp ends: pairs turning > β times within L keep θ, < α get θ/s
YARN_ALPHA, YARN_BETA = (1.0, 32.0)
# Llama 3's ramp ends (Llama 3.1's rope_scaling low_freq_factor, high_freq_factor): pairs whose
# wavelength exceeds L/low get θ/s, below L/high keep θ, in between a blend linear in L/wavelength
# (Hugging Face, rope_type llama3)
LLAMA3_LOW, LLAMA3_HIGH = 1.0, 4.0
SCALINGS = ("pi", "ntk", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE extended to a context s times the training one, at evaluation: `kind` pi | ntk | yarn |
    llama3, `factor` s >= 1, `original_length` L the training context (YaRN's and Llama 3's ramps
    read it). A pure function of these three: nothing is carried from one call to the next."""

    kind: str
    factor: float
    original_length: int

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise ValueError(
                f"rope_scaling: {self.kind!r} is not allowed; choose one of {', '.join(SCALINGS)}"
            )
        if self.factor < 1.0:
            raise ValueError(f"rope_scale: {self.factor} is out of range; allowed [1, inf]")

    @property
    def attention_factor(self) -> float:
        """What the rotated dimensions of q and of k are multiplied by: YaRN's √(1/t) = 0.1 ln s + 1
        (their product, by its square); 1 for pi and ntk."""
        return 0.1 * math.log(self.factor) + 1.0 if self.kind == "yarn" else 1.0


def yarn_ramp(d_rot: int, base: float, original_length: int, device=None) -> Tensor:
    """YaRN's γ_p per rotary pair, 1: θ_p kept, 0: θ_p/s, as the authors' code (jquesnelle/yarn) and
    Hugging Face compute it: linear in the pair index p from the pair that turns β times within L to
    the one that turns α times (pair p(r) = d_rot·ln(L/(2πr))/(2 ln base) turns r times; the ends
    rounded outwards and clipped to [0, d_rot - 1]). The paper's Eq. 18 is linear in the turns
    instead (docs/schemes/index.md). [d_rot/2]."""

    def turning(turns: float) -> float:
        return d_rot * math.log(original_length / (2 * math.pi * turns)) / (2 * math.log(base))

    low, high = (
        max(math.floor(turning(YARN_BETA)), 0),
        min(math.ceil(turning(YARN_ALPHA)), d_rot - 1),
    )
    width = high - low if high != low else 0.001  # their code's guard: one pair is a step, not 0/0
    pairs = torch.arange(d_rot // 2, dtype=torch.float64, device=device)
    return 1 - ((pairs - low) / width).clamp(0.0, 1.0)


def llama3_ramp(theta: Tensor, original_length: int) -> Tensor:
    """Llama 3's γ per rotary pair (Hugging Face's `_compute_llama3_parameters`, rope_type llama3):
    with wavelength λ_p = 2π/θ_p and the training context L, γ = 1 (θ kept) where λ_p < L/high, 0
    (θ/s) where λ_p > L/low, else (L/λ_p - low)/(high - low): linear in the turns L/λ_p.
    [d_rot/2] float64."""
    turns = original_length * theta / (2 * math.pi)  # L/λ_p
    wavelength = 2 * math.pi / theta
    ramp = (turns - LLAMA3_LOW) / (LLAMA3_HIGH - LLAMA3_LOW)
    ramp = torch.where(wavelength > original_length / LLAMA3_LOW, torch.zeros_like(ramp), ramp)
    return torch.where(wavelength < original_length / LLAMA3_HIGH, torch.ones_like(ramp), ramp)


def rope_frequencies(
    d_rot: int,
    base: float,
    scaling: RopeScaling | None = None,
    device=None,
    rotating: int | None = None,
) -> Tensor:
    """θ_p = base^(-2p/d_rot), p = 0 .. d_rot/2 - 1, as `scaling` changes them: [d_rot/2] float64.

    pi: θ_p / s. ntk: the base becomes base·s^(d_rot/(d_rot - 2)). yarn: γ_p·θ_p + (1 - γ_p)·θ_p/s
    with γ the ramp of `yarn_ramp`. llama3: the same blend with Llama 3's ramp (`llama3_ramp`).
    rotating (p-RoPE): only the first `rotating` pairs, the highest frequencies, keep theirs; the
    others get θ_p = 0 (not rotated; scaling leaves 0 at 0). None or d_rot/2: every pair turns."""
    theta = _scaled_frequencies(d_rot, base, scaling, device)
    if rotating is not None:
        theta[rotating:] = 0.0
    return theta


def _scaled_frequencies(d_rot: int, base: float, scaling: RopeScaling | None, device) -> Tensor:
    if scaling is not None and scaling.kind == "ntk":
        if d_rot <= 2:
            raise ValueError(
                "rope_scaling: ntk rescales the base by s^(d/(d-2)); it needs at least 2 "
                "rotary pairs"
            )
        base = base * scaling.factor ** (d_rot / (d_rot - 2))
    theta = inverse_frequencies(d_rot, base, device)
    if scaling is None or scaling.kind == "ntk":
        return theta
    if scaling.kind == "pi":
        return theta / scaling.factor
    if scaling.kind == "llama3":
        ramp = llama3_ramp(theta, scaling.original_length)
        return ramp * theta + (1 - ramp) * theta / scaling.factor
    ramp = yarn_ramp(d_rot, base, scaling.original_length, device)
    return ramp * theta + (1 - ramp) * theta / scaling.factor


def xpos_decay(d_rot: int, device=None) -> Tensor:
    """ζ_p = (2p + γ·d_rot)/((1 + γ)·d_rot) for p = 0 .. d_rot/2 - 1: [d_rot/2] float64, in [0.29,
    1)."""
    p = torch.arange(0, d_rot, 2, dtype=torch.float64, device=device)  # 2p
    return (p + XPOS_GAMMA * d_rot) / ((1 + XPOS_GAMMA) * d_rot)


def rotate(
    x: Tensor,
    positions: Tensor,
    d_rot: int,
    base: float,
    *,
    scaling: RopeScaling | None = None,
    xpos_scale_base: float | None = None,
    xpos_sign: float = 1.0,
    xpos_centre: Tensor | float = 0.0,
    rotating: int | None = None,
) -> Tensor:
    """x [..., n, d] with its first d_rot dimensions rotated by angle position·θ_p per pair (p, p +
    d_rot/2) and multiplied by the scaling's attention factor (YaRN's; as Hugging Face's partial
    rotary, the others are left as they are). xPos also scales pair p by ζ_p^(sign·(position -
    centre)/B): sign +1 for queries, -1 for keys, one centre for both (it cancels in their product
    and keeps the scales in range). rotating: p-RoPE's rotating pairs (rope_frequencies)."""
    pos = positions.to(torch.float64)[:, None]  # (n, 1)
    angles = pos * rope_frequencies(d_rot, base, scaling, x.device, rotating)[None]  # (n, d_rot/2)
    factor = 1.0 if scaling is None else scaling.attention_factor
    cos, sin = angles.cos() * factor, angles.sin() * factor
    if xpos_scale_base is not None:
        scale = xpos_decay(d_rot, x.device)[None] ** (
            xpos_sign * (pos - xpos_centre) / xpos_scale_base
        )
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (n, d_rot/2): pair p is (p, p + d_rot/2)
    if torch.compiler.is_compiling():  # Inductor fuses the plain formula itself
        first, second, rest = x[..., : d_rot // 2], x[..., d_rot // 2 : d_rot], x[..., d_rot:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    return _Rotation.apply(x, cos, sin)


def _turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pair p of x's first 2·len(cos) dimensions, (x_p, x_p+h), turned to (x_p·c - x_p+h·s,
    x_p+h·c + x_p·s); the rest copied. Written into one new tensor: four passes over the rotated
    half-widths, where x·cos + cat(-second, first)·sin and its autograd made about twelve (RoPE at
    L = 1024 on CPU: ~10% of the layer's forward + backward)."""
    half = cos.shape[-1]
    out = torch.empty_like(x)
    first, second = x[..., :half], x[..., half : 2 * half]
    out_first, out_second = out[..., :half], out[..., half : 2 * half]
    torch.mul(first, cos, out=out_first).addcmul_(second, sin, value=-1.0)
    torch.mul(second, cos, out=out_second).addcmul_(first, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out


class _Rotation(torch.autograd.Function):
    """x turned pair by pair (`_turn`); its gradient is the transposed turn, the same with sin
    negated (the cos and sin of xPos and YaRN carry a common factor per pair, which transposing
    keeps), itself a _Rotation, so derivatives of any order exist. No gradient reaches the angles:
    positions and frequencies are not learned."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _turn(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        # itself a _Rotation: differentiable again
        return (_Rotation.apply(grad, cos, -sin), None, None)


def rotate_queries_keys(
    q: Tensor,
    k: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    d_rot: int,
    base: float,
    scaling: RopeScaling | None = None,
    xpos_scale_base: float | None = None,
    rotating: int | None = None,
) -> tuple[Tensor, Tensor]:
    """RoPE of one attention call: q [B, H, L, d] at query_positions [L], k [B, H, K, d] at
    key_positions [K]; xPos centred once for both (the middle of the keys' positions); rotating:
    p-RoPE's pairs."""
    centre = (key_positions.amin() + key_positions.amax()).double() / 2
    q = rotate(
        q,
        query_positions,
        d_rot,
        base,
        scaling=scaling,
        xpos_scale_base=xpos_scale_base,
        xpos_sign=1.0,
        xpos_centre=centre,
        rotating=rotating,
    )
    k = rotate(
        k,
        key_positions,
        d_rot,
        base,
        scaling=scaling,
        xpos_scale_base=xpos_scale_base,
        xpos_sign=-1.0,
        xpos_centre=centre,
        rotating=rotating,
    )
    return q, k


class Rotary(Part):
    """RoPE as a layer applies it (`absolute: rope`): q and k of the first round(rope_heads·H)
    heads rotated at the call's positions (rotate_queries_keys), the other heads left as they are
    (NoPE heads). Stage 1: QK-norm and other q/k transforms are placed before or after it."""

    attribute = "rotary"
    stage = 1.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        self.d_rot = rotary_width(config, d_head)
        self.base, self.xpos = config.rope_base, config.xpos_scale_base
        self.rotating = rotating_pairs(config, self.d_rot)
        self.heads = rotating_heads(config.rope_heads, n_heads)

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        h, place = self.heads, at.placement
        turned = rotate_queries_keys(
            q[:, :h],
            k[:, :h],
            place.query_positions,
            place.key_positions,
            self.d_rot,
            self.base,
            at.rope_scaling,
            self.xpos,
            self.rotating,
        )
        if h == q.shape[1]:
            return turned
        return torch.cat([turned[0], q[:, h:]], 1), torch.cat([turned[1], k[:, h:]], 1)


def rotating_heads(fraction: float, n_heads: int) -> int:
    """How many heads rotate: round(rope_heads·H), at least one."""
    return max(1, round(fraction * n_heads))
