"""Known values and defining properties of the 2022-2025 schemes (docs/schemes/index.md): RoPE's
frequencies under PI / NTK / YaRN, xPos's decay and its centring, FoX as data-dependent ALiBi,
CoPE's counting, Sandwich's curve, windows, sinks, log-n scaling and the learned temperature. Each
expected value is computed here by hand or quoted from the paper / reference code, never read back
from the code under test. Run: pytest tests/model/test_newer_known_values.py -q"""

import math
import re
from pathlib import Path

import pytest
import torch

from fixtures.attention import inputs, randomize
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.config.scheme_checks import rotary_width
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.schemes import (
    RopeScaling,
    alibi_slopes,
    build_bias,
    rope_frequencies,
    xpos_decay,
)


def attention(seed=0, d_model=16, heads=2, d_head=8, **fields):
    attn = RelPosAttention(d_model, heads, d_head, AttentionConfig(**fields)).double()
    randomize(attn, seed)
    return attn


# ------------------------------------------------------------------ RoPE context extension
def test_position_interpolation_divides_every_frequency_by_s():
    theta = [10000 ** (-2 * p / 16) for p in range(8)]
    got = rope_frequencies(16, 10000.0, RopeScaling("pi", 4.0, 32))
    torch.testing.assert_close(got, torch.tensor(theta, dtype=torch.float64) / 4)


def test_ntk_keeps_the_fastest_pair_and_interpolates_the_slowest():
    """YaRN Def. 1: b' = b·s^(d/(d-2)); for d = 64, s = 4, b' ≈ 41 829 (the paper's example
    values)."""
    plain, ntk = (
        rope_frequencies(64, 10000.0),
        rope_frequencies(64, 10000.0, RopeScaling("ntk", 4.0, 512)),
    )
    assert ntk[0] == plain[0] == 1.0
    torch.testing.assert_close(ntk[-1], plain[-1] / 4, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        ntk[1], torch.tensor(41829.36592889948, dtype=torch.float64) ** (-2 / 64)
    )


