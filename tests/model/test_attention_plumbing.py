"""The attention plumbing of 2025-26 (docs/schemes/attention-plumbing.md) against values computed
by hand: QK-norm's norms, the sink logit's softmax_1 and its σ(lse - s) identity, the output
gate's factor, Canon's convolution; segment memory with each is one long pass. The float64
reference on every kernel with gradients is tests/model/test_parity_matrix.py (PART_SETTINGS)."""

import math

import pytest
import torch

from fixtures.attention import randomize
from relpos_ablate import AttentionConfig, ModelConfig, RelPosAttention, TransformerLM
from relpos_ablate.config import ConfigError

PLUMBING = [
    dict(qk_norm="rms"),
    dict(qk_norm="l2", qk_norm_order="after_rope"),
    dict(output_gate="elementwise"),
    dict(output_gate="headwise"),
    dict(sink_logit="learned"),
    dict(sink_logit="off_by_one"),
    dict(canon_width=3),
]


def _layer(**fields) -> RelPosAttention:
    attn = RelPosAttention(16, 2, 8, AttentionConfig(terms="a", **fields)).double()
    randomize(attn, 0)
    return attn


def _x(length=7, seed=0):
    return torch.randn(2, length, 16, generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("fields", PLUMBING, ids=[str(f) for f in PLUMBING])
def test_memory_with_the_plumbing_reproduces_one_long_pass(fields):
    """Segment 2 with memory equals the last tokens of one long causal pass (Canon's convolution
    sees the previous segment's last k - 1 tokens through the memory)."""
    cfg = ModelConfig(
        vocab_size=13, d_model=16, n_layers=2, n_heads=2, d_head=8, d_inner=32, dropout=0.0,
        mem_len=6, attention=AttentionConfig(terms="a", absolute="rope", **fields),
    )  # fmt: skip
    m = TransformerLM(cfg).double().eval()
    randomize(m, 1, scale=0.3)
    seq = torch.randint(0, 13, (2, 10), generator=torch.Generator().manual_seed(0))
    full, _ = m(seq)
    _, mems = m(seq[:, :6])
    second, _ = m(seq[:, 6:], mems)
    torch.testing.assert_close(second, full[:, 6:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_qk_norm_gives_each_head_vector_its_scale(kind):
    """RMSNorm: every q and k row has RMS 1 before the per-channel scale; L2: norm |g_h|."""
    attn = _layer(qk_norm=kind)
    q, k = torch.randn(2, 2, 5, 8).double(), torch.randn(2, 2, 5, 8).double()
    nq, nk = attn.qk_norm.queries_keys(q, k, None)
    if kind == "rms":
        expected = q / q.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * attn.qk_norm.query_scale
        torch.testing.assert_close(nq, expected)
    else:
        for got, g in ((nq, attn.qk_norm.query_scale), (nk, attn.qk_norm.key_scale)):
            torch.testing.assert_close(got.norm(dim=-1), g.abs()[None, :, None].expand(2, 2, 5))
    fresh = RelPosAttention(16, 2, 8, AttentionConfig(terms="a", qk_norm=kind))
    start = 1.0 if kind == "rms" else math.sqrt(8)  # l2: √dh, the RMS-normed pair's logit scale
    assert torch.all(fresh.qk_norm.query_scale == start)


def test_off_by_one_is_softmax_plus_one_and_learned_is_sigma_of_lse_minus_s():
    """softmax_1 (a zero logit with a zero value in the denominator) by hand; with s_h learned, out
    = out_softmax · σ(lse - s_h), the identity every kernel rides on."""
    plain, one = _layer(), _layer(sink_logit="off_by_one")
    one.load_state_dict(plain.state_dict())
    x = _x()
    out, probs = plain(x, need_weights=True)
    _, probs_one = one(x, need_weights=True)
    # probs of softmax_1: exp(z)/(1 + Σ exp(z)) = p·Z/(1 + Z), Z = Σ exp(z) from the scores
    q = x @ plain.q_net.weight.T
    k = x @ plain.kv_net.weight[:16].T
    z = torch.einsum("bihd,bjhd->bhij", q.view(2, 7, 2, 8), k.view(2, 7, 2, 8)) / math.sqrt(8)
    z = z.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = z.exp() / (1 + z.exp().sum(-1, keepdim=True))
    torch.testing.assert_close(probs_one, expected)
    learned = _layer(sink_logit="learned")
    learned.load_state_dict({**plain.state_dict(), "sink_logit.logit": torch.tensor([0.7, -1.3])})
    for backend in ("explicit", "blocks", "sdpa"):
        learned.config = AttentionConfig(terms="a", sink_logit="learned", backend=backend)
        got, _ = learned(x)
        lse = torch.logsumexp(z, -1)  # (B, H, L)
        factor = torch.sigmoid(lse - torch.tensor([0.7, -1.3]).double()[:, None])
        heads = probs @ (x @ plain.kv_net.weight[16:].T).view(2, 7, 2, 8).transpose(1, 2)
        want = (heads * factor[..., None]).transpose(1, 2).reshape(
            2, 7, 16
        ) @ plain.out_net.weight.T
        torch.testing.assert_close(got, want, msg=backend)
    del out


def test_a_zero_headwise_gate_halves_the_output():
    """σ(0) = 1/2: with W_θ = 0 the gated output is half the plain one."""
    plain, gated = _layer(), _layer(output_gate="headwise")
    state = plain.state_dict() | {"output_gate.proj.weight": torch.zeros(2, 16).double()}
    gated.load_state_dict(state)
    x = _x()
    torch.testing.assert_close(gated(x)[0], plain(x)[0] / 2)


def test_canon_adds_a_causal_depthwise_convolution():
    """x_t + Σ_s w_s ∘ x_{t-s}: with a one-hot tap on the previous token the attention's input is
    x_t + w ∘ x_(t-1), so the layer equals a plain one fed that sum."""
    plain, canon = _layer(), _layer(canon_width=2)
    weight = torch.zeros(16, 1, 2).double()
    weight[:, 0, 0] = torch.linspace(-1, 1, 16)  # tap k - 1 - s = 0: s = 1, the previous token
    canon.load_state_dict(plain.state_dict() | {"canon.conv.weight": weight})
    x = _x()
    shifted = torch.cat([torch.zeros(2, 1, 16).double(), x[:, :-1]], 1)
    torch.testing.assert_close(canon(x)[0], plain(x + shifted * torch.linspace(-1, 1, 16))[0])


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(qk_norm="layer"), "qk_norm"),
        (dict(qk_norm_order="middle"), "qk_norm_order"),
        (dict(output_gate="scalar"), "output_gate"),
        (dict(sink_logit="yes"), "sink_logit"),
        (dict(canon_width=-1), "canon_width"),
        (dict(canon_width=4, chunk=8), "canon_width"),
        (dict(rope_heads=0.5), "rope_heads"),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        AttentionConfig(terms="a", **fields)
    assert "\n" not in str(err.value)


def test_pope_scores_are_softplus_magnitudes_times_the_cosine_of_position_alone():
    """q̃_i·k̃_j = Σ_c softplus(q_ic)·softplus(k_jc)·cos((i - j)·θ_c - δ_c), θ_c = 10000^(-c/dh),
    by hand; the content's sign changes no phase."""
    attn = _layer(pope=True, pope_phase_bias=True)
    with torch.no_grad():
        attn.pope.phase_bias.uniform_(-2 * math.pi, 0)
    q, k = torch.randn(1, 2, 4, 8).double(), torch.randn(1, 2, 5, 8).double()
    place = type("P", (), {})()
    place.query_positions, place.key_positions = torch.arange(1, 5), torch.arange(5)
    from relpos_ablate.model.core.parts import Where

    pq, pk = attn.pope.queries_keys(q, k, Where(place))
    got = (pq @ pk.transpose(-1, -2)).detach()
    delta = attn.pope.phase_bias.detach().double()
    for h in range(2):
        for i in range(4):
            for j in range(5):
                want = sum(
                    math.log1p(math.exp(q[0, h, i, c]))
                    * math.log1p(math.exp(k[0, h, j, c]))
                    * math.cos((i + 1 - j) * 10000 ** (-c / 8) - float(delta[h, c]))
                    for c in range(8)
                )
                assert abs(float(got[0, h, i, j]) - want) < 1e-9


@pytest.mark.parametrize("fields", [dict(pope=True), dict(qk_rope_dim=4)], ids=["pope", "mla"])
def test_pope_and_mla_depend_on_distances_only(fields):
    """Both place q·k by relative position: shifting every position leaves the output unchanged."""
    from relpos_ablate.model import AttentionOptions

    attn, x = _layer(**fields), _x()
    out, _ = attn(x, options=AttentionOptions(positions=torch.arange(7)))
    shifted, _ = attn(x, options=AttentionOptions(positions=torch.arange(7) + 11))
    torch.testing.assert_close(out, shifted)


def test_mla_shares_one_rotary_key_across_heads_and_keeps_the_content_part():
    """k's last r channels are the same rotated W_KR·x for every head; q's and k's first dh - r
    channels are the projections themselves (no position)."""
    from relpos_ablate.model.core.parts import Where

    attn = _layer(qk_rope_dim=4)
    q, k = torch.randn(2, 2, 5, 8).double(), torch.randn(2, 2, 5, 8).double()
    place = type("P", (), {})()
    place.query_positions = place.key_positions = torch.arange(5)
    mq, mk = attn.mla.queries_keys(q, k, Where(place, None, _x(5)))
    torch.testing.assert_close(mk[:, 0, :, 4:], mk[:, 1, :, 4:])
    torch.testing.assert_close(mq[..., :4], q[..., :4])
    torch.testing.assert_close(mk[..., :4], k[..., :4])
    # at position 0 nothing turns: the shared key is W_KR·x itself
    torch.testing.assert_close(mk[:, 0, 0, 4:], _x(5)[:, 0] @ attn.mla.key_proj.weight.T)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(qk_rope_dim=3), "qk_rope_dim"),
        (dict(qk_rope_dim=8), "qk_rope_dim"),
        (dict(pope=True, absolute="rope"), "pope"),
        (dict(pope_phase_bias=True), "pope_phase_bias"),
        (dict(pope=True, qk_rope_dim=4), "pope"),
    ],
)
def test_bad_placements_are_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        RelPosAttention(16, 2, 8, AttentionConfig(terms="a", **fields))
    assert "\n" not in str(err.value)
