"""RelPosAttention equals the float64 reference (tests/fixtures/reference.py, written from
docs/schemes/index.md) for every term subset × memory × causal/bidirectional × built-in bias type
(BIAS_TYPES, from the registry), on both kernels (SDPA query blocks and explicit scores), with
random weights. Schemes registered from outside the package have no reference formula here:
test_bias_registry.py checks their kernels, memory and causality. Run: pytest
tests/model/test_attention_reference.py -q"""

import itertools

import pytest
import torch

from fixtures.attention import D_HEAD, D_MODEL, HEADS, LQ, MEM, inputs, randomize
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.model import AttentionOptions

TERM_SUBSETS = ["".join(c) for n in range(1, 5) for c in itertools.combinations("abcd", n)]


def make(seed=0, **fields):
    # several blocks even at L=5, so block boundaries are tested
    fields.setdefault("query_chunk", 2)
    if fields.get("bias") == "t5":
        fields.setdefault("num_buckets", 8)
        fields.setdefault("max_distance", 6)
    elif fields.get("bias") == "xl_table":
        # smaller than the distances used: the clamp is exercised
        fields.setdefault("max_distance", 3)
    attn = RelPosAttention(D_MODEL, HEADS, D_HEAD, AttentionConfig(**fields)).double()
    randomize(attn, seed)
    return attn


