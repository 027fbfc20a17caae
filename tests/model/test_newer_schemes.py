"""The schemes of 2022-2025 against the float64 reference (tests/fixtures/reference.py, written from
docs/schemes/index.md): partial rotary, p-RoPE, xPos, RoPE context extension (Llama 3's too), FoX,
CoPE, sliding windows, learned sinks, log-n scaling, SSMax and a learned temperature, alone and
combined, on every kernel (explicit, SDPA per block, the block kernel that rebuilds in backward,
FlexAttention forward on CPU), with memory, key padding and explicit (randomized) positions; their
fast backward equals autograd through the explicit scores.
Run: pytest tests/model/test_newer_schemes.py -q"""

import dataclasses

import pytest
import torch

from fixtures.attention import (
    D_HEAD,
    D_MODEL,
    HEADS,
    LQ,
    MEM,
    drawn,
    fast_and_explicit_gradients,
    inputs,
    randomize,
)
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.schemes import RopeScaling

SCHEMES = {
    "rope_partial": dict(terms="a", absolute="rope", rope_fraction=0.5),
    "p_rope": dict(terms="a", absolute="rope", rope_p=0.5),  # 2 of the 4 rotary pairs turn
    "p_rope_partial_alibi": dict(
        terms="a", absolute="rope", rope_fraction=0.75, rope_p=0.4, bias="alibi"
    ),
    # small B: the decay shows at these lengths
    "rope_xpos": dict(terms="a", absolute="rope", xpos_scale_base=6.0),
    "xpos_partial_alibi": dict(
        terms="a", absolute="rope", rope_fraction=0.75, xpos_scale_base=9.0, bias="alibi"
    ),
    "fox": dict(terms="a", forget_gate=True),
    "fox_xl_t5": dict(terms="abcd", forget_gate=True, bias="t5", num_buckets=8, max_distance=6),
    "cope": dict(terms="a", cope_positions=4),  # p_max below the keys: the clamp is exercised
    "cope_c": dict(terms="ac", cope_positions=6),
    "cope_rope": dict(terms="a", cope_positions=6, absolute="rope"),
    "window": dict(terms="abcd", window=3, bias="kerple_log"),
    "sinks": dict(terms="a", sinks=2),
    "sinks_xl_fire": dict(terms="abcd", sinks=1, bias="fire"),
    "sinks_window_fox": dict(terms="ac", sinks=2, window=2, forget_gate=True),
    "log_n": dict(terms="a", score_scale="log_n", log_n_length=4),
    "log_n_alibi_tau": dict(
        terms="abcd", score_scale="log_n", log_n_length=3, learned_temperature=True, bias="alibi"
    ),
    "tau_sandwich": dict(terms="ab", learned_temperature=True, bias="sandwich"),
    "ssmax": dict(terms="a", score_scale="ssmax", log_n_length=4),
    "ssmax_xl_t5_tau": dict(
        terms="abcd",
        score_scale="ssmax",
        log_n_length=6,
        learned_temperature=True,
        bias="t5",
        num_buckets=8,
        max_distance=6,
    ),
    "everything": dict(
        terms="a",
        absolute="rope",
        rope_fraction=0.5,
        forget_gate=True,
        cope_positions=5,
        window=4,
        sinks=2,
        score_scale="log_n",
        log_n_length=5,
        learned_temperature=True,
    ),
    "stick_breaking": dict(terms="a", normaliser="stick_breaking"),
    "stick_breaking_xl_alibi": dict(terms="abcd", normaliser="stick_breaking", bias="alibi"),
    "path": dict(terms="a", path=True),
    "path_fox_sinks": dict(terms="a", path=True, forget_gate=True, sinks=2),  # PaTH-FoX
    "dape": dict(terms="a", bias="kerple_log", dape="v1", dape_width=6),
    "dape_v2": dict(terms="a", bias="kerple_log", dape="v2", dape_width=5),
    "dape_v2_xl_t5_log_n_fox": dict(
        terms="abcd",
        bias="t5",
        num_buckets=8,
        max_distance=6,
        dape="v2",
        dape_width=4,
        dape_kernel=5,
        score_scale="log_n",
        log_n_length=4,
        forget_gate=True,
    ),
    "materialised_everything": dict(
        terms="a",
        path=True,
        normaliser="stick_breaking",
        dape="v2",
        dape_width=4,
        bias="alibi_learned",
        forget_gate=True,
        window=4,
        learned_temperature=True,
    ),
}
KERNELS = ("explicit", "sdpa", "blocks", "flex")
#: cases of tests/model/test_parity_matrix.py (alone on term a: memory or none, key padding, every
#: kernel, forward and gradients): not repeated in the tests of one condition at a time here
IN_THE_MATRIX = ("fox", "cope")