def test_yarn_ramps_linearly_in_the_pair_index_between_its_correction_pairs():
    """As YaRN's authors' code and Hugging Face: d = 16, base 10^4, L = 1000. Pair p turns L·θ_p/2π
    times within L, so the pair that turns r times is p(r) = d·ln(L/(2πr))/(2 ln base): p(32) =
    1.393 and p(1) = 4.404, rounded outwards to 1 and 5. Pairs 0-1 keep θ, pairs 5-7 get θ/s, pairs
    2-4 keep 3/4, 1/2, 1/4 of θ (linear in p). The paper's Eq. 18, linear in the turns (159, 50,
    15.9, 5.0, ...), would keep 48%, 13% and 2% of them."""
    length, s = 1000, 8.0
    assert 16 * math.log(length / (2 * math.pi * 32)) / (2 * math.log(10000)) == pytest.approx(
        1.393, abs=1e-3
    )
    assert 16 * math.log(length / (2 * math.pi)) / (2 * math.log(10000)) == pytest.approx(
        4.404, abs=1e-3
    )
    kept = [1, 1, 0.75, 0.5, 0.25, 0, 0, 0]
    theta = [10000 ** (-2 * p / 16) for p in range(8)]
    expected = [g * t + (1 - g) * t / s for g, t in zip(kept, theta)]
    got = rope_frequencies(16, 10000.0, RopeScaling("yarn", s, length))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "head, fraction, base, s, length",
    [
        (64, 1.0, 10000.0, 4.0, 64),  # alibi_extrapolation_cpu's RoPE at 4x
        (16, 1.0, 10000.0, 8.0, 1000),
        (128, 1.0, 500000.0, 8.0, 8192),  # Llama-3-like
        (32, 1.0, 50.0, 3.0, 6),  # both ends at pair 0: the code's 0.001 guard
        (64, 0.25, 10000.0, 16.0, 2048),  # partial rotary: the ramp over the 16 rotated dimensions
    ],
)
def test_yarn_equals_hugging_faces_compute_yarn_parameters(head, fraction, base, s, length):
    """Frequencies and attention factor equal transformers' `_compute_yarn_parameters` (float32
    there)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    sizes = dict(
        hidden_size=2 * head, num_attention_heads=2, head_dim=head, max_position_embeddings=length
    )
    yarn = {"rope_type": "yarn", "factor": s}
    if int(transformers.__version__.split(".")[0]) >= 5:
        config = transformers.LlamaConfig(
            **sizes, rope_parameters={**yarn, "rope_theta": base, "partial_rotary_factor": fraction}
        )
    else:
        config = transformers.LlamaConfig(
            **sizes, rope_theta=base, rope_scaling=yarn, partial_rotary_factor=fraction
        )
    inv_freq, attention_factor = _compute_yarn_parameters(config, "cpu")
    scaling = RopeScaling("yarn", s, length)
    d_rot = rotary_width(AttentionConfig(absolute="rope", terms="a", rope_fraction=fraction), head)
    torch.testing.assert_close(
        rope_frequencies(d_rot, base, scaling), inv_freq.double(), rtol=1e-6, atol=0
    )
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("s, root", [(4, 1.139), (8, 1.208), (16, 1.277), (32, 1.347)])
def test_yarn_temperature(s, root):
    """√(1/t) = 0.1 ln s + 1 on the rotated dimensions of q and of k; 1 for pi and ntk."""
    assert RopeScaling("yarn", s, 64).attention_factor == pytest.approx(root, abs=5e-4)
    assert (
        RopeScaling("pi", s, 64).attention_factor
        == RopeScaling("ntk", s, 64).attention_factor
        == 1.0
    )


@pytest.mark.parametrize("kind", ["pi", "ntk", "yarn"])
def test_a_factor_of_one_is_the_trained_rope(kind):
    attn = attention(terms="a", absolute="rope")
    x, mems = inputs(1, 3)
    plain, _ = attn(x, mems)
    scaled, _ = attn(x, mems, AttentionOptions(rope_scaling=RopeScaling(kind, 1.0, 8)))
    torch.testing.assert_close(scaled, plain, rtol=1e-12, atol=1e-12)


def test_rope_scaling_is_a_pure_function_of_its_arguments():
    """No state carried between calls: the same call twice, or after another scaling, gives the same
    output."""
    attn = attention(terms="a", absolute="rope")
    x, mems = inputs(2, 3)
    yarn = AttentionOptions(rope_scaling=RopeScaling("yarn", 4.0, 8))
    first, _ = attn(x, mems, yarn)
    attn(x[:, :3], None, AttentionOptions(rope_scaling=RopeScaling("pi", 16.0, 2)))
    torch.testing.assert_close(attn(x, mems, yarn)[0], first, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kind, factor, phrase", [("linear", 2.0, "pi, ntk, yarn"), ("pi", 0.5, "rope_scale: 0.5")]
)
def test_bad_rope_scalings_are_one_line_errors(kind, factor, phrase):
    with pytest.raises(ValueError, match=phrase):
        RopeScaling(kind, factor, 8)


@pytest.mark.parametrize(
    "fields, model",
    [
        (dict(absolute="rope", xpos_scale_base=512.0), "absolute='rope' with xPos"),
        (dict(bias="alibi"), "absolute='none'"),
    ],
    ids=["xpos", "alibi"],
)
def test_rope_scaling_of_a_model_without_plain_rope_is_a_one_line_error(fields, model):
    """xPos has no published context extension, a model without RoPE nothing to extend: the call is
    refused (it was ignored), as evaluation skips such settings (train/run.py
    unsupported_reason)."""
    attn = attention(terms="a", **fields)
    x, mems = inputs(1, 3)
    with pytest.raises(
        ValueError, match=rf"^rope_scaling: yarn extends RoPE; this model has {re.escape(model)}"
    ):
        attn(x, mems, AttentionOptions(rope_scaling=RopeScaling("yarn", 4.0, 8)))


# ------------------------------------------------------------------ partial rotary and xPos
@pytest.mark.parametrize(
    "scaling, rates, factor",
    [
        (None, (1.0, 0.01), 1.0),
        # d_rot 4, L 8: p(32) < 0 and p(1) = 4·ln(8/2π)/(2 ln 10^4) = 0.05, so the ramp runs from
        # pair 0 to pair 1: pair 0 keeps its rate, pair 1 gets 0.01/s; the rotated dimensions of q
        # and of k are multiplied by 0.1 ln 2 + 1 each (as HF's partial rotary), the others are not
        (RopeScaling("yarn", 2.0, 8), (1.0, 0.01 / 2), 0.1 * math.log(2) + 1),
    ],
    ids=["rope", "yarn"],
)
def test_partial_rotary_turns_only_the_first_dimensions(scaling, rates, factor):
    """rope_fraction 0.5 of d_head 8: dimensions 4..7 score as NoPE, 0..3 as RoPE over a width of 4
    (a context extension changes only those)."""
    attn = attention(terms="a", absolute="rope", rope_fraction=0.5)
    x, _ = inputs(3, 0)
    # (B, H, L, K), s·q_rot·k_rot
    maps = attn.score_terms(x, options=AttentionOptions(rope_scaling=scaling))["a"]
    q = attn.q_net(x).view(2, 5, 2, 8).transpose(1, 2)
    k = attn.kv_net(x)[..., :16].view(2, 5, 2, 8).transpose(1, 2)
    i, j = 4, 1  # pair (0, 2): rate 1; pair (1, 3): rate 10000^(-1/2)
    expected = (q[:, :, i, 4:] * k[:, :, j, 4:]).sum(-1)  # the dimensions that carry no position
    for p, rate in zip((0, 1), rates):
        a_i, b_i, a_j, b_j = q[:, :, i, p], q[:, :, i, p + 2], k[:, :, j, p], k[:, :, j, p + 2]
        r = (
            i - j
        ) * rate  # Su et al. Eq. 16: (a_i a_j + b_i b_j) cos rθ - (b_i a_j - a_i b_j) sin rθ
        pair = (a_i * a_j + b_i * b_j) * math.cos(r) - (b_i * a_j - a_i * b_j) * math.sin(r)
        expected = expected + factor**2 * pair
    torch.testing.assert_close(maps[:, :, i, j], expected / math.sqrt(8), rtol=1e-10, atol=1e-12)


def test_xpos_decay_rates_are_the_papers():
    """ζ_p = (2p/d + 0.4)/1.4: for d = 64, ζ_0 = 0.2857 and ζ_31 = 0.9777 (the authors' code)."""
    zeta = xpos_decay(64)
    assert zeta[0].item() == pytest.approx(0.4 / 1.4) and zeta[-1].item() == pytest.approx(
        87.6 / 89.6
    )


def test_xpos_centring_keeps_far_positions_finite_in_float32():
    """Uncentred, a key 40 000 positions in would be scaled by ζ_0^(-78) ≈ 1e42 (fp32 overflows at
    3e38); with one centre for q and k the output is that of positions 0 .. K - 1 (only differences
    matter)."""
    attn = attention(terms="a", absolute="rope", xpos_scale_base=512.0).float()
    x, mems = (t.float() for t in inputs(4, 3))
    near, _ = attn(x, mems)
    far, _ = attn(x, mems, AttentionOptions(positions=torch.arange(8) + 40_000))
    assert torch.isfinite(far).all()
    torch.testing.assert_close(far, near, rtol=1e-4, atol=1e-5)


def test_xpos_pair_terms_decay_as_zeta_to_the_distance_over_b():
    """One rotary pair, q = k = (1, 0) at every position: the score of distance r is
    ζ^(r/B)·cos(r·θ)·s."""
    attn = attention(
        d_model=2,
        heads=1,
        d_head=2,
        terms="a",
        absolute="rope",
        xpos_scale_base=4.0,
        rope_base=100.0,
    )
    with torch.no_grad():
        attn.q_net.weight.copy_(torch.eye(2))
        attn.kv_net.weight.copy_(torch.cat([torch.eye(2), torch.eye(2)]))
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(1, 6, 2)
    maps = attn.score_terms(x)["a"][0, 0]  # (L, K)
    zeta = 0.4 / 1.4  # p = 0, d = 2
    for i, j in ((5, 0), (5, 3), (2, 2)):
        assert maps[i, j].item() == pytest.approx(
            zeta ** ((i - j) / 4) * math.cos(i - j) / math.sqrt(2)
        )


# ------------------------------------------------------------------ FoX
def test_fox_with_a_constant_gate_is_alibi():
    """f = e^(-m_h) for every token (w = 0, b_h = -log(e^(m_h) - 1)) gives D_ij = -m_h·(i - j):
    ALiBi exactly (Lin et al. 2025: FoX is data-dependent ALiBi), memory included."""
    fox, alibi = (
        attention(seed=5, terms="a", forget_gate=True),
        attention(seed=5, terms="a", bias="alibi"),
    )
    alibi.load_state_dict(
        {k: v for k, v in fox.state_dict().items() if not k.startswith("forget_gate")}
    )
    slopes = torch.tensor(alibi_slopes(2), dtype=torch.float64)
    with torch.no_grad():
        fox.forget_gate.proj.weight.zero_()
        fox.forget_gate.proj.bias.copy_(-torch.log(torch.expm1(slopes)))
    x, mems = inputs(5, 3)
    torch.testing.assert_close(fox(x, mems)[0], alibi(x, mems)[0], rtol=1e-10, atol=1e-12)


def test_fox_counts_the_querys_gate_and_not_the_keys():
    """D_ii = 0 and D_{i,i-1} = log f_i: the gates between key and query, the key's own excluded."""
    attn = attention(seed=6, terms="a", forget_gate=True)
    x, mems = inputs(6, 3)
    decay = attn.score_terms(x, mems)["decay"]  # (B, H, L, M + L)
    gate = attn.forget_gate.proj
    # (B, K, H)
    log_f = torch.nn.functional.logsigmoid(torch.cat([mems, x], 1) @ gate.weight.T + gate.bias)
    for i in range(5):
        assert decay[:, :, i, 3 + i].abs().max() == 0
        torch.testing.assert_close(decay[:, :, i, 3 + i - 1], log_f[:, 3 + i])
        torch.testing.assert_close(decay[:, :, i, 0], log_f[:, 1 : 3 + i + 1].sum(1))


# ------------------------------------------------------------------ CoPE
def test_cope_counts_half_a_position_per_key_when_every_gate_is_a_half():
    """q = 0: every gate is σ(0) = 1/2, so p_ij = (i' - j + 1)/2 over the keys the query sees (the
    query itself counts, later keys do not), clamped to p_max - 1."""
    attn = attention(terms="a", cope_positions=3)
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    visible = torch.arange(2, 6)[:, None] >= torch.arange(6)[None, :]  # memory of 2, causal
    p = attn.contextual.positions(q, k, 1.0, visible)[0, 0]
    expected = ((torch.arange(2, 6)[:, None] - torch.arange(6)[None, :] + 1) / 2).clamp(
        min=0, max=2
    ) * visible
    torch.testing.assert_close(p, expected.double())


def test_cope_interpolates_the_table_linearly():
    """e[n] = n·c makes q·e[p] = p·(q·c) for fractional p as well (gates all 1/2: p = 0.5, 1, 1.5,
    ...)."""
    attn = attention(terms="a", cope_positions=16)
    c = torch.randn(8, dtype=torch.float64)
    with torch.no_grad():
        attn.contextual.embeddings.copy_(torch.arange(16, dtype=torch.float64)[:, None] * c)
    q = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    visible = torch.ones(3, 3, dtype=torch.bool).tril()
    zero_keys = torch.zeros(1, 1, 3, 8, dtype=torch.float64)  # q·k = 0: every gate 1/2
    scores = attn.contextual.scores(q, zero_keys, 0.5, visible)[0, 0]
    p = ((torch.arange(3)[:, None] - torch.arange(3)[None, :] + 1) / 2).clamp(min=0) * visible
    torch.testing.assert_close(scores, 0.5 * p * (q[0, 0] @ c)[:, None])


def test_the_documented_cope_interpolation_is_e_itself_at_whole_positions():
    """docs/schemes/data-dependent.md#cope's e[p], evaluated as written: e[n] at every whole n (the
    authors' code: (p - ⌊p⌋)·e[⌈p⌉] + (1 - p + ⌊p⌋)·e[⌊p⌋]; a weight ⌈p⌉ - p would give 0 there),
    linear between."""
    text = (
        Path(__file__).resolve().parents[2] / "docs" / "schemes" / "data-dependent.md"
    ).read_text()
    written = re.search(r"e\[p\] = (.+?),$", text[text.index("## CoPE") :], flags=re.M).group(1)
    python = (
        written.replace("⌈p⌉", "ceil(p)")
        .replace("⌊p⌋", "floor(p)")
        .replace("·", "*")
        .replace("−", "-")
    )
    python = re.sub(r"e\[([^]]*)\]", r"table[\1]", python)
    table = [10.0, 20.0, 40.0, 80.0]
    for p, expected in ((0, 10.0), (1, 20.0), (2, 40.0), (3, 80.0), (1.25, 25.0), (2.5, 60.0)):
        got = eval(python, {"ceil": math.ceil, "floor": math.floor, "table": table, "p": p})
        assert got == pytest.approx(expected), (written, p)


# ------------------------------------------------------------------ Sandwich
def test_sandwich_curve_is_the_sinusoid_inner_product_per_head():
    """d = 64: p_i·p_j - d/2 at r = 0, 1, 4, 64, 128, 256 (not monotone), divided by 8h/H."""
    scheme = build_bias(AttentionConfig(bias="sandwich"), 8, 64).double()
    curve = scheme.curve(torch.tensor([0, 1, 4, 64, 128, 256, -4]))
    head_1 = [0.0, -0.6235, -6.4120, -17.4858, -21.2239, -19.6427, -6.4120]  # divisor 8·1/8 = 1
    torch.testing.assert_close(
        curve[0], torch.tensor(head_1, dtype=torch.float64), rtol=0, atol=1e-4
    )
    at_4 = [-6.411995 / h for h in range(1, 9)]  # divisor 8h/8 = h
    torch.testing.assert_close(
        curve[:, 2], torch.tensor(at_4, dtype=torch.float64), rtol=0, atol=1e-6
    )


def test_sandwich_needs_the_head_width():
    scheme = build_bias(AttentionConfig(bias="sandwich"), 2)
    with pytest.raises(ValueError, match="reads the head width"):
        scheme.curve(torch.arange(3))


# ------------------------------------------------------------------ windows, sinks, temperature
def test_a_window_leaves_each_query_its_window_of_keys():
    attn = attention(terms="a", window=3)
    x, mems = inputs(7, 4)
    visible = attn.score_terms(x, mems)["visible"]  # (L, M + L)
    assert visible.sum(-1).tolist() == [3] * 5
    assert visible[0].nonzero().flatten().tolist() == [2, 3, 4]


def test_zero_sinks_add_e_to_the_zero_to_the_softmax_denominator():
    """Sink keys and values 0: logit 0 each, so with S sinks p_ij = e^(s_ij) / (S + Σ_j
    e^(s_ij))."""
    attn = attention(seed=8, terms="a", sinks=3)
    plain = attention(seed=8, terms="a")
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("sinks")})
    with torch.no_grad():
        attn.sinks.keys.zero_()
        attn.sinks.values.zero_()
    x, mems = inputs(8, 2)
    _, probs = attn(x, mems, need_weights=True)
    scores = plain.score_terms(x, mems)
    weights = scores["a"].masked_fill(~scores["visible"], float("-inf")).exp()
    torch.testing.assert_close(probs, weights / (3 + weights.sum(-1, keepdim=True)))


