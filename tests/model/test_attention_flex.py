"""FlexAttention path (backend='flex') against the float64 reference. FlexAttention has no backward
on CPU, so here the forward runs eagerly under no_grad; with CUDA, compiled forward+backward run
too. Run: pytest tests/model/test_attention_flex.py -q"""

import copy
import dataclasses

import pytest
import torch
from torch import Tensor

from fixtures.attention import randomize
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.kernels import flex

pytest.importorskip("torch.nn.attention.flex_attention")
CASES = [
    dict(terms="abcd"),
    dict(terms="bd", clamp_len=3),
    dict(terms="a", bias="t5", num_buckets=8, max_distance=6),
    dict(terms="ac", bias="alibi"),
    dict(terms="d", bias="kerple_log"),
    dict(terms="a", bias="kerple_power"),  # the closed form (no term d folded in)
    dict(terms="a", bias="fire"),
    dict(terms="a", absolute="rope"),
    dict(terms="abcd", bias="xl_table", max_distance=3),
]


def make(d_head=8, **fields):
    attn = RelPosAttention(16, 2, d_head, AttentionConfig(backend="flex", **fields)).double()
    randomize(attn, 5)
    return attn


# causal terms abcd, and term a with T5 (8 buckets, 6), FIRE or RoPE, with and without memory, are
# cases of tests/model/test_parity_matrix.py: not repeated here
MATRIX = [
    dict(terms="abcd"),
    dict(terms="a", bias="t5", num_buckets=8, max_distance=6),
    dict(terms="a", bias="fire"),
    dict(terms="a", absolute="rope"),
]
FORWARD_CASES = [
    (fields, causal, n_mem)
    for fields in CASES
    for causal in (True, False)
    for n_mem in (0, 3)
    if not (causal and fields in MATRIX)
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "fields, causal, n_mem",
    FORWARD_CASES,
    ids=[f"{n}-{c}-{f}" for f, c, n in FORWARD_CASES],
)
def test_flex_forward_matches_reference(fields, causal, n_mem):
    attn = make(causal=causal, **fields)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    mems = torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None
    ref, _ = reference_attention(attn, x, mems)
    with torch.no_grad():
        out, _ = attn(x, mems)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_same_length_and_padding():
    attn = make(terms="abcd", bias="alibi")
    x, mems = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[0, 1] = True
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, mems, AttentionOptions(window=2))[0],
            reference_attention(attn, x, mems, window=2)[0],
        )
        torch.testing.assert_close(
            attn(x, mems, AttentionOptions(key_padding_mask=padding))[0],
            reference_attention(attn, x, mems, padding=padding)[0],
        )