def make(fields, backend="auto", seed=0, **extra):
    fields = {"query_chunk": 2, **fields, **extra, "backend": backend}
    attn = RelPosAttention(D_MODEL, HEADS, D_HEAD, AttentionConfig(**fields)).double()
    randomize(attn, seed)
    if attn.bias_scheme is not None and hasattr(attn.bias_scheme, "threshold"):
        with torch.no_grad():
            attn.bias_scheme.threshold.fill_(4.0)
    return attn


def runs_on(fields, backend):
    """CoPE needs each query's whole row before the softmax: no FlexAttention; stick-breaking, PaTH
    and DAPE need the materialised scores: the explicit and per-block paths only."""
    if AttentionConfig(**fields).needs_scores:
        return backend in ("explicit", "sdpa", "auto")
    return not (fields.get("cope_positions") and backend == "flex")


def check(attn, x, mems, **kw):
    """Output (fast path) and probabilities (need_weights) equal the float64 reference."""
    options = AttentionOptions(
        window=kw.get("window"),
        key_padding_mask=kw.get("padding"),
        positions=kw.get("positions"),
        rope_scaling=kw.get("rope_scaling"),
    )
    ref_out, ref_probs = reference_attention(attn, x, mems, **kw)
    with torch.no_grad():
        out, _ = attn(x, mems, options)
        _, probs = attn(x, mems, options, need_weights=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", [name for name in SCHEMES if name not in IN_THE_MATRIX])
def test_every_scheme_matches_the_reference_on_every_kernel(name, backend):
    fields = SCHEMES[name]
    if not runs_on(fields, backend):
        pytest.skip("not a kernel of this scheme (runs_on)")
    for i, n_mem in enumerate((0, MEM)):
        attn = make(fields, backend, seed=i)
        check(attn, *inputs(i, n_mem))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", SCHEMES)
def test_every_scheme_with_padding_window_and_explicit_positions(name, backend):
    """Randomized positions (every encoding reads them; FoX, CoPE and sinks read none), a call's
    window (narrowed by the config's) and padded keys, on every kernel."""
    fields = SCHEMES[name]
    if not runs_on(fields, backend):
        pytest.skip("not a kernel of this scheme (runs_on)")
    attn = make(fields, backend, seed=3)
    x, mems = inputs(3, MEM)
    padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
    padding[0, :2] = True
    padding[1, 4] = True
    check(attn, x, mems, positions=drawn(MEM + LQ, seed=3), window=5, padding=padding)


GRADIENT_CASES = [
    (name, backend)
    for name in SCHEMES
    for backend in ("blocks", "sdpa")
    if runs_on(SCHEMES[name], backend) and name not in IN_THE_MATRIX
]


@pytest.mark.parametrize(
    "name, backend", GRADIENT_CASES, ids=[f"{n}-{b}" for n, b in GRADIENT_CASES]
)
def test_fast_backward_equals_autograd_of_explicit_scores(name, backend):
    """Every parameter (FoX's gate, CoPE's table, the sinks, the temperature) and the input get the
    gradients of autograd through the materialised scores."""
    attn = make(SCHEMES[name], backend, seed=5)
    x, mems = inputs(6, MEM)
    padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
    padding[1, 1] = True
    grads = fast_and_explicit_gradients(attn, x, mems, AttentionOptions(key_padding_mask=padding))
    for (name_, _), fast, slow in zip([("x", None), *attn.named_parameters()], *grads):
        assert slow is not None, f"{name_} gets no gradient"
        torch.testing.assert_close(
            fast, slow, rtol=1e-7, atol=1e-10, msg=lambda m, name_=name_: f"{name_}: {m}"
        )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "kind, factor",
    [("pi", 2.0), ("ntk", 4.0), ("yarn", 3.0), ("yarn", 1.0), ("llama3", 3.0), ("dynamic", 3.0)],
)
@pytest.mark.parametrize("backend", KERNELS)
def test_rope_context_extension_matches_the_reference(kind, factor, backend):
    """Llama 3 at L = 40, base 50: pair 0 (wavelength 6.3 < L/4) keeps θ, pair 1 (16.7) is blended,
    the rest (> L) get θ/s; at L = 6 every pair would be beyond L (position interpolation)."""
    scaling = RopeScaling(kind, factor, original_length=40 if kind == "llama3" else 6)
    for fields in (
        SCHEMES["rope_partial"],
        dict(terms="a", absolute="rope", rope_base=50.0),
        SCHEMES["p_rope"],
    ):
        attn = make(fields, backend, seed=7)
        x, mems = inputs(7, MEM)
        check(attn, x, mems, rope_scaling=scaling)
        check(attn, x, mems, rope_scaling=scaling, positions=drawn(MEM + LQ, seed=7))


