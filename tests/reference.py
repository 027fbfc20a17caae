"""An obviously-right reference for RelPosAttention: every term materialised in float64.

Slow on purpose (seed-000 style: R is built for every (i, j) pair, [L, K, d_model]); it shares no
code with the module, only its parameters, and follows docs/formulas.md literally.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sinusoid_row(pos: float, dim: int) -> list[float]:
    """R_pos = [sin(pos·f_0) .. sin(pos·f_{D/2-1}), cos(pos·f_0) .. cos(pos·f_{D/2-1})], f_k = 10000^(-2k/D)."""
    freqs = [1.0 / 10000 ** (k / dim) for k in range(0, dim, 2)]
    return [math.sin(pos * f) for f in freqs] + [math.cos(pos * f) for f in freqs]


def t5_bucket_hf(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket, written for relative_position = key - query, as HF T5 does (docs/formulas.md#t5)."""
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
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def alibi_slopes_reference(n: int) -> list[float]:
    """Press et al.: 2^(-8h/n) for powers of two; else p = 2^floor(log2 n) slopes + every other of 2p's."""
    if n & (n - 1) == 0:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    p = 1 << (n.bit_length() - 1)
    big = [2 ** (-8 * h / (2 * p)) for h in range(1, 2 * p + 1)]
    return [2 ** (-8 * h / p) for h in range(1, p + 1)] + big[0::2][: n - p]


def _xl_table(cfg, p, h, i, j):
    k, d = cfg.max_distance, i - j
    row = min(max(d, 0), k) if cfg.causal else min(max(d, -k), k) + k
    return p["table"][row]


def _t5(cfg, p, h, i, j):
    return p["table"][t5_bucket_hf(j - i, not cfg.causal, cfg.num_buckets, cfg.max_distance)]


def _alibi(cfg, p, h, i, j):
    return -torch.tensor(alibi_slopes_reference(h), dtype=torch.float64) * abs(i - j)


def _alibi_learned(cfg, p, h, i, j):
    return -p["log_slopes"].exp() * abs(i - j)


def _kerple_log(cfg, p, h, i, j):
    a, pw = p["a"].clamp(min=0.01), p["p"].clamp(min=0.01)
    return -pw * torch.log(1 + a * abs(i - j))


def _kerple_power(cfg, p, h, i, j):
    a, pw = p["a"].clamp(min=0.01), p["p"].clamp(min=0.01, max=2.0)
    return -a * abs(i - j) ** pw


def _fire(cfg, p, h, i, j):
    c, threshold = p["c"].abs(), p["threshold"].abs()

    def psi(x):
        return math.copysign(1.0, x) * torch.log(c * abs(x) + 1) if x != 0 else torch.zeros((), dtype=torch.float64)

    x = psi(i - j) / torch.log(c * torch.maximum(torch.tensor(float(i), dtype=torch.float64), threshold) + 1)
    hidden = torch.relu(p["mlp.0.weight"][:, 0] * x + p["mlp.0.bias"])
    return p["mlp.2.weight"] @ hidden + p["mlp.2.bias"]


def _dynamic(cfg, p, h, i, j):
    d = i - j
    x = math.copysign(math.log(1 + abs(d)), d) if d else 0.0
    hidden = torch.nn.functional.silu(p["mlp.0.weight"][:, 0] * x + p["mlp.0.bias"])
    return p["mlp.2.weight"] @ hidden + p["mlp.2.bias"]


#: B_h(i, j) of every built-in bias type, written from docs/formulas.md#bias-types (a test demands
#: one per built-in; a scheme of your own is checked against its formula in its own test file).
BIAS_FORMULAS = {
    "xl_table": _xl_table, "t5": _t5, "alibi": _alibi, "alibi_learned": _alibi_learned,
    "kerple_log": _kerple_log, "kerple_power": _kerple_power, "fire": _fire, "dynamic": _dynamic,
}


def bias_value(attn, i: int, j: int) -> Tensor:
    """B_h(i, j) for every head h [H] in float64, from the scheme's formula and the module's parameters."""
    p = {name: t.detach().double() for name, t in attn.bias_scheme.named_parameters()}
    return BIAS_FORMULAS[attn.config.bias](attn.config, p, attn.n_heads, i, j)


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