def test_log_n_is_one_at_the_training_length():
    """The query that sees exactly log_n_length keys is scored as with score_scale sqrt_d; earlier
    ones (fewer keys) are cooler, log(n)/log(L) < 1."""
    scaled = attention(seed=9, terms="a", bias="alibi", score_scale="log_n", log_n_length=6)
    plain = attention(seed=9, terms="a", bias="alibi")
    x, mems = inputs(9, 3)  # query i sees 3 + i + 1 keys: i = 2 sees 6
    s_maps, p_maps = scaled.score_terms(x, mems), plain.score_terms(x, mems)
    for i in range(5):
        factor = math.log(3 + i + 1) / math.log(6)
        for name in ("a", "bias"):  # the whole score: ALiBi's slope is scaled too
            torch.testing.assert_close(s_maps[name][:, :, i], p_maps[name][:, :, i] * factor)
    torch.testing.assert_close(scaled(x, mems)[0][:, 2], plain(x, mems)[0][:, 2])


def test_a_learned_temperature_starts_at_one_and_learns():
    attn, plain = attention(terms="ab", learned_temperature=True), attention(terms="ab")
    with torch.no_grad():
        attn.temperature.log_tau.zero_()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "temperature" not in k})
    x, mems = inputs(10, 3)
    out, _ = attn(x, mems)
    torch.testing.assert_close(out, plain(x, mems)[0])
    (grad,) = torch.autograd.grad(out.square().sum(), [attn.temperature.log_tau])
    assert grad.abs().min() > 0