def assert_matches_reference(attn, x, mems, **kw):
    ref_out, ref_probs = reference_attention(attn, x, mems, **kw)
    options = AttentionOptions(
        clamp_len=kw.get("clamp_len"), window=kw.get("window"), key_padding_mask=kw.get("padding")
    )
    fast, none = attn(x, mems, options)
    slow, probs = attn(x, mems, options, need_weights=True)
    assert none is None
    torch.testing.assert_close(fast, ref_out, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(slow, ref_out, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("bias", BIAS_TYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("n_mem", [0, MEM], ids=["nomem", "mem"])
def test_every_term_subset_matches_reference(bias, causal, n_mem):
    for i, terms in enumerate(TERM_SUBSETS):
        attn = make(seed=i, terms=terms, bias=bias, causal=causal)
        x, mems = inputs(i, n_mem)
        assert_matches_reference(attn, x, mems)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shaw_values", [False, True])
def test_shaw_learned_clipped_r_matches_reference(causal, shaw_values):
    attn = make(terms="ab", rel="learned", clamp_len=2, causal=causal, shaw_values=shaw_values)
    x, mems = inputs(1, MEM)
    assert_matches_reference(attn, x, mems)


@pytest.mark.parametrize("causal", [True, False])
def test_clamp_len_and_its_evaluation_override(causal):
    attn = make(terms="abcd", clamp_len=3, causal=causal)
    x, mems = inputs(2, MEM)
    assert_matches_reference(attn, x, mems)
    assert_matches_reference(attn, x, mems, clamp_len=1)


def test_learned_r_cannot_be_unclamped_beyond_its_table():
    attn = make(terms="ab", rel="learned", clamp_len=2)
    with pytest.raises(ValueError, match="clamp_len: 5 exceeds the learned table"):
        attn(*inputs(0, 0), AttentionOptions(clamp_len=5))


@pytest.mark.parametrize("n_mem", [0, MEM])
def test_rope_matches_reference(n_mem):
    attn = make(terms="a", absolute="rope", bias="alibi")
    assert_matches_reference(attn, *inputs(3, n_mem))


@pytest.mark.parametrize(
    "score_scale, bias_scaled", [("none", False), ("sqrt_d", True), ("none", True)]
)
def test_scaling_conventions(score_scale, bias_scaled):
    attn = make(terms="abcd", bias="t5", score_scale=score_scale, bias_scaled=bias_scaled)
    assert_matches_reference(attn, *inputs(4, MEM))


@pytest.mark.parametrize("bias", ["none", "alibi", "fire"])
def test_same_length(bias):
    attn = make(terms="abcd", bias=bias)
    assert_matches_reference(attn, *inputs(5, MEM), window=2)


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_mask(causal):
    attn = make(terms="abcd", bias="xl_table", causal=causal)
    x, mems = inputs(6, MEM)
    padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
    padding[0, :2] = True
    padding[1, -1] = True
    assert_matches_reference(attn, x, mems, padding=padding)


@pytest.mark.parametrize("chunk", [0, 1, 3, 64])
def test_query_block_size_does_not_change_the_result(chunk):
    attn = make(terms="abcd", bias="t5", query_chunk=chunk)
    assert_matches_reference(attn, *inputs(7, MEM))


def test_float32_module_is_close_to_float64_reference():
    attn = make(terms="abcd", bias="kerple_log")
    x, mems = inputs(8, MEM)
    ref, _ = reference_attention(attn, x, mems)
    out, _ = attn.float()(x.float(), mems.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "terms, bias, causal",
    [("abcd", "t5", True), ("bd", "fire", False), ("ab", "kerple_power", True)],
)
def test_gradients_match_finite_differences(terms, bias, causal):
    attn = make(terms=terms, bias=bias, causal=causal, max_distance=6 if bias == "t5" else 128)
    x, mems = inputs(9, 2, batch=1)
    x.requires_grad_(True)
    params = list(attn.parameters())
    assert torch.autograd.gradcheck(lambda x: attn(x, mems)[0], (x,), eps=1e-6, atol=1e-6)
    out = attn(x, mems)[0].square().sum()
    grads = torch.autograd.grad(out, params, allow_unused=True)
    for p, g in zip(params, grads):
        if g is None:
            continue
        idx = tuple(0 for _ in p.shape)
        with torch.no_grad():
            orig = p[idx].item()
            p[idx] = orig + 1e-6
            up = attn(x, mems)[0].square().sum().item()
            p[idx] = orig - 1e-6
            down = attn(x, mems)[0].square().sum().item()
            p[idx] = orig
        assert abs((up - down) / 2e-6 - g[idx].item()) < 1e-5 * max(1.0, abs(g[idx].item()))


def test_terms_are_really_off():
    """A disabled term has no parameters and no effect: u/v/W_R do not exist when unused."""
    attn = make(terms="a")
    assert attn.content_bias_u is None and attn.position_bias_v is None and attn.r_net is None
    attn = make(terms="ac")
    assert attn.position_bias_v is None and attn.r_net is None and attn.content_bias_u is not None


def test_score_terms_sum_to_the_scores():
    attn = make(terms="abcd", bias="alibi")
    x, mems = inputs(10, MEM)
    maps = attn.score_terms(x, mems)
    total = maps["a"] + maps["b"] + maps["c"] + maps["d"] + maps["bias"]
    _, ref_probs = reference_attention(attn, x, mems)
    probs = total.masked_fill(~maps["visible"], float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-9)


SCALED_CASES = [
    dict(terms="abcd", bias="t5", bias_scaled=True, score_scale="log_n", log_n_length=8),
    dict(terms="ab", score_scale="none", learned_temperature=True),
    dict(terms="a", forget_gate=True, cope_positions=3),
]


@pytest.mark.parametrize(
    "fields", SCALED_CASES, ids=["log_n-t5-scaled", "unscaled-temperature", "fox-cope"]
)
def test_score_term_maps_are_the_softmax_input_as_they_enter_it(fields):
    """The README's promise: the maps already carry every scale (1/sqrt(d_head), log-n,
    temperature), so their sum with the mask, softmaxed, is the attention's own probabilities."""
    attn = make(seed=3, **fields)
    x, mems = inputs(10, MEM)
    maps = attn.score_terms(x, mems)
    total = sum(value for name, value in maps.items() if name != "visible")
    _, probs = attn(x, mems, need_weights=True)
    torch.testing.assert_close(
        total.masked_fill(~maps["visible"], float("-inf")).softmax(-1), probs, rtol=1e-6, atol=1e-9
    )


def test_score_term_maps_include_the_one_over_sqrt_d_head_scale():
    scaled, plain = make(seed=4, terms="abcd"), make(seed=4, terms="abcd", score_scale="none")
    x, mems = inputs(11, MEM)
    for name, value in plain.score_terms(x, mems).items():
        if name != "visible":
            torch.testing.assert_close(scaled.score_terms(x, mems)[name] * D_HEAD**0.5, value)


# causal attention with term a and a bias, or terms abcd without one, is a case of
# tests/model/test_parity_matrix.py (memory, every kernel): not repeated here
GRAD_CASES = [
    (terms, bias, causal)
    for bias in BIAS_TYPES
    for terms in ("a", "abcd", "bd", "c")
    for causal in (True, False)
    if not (causal and (terms, bias != "none") in (("a", True), ("abcd", False)))
]


@pytest.mark.parametrize(
    "terms, bias, causal",
    GRAD_CASES,
    ids=[f"{'causal' if c else 'bidir'}-{t}-{b}" for t, b, c in GRAD_CASES],
)
@pytest.mark.parametrize("backend", ["blocks", "sdpa"])
def test_fast_backward_equals_autograd_of_explicit_scores(terms, bias, causal, backend):
    """The block kernel's hand-written backward (scores and bias rebuilt per block) and the SDPA
    path give the same gradients, for every parameter and the input, as autograd through the
    explicit scores."""
    attn = make(seed=11, terms=terms, bias=bias, causal=causal, backend=backend)
    x, mems = inputs(12, MEM)
    grads = []
    for explicit in (False, True):
        xx = x.clone().requires_grad_(True)
        out, _ = attn(xx, mems, need_weights=explicit)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        params = [p for p in attn.parameters()]
        grads.append(torch.autograd.grad((out * weights).sum(), [xx] + params, allow_unused=True))
    for fast, slow in zip(*grads):
        if slow is None:
            assert fast is None or fast.abs().max() == 0
            continue
        torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("threshold", [2.5, 100.0])
@pytest.mark.parametrize("backend", ["blocks", "sdpa", "explicit"])
def test_fire_curve_shortcut_and_pairwise_blocks_both_match(backend, threshold):
    """Blocks whose queries all sit below FIRE's threshold use a per-distance curve, later blocks
    the full (i, j) evaluation: with the threshold at 2.5 and blocks of 2 queries, both kinds occur.
    With every query below it (100) the whole call's bias is one curve over distances, as a
    distance-only bias's."""
    attn = make(terms="a", bias="fire", backend=backend)
    with torch.no_grad():
        attn.bias_scheme.threshold.fill_(threshold)
    x, _ = inputs(13, 0)
    x.requires_grad_(True)
    assert_matches_reference(attn, x, None)
    out, _ = attn(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *attn.bias_scheme.parameters()])
    ref_attn = make(terms="a", bias="fire", backend="explicit")
    ref_attn.load_state_dict(attn.state_dict())
    ref_out, _ = ref_attn(x, need_weights=True)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [x, *ref_attn.bias_scheme.parameters()])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-10)