def rope_reference(x: Tensor, pos: int, base: float) -> Tensor:
    """Rotate pairs (k, k + d/2) of x [..., d] by angle pos·base^(-2k/d), one 2x2 rotation at a time."""
    d = x.shape[-1]
    out = x.clone()
    for k in range(d // 2):
        theta = pos * base ** (-2 * k / d)
        c, s = math.cos(theta), math.sin(theta)
        out[..., k] = x[..., k] * c - x[..., k + d // 2] * s
        out[..., k + d // 2] = x[..., k] * s + x[..., k + d // 2] * c
    return out


def reference_mask(n_queries: int, n_mem: int, causal: bool, window: int | None = None) -> Tensor:
    """Bool [L, M + L], True where query i (at key position i' = M + i) may see key j: causal
    attention sees j <= i'; a window W keeps the W most recent of those, i' - W < j (itself included)."""
    visible = torch.ones(n_queries, n_mem + n_queries, dtype=torch.bool)
    for i in range(n_queries):
        for j in range(n_mem + n_queries):
            distance = n_mem + i - j
            if causal and (distance < 0 or (window is not None and distance >= window)):
                visible[i, j] = False
    return visible


def reference_attention(attn, x, mems=None, *, padding=None, window=None, clamp_len=None, positions=None):
    """(out [B, L, d_model], probs [B, H, L, M+L]) in float64 by the formulas of docs/formulas.md.

    positions [M + L]: where the keys sit (queries: the last L), as every encoding reads them; the mask
    stays by index. Default 0 .. M + L - 1."""
    cfg = attn.config
    terms = cfg.terms
    h, dh = attn.n_heads, attn.d_head
    x = x.double()
    cat = x if mems is None else torch.cat([mems.double(), x], dim=1)
    b, lq, _ = x.shape
    n_keys = cat.shape[1]
    n_mem = n_keys - lq
    pos = list(range(n_keys)) if positions is None else [int(p) for p in positions]
    wq = attn.q_net.weight.detach().double()
    wk, wv = attn.kv_net.weight.detach().double().chunk(2, dim=0)
    q = (x @ wq.T).view(b, lq, h, dh)
    k = (cat @ wk.T).view(b, n_keys, h, dh)
    v = (cat @ wv.T).view(b, n_keys, h, dh)
    if cfg.absolute == "rope":
        q = torch.stack([rope_reference(q[:, i], pos[n_mem + i], cfg.rope_base) for i in range(lq)], dim=1)
        k = torch.stack([rope_reference(k[:, j], pos[j], cfg.rope_base) for j in range(n_keys)], dim=1)
    s = dh**-0.5 if cfg.score_scale == "sqrt_d" else 1.0
    s_bias = s if cfg.bias_scaled else 1.0
    scores = torch.zeros(b, h, lq, n_keys, dtype=torch.float64)
    if "a" in terms:
        scores += torch.einsum("bihd,bjhd->bhij", q, k)
    if "c" in terms:
        u = attn.content_bias_u.detach().double()
        scores += torch.einsum("hd,bjhd->bhj", u, k)[:, :, None, :]
    if cfg.uses_r:
        wr = attn.r_net.weight.detach().double()
        r_pairs = torch.stack([
            torch.stack([relative_vector(attn, pos[n_mem + i] - pos[j], clamp_len) for j in range(n_keys)])
            for i in range(lq)
        ])  # (L, K, d_model): materialised on purpose
        wr_r = (r_pairs @ wr.T).view(lq, n_keys, h, dh)
        if "b" in terms:
            scores += torch.einsum("bihd,ijhd->bhij", q, wr_r)
        if "d" in terms:
            vv = attn.position_bias_v.detach().double()
            scores += torch.einsum("hd,ijhd->hij", vv, wr_r)[None]
    scores = scores * s
    if attn.bias_scheme is not None:
        bias = torch.stack([
            torch.stack([bias_value(attn, pos[n_mem + i], pos[j]) for j in range(n_keys)], dim=-1) for i in range(lq)
        ], dim=1)  # (H, L, K)
        scores = scores + s_bias * bias[None]
    visible = reference_mask(lq, n_mem, cfg.causal, window)[None, None].expand(b, 1, lq, n_keys)
    if padding is not None:
        visible = visible & ~padding[:, None, None, :]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    probs = probs.nan_to_num(0.0)  # a query that sees no key (all padded) attends to nothing: 0, not NaN
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    if cfg.shaw_values:
        table = attn.value_table.detach().double()
        c = clamp_len if clamp_len is not None else cfg.clamp_len  # the same clipped distance as the keys'
        for i in range(lq):
            for j in range(n_keys):
                d = pos[n_mem + i] - pos[j]
                row = min(max(d, 0), c) if cfg.causal else min(max(d, -c), c) + cfg.clamp_len
                out[:, i] += probs[:, :, i, j, None] * table[row]
    out = out.reshape(b, lq, h * dh) @ attn.out_net.weight.detach().double().T
    return out, probs
