"""Rotary position embedding (RoPE, Su et al. 2021) and its variants: partial rotary, p-RoPE, xPos,
and the evaluation-time context extensions (position interpolation, NTK-aware base, YaRN, Llama 3,
dynamic NTK, LongRoPE).

Formulas, defaults and papers: docs/schemes/baselines.md#rope and the sections after it. Pairs are
(p, p + d_rot/2) of the first d_rot dimensions (rotate-half pairing); angles and scales are computed
in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from relpos_ablate.config.evaluation import ROPE_SCALINGS, check_rope_extension
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
LENGTH_AWARE = ("dynamic", "longrope")  # their frequencies read the call's length n


@dataclass(frozen=True)
class RopeScaling:
    """RoPE extended to a context s times the training one, at evaluation: `kind` pi | ntk | yarn |
    llama3 | dynamic | longrope, `factor` s >= 1, `original_length` L the training context (the
    ramps, dynamic's growth, longrope's choice and factor read it), and the fields only some kinds
    read (eval.settings[i].rope_*; checked as there, by config.evaluation.check_rope_extension). A
    pure function of these and, for dynamic and longrope, of the call's length n (the largest key
    position + 1, `rotate_queries_keys`): nothing is carried from one call to the next."""

    kind: str
    factor: float
    original_length: int
    long_factor: tuple[float, ...] | None = None
    """longrope: θ_p / long_factor[p] when n > L (Phi-3's long_factor; d_rot/2 values)."""
    short_factor: tuple[float, ...] | None = None
    """longrope: θ_p / short_factor[p] when n <= L."""
    mscale: float | None = None
    """yarn with mscale_all_dim (DeepSeek's): the factor m(s, mscale)/m(s, mscale_all_dim)."""
    mscale_all_dim: float | None = None
    """yarn: the divisor's c of `mscale`; both or neither."""
    truncate: bool = True
    """yarn: the ramp's end pairs rounded outwards (True, YaRN's code) or kept as real numbers."""

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(
                f"rope_scaling: {self.kind!r} is not allowed; choose one of "
                + ", ".join(ROPE_SCALINGS)
            )
        if self.factor < 1.0:
            raise ValueError(f"rope_scale: {self.factor} is out of range; allowed [1, inf]")
        check_rope_extension(
            self.kind,
            self.long_factor,
            self.short_factor,
            self.mscale,
            self.mscale_all_dim,
            self.truncate,
        )
        if self.kind == "longrope" and self.original_length < 2:
            raise ValueError(
                f"rope_scaling: longrope's factor √(1 + ln s/ln L) needs a training context L >= "
                f"2, not {self.original_length}"
            )

    @property
    def attention_factor(self) -> float:
        """What the rotated dimensions of q and of k are multiplied by (their product, by its
        square; Hugging Face multiplies cos and sin alike): YaRN's √(1/t) = m(s, 1) = 0.1 ln s + 1,
        or m(s, mscale)/m(s, mscale_all_dim) with both given; LongRoPE's √(1 + ln s/ln L); 1 for
        the others."""
        s = self.factor
        if self.kind == "yarn" and self.mscale is not None:
            return yarn_mscale(s, self.mscale) / yarn_mscale(s, self.mscale_all_dim)
        if self.kind == "yarn":
            return yarn_mscale(s)
        if self.kind == "longrope":
            return math.sqrt(1 + math.log(s) / math.log(self.original_length))
        return 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's m(s, c) = 0.1·c·ln s + 1, 1 for s <= 1 (Hugging Face's `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_ramp(
    d_rot: int, base: float, original_length: int, device=None, truncate: bool = True
) -> Tensor:
    """YaRN's γ_p per rotary pair, 1: θ_p kept, 0: θ_p/s, as the authors' code (jquesnelle/yarn) and
    Hugging Face compute it: linear in the pair index p from the pair that turns β times within L to
    the one that turns α times (pair p(r) = d_rot·ln(L/(2πr))/(2 ln base) turns r times; the ends
    rounded outwards unless not `truncate`, then clipped to [0, d_rot - 1]). The paper's Eq. 18 is
    linear in the turns instead (docs/schemes/index.md). [d_rot/2]."""

    def turning(turns: float) -> float:
        return d_rot * math.log(original_length / (2 * math.pi * turns)) / (2 * math.log(base))

    low, high = turning(YARN_BETA), turning(YARN_ALPHA)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_rot - 1)
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


def ntk_base(d_rot: int, base: float, scaling: RopeScaling, length: int | None = None) -> float:
    """The base ntk and dynamic rotate with: base·g^(d_rot/(d_rot - 2)), g = s (ntk) or, for
    dynamic, g = s·n/L - (s - 1) with n = max(length, L) (g = 1 at n <= L: the trained base)."""
    s, trained = scaling.factor, scaling.original_length
    if d_rot <= 2:
        raise ValueError(
            f"rope_scaling: {scaling.kind} rescales the base by g^(d/(d-2)); it needs at least 2 "
            "rotary pairs"
        )
    if scaling.kind == "ntk":
        return base * s ** (d_rot / (d_rot - 2))
    n = trained if length is None else max(length, trained)
    return base * (s * n / trained - (s - 1)) ** (d_rot / (d_rot - 2))


def longrope_factors(
    d_rot: int, scaling: RopeScaling, length: int | None = None, device=None
) -> Tensor:
    """LongRoPE's λ_p, what θ_p is divided by: long_factor when n > L, else short_factor (n None:
    short). Both lists are checked to hold one value per rotary pair. [d_rot/2] float64."""
    for name, factors in (
        ("rope_long_factor", scaling.long_factor),
        ("rope_short_factor", scaling.short_factor),
    ):
        if len(factors) != d_rot // 2:
            raise ValueError(
                f"{name}: {len(factors)} values given; this RoPE has d_rot/2 = {d_rot // 2} "
                "rotary pairs, one factor each"
            )
    long = length is not None and length > scaling.original_length
    chosen = scaling.long_factor if long else scaling.short_factor
    return torch.tensor(chosen, dtype=torch.float64, device=device)


def rope_frequencies(
    d_rot: int,
    base: float,
    scaling: RopeScaling | None = None,
    device=None,
    rotating: int | None = None,
    length: int | None = None,
) -> Tensor:
    """θ_p = base^(-2p/d_rot), p = 0 .. d_rot/2 - 1, as `scaling` changes them: [d_rot/2] float64.

    pi: θ_p / s. ntk: the base becomes base·s^(d_rot/(d_rot - 2)); dynamic: base·(s·n/L - (s -
    1))^(d_rot/(d_rot - 2)) (`ntk_base`). yarn: γ_p·θ_p + (1 - γ_p)·θ_p/s with γ the ramp of
    `yarn_ramp`. llama3: the same blend with Llama 3's ramp (`llama3_ramp`). longrope: θ_p / λ_p
    (`longrope_factors`). length: the call's length n that dynamic and longrope read (None: L, the
    training context: dynamic's base unchanged, longrope's short factors). rotating (p-RoPE): only
    the first `rotating` pairs, the highest frequencies, keep theirs; the others get θ_p = 0 (not
    rotated; scaling leaves 0 at 0). None or d_rot/2: every pair turns."""
    theta = _scaled_frequencies(d_rot, base, scaling, device, length)
    if rotating is not None:
        theta[rotating:] = 0.0
    return theta


def _scaled_frequencies(
    d_rot: int, base: float, scaling: RopeScaling | None, device, length: int | None
) -> Tensor:
    if scaling is None:
        return inverse_frequencies(d_rot, base, device)
    if scaling.kind in ("ntk", "dynamic"):
        return inverse_frequencies(d_rot, ntk_base(d_rot, base, scaling, length), device)
    theta = inverse_frequencies(d_rot, base, device)
    if scaling.kind == "pi":
        return theta / scaling.factor
    if scaling.kind == "longrope":
        return theta / longrope_factors(d_rot, scaling, length, device)
    if scaling.kind == "llama3":
        ramp = llama3_ramp(theta, scaling.original_length)
    else:
        ramp = yarn_ramp(d_rot, base, scaling.original_length, device, scaling.truncate)
    return ramp * theta + (1 - ramp) * theta / scaling.factor


def call_length(key_positions: Tensor, scaling: RopeScaling | None) -> int | None:
    """n of one attention call, for the kinds that read it (dynamic, longrope): the largest key
    position + 1, as Hugging Face's max(position_ids) + 1 (it waits for the device); None for the
    others."""
    if scaling is None or scaling.kind not in LENGTH_AWARE:
        return None
    return int(key_positions.amax()) + 1


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
    length: int | None = None,
) -> Tensor:
    """x [..., n, d] with its first d_rot dimensions rotated by angle position·θ_p per pair (p, p +
    d_rot/2) (positions [n], or [B, 1, n]: per row, packed documents) and multiplied by the
    scaling's attention factor (YaRN's, LongRoPE's; as Hugging Face's partial rotary, the others are
    left as they are). xPos also scales pair p by ζ_p^(sign·(position - centre)/B): sign +1 for
    queries, -1 for keys, one centre for both (it cancels in their product and keeps the scales in
    range). rotating: p-RoPE's rotating pairs (rope_frequencies). length: the call's length n of
    dynamic and longrope, the same for q and k (None: these positions' `call_length`)."""
    if length is None:
        length = call_length(positions, scaling)
    pos = positions.to(torch.float64)[..., None]  # (n, 1), or per row (B, 1, n, 1)
    theta = rope_frequencies(d_rot, base, scaling, x.device, rotating, length)
    angles = pos * theta  # (n, d_rot/2) or (B, 1, n, d_rot/2)
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
    key_positions [K]; xPos centred once for both (the middle of the keys' positions); dynamic's and
    longrope's length n read once, from the keys, for both (q·k stays a function of i - j);
    rotating: p-RoPE's pairs."""
    centre = (key_positions.amin() + key_positions.amax()).double() / 2
    length = call_length(key_positions, scaling)
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
        length=length,
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
        length=length,
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
