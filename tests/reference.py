"""An obviously-right reference for RelPosAttention: every term materialised in float64.

Slow on purpose (seed-000 style: R is built for every (i, j) pair, [L, K, d_model]); it shares no
code with the module, only its parameters, and follows docs/schemes/index.md literally.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sinusoid_row(pos: float, dim: int) -> list[float]:
    """R_pos = [sin(pos·f_0) .. sin(pos·f_{D/2-1}), cos(pos·f_0) .. cos(pos·f_{D/2-1})], f_k =
    10000^(-2k/D)."""
    freqs = [1.0 / 10000 ** (k / dim) for k in range(0, dim, 2)]
    return [math.sin(pos * f) for f in freqs] + [math.cos(pos * f) for f in freqs]


def t5_bucket_hf(
    relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> int:
    """T5's bucket, written for relative_position = key - query, as HF T5 does
    (docs/schemes/distance-biases.md#t5)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative_position > 0:
            bucket += num_buckets
        n = abs(relative_position)
    else:
        n = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return bucket + min(large, num_buckets - 1)


def alibi_slopes_reference(n: int) -> list[float]:
    """Press et al.: 2^(-8h/n) for powers of two; else p = 2^floor(log2 n) slopes + every other of
    2p's."""
    if n & (n - 1) == 0:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    p = 1 << (n.bit_length() - 1)
    big = [2 ** (-8 * h / (2 * p)) for h in range(1, 2 * p + 1)]
    return [2 ** (-8 * h / p) for h in range(1, p + 1)] + big[0::2][: n - p]


def _xl_table(cfg, p, widths, i, j):
    k, d = cfg.max_distance, i - j
    row = min(max(d, 0), k) if cfg.causal else min(max(d, -k), k) + k
    return p["table"][row]


def _t5(cfg, p, widths, i, j):
    return p["table"][t5_bucket_hf(j - i, not cfg.causal, cfg.num_buckets, cfg.max_distance)]


def _alibi(cfg, p, widths, i, j):
    return -torch.tensor(alibi_slopes_reference(widths[0]), dtype=torch.float64) * abs(i - j)


def _alibi_learned(cfg, p, widths, i, j):
    return -p["log_slopes"].exp() * abs(i - j)


def _kerple_log(cfg, p, widths, i, j):
    a, pw = p["a"].clamp(min=0.01), p["p"].clamp(min=0.01)
    return -pw * torch.log(1 + a * abs(i - j))


def _kerple_power(cfg, p, widths, i, j):
    a, pw = p["a"].clamp(min=0.01), p["p"].clamp(min=0.01, max=2.0)
    return -a * abs(i - j) ** pw


def _fire(cfg, p, widths, i, j):
    c, threshold = p["c"].abs(), p["threshold"].abs()

    def psi(x):
        return (
            math.copysign(1.0, x) * torch.log(c * abs(x) + 1)
            if x != 0
            else torch.zeros((), dtype=torch.float64)
        )

    x = psi(i - j) / torch.log(
        c * torch.maximum(torch.tensor(float(i), dtype=torch.float64), threshold) + 1
    )
    hidden = torch.relu(p["mlp.0.weight"][:, 0] * x + p["mlp.0.bias"])
    return p["mlp.2.weight"] @ hidden + p["mlp.2.bias"]


def _dynamic(cfg, p, widths, i, j):
    d = i - j
    x = math.copysign(math.log(1 + abs(d)), d) if d else 0.0
    hidden = torch.nn.functional.silu(p["mlp.0.weight"][:, 0] * x + p["mlp.0.bias"])
    return p["mlp.2.weight"] @ hidden + p["mlp.2.bias"]


def _sandwich(cfg, p, widths, i, j):
    n_heads, d = widths
    # p_i·p_j
    inner = sum(math.cos(abs(i - j) * 10000 ** (-2 * k / d)) for k in range(1, d // 2 + 1))
    return torch.tensor(
        [(inner - d / 2) / (8 * h / n_heads) for h in range(1, n_heads + 1)], dtype=torch.float64
    )


#: B_h(i, j) of every built-in bias type, written from docs/schemes/distance-biases.md#bias-types (a
#: test demands one per built-in; a scheme of your own is checked against its formula in its own
#: test file). Arguments: the config, the scheme's parameters in float64, (n_heads, d_head), query
#: i, key j.
BIAS_FORMULAS = {
    "xl_table": _xl_table,
    "t5": _t5,
    "alibi": _alibi,
    "alibi_learned": _alibi_learned,
    "kerple_log": _kerple_log,
    "kerple_power": _kerple_power,
    "fire": _fire,
    "dynamic": _dynamic,
    "sandwich": _sandwich,
}


def bias_value(attn, i: int, j: int) -> Tensor:
    """B_h(i, j) for every head h [H] in float64, from the scheme's formula and the module's
    parameters."""
    p = {name: t.detach().double() for name, t in attn.bias_scheme.named_parameters()}
    return BIAS_FORMULAS[attn.config.bias](attn.config, p, (attn.n_heads, attn.d_head), i, j)


def relative_vector(attn, d: int, clamp_len: int | None) -> Tensor:
    """R_d in float64: the sinusoid of the clamped distance, or the learned table's clamped row."""
    cfg = attn.config
    c = clamp_len if clamp_len is not None else cfg.clamp_len
    if cfg.rel == "learned":
        dc = min(max(d, 0), c) if cfg.causal else min(max(d, -c), c) + cfg.clamp_len
        return attn.r_table.detach().double()[dc]
    if c is not None:
        d = min(max(d, -c), c)
    return torch.tensor(sinusoid_row(d, attn.d_model), dtype=torch.float64)


def rope_rate(k: int, d_rot: int, base: float, scaling=None, p: float = 1.0) -> float:
    """θ_k of rotary pair k (docs/schemes/baselines.md#rope), as a context extension changes it
    (#rope-context-extension; scaling: anything with kind, factor, original_length). p-RoPE
    (#p-rope): pairs k >= int(p·d_rot/2), the lowest frequencies, do not turn."""
    if k >= int(p * d_rot // 2):
        return 0.0
    theta = base ** (-2 * k / d_rot)
    if scaling is None:
        return theta
    s = scaling.factor
    # Llama 3.1: wavelength 2π/θ against L/1 (θ/s above) and L/4 (θ below)
    if scaling.kind == "llama3":
        wavelength, length = 2 * math.pi / theta, scaling.original_length
        if wavelength < length / 4:
            return theta
        if wavelength > length / 1:
            return theta / s
        smooth = (length / wavelength - 1) / (4 - 1)
        return (1 - smooth) * theta / s + smooth * theta
    if scaling.kind == "pi":
        return theta / s
    if scaling.kind == "ntk":
        return (base * s ** (d_rot / (d_rot - 2))) ** (-2 * k / d_rot)

    # yarn, as its authors' code: pairs up to the one that turns 32 times within L keep θ, from the
    # one that turns once they get θ/s, linear in the pair index between (the ends rounded outwards,
    # kept in range)
    def pair_turning(turns):
        return (
            d_rot * math.log(scaling.original_length / (2 * math.pi * turns)) / (2 * math.log(base))
        )

    first, last = max(math.floor(pair_turning(32)), 0), min(math.ceil(pair_turning(1)), d_rot - 1)
    interpolated = min(max((k - first) / ((last - first) or 0.001), 0.0), 1.0)
    return (1 - interpolated) * theta + interpolated * theta / s


def rope_reference(
    x: Tensor,
    pos: float,
    base: float,
    d_rot: int | None = None,
    scaling=None,
    xpos_base: float | None = None,
    sign: int = 1,
    p: float = 1.0,
) -> Tensor:
    """Rotate pairs (k, k + d_rot/2) of the first d_rot dims of x [..., d] by angle pos·θ_k, one 2x2
    rotation at a time; YaRN multiplies the rotated dims by 0.1 ln s + 1; xPos scales pair k by
    ζ_k^(sign·pos/B), ζ_k = (2k + 0.4·d_rot)/(1.4·d_rot) (no centring: it cancels in q·k)."""
    d_rot = x.shape[-1] if d_rot is None else d_rot
    half = d_rot // 2
    out = x.clone()
    temperature = (
        0.1 * math.log(scaling.factor) + 1
        if scaling is not None and scaling.kind == "yarn"
        else 1.0
    )
    for k in range(half):
        angle = pos * rope_rate(k, d_rot, base, scaling, p)
        c, s = math.cos(angle), math.sin(angle)
        scale = (
            temperature
            if xpos_base is None
            else temperature * ((2 * k + 0.4 * d_rot) / (1.4 * d_rot)) ** (sign * pos / xpos_base)
        )
        out[..., k] = (x[..., k] * c - x[..., k + half] * s) * scale
        out[..., k + half] = (x[..., k] * s + x[..., k + half] * c) * scale
    return out


def fox_decay(attn, cat: Tensor, padding: Tensor | None, n_mem: int) -> Tensor:
    """FoX's D_ij = Σ_{l=j+1..i'} log σ(w·x_l + b) literally, padded keys' gates counted as 1: [B,
    H, L, K]."""
    gate = attn.forget_gate.proj
    logits = cat @ gate.weight.detach().double().T + gate.bias.detach().double()  # (B, K, H)
    log_f = torch.nn.functional.logsigmoid(logits)
    if padding is not None:
        log_f = log_f.masked_fill(padding[..., None], 0.0)
    b, n_keys, h = log_f.shape
    out = torch.zeros(b, h, n_keys - n_mem, n_keys, dtype=torch.float64)
    for i in range(n_keys - n_mem):
        for j in range(n_keys):
            for t in range(j + 1, n_mem + i + 1):
                out[:, :, i, j] += log_f[:, t]
    return out


def cope_scores(attn, q_content: Tensor, k: Tensor, visible: Tensor, s: float) -> Tensor:
    """CoPE (docs/schemes/data-dependent.md#cope) pair by pair: p_ij = Σ_{t >= j, t seen}
    σ(s·q_i·k_t) clamped to p_max - 1, s·q_i·e[p] with e interpolated between ⌊p⌋ and ⌈p⌉. q_content
    [B, H, L, dh], k [B, K, H, dh], visible [B, 1, L, K] -> [B, H, L, K]."""
    table = attn.contextual.embeddings.detach().double()
    top = table.shape[0] - 1
    b, h, lq, _ = q_content.shape
    out = torch.zeros(b, h, lq, k.shape[1], dtype=torch.float64)
    gates = torch.sigmoid(s * torch.einsum("bhid,bjhd->bhij", q_content, k)) * visible
    for i in range(lq):
        for j in range(k.shape[1]):
            p = gates[:, :, i, j:].sum(-1).clamp(max=top)  # (B, H)
            low, w = p.floor(), p - p.floor()
            # (B, H, dh)
            e = (1 - w)[..., None] * table[low.long()] + w[..., None] * table[p.ceil().long()]
            out[:, :, i, j] = s * (q_content[:, :, i] * e).sum(-1)
    return out


def path_logits_reference(
    attn, q: Tensor, k: Tensor, cat: Tensor, padding: Tensor | None, n_mem: int
) -> Tensor:
    """PaTH (docs/schemes/score-readers.md#path) pair by pair: q_i·(H_i' ··· H_(j+1)) k_j with every
    H_t = I - β_t w_t w_tᵀ a dense d×d matrix and the product multiplied out. w_t: the l2-normalised
    SiLU of a causal depthwise conv (kernel 3) of W_up W_down x_t; β_t = 2σ(W_β x_t + b), 0 at
    padded keys. q [B, L, H, dh], k [B, K, H, dh], cat [B, K, d_model] -> [B, H, L, K] (entries j >
    i' left 0)."""
    p = {name: t.detach().double() for name, t in attn.path.named_parameters()}
    b, n_keys, _ = cat.shape
    h, dh = attn.n_heads, attn.d_head
    raw = cat @ p["w_down.weight"].T @ p["w_up.weight"].T  # (B, K, H·dh)
    conv = p["w_conv.weight"][:, 0]  # (H·dh, 3): tap m reads token t - 2 + m
    w = torch.zeros_like(raw)
    for t in range(n_keys):
        for m in range(3):
            if t - 2 + m >= 0:
                w[:, t] += conv[:, m] * raw[:, t - 2 + m]
    w = torch.nn.functional.silu(w).view(b, n_keys, h, dh)
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.sigmoid(cat @ p["beta.weight"].T + p["beta.bias"])  # (B, K, H)
    if padding is not None:
        beta = beta.masked_fill(padding[..., None], 0.0)
    eye = torch.eye(dh, dtype=torch.float64)
    out = torch.zeros(b, h, q.shape[1], n_keys, dtype=torch.float64)
    for bb in range(b):
        for hh in range(h):
            for i in range(q.shape[1]):
                for j in range(n_mem + i + 1):
                    product = eye.clone()
                    for t in range(j + 1, n_mem + i + 1):  # H_t applied after the earlier ones
                        wt = w[bb, t, hh]
                        product = (eye - beta[bb, t, hh] * torch.outer(wt, wt)) @ product
                    out[bb, hh, i, j] = q[bb, i, hh] @ product @ k[bb, j, hh]
    return out


def dape_reference(attn, other: Tensor, bias: Tensor, visible: Tensor) -> Tensor:
    """DAPE (docs/schemes/score-readers.md#dape) entry by entry: X + B + f([X; B]); v1: the MLP 2H
    -> width -> H (LeakyReLU 0.01) of each pair's 2H numbers; v2: two 1×k convolutions along the
    keys written as sums over taps, inputs 0 where a query sees no key and beyond the map's ends.
    other, bias [B, H, L, K]; visible [B, 1, L, K]."""
    p = {name: t.detach().double() for name, t in attn.dape.named_parameters()}
    leaky = torch.nn.functional.leaky_relu
    features = torch.cat([other, bias], dim=1)  # (B, 2H, L, K)
    b, _, lq, n_keys = features.shape
    if attn.config.dape == "v1":
        adjust = torch.zeros_like(other)
        for i in range(lq):
            for j in range(n_keys):
                f = features[:, :, i, j]  # (B, 2H)
                adjust[:, :, i, j] = (
                    leaky(f @ p["net.0.weight"].T + p["net.0.bias"], 0.01) @ p["net.2.weight"].T
                    + p["net.2.bias"]
                )
        return other + bias + adjust

    # x (B, C, L, K), weight (C_out, C, 1, k)
    def conv(x: Tensor, weight: Tensor, b_: Tensor) -> Tensor:
        taps = weight.shape[-1]
        y = b_[None, :, None, None].expand(x.shape[0], -1, lq, n_keys).clone()
        for j in range(n_keys):
            for m in range(taps):
                src = j + m - taps // 2
                if 0 <= src < n_keys:
                    y[:, :, :, j] += torch.einsum(
                        "oc,bcl->bol", weight[:, :, 0, m], x[:, :, :, src]
                    )
        return y

    hidden = leaky(conv(features * visible, p["net.0.weight"], p["net.0.bias"]), 0.01)
    return other + bias + conv(hidden, p["net.2.weight"], p["net.2.bias"])


def stick_breaking_reference(scores: Tensor, visible: Tensor, n_mem: int) -> Tensor:
    """Stick-breaking (docs/schemes/score-readers.md#stick-breaking) as a literal product: A_ij =
    σ(z_ij)·∏(1 - σ(z_ik)) over the visible keys k with j < k < i'; the remainder 1 - Σ_j A_ij on
    the query's own key i' when it is visible. scores [B, H, L, K], visible [B, 1, L, K] -> weights
    [B, H, L, K]."""
    b, h, lq, n_keys = scores.shape
    beta = torch.sigmoid(scores)
    out = torch.zeros_like(scores)
    for i in range(lq):
        own = n_mem + i
        for j in range(n_keys):
            if j == own:
                continue
            rest = torch.ones(b, h, dtype=torch.float64)
            for k_ in range(j + 1, n_keys):
                if k_ != own:
                    rest = rest * torch.where(
                        visible[:, :, i, k_], 1 - beta[:, :, i, k_], torch.ones_like(rest)
                    )
            out[:, :, i, j] = torch.where(
                visible[:, :, i, j], beta[:, :, i, j] * rest, torch.zeros_like(rest)
            )
        out[:, :, i, own] = torch.where(
            visible[:, :, i, own], 1 - out[:, :, i].sum(-1), torch.zeros(b, h, dtype=torch.float64)
        )
    return out


def reference_mask(
    n_queries: int, n_mem: int, causal: bool, window: int | None = None, chunk: int | None = None
) -> Tensor:
    """Bool [L, M + L], True where query i (at key position i' = M + i) may see key j: causal
    attention sees j <= i'; a window W keeps the W most recent of those, i' - W < j (itself
    included); chunks of C (counted from the segment's first token, memory before them) keep the
    keys of the query's own chunk, floor(i / C) = floor((j - M) / C) with j >= M."""
    visible = torch.ones(n_queries, n_mem + n_queries, dtype=torch.bool)
    for i in range(n_queries):
        for j in range(n_mem + n_queries):
            distance = n_mem + i - j
            if causal and (distance < 0 or (window is not None and distance >= window)):
                visible[i, j] = False
            if chunk is not None and (j < n_mem or i // chunk != (j - n_mem) // chunk):
                visible[i, j] = False
    return visible


def reference_attention(
    attn,
    x,
    mems=None,
    *,
    padding=None,
    window=None,
    clamp_len=None,
    positions=None,
    rope_scaling=None,
    distances=None,
):
    """(out [B, L, d_model], probs [B, H, L, M+L]) in float64 by the formulas of
    docs/schemes/index.md.

    positions [M + L]: where the keys sit (queries: the last L), as every encoding reads them; the
    mask stays by index. Default 0 .. M + L - 1. distances [M + L]: d_r for offsets r >= 0; the
    bias, terms b/d and Shaw's values then read sign(i' - j)·d_|i' - j| instead of a difference of
    positions (RoPE still reads the positions). window: the call's (the config's applies too, the
    narrower wins). rope_scaling: kind, factor, original_length of a RoPE context extension. With
    sinks, probs are those of the stream's keys (rows sum to 1 minus the sinks' share)."""
    cfg = attn.config
    terms = cfg.terms
    h, dh = attn.n_heads, attn.d_head
    x = x.double()
    cat = x if mems is None else torch.cat([mems.double(), x], dim=1)
    b, lq, _ = x.shape
    n_keys = cat.shape[1]
    n_mem = n_keys - lq
    pos = list(range(n_keys)) if positions is None else [int(p) for p in positions]

    # what the relative encodings read for query i (index n_mem + i), key j
    def dist(i: int, j: int) -> int:
        if distances is None:
            return pos[n_mem + i] - pos[j]
        r = n_mem + i - j
        return int(distances[abs(r)]) * (1 if r >= 0 else -1)

    # q and k are 0 where the module builds no projection for them (no enabled term reads them)
    q = torch.zeros(b, lq, h, dh, dtype=torch.float64)
    if attn.q_net is not None:
        q = (x @ attn.q_net.weight.detach().double().T).view(b, lq, h, dh)
    *wk, wv = attn.kv_net.weight.detach().double().split(h * dh)  # [W_k;] W_v
    k = (
        (cat @ wk[0].T).view(b, n_keys, h, dh)
        if wk
        else torch.zeros(b, n_keys, h, dh, dtype=torch.float64)
    )
    v = (cat @ wv.T).view(b, n_keys, h, dh)
    if cfg.absolute == "rope":
        d_rot = int(cfg.rope_fraction * dh) // 2 * 2
        turn = dict(d_rot=d_rot, scaling=rope_scaling, xpos_base=cfg.xpos_scale_base, p=cfg.rope_p)
        q = torch.stack(
            [
                rope_reference(q[:, i], pos[n_mem + i], cfg.rope_base, sign=1, **turn)
                for i in range(lq)
            ],
            1,
        )
        k = torch.stack(
            [
                rope_reference(k[:, j], pos[j], cfg.rope_base, sign=-1, **turn)
                for j in range(n_keys)
            ],
            1,
        )
    # Llama 4: q times 1 + a·log(floor((p + 1)/f) + 1) at the query's position p
    if cfg.temperature_tuning:
        tuned = [
            1
            + cfg.temperature_scale
            * math.log(math.floor((pos[n_mem + i] + 1) / cfg.temperature_floor_scale) + 1)
            for i in range(lq)
        ]
        q = q * torch.tensor(tuned, dtype=torch.float64)[None, :, None, None]
    s = dh**-0.5 if cfg.score_scale in ("sqrt_d", "log_n", "ssmax") else 1.0
    s_bias = s if cfg.bias_scaled else 1.0
    scores = torch.zeros(b, h, lq, n_keys, dtype=torch.float64)
    if "a" in terms and cfg.path:
        scores += path_logits_reference(attn, q, k, cat, padding, n_mem)
    elif "a" in terms:
        scores += torch.einsum("bihd,bjhd->bhij", q, k)
    if "c" in terms:
        u = attn.content_bias_u.detach().double()
        scores += torch.einsum("hd,bjhd->bhj", u, k)[:, :, None, :]
    if cfg.uses_r:
        wr = attn.r_net.weight.detach().double()
        # (L, K, d_model): materialised on purpose
        r_pairs = torch.stack(
            [
                torch.stack([relative_vector(attn, dist(i, j), clamp_len) for j in range(n_keys)])
                for i in range(lq)
            ]
        )
        wr_r = (r_pairs @ wr.T).view(lq, n_keys, h, dh)
        if "b" in terms:
            scores += torch.einsum("bihd,ijhd->bhij", q, wr_r)
        if "d" in terms:
            vv = attn.position_bias_v.detach().double()
            scores += torch.einsum("hd,ijhd->hij", vv, wr_r)[None]
    scores = scores * s
    bias_part = torch.zeros(1, h, lq, n_keys, dtype=torch.float64)  # s_B·B, kept apart for DAPE
    if attn.bias_scheme is not None:
        # (H, L, K)
        bias = torch.stack(
            [
                torch.stack(
                    [
                        bias_value(
                            attn,
                            *((pos[n_mem + i], pos[j]) if distances is None else (dist(i, j), 0)),
                        )
                        for j in range(n_keys)
                    ],
                    dim=-1,
                )
                for i in range(lq)
            ],
            dim=1,
        )
        bias_part = s_bias * bias[None]
        scores = scores + bias_part
    if cfg.forget_gate:
        scores = scores + fox_decay(attn, cat, padding, n_mem)
    windows = [w for w in (window, cfg.window) if w is not None]
    visible = reference_mask(lq, n_mem, cfg.causal, min(windows) if windows else None, cfg.chunk)
    visible = visible[None, None].expand(b, 1, lq, n_keys)
    if padding is not None:
        visible = visible & ~padding[:, None, None, :]
    temperature = torch.ones(b, h, lq, 1, dtype=torch.float64)  # λ: log_n and the learned τ_h
    if cfg.score_scale in ("log_n", "ssmax"):
        # keys each query sees, sinks included
        seen = visible.sum(-1, keepdim=True).double() + cfg.sinks
        if cfg.score_scale == "log_n":  # log_{L_train}(n)
            temperature = temperature * seen.clamp(min=1).log() / math.log(cfg.log_n_length)
        else:  # SSMax: s_h·log(n), s_h learned per head
            s_h = attn.temperature.ssmax_scale.detach().double()[None, :, None, None]
            temperature = temperature * s_h * seen.clamp(min=1).log()
    if cfg.learned_temperature:
        temperature = (
            temperature * attn.temperature.log_tau.detach().double().exp()[None, :, None, None]
        )
    scores = scores * temperature
    q_content = q.transpose(1, 2) + (
        attn.content_bias_u.detach().double()[None, :, None] if "c" in terms else 0
    )
    q_content = q_content * temperature  # (B, H, L, dh): the content query as the kernels scale it
    if cfg.cope_positions:
        scores = scores + cope_scores(attn, q_content, k, visible, s)
    # X: every term but the bias, as they enter the sum (temperature included)
    if cfg.dape != "none":
        bias_part = bias_part * temperature
        scores = dape_reference(attn, scores - bias_part, bias_part.expand_as(scores), visible)
    if cfg.sinks:  # the slots first: logits s·q̃·k_s, visible to every query
        sink_keys, sink_values = (
            attn.sinks.keys.detach().double(),
            attn.sinks.values.detach().double(),
        )
        scores = torch.cat(
            [s * torch.einsum("bhid,hsd->bhis", q_content, sink_keys), scores], dim=-1
        )
        visible = torch.cat([torch.ones(b, 1, lq, cfg.sinks, dtype=torch.bool), visible], dim=-1)
    if cfg.normaliser == "stick_breaking":
        probs = stick_breaking_reference(scores, visible, n_mem)
    else:
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    # a query that sees no key (all padded) attends to nothing: 0, not NaN
    probs = probs.nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs[..., cfg.sinks :], v)
    if cfg.sinks:
        out = out + torch.einsum("bhis,hsd->bihd", probs[..., : cfg.sinks], sink_values)
    probs = probs[..., cfg.sinks :]
    if cfg.shaw_values:
        table = attn.value_table.detach().double()
        # the same clipped distance as the keys'
        c = clamp_len if clamp_len is not None else cfg.clamp_len
        for i in range(lq):
            for j in range(n_keys):
                d = dist(i, j)
                row = min(max(d, 0), c) if cfg.causal else min(max(d, -c), c) + cfg.clamp_len
                out[:, i] += probs[:, :, i, j, None] * table[row]
    out = out.reshape(b, lq, h * dh) @ attn.out_net.weight.detach().double().T
    return out, probs