@pytest.fixture
def ieee_fp32():
    """fp32 products in IEEE single precision (TF32 off) on CUDA for the test, restored after."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = saved


def attention_and_gradients(module, backend: str, x: Tensor, mems: Tensor, grad=True) -> dict:
    """{name: tensor}: the output and the gradients of x and every parameter of a fixed loss (with
    grad)."""
    module.config = dataclasses.replace(module.config, backend=backend)
    x = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, _ = module(x, mems)
    if not grad:
        return {"out": out}
    names, params = ["x"], [x]
    for name, p in module.named_parameters():
        names.append(name)
        params.append(p)
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    return {"out": out.detach(), **{n: g for n, g in zip(names, grads) if g is not None}}


def compare_with_float64(fields: dict, device: str, backends: tuple[str, ...], grad=True) -> None:
    """Each backend in fp32 on `device` against the explicit path in float64, the output and every
    gradient: its largest error at most 16x that of the explicit path run in fp32 on the same device
    (the formula's own fp32 rounding: the yardstick) plus 2e-5 of the tensor's largest entry. An
    entry is a sum of terms as large as the tensor's largest, or larger (a per-head constant's
    gradient sums to 0 over each row: 1e-12 in float64, 3e-4 in fp32), so its fp32 error scales
    with those terms, not with its value: a relative test per entry asserts what fp32 cannot
    give."""
    attn = make(d_head=16, **fields)  # compiled FlexAttention needs heads of >= 16 channels
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 256, 16, generator=gen, dtype=torch.float64)
    mems = torch.randn(2, 64, 16, generator=gen, dtype=torch.float64)

    def fp32(backend):
        fast = copy.deepcopy(attn).float().to(device)
        got = attention_and_gradients(
            fast, backend, x.float().to(device), mems.float().to(device), grad
        )
        return {name: g.cpu().double() for name, g in got.items()}

    want = attention_and_gradients(attn, "explicit", x, mems, grad)
    yardstick = fp32("explicit")
    for backend in backends:
        got = fp32(backend)
        assert got.keys() == want.keys()
        for name, w in want.items():
            error = (got[name] - w).abs().max().item()
            bound = 16 * (yardstick[name] - w).abs().max().item() + 2e-5 * w.abs().max().item()
            assert error <= bound, f"{backend} {name}: error {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("fields", CASES, ids=[str(c) for c in CASES])
def test_the_block_kernel_in_fp32_matches_float64_within_scale(fields):
    """The CUDA test's comparison below, on the CPU for the block kernel (FlexAttention has no CPU
    backward)."""
    compare_with_float64(fields, "cpu", ("blocks",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fields", CASES, ids=[str(c) for c in CASES])
def test_flex_cuda_forward_and_backward_match_float64(fields, ieee_fp32):
    """Compiled FlexAttention and the block kernel in fp32 on CUDA against the explicit path in
    float64, output and every gradient (compare_with_float64). The two fp32 kernels were once
    compared with each other entry by entry (rtol = atol = 5e-3): terms abcd failed on 2 of 512
    gradient entries (|diff| <= 0.0068) while both agreed with float64 to 9.4e-7 of the norm: on the
    CPU the block kernel's and the fp32 explicit path's largest errors against float64 are of the
    same size (test above), and an entrywise relative test fails on cancelled entries whatever the
    kernel. FIRE: FlexAttention forward only (flex.untrusted_gradient), the block kernel both."""
    if fields.get("bias") != "fire":
        compare_with_float64(fields, "cuda", ("flex", "blocks"))
        return
    compare_with_float64(fields, "cuda", ("blocks",))
    compare_with_float64(fields, "cuda", ("flex",), grad=False)
    fast = make(d_head=16, **fields).float().cuda()
    with pytest.raises(ValueError, match="cannot train the score term"):
        fast(torch.randn(2, 256, 16, device="cuda", requires_grad=True))


@pytest.mark.parametrize("causal", [True, False])
def test_fire_pair_scores_unit_by_unit_and_as_one_product_are_its_mlp(causal):
    """FIRE's two per-pair forms (pair_score: pointwise, for compiled FlexAttention;
    eager_pair_score: one product over the hidden units, under vmap) against the MLP written out
    here, in float64, for queries on both sides of the threshold and keys on both sides of the
    query."""
    attn = make(terms="a", bias="fire", causal=causal)
    scheme = attn.bias_scheme
    with torch.no_grad():
        scheme.threshold.fill_(6.0)
    first, _, second = scheme.mlp
    q_pos = torch.arange(12, dtype=torch.float64)
    k_pos = torch.arange(-3, 12, dtype=torch.float64)
    c, threshold = scheme.c.abs(), scheme.threshold.abs()
    psi = lambda x: torch.sign(x) * torch.log(1 + c * x.abs())  # noqa: E731
    # [Lq, K]
    x = psi(q_pos[:, None] - k_pos[None, :]) / psi(torch.maximum(q_pos, threshold))[:, None]
    hidden = torch.relu(x[..., None] * first.weight[:, 0] + first.bias)  # [Lq, K, 32]
    expected = (hidden @ second.weight.T + second.bias).permute(2, 0, 1)  # [H, Lq, K]

    heads = torch.arange(scheme.n_heads)
    for form in (scheme.pair_score, scheme.eager_pair_score):
        per_key = torch.vmap(form, in_dims=(None, 0, None))
        per_query = torch.vmap(per_key, in_dims=(0, None, None))
        per_head = torch.vmap(per_query, in_dims=(None, None, 0))
        with torch.no_grad():
            got = per_head(q_pos, k_pos, heads)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_compiled_flex_with_heads_under_16_channels_says_so(monkeypatch):
    """Compiled FlexAttention (CUDA) cannot lower heads narrower than 16 channels (inductor's
    NotImplementedError, seen on an H200): a pinned 'flex' says so in one line; 'auto' never sends
    such heads there (dispatch.py)."""
    monkeypatch.setattr(flex, "compiles", lambda q: True)
    monkeypatch.setattr(flex, "min_head_dim", lambda device_type: 16)  # CUDA's least, here on CPU
    attn = make(terms="a", bias="alibi").float()
    with pytest.raises(
        ValueError, match=r"model.attention.backend: 'flex' on cpu needs d_head >= 16.*got 8"
    ):
        attn(torch.randn(1, 4, 16))


def test_training_fire_through_compiled_flex_is_refused_and_auto_leaves_it_to_the_others(
    monkeypatch,
):
    """FIRE's gradient through compiled FlexAttention differed from the block kernel's on an H200: a
    pinned 'flex' refuses to train it in one line (its forward stays: test_compiled_flex.py), and
    flex.untrusted_gradient, which keeps 'auto' off FlexAttention on CUDA, says so only where the
    parameters of a term whose point form's gradient is not trusted need gradients."""
    monkeypatch.setattr(flex, "compiles", lambda q: True)
    fire, alibi = make(terms="a", bias="fire").float(), make(terms="a", bias="alibi").float()
    x = torch.randn(1, 4, 16)
    with pytest.raises(
        ValueError,
        match=r"model.attention.backend: 'flex' on cpu cannot train the score term 'bias'",
    ):
        fire(x)
    call, _, _ = fire.kernel_call(x)
    assert flex.untrusted_gradient(call) and not flex.untrusted_gradient(alibi.kernel_call(x)[0])
    with torch.no_grad():
        assert not flex.untrusted_gradient(fire.kernel_call(x)[0])
    fire.bias_scheme.requires_grad_(False)
    assert not flex.untrusted_gradient(fire.kernel_call(x)[0])