def test_log_n_needs_the_training_length():
    with pytest.raises(
        ConfigError, match="^log_n_length: score_scale log_n needs the training attention length"
    ):
        RelPosAttention(16, 2, 8, AttentionConfig(score_scale="log_n"))


# ------------------------------------------------------------------ p-RoPE, Llama 3 scaling, SSMax
def test_p_rope_keeps_the_highest_frequencies_and_stops_the_lowest():
    """p = 0.75 of d_rot = 16 (8 pairs): int(0.75·16 // 2) = 6 pairs turn at RoPE's own θ_p =
    10^4^(-2p/16); pairs 6 and 7 get frequency 0 (Barbero et al.'s apply_p_rope: timescale padded
    with inf)."""
    cfg = AttentionConfig(terms="a", absolute="rope", rope_p=0.75)
    from relpos_ablate.config.scheme_checks import rotating_pairs

    assert rotating_pairs(cfg, 16) == 6
    expected = [10000 ** (-2 * p / 16) for p in range(6)] + [0.0, 0.0]
    got = rope_frequencies(16, 10000.0, rotating=6)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)


def test_p_rope_is_not_gpt_neox_partial_rotary():
    """rope_fraction 0.75 (GPT-NeoX) rotates dims 0-11 with θ_p = 10^4^(-2p/12), p < 6, and leaves
    dims 12-15; rope_p 0.75 rotates pairs (p, p + 8), p < 6, at 10^4^(-2p/16) and leaves pairs
    (6, 14) and (7, 15). So a query and key that live on dims 6 and 14 carry position under partial
    rotary and none under p-RoPE; on dims 12 and 13 the other way round."""

    def score(fields, dims, distance):
        attn = attention(seed=0, d_model=16, heads=1, d_head=16, **fields)
        q = torch.zeros(1, 1, 1, 16, dtype=torch.float64)
        q[..., dims] = 1.0
        from relpos_ablate.config.scheme_checks import rotary_width, rotating_pairs
        from relpos_ablate.model.schemes import rotate_queries_keys

        d_rot = rotary_width(attn.config, 16)
        rotating = rotating_pairs(attn.config, d_rot) if attn.config.rope_p != 1 else None
        qr, kr = rotate_queries_keys(
            q,
            q.clone(),
            torch.tensor([distance]),
            torch.tensor([0]),
            d_rot,
            10000.0,
            rotating=rotating,
        )
        return float((qr * kr).sum())

    p_rope, neox = (
        dict(terms="a", absolute="rope", rope_p=0.75),
        dict(terms="a", absolute="rope", rope_fraction=0.75),
    )
    assert score(p_rope, [6, 14], 0) == score(p_rope, [6, 14], 37) == pytest.approx(2.0, abs=1e-12)
    assert score(neox, [6, 14], 37) != pytest.approx(2.0, abs=1e-3)
    assert score(neox, [12, 13], 37) == pytest.approx(2.0, abs=1e-12)
    assert score(p_rope, [12, 13], 37) != pytest.approx(2.0, abs=1e-3)
    # the pairs both rotate (pair 1: dims 1 and 9 under p-RoPE, 1 and 7 under NeoX) turn at
    # different rates
    assert score(p_rope, [1, 9], 5) == pytest.approx(
        2 * math.cos(5 * 10000 ** (-2 / 16)), abs=1e-12
    )
    assert score(neox, [1, 7], 5) == pytest.approx(2 * math.cos(5 * 10000 ** (-2 / 12)), abs=1e-12)