def test_a_window_in_the_config_and_one_in_the_call_give_the_narrower():
    attn = make(dict(terms="abcd", window=2))
    x, mems = inputs(8, MEM)
    wide, _ = attn(x, mems, AttentionOptions(window=4))
    narrow, _ = attn(x, mems)
    torch.testing.assert_close(wide, narrow, rtol=0, atol=0)
    check(attn, x, mems, window=4)


def test_the_explicit_path_reports_the_new_terms_separately():
    """score_terms: FoX's decay and CoPE's scores are their own maps, the sinks are not a key of the
    stream."""
    attn = make(dict(terms="a", forget_gate=True, cope_positions=3, sinks=2))
    x, mems = inputs(9, MEM)
    maps = attn.score_terms(x, mems)
    assert set(maps) == {"a", "decay", "cope", "visible"}
    assert maps["decay"].shape == maps["cope"].shape == (2, HEADS, LQ, MEM + LQ)
    # D_ii = 0
    torch.testing.assert_close(
        torch.diagonal(maps["decay"][..., MEM:], dim1=-2, dim2=-1),
        torch.zeros(2, HEADS, LQ, dtype=torch.float64),
    )


def test_float32_fox_on_long_contexts_keeps_the_decay_of_near_keys():
    """Λ grows with the context (here ~2.1 per token, |Λ| up to ~4300): summed in float64 and
    differenced in float64 before the cast, the fp32 kernels stay within a few fp32 roundings of
    float64 (a difference of fp32 Λs is off by ~7e-5, one restarted per query block by ~2e-6)."""
    torch.manual_seed(0)
    attn = RelPosAttention(32, 2, 16, AttentionConfig(terms="a", forget_gate=True, query_chunk=64))
    with torch.no_grad():
        # log f ≈ -2.1 per token: |Λ| reaches ~4000 at the end
        attn.forget_gate.proj.bias.fill_(-2.0)
    x = torch.randn(1, 2048, 32)
    options = AttentionOptions()
    for backend in ("sdpa", "blocks"):
        attn.config = dataclasses.replace(attn.config, backend=backend)
        with torch.no_grad():
            out32, _ = attn(x, None, options)
        expected, _ = attn.double()(x.double())
        attn.float()
        torch.testing.assert_close(out32.double(), expected, rtol=2e-7, atol=5e-7)


@pytest.mark.parametrize(
    "fields",
    [
        dict(terms="abcd", bias="t5", num_buckets=8, max_distance=6),
        dict(terms="bd", bias="fire"),
        dict(terms="a", forget_gate=True, sinks=2),
        dict(terms="a", cope_positions=4),
        dict(terms="ac", absolute="none"),
    ],
    ids=["xl_t5", "bd_fire", "fox_sinks", "cope", "ac"],
)
@pytest.mark.parametrize("backend", ["sdpa", "blocks"])
def test_windowed_blocks_skip_the_keys_before_their_window(fields, backend):
    """Several query blocks of 16 over 48 queries and 7 memory keys with a window of 5: each block
    reads keys from its first query's window on (k0 > 0, with the sinks in front: two ranges);
    forward and every gradient equal the explicit scores, which read every key."""
    if not runs_on(fields, backend):
        pytest.skip("not a kernel of this scheme (runs_on)")
    attn = make(fields, backend, seed=11, window=5, query_chunk=16)
    if "fire" in fields.get("bias", ""):
        with torch.no_grad():
            attn.bias_scheme.threshold.fill_(30.0)  # blocks below and beyond it
    gen = torch.Generator().manual_seed(11)
    x, mems = (torch.randn(2, n, D_MODEL, generator=gen, dtype=torch.float64) for n in (48, 7))
    blocks = attn.kernel_call(x, mems)[0].blocks(256 * 1024, windowed=True)
    assert [b.k0 for b in blocks] == [3, 19, 35]
    torch.testing.assert_close(
        attn(x, mems)[0], attn(x, mems, need_weights=True)[0], rtol=1e-7, atol=1e-10
    )
    for fast, slow in zip(*fast_and_explicit_gradients(attn, x, mems, AttentionOptions())):
        torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "blocks"])
