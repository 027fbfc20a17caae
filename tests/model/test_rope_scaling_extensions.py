"""RoPE context extensions after the first four (docs/schemes/rope-scaling.md): dynamic NTK,
LongRoPE, and YaRN's mscale / mscale_all_dim and truncate. Each against values computed here by
hand (the formulas written out, never numbers read back from the code under test), against
transformers' rope utils where it is installed, through an evaluation setting into a RoPE attention
layer, and their one-line errors. Run: pytest tests/model/test_rope_scaling_extensions.py -q"""

import hashlib
import inspect
import json
import math

import pytest
import torch

from fixtures.attention import inputs, randomize
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.config import EvalSetting, load_run_config, run_id
from relpos_ablate.config.scheme_checks import rotary_width
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.schemes import RopeScaling, rope_frequencies, rotate
from relpos_ablate.train.evaluation import setting_record
from relpos_ablate.train.module import rope_scaling

BASE = 10000.0


def plain(d_rot, base=BASE):
    """θ_p = base^(-2p/d_rot), written out."""
    return torch.tensor([base ** (-2 * p / d_rot) for p in range(d_rot // 2)], dtype=torch.float64)


# ------------------------------------------------------------------ dynamic NTK
def test_dynamic_grows_the_base_with_the_calls_length():
    """d_rot 16, L = 1000, s = 4, n = 3000: base' = base·(4·3000/1000 - 3)^(16/14), i.e.
    base·9^(8/7)."""
    grown = BASE * 9 ** (8 / 7)
    got = rope_frequencies(16, BASE, RopeScaling("dynamic", 4.0, 1000), length=3000)
    torch.testing.assert_close(got, plain(16, grown), rtol=1e-14, atol=0)
    assert RopeScaling("dynamic", 4.0, 1000).attention_factor == 1.0


@pytest.mark.parametrize("length", [None, 1, 999, 1000])
def test_dynamic_at_or_below_the_training_length_is_plain_rope(length):
    """n <= L: the bracket s·n/L - (s - 1) is taken at n = L, i.e. 1: the trained base."""
    got = rope_frequencies(16, BASE, RopeScaling("dynamic", 4.0, 1000), length=length)
    torch.testing.assert_close(got, rope_frequencies(16, BASE), rtol=0, atol=0)
    torch.testing.assert_close(got, plain(16), rtol=1e-15, atol=0)


def test_rotate_reads_dynamics_length_from_its_positions():
    """Without an explicit length, n = the largest position + 1 (Hugging Face's max(position_ids) +
    1): positions up to 9 at L = 4, s = 2 give base·(2·10/4 - 1)^(8/6) = base·4^(4/3)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 10, 8, generator=gen, dtype=torch.float64)
    positions = torch.arange(10)
    got = rotate(x, positions, 8, BASE, scaling=RopeScaling("dynamic", 2.0, 4))
    theta = plain(8, BASE * 4 ** (4 / 3))
    angles = positions.double()[:, None] * theta[None]
    first, second = x[..., :4], x[..., 4:]
    want = torch.cat(
        [
            first * angles.cos() - second * angles.sin(),
            second * angles.cos() + first * angles.sin(),
        ],
        -1,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ LongRoPE
LONG, SHORT = (1.0, 2.0, 4.0, 8.0), (1.0, 1.5, 2.0, 3.0)


@pytest.mark.parametrize("length, factors", [(None, SHORT), (16, SHORT), (17, LONG), (64, LONG)])
def test_longrope_picks_short_or_long_factors_by_length(length, factors):
    """d_rot 8, L = 16: θ_p/λ_p with λ the short factors up to n = L, the long ones beyond."""
    scaling = RopeScaling("longrope", 4.0, 16, long_factor=LONG, short_factor=SHORT)
    got = rope_frequencies(8, BASE, scaling, length=length)
    want = plain(8) / torch.tensor(factors, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)


def test_longrope_attention_factor():
    """√(1 + ln s/ln L), the same at every length: s = 4, L = 16 gives √1.5; s = 1 gives 1."""
    scaling = RopeScaling("longrope", 4.0, 16, long_factor=LONG, short_factor=SHORT)
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))
    assert scaling.attention_factor == pytest.approx(math.sqrt(1.5), rel=1e-15)
    unit = RopeScaling("longrope", 1.0, 16, long_factor=LONG, short_factor=SHORT)
    assert unit.attention_factor == 1.0


# ------------------------------------------------------------------ YaRN's mscale and truncate
@pytest.mark.parametrize(
    "s, mscale, all_dim",
    [(8.0, 2.0, 1.0), (4.0, 1.0, 0.5), (40.0, 0.707, 0.707), (1.0, 2.0, 1.0)],
)
def test_yarn_mscale_pair_gives_the_ratio_of_two_mscales(s, mscale, all_dim):
    """m(s, c) = 0.1·c·ln s + 1 (1 at s <= 1): the factor is m(s, mscale)/m(s, mscale_all_dim);
    DeepSeek-V2's mscale = mscale_all_dim (0.707) gives 1."""

    def m(c):
        return 1.0 if s <= 1 else 0.1 * c * math.log(s) + 1

    got = RopeScaling("yarn", s, 64, mscale=mscale, mscale_all_dim=all_dim).attention_factor
    assert got == pytest.approx(m(mscale) / m(all_dim), rel=1e-15)
    if mscale == all_dim:
        assert got == 1.0
    assert RopeScaling("yarn", s, 64).attention_factor == pytest.approx(m(1.0), rel=1e-15)


def test_yarn_without_truncate_keeps_the_ramps_ends_real():
    """d_rot 16, L = 1000, s = 8: the ends p(32) = 16·ln(1000/64π)/(2 ln 10^4) = 1.393 and p(1) =
    4.404 stay as they are instead of becoming pairs 1 and 5: γ_p = 1 - clamp((p - 1.393)/(4.404 -
    1.393), 0, 1), so pairs 2-4 keep 0.80, 0.47, 0.13 of θ instead of 3/4, 1/2, 1/4."""
    low = 16 * math.log(1000 / (2 * math.pi * 32)) / (2 * math.log(BASE))
    high = 16 * math.log(1000 / (2 * math.pi)) / (2 * math.log(BASE))
    kept = [1 - min(max((p - low) / (high - low), 0.0), 1.0) for p in range(8)]
    theta = plain(16)
    want = torch.tensor(kept, dtype=torch.float64) * theta
    want = want + (1 - torch.tensor(kept, dtype=torch.float64)) * theta / 8
    got = rope_frequencies(16, BASE, RopeScaling("yarn", 8.0, 1000, truncate=False))
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    truncated = rope_frequencies(16, BASE, RopeScaling("yarn", 8.0, 1000))
    truncated_kept = [1, 1, 0.75, 0.5, 0.25, 0, 0, 0]
    torch.testing.assert_close(
        truncated,
        torch.tensor(
            [g * t + (1 - g) * t / 8 for g, t in zip(truncated_kept, theta.tolist())],
            dtype=torch.float64,
        ),
        rtol=1e-14,
        atol=0,
    )
    assert kept[2:5] == pytest.approx([0.798, 0.466, 0.134], abs=1e-3)
    assert not torch.equal(got, truncated)


# ------------------------------------------------------------------ transformers' rope utils
def hf_config(transformers, head, length, params):
    """A LlamaConfig with rope `params` ({"rope_type", ...}, rope_theta included) at
    max_position_embeddings = length, in either of transformers' config layouts."""
    sizes = dict(
        hidden_size=2 * head, num_attention_heads=2, head_dim=head, max_position_embeddings=length
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.LlamaConfig(
            **sizes, rope_parameters={**params, "original_max_position_embeddings": length}
        )
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return transformers.LlamaConfig(
        **sizes,
        rope_theta=params["rope_theta"],
        rope_scaling=scaling,
        partial_rotary_factor=params.get("partial_rotary_factor", 1.0),
    )


def d_rot_of(head, fraction):
    return rotary_width(AttentionConfig(absolute="rope", terms="a", rope_fraction=fraction), head)


@pytest.mark.parametrize(
    "head, fraction, s, length, n",
    [(64, 1.0, 4.0, 512, 256), (64, 1.0, 4.0, 512, 512), (64, 1.0, 4.0, 512, 2048),
     (128, 0.5, 8.0, 1000, 5000)],
)  # fmt: skip
def test_dynamic_equals_hugging_faces_compute_dynamic_ntk_parameters(head, fraction, s, length, n):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    params = {"rope_type": "dynamic", "factor": s, "rope_theta": BASE}
    config = hf_config(transformers, head, length, {**params, "partial_rotary_factor": fraction})
    inv_freq, attention_factor = _compute_dynamic_ntk_parameters(config, "cpu", seq_len=n)
    scaling = RopeScaling("dynamic", s, length)
    got = rope_frequencies(d_rot_of(head, fraction), BASE, scaling, length=n)
    torch.testing.assert_close(got, inv_freq.double(), rtol=1e-6, atol=0)
    assert attention_factor == scaling.attention_factor == 1.0


@pytest.mark.parametrize("n", [None, 64, 65, 300])
def test_longrope_equals_hugging_faces_compute_longrope_parameters(n):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    head, length, s = 16, 64, 4.0
    long = tuple(1.0 + p for p in range(head // 2))
    short = tuple(1.0 + 0.1 * p for p in range(head // 2))
    params = {
        "rope_type": "longrope",
        "factor": s,
        "long_factor": list(long),
        "short_factor": list(short),
        "rope_theta": BASE,
    }
    inv_freq, attention_factor = _compute_longrope_parameters(
        hf_config(transformers, head, length, params), "cpu", seq_len=n
    )
    scaling = RopeScaling("longrope", s, length, long_factor=long, short_factor=short)
    got = rope_frequencies(head, BASE, scaling, length=n)
    torch.testing.assert_close(got, inv_freq.double(), rtol=1e-6, atol=0)
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize(
    "head, s, length, extra",
    [
        (64, 40.0, 4096, {"mscale": 0.707, "mscale_all_dim": 0.707}),  # DeepSeek-V2's
        (64, 8.0, 1000, {"mscale": 2.0, "mscale_all_dim": 1.0}),
        (64, 32.0, 4096, {"truncate": False}),  # gpt-oss's
        (16, 8.0, 1000, {"truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}),
    ],
)
def test_yarn_options_equal_hugging_faces_compute_yarn_parameters(head, s, length, extra):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    source = inspect.getsource(_compute_yarn_parameters)
    for key in extra:
        if key not in source:
            pytest.skip(f"this transformers' yarn has no {key}")
    params = {"rope_type": "yarn", "factor": s, "rope_theta": BASE, **extra}
    inv_freq, attention_factor = _compute_yarn_parameters(
        hf_config(transformers, head, length, params), "cpu"
    )
    scaling = RopeScaling("yarn", s, length, **extra)
    torch.testing.assert_close(
        rope_frequencies(head, BASE, scaling), inv_freq.double(), rtol=1e-6, atol=0
    )
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)


# ------------------------------------------------------------------ through an evaluation setting
def rope_attention():
    attn = RelPosAttention(16, 2, 8, AttentionConfig(terms="a", absolute="rope")).double()
    randomize(attn, 4)
    return attn


def expected_scores(attn, x, mems, theta, factor):
    """Term a of RoPE by Su et al. Eq. 16, pair by pair (p, p + 4) of d_head 8 at positions 0 ..
    M + L - 1: (a_i a_j + b_i b_j) cos rθ - (b_i a_j - a_i b_j) sin rθ, r = i - j, times factor²
    (q's and k's), over √8. [B, H, L, M + L]."""
    cat = x if mems is None else torch.cat([mems, x], 1)
    b, lq, n_keys = x.shape[0], x.shape[1], cat.shape[1]
    q = attn.q_net(x).view(b, lq, 2, 8).transpose(1, 2)
    k = attn.kv_net(cat)[..., :16].view(b, n_keys, 2, 8).transpose(1, 2)
    r = (torch.arange(lq) + n_keys - lq)[:, None] - torch.arange(n_keys)[None]  # (L, M + L)
    r = r.double()
    scores = torch.zeros(b, 2, lq, n_keys, dtype=torch.float64)
    for p in range(4):
        a_i, b_i = q[..., p, None], q[..., p + 4, None]  # (B, H, L, 1)
        a_j, b_j = k[..., None, :, p], k[..., None, :, p + 4]  # (B, H, 1, M + L)
        angle = r * theta[p].item()
        scores += (a_i * a_j + b_i * b_j) * angle.cos() - (b_i * a_j - a_i * b_j) * angle.sin()
    return factor**2 * scores / math.sqrt(8)


def scored(attn, config, setting, x, mems):
    options = AttentionOptions(rope_scaling=rope_scaling(config, setting))
    with torch.no_grad():
        return attn.score_terms(x, mems, options)["a"]


RUN = ["model.attention.terms=a", "model.attention.absolute=rope"]


def test_dynamic_evaluates_end_to_end_at_the_keys_length():
    """L = 2 (train.segment_len), a setting of 5 tokens with 3 of memory: auto s = 8/2 = 4, and
    the call's 8 keys grow the base to base·(4·8/2 - 3)^(8/6) = base·13^(4/3)."""
    config = load_run_config(None, [*RUN, "train.segment_len=2", "data.offset=1"])
    setting = EvalSetting(segment_len=5, mem_len=3, rope_scaling="dynamic")
    assert rope_scaling(config, setting) == RopeScaling("dynamic", 4.0, 2)
    attn = rope_attention()
    x, mems = inputs(3, 3)
    got = scored(attn, config, setting, x, mems)
    want = expected_scores(attn, x, mems, plain(8, BASE * 13 ** (4 / 3)), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_longrope_evaluates_end_to_end_short_and_long():
    """L = 2, s = 4 (auto, 8 keys over 2): 8 keys take the long factors, a call of 2 the short ones;
    both multiply q's and k's rotated dimensions by √(1 + ln 4/ln 2) = √3."""
    config = load_run_config(None, [*RUN, "train.segment_len=2", "data.offset=1"])
    setting = EvalSetting(
        segment_len=5,
        mem_len=3,
        rope_scaling="longrope",
        rope_long_factor=LONG,
        rope_short_factor=SHORT,
    )
    attn = rope_attention()
    x, mems = inputs(5, 3)
    long = torch.tensor(LONG, dtype=torch.float64)
    short = torch.tensor(SHORT, dtype=torch.float64)
    got = scored(attn, config, setting, x, mems)
    want = expected_scores(attn, x, mems, plain(8) / long, math.sqrt(3))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got = scored(attn, config, setting, x[:, :2], None)
    want = expected_scores(attn, x[:, :2], None, plain(8) / short, math.sqrt(3))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_yarn_mscale_and_truncate_evaluate_end_to_end():
    """L = 64, s = 4, d_rot 8: p(32) < 0 and p(1) = 8·ln(64/2π)/(2 ln 10^4) = 1.008, so without
    truncate γ = 1, 1 - 1/1.008, 0, 0 (with it the end would be pair 2: γ_1 = 1/2); factor
    m(4, 2)/m(4, 1) = (0.2 ln 4 + 1)/(0.1 ln 4 + 1)."""
    config = load_run_config(None, [*RUN, "train.segment_len=64"])
    setting = EvalSetting(
        segment_len=5,
        rope_scaling="yarn",
        rope_scale=4,
        rope_mscale=2.0,
        rope_mscale_all_dim=1.0,
        rope_truncate=False,
    )
    high = 8 * math.log(64 / (2 * math.pi)) / (2 * math.log(BASE))
    assert high == pytest.approx(1.008, abs=1e-3)
    kept = torch.tensor([1.0, 1 - 1 / high, 0.0, 0.0], dtype=torch.float64)
    theta = kept * plain(8) + (1 - kept) * plain(8) / 4
    factor = (0.2 * math.log(4) + 1) / (0.1 * math.log(4) + 1)
    attn = rope_attention()
    x, _ = inputs(6, 0)
    got = scored(attn, config, setting, x, None)
    torch.testing.assert_close(
        got, expected_scores(attn, x, None, theta, factor), rtol=1e-10, atol=1e-12
    )


# ------------------------------------------------------------------ run ids and eval.json records
def test_new_fields_leave_existing_run_ids_and_records_as_they_were():
    """run_id hashes the non-default fields only: an existing setting's id is the hash of exactly
    the fields it sets, and its eval.json record has the keys it always had."""
    setting = "eval.settings=[{segment_len: 64, rope_scaling: yarn, rope_scale: 4}]"
    config = load_run_config(None, [setting])
    written = {
        "eval": {"settings": [{"segment_len": 64, "rope_scaling": "yarn", "rope_scale": 4.0}]}
    }
    canonical = json.dumps(written, sort_keys=True, separators=(",", ":"))
    assert run_id(config) == hashlib.sha256(canonical.encode()).hexdigest()[:10]
    assert setting_record(config, config.eval.settings[0]) == {
        "protocol": "non_overlapping",
        "segment_len": 64,
        "stride": None,
        "mem_len": 0,
        "clamp_len": None,
        "same_length": False,
        "max_targets": 0,
        "token_losses": None,
        "attn_len": 64,
        "rope_scaling": "yarn",
        "rope_scale": 4.0,
        "split": "valid",
    }
    longrope = "{segment_len: 64, rope_scaling: longrope, rope_long_factor: [1, 2], "
    longrope += "rope_short_factor: [1, 1]}"
    assert load_run_config(None, [f"eval.settings=[{longrope}]"]).eval.settings[0] == EvalSetting(
        segment_len=64,
        rope_scaling="longrope",
        rope_long_factor=(1.0, 2.0),
        rope_short_factor=(1.0, 1.0),
    )


# ------------------------------------------------------------------ one-line errors
BAD = [
    (
        "{segment_len: 8, rope_scaling: longrope, rope_short_factor: [1]}",
        "rope_long_factor",
        "rope_scaling longrope needs it",
    ),
    (
        "{segment_len: 8, rope_scaling: longrope, rope_long_factor: [1, -2], "
        "rope_short_factor: [1, 1]}",
        "rope_long_factor[1]",
        "-2.0 is out of range; allowed (0, inf)",
    ),
    (
        "{segment_len: 8, rope_scaling: yarn, rope_short_factor: [1]}",
        "rope_short_factor",
        "is read only by rope_scaling longrope (rope_scaling is 'yarn')",
    ),
    (
        "{segment_len: 8, rope_scaling: ntk, rope_mscale: 1}",
        "rope_mscale",
        "is read only by rope_scaling yarn (rope_scaling is 'ntk')",
    ),
    (
        "{segment_len: 8, rope_truncate: false}",
        "rope_truncate",
        "is read only by rope_scaling yarn (rope_scaling is None)",
    ),
    (
        "{segment_len: 8, rope_scaling: yarn, rope_mscale: 1}",
        "rope_mscale_all_dim",
        "needs both; set both or neither",
    ),
    (
        "{segment_len: 8, rope_scaling: yarn, rope_mscale: 0, rope_mscale_all_dim: 1}",
        "rope_mscale",
        "0.0 is out of range; allowed (0, inf)",
    ),
    (
        "{segment_len: 8, rope_scaling: dynamic, rope_long_factor: x}",
        "rope_long_factor",
        "expected a list",
    ),
]


@pytest.mark.parametrize("setting, field, phrase", BAD)
def test_bad_settings_are_one_line_errors_naming_the_field(setting, field, phrase):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [f"eval.settings=[{setting}]"])
    message = str(err.value)
    assert message.startswith(f"eval.settings[0].{field}: ") and phrase in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    "build, phrase",
    [
        (
            lambda: RopeScaling(
                "longrope", 2.0, 8, long_factor=(1.0,) * 3, short_factor=(1.0,) * 4
            ),
            "rope_long_factor: 3 values given; this RoPE has d_rot/2 = 4 rotary pairs",
        ),
        (
            lambda: RopeScaling(
                "longrope", 2.0, 8, long_factor=(1.0,) * 4, short_factor=(1.0,) * 5
            ),
            "rope_short_factor: 5 values given; this RoPE has d_rot/2 = 4 rotary pairs",
        ),
        (lambda: RopeScaling("dynamic", 2.0, 8), "dynamic rescales the base"),
    ],
)
def test_what_only_the_model_knows_is_a_one_line_error(build, phrase):
    """The factor lists' length needs d_rot (here 8, of d_head 8), checked at every length;
    dynamic, as ntk, needs d_rot > 2."""
    scaling = build()
    d_rot = 2 if scaling.kind == "dynamic" else 8
    with pytest.raises(ValueError) as err:
        rope_frequencies(d_rot, BASE, scaling, length=1)
    assert phrase in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "fields, phrase",
    [
        (dict(kind="longrope"), "rope_long_factor: rope_scaling longrope needs it"),
        (dict(kind="pi", mscale=1.0, mscale_all_dim=1.0), "rope_mscale: is read only by"),
        (dict(kind="ntk", truncate=False), "rope_truncate: is read only by rope_scaling yarn"),
        (
            dict(kind="longrope", original_length=1, long_factor=(1.0,), short_factor=(1.0,)),
            "needs a training context L >= 2",
        ),
        (dict(kind="linear"), "dynamic, longrope"),
    ],
)
def test_a_rope_scaling_built_in_python_is_checked_as_a_setting(fields, phrase):
    fields = {"factor": 2.0, "original_length": 8, **fields}
    with pytest.raises(ValueError, match=phrase) as err:
        RopeScaling(**fields)
    assert "\n" not in str(err.value)