def test_p_rope_needs_a_rotating_pair_and_is_refused_with_xpos():
    with pytest.raises(ConfigError, match="rope_p"):
        # int(0.2·8 // 2) = 0
        RelPosAttention(16, 2, 8, AttentionConfig(terms="a", absolute="rope", rope_p=0.2))
    with pytest.raises(ConfigError, match="rope_p"):
        AttentionConfig(terms="a", absolute="rope", rope_p=0.5, xpos_scale_base=512.0)
    with pytest.raises(ConfigError, match="rope_p"):
        AttentionConfig(terms="a", absolute="none", rope_p=0.5)


def test_llama3_scaling_by_hand():
    """d_rot 16, base 10^4, L = 1000, s = 8. Wavelengths 2π/θ_p = 2π·10^(p/2): 6.3, 19.9, 62.8,
    198.7 (below L/4 = 250: θ kept), 628.3 (between: γ = (1000/628.3 - 1)/(4 - 1) = 0.197, θ·(γ +
    (1 - γ)/8)), then 1987, 6283, 19869 (above L: θ/8), as Llama 3.1's rope_scaling (low_freq_factor
    1, high_freq_factor 4)."""
    theta = [10000 ** (-2 * p / 16) for p in range(8)]
    gamma = (1000 / (2 * math.pi / theta[4]) - 1) / 3
    assert gamma == pytest.approx(0.19718, abs=1e-5)
    expected = theta[:4] + [theta[4] * (gamma + (1 - gamma) / 8)] + [t / 8 for t in theta[5:]]
    got = rope_frequencies(16, 10000.0, RopeScaling("llama3", 8.0, 1000))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=0)
    assert RopeScaling("llama3", 8.0, 1000).attention_factor == 1.0