@pytest.mark.parametrize("name", SCHEMES)
def test_attention_statistics_of_every_scheme_match_their_definitions(name, backend):
    """The diagnostics gathered in the same forward (model/diagnostics.py) equal their definitions
    on the reference probabilities of the stream's keys (with sinks, rows sum to less than 1), and
    leave the output unchanged."""
    from fixtures.attention import reference_statistics
    from relpos_ablate.model.diagnostics import AttentionStatistics

    fields = SCHEMES[name]
    if not runs_on(fields, backend):
        pytest.skip("not a kernel of this scheme (runs_on)")
    attn = make(fields, backend, seed=12)
    x, mems = inputs(12, MEM)
    weight = (torch.rand(2, LQ, generator=torch.Generator().manual_seed(12)) > 0.3).double()
    stats = AttentionStatistics(1, HEADS, weight, max_seen_distance=4)
    with torch.no_grad():
        out, _ = attn(x, mems, AttentionOptions(statistics=stats.layer(0)))
        torch.testing.assert_close(out, attn(x, mems)[0], rtol=1e-9, atol=1e-12)
    _, probs = reference_attention(attn, x, mems)
    expected = reference_statistics(
        probs, MEM, weight, 4, None, attn.score_terms(x, mems)["visible"]
    )
    torch.testing.assert_close(stats.sums[:, 0], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", SCHEMES)
def test_bf16_autocast_forward_backward_matches_float32(name):
    """Under torch.autocast("cpu", bfloat16) every backend's output and gradients stay within 2.5%
    (of the norm) of float32, as for the older schemes (test_attention_precision.py explains the
    tolerance); FoX's float64 Λ and the sinks' fp32 slots meet bf16 queries and keys."""
    from fixtures.attention import BACKENDS, RTOL, forward_backward, relative_error

    fields = SCHEMES[name]
    gen = torch.Generator().manual_seed(1)
    x, mems = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    for backend, extra in BACKENDS.items():
        if not runs_on(fields, backend):
            continue
        attn = RelPosAttention(
            16, 2, 8, AttentionConfig(**{"query_chunk": 2, **fields, "backend": backend, **extra})
        )
        randomize(attn, 0, scale=0.2)
        out32, grads32 = forward_backward(attn, x, mems, autocast=False)
        out16, grads16 = forward_backward(attn, x, mems, autocast=True)
        assert relative_error([out16], [out32]) < RTOL, backend
        assert relative_error(grads16, grads32) < RTOL, backend


@pytest.mark.parametrize(
    "d_rot, xpos, scaling",
    [
        (8, None, None),
        (4, None, None),
        (8, 6.0, None),
        (8, None, RopeScaling("yarn", 3.0, original_length=4)),
    ],
)
def test_the_rotation_is_the_pairwise_turn_and_differentiable_to_second_order(d_rot, xpos, scaling):
    """schemes/rope.py's one-Function rotation against the turn written out here (x_p·cos -
    x_p+h·sin, x_p+h·cos + x_p·sin per pair p, angle position·θ_p, times xPos's ζ_p^(position/B) and
    YaRN's factor), in float64, with its first and second derivatives checked numerically (its
    backward is itself a rotation)."""
    from relpos_ablate.model.schemes.rope import rope_frequencies, rotate, xpos_decay

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([0, 2, 3, 7, 11])
    got = rotate(x, positions, d_rot, 100.0, scaling=scaling, xpos_scale_base=xpos)
    half = d_rot // 2
    angles = positions.double()[:, None] * rope_frequencies(d_rot, 100.0, scaling)[None]
    factor = 1.0 if scaling is None else scaling.attention_factor
    radius = factor * (
        1.0 if xpos is None else xpos_decay(d_rot)[None] ** (positions.double()[:, None] / xpos)
    )
    first, second = x[..., :half], x[..., half:d_rot]
    want = torch.cat(
        [
            radius * (first * angles.cos() - second * angles.sin()),
            radius * (second * angles.cos() + first * angles.sin()),
            x[..., d_rot:],
        ],
        dim=-1,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    turn = lambda t: rotate(t, positions, d_rot, 100.0, scaling=scaling, xpos_scale_base=xpos)  # noqa: E731
    assert torch.autograd.gradcheck(turn, (x,)) and torch.autograd.gradgradcheck(turn, (x,))