def test_compiling_flex_raises_dynamos_recompile_limit_and_never_lowers_it():
    """Each score_mod structure, dtype, autocast state and shape compiles flex_attention once more;
    past dynamo's limit (8) it would run eagerly with the whole score matrix (20-85x slower on an
    H200): the first compiled kernel raises the limit, and a user's larger one stays."""
    config = torch._dynamo.config
    # (dynamo's config module: no monkeypatch)
    saved = (config.recompile_limit, config.accumulated_recompile_limit)
    flex._kernel.cache_clear()
    try:
        config.recompile_limit, config.accumulated_recompile_limit = 8, 256
        flex._kernel(True)
        assert config.recompile_limit == flex.RECOMPILE_LIMIT
        assert config.accumulated_recompile_limit == 4 * flex.RECOMPILE_LIMIT
        config.recompile_limit = 10_000
        flex._kernel.cache_clear()
        flex._kernel(True)
        assert config.recompile_limit == 10_000
    finally:
        config.recompile_limit, config.accumulated_recompile_limit = saved
        flex._kernel.cache_clear()


CLOSED_FORMS = ["alibi", "alibi_learned", "kerple_log", "kerple_power"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("bias", CLOSED_FORMS)
def test_a_bias_with_a_closed_form_is_not_read_from_its_table(bias, causal):
    """The score_mod of ALiBi and KERPLE computes B_h(|i - j|) per pair (BiasScheme.point_curve),
    not a gather from the [H, n] table: with the table replaced by NaN the output equals the float64
    reference (memory, and a window where causal)."""
    attn = make(terms="a", bias=bias, causal=causal)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    mems = torch.randn(2, 4, 16, dtype=torch.float64)
    options = AttentionOptions(window=5 if causal else None)
    with torch.no_grad():
        call, q_content, _ = attn.kernel_call(x, mems, options)
        assert call.distance_point is not None
        table = torch.full_like(call.distance_scores, float("nan"))
        poisoned = dataclasses.replace(call, inputs=call.inputs._replace(distance_scores=table))
        _, k, v = attn._project(x, torch.cat([mems, x], 1), call.placement, None)
        out = flex.flex_attend(poisoned, q_content, k, v, None)
        want, _ = reference_attention(attn, x, mems, window=options.window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(attn.out_net(out.transpose(1, 2).flatten(2)), want)


@pytest.mark.parametrize("bias", CLOSED_FORMS)
def test_the_closed_form_equals_the_curve_and_its_gradient(bias):
    """point_curve(head, r) over every head and distance is curve(distances) (float64, distance 0
    and a parameter on its floor included), and so are the gradients of its parameters
    (FlexAttention differentiates the captured parameters on CUDA; CPU has no FlexAttention
    backward)."""
    attn = make(terms="a", bias=bias)
    scheme = attn.bias_scheme
    with torch.no_grad():  # a KERPLE parameter on the clamp's floor
        for p in scheme.parameters():
            p[0] = 0.01
    distances = torch.arange(40, -1, -1)
    weights = torch.randn(2, distances.numel(), dtype=torch.float64)
    heads = torch.arange(2)[:, None]
    sums = [
        (scheme.curve(distances) * weights).sum(),
        (scheme.point_curve()(heads, distances.abs()[None]) * weights).sum(),
    ]
    torch.testing.assert_close(sums[1], sums[0], rtol=1e-12, atol=0)
    params = list(scheme.parameters())
    if params:
        want, got = (torch.autograd.grad(total, params) for total in sums)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_a_bias_without_a_closed_form_is_read_from_its_table():
    """Sandwich (d/2 cosines per pair), T5 and the XL table give no closed form: the kernel reads
    the table."""
    for bias in ("sandwich", "t5", "xl_table"):
        with torch.no_grad():
            call, _, _ = make(terms="a", bias=bias).kernel_call(torch.randn(1, 5, 16).double())
        assert call.distance_point is None and call.distance_scores is not None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_block_mask_is_built_once_per_shape_across_layers_and_steps():
    flex._block_mask.cache_clear()
    layers = [make(terms="a", bias="alibi") for _ in range(2)]
    with torch.no_grad():
        for _step in range(2):
            for attn in layers:
                attn(torch.randn(1, 8, 16, dtype=torch.float64))
    assert flex._block_mask.cache_info().misses == 1
    assert flex._block_mask.cache_info().hits == 3


def test_a_compiled_call_that_takes_gradients_pins_the_triton_kernel():
    """FlexAttention's FLASH backend has no backward for captured tensors that require grad: with
    gradients the compiled call asks for the Triton kernel, without them it leaves AUTO's choice."""
    assert flex._knows_backend()  # torch 2.13
    assert flex.kernel_options(compiled=True) == {"BACKEND": "TRITON"}
    with torch.no_grad():
        assert flex.kernel_options(compiled=True) is None
    assert flex.kernel_options(compiled=False) is None


def test_auto_leaves_term_b_to_the_block_kernel_and_a_plain_call_to_sdpa_on_cuda():
    """'auto' on CUDA never sends term b to FlexAttention (it would hold a [B, H, L, M + 2L - 1]
    tensor), nor a call with nothing added or masked but causality (NoPE, RoPE: one SDPA call,
    its flash kernel); other calls it does (a bias, a window), and a pinned 'flex' keeps term b."""
    from relpos_ablate.model.kernels.dispatch import prefers_flex

    for fields, expected in (
        (dict(terms="abcd", bias="alibi"), False),
        (dict(terms="ac", bias="alibi"), True),
        (dict(terms="a"), False),
        (dict(terms="a", absolute="rope"), False),
        (dict(terms="a", absolute="rope", window=4), True),
    ):
        attn = RelPosAttention(16, 2, 16, AttentionConfig(**fields)).double()
        with torch.no_grad():
            call, q_content, q_position = attn.kernel_call(
                torch.randn(1, 8, 16, dtype=torch.float64)
            )
        assert prefers_flex(call, q_content, q_position, attn.config, 0.0, cuda=True) is expected
        assert not prefers_flex(call, q_content, q_position, attn.config, 0.0, cuda=False)
    pinned = make(d_head=16, terms="abcd")
    with torch.no_grad():
        call, q_content, q_position = pinned.kernel_call(torch.randn(1, 8, 16, dtype=torch.float64))
    assert prefers_flex(call, q_content, q_position, pinned.config, 0.0, cuda=True)