@pytest.mark.parametrize(
    "head, base, s, length",
    [(128, 500000.0, 8.0, 8192), (64, 10000.0, 4.0, 512), (16, 10000.0, 8.0, 1000)],
)
def test_llama3_equals_hugging_faces_compute_llama3_parameters(head, base, s, length):
    """Frequencies equal transformers' `_compute_llama3_parameters` (float32 there) at Llama 3.1's
    factors."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    sizes = dict(
        hidden_size=2 * head,
        num_attention_heads=2,
        head_dim=head,
        max_position_embeddings=4 * length,
    )
    llama3 = {
        "rope_type": "llama3",
        "factor": s,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": length,
    }
    if int(transformers.__version__.split(".")[0]) >= 5:
        config = transformers.LlamaConfig(**sizes, rope_parameters={**llama3, "rope_theta": base})
    else:
        config = transformers.LlamaConfig(**sizes, rope_theta=base, rope_scaling=llama3)
    inv_freq, attention_factor = _compute_llama3_parameters(config, "cpu")
    torch.testing.assert_close(
        rope_frequencies(head, base, RopeScaling("llama3", s, length)),
        inv_freq.double(),
        rtol=1e-6,
        atol=0,
    )
    assert attention_factor == 1.0


def test_ssmax_starts_as_log_n_and_scales_by_s_log_n():
    """At s_h = 1/log(L_train) SSMax is log_n; with s_h = c/log(L_train) it is log_n with a
    temperature of c; the score of a query that sees n keys is s_h·log(n) times the sqrt_d one."""
    ssmax = attention(seed=11, terms="a", bias="alibi", score_scale="ssmax", log_n_length=6)
    log_n = attention(seed=11, terms="a", bias="alibi", score_scale="log_n", log_n_length=6)
    plain = attention(seed=11, terms="a", bias="alibi")
    x, mems = inputs(11, 3)
    with torch.no_grad():
        ssmax.temperature.ssmax_scale.fill_(1 / math.log(6))
    torch.testing.assert_close(ssmax(x, mems)[0], log_n(x, mems)[0], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        ssmax.temperature.ssmax_scale.copy_(torch.tensor([0.3, -0.7], dtype=torch.float64))
    got, ref = ssmax.score_terms(x, mems), plain.score_terms(x, mems)
    for i in range(5):  # query i sees 3 + i + 1 keys
        for h, s_h in enumerate((0.3, -0.7)):
            factor = s_h * math.log(3 + i + 1)
            for name in ("a", "bias"):
                torch.testing.assert_close(got[name][:, h, i], ref[name][:, h, i] * factor)
    (grad,) = torch.autograd.grad(ssmax(x, mems)[0].square().sum(), [ssmax.temperature.ssmax_scale])
    assert grad.abs().min() > 0


def test_ssmax_starts_at_one_over_log_of_the_training_length():
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(terms="a", score_scale="ssmax", log_n_length=64)
    )
    torch.testing.assert_close(attn.temperature.ssmax_scale, torch.full((2,), 1 / math.log(64)))
    with pytest.raises(ConfigError, match="log_n_length"):
        RelPosAttention(16, 2, 8, AttentionConfig(terms="a", score_scale="ssmax"))
