"""Stick-breaking, PaTH and DAPE / DAPE v2, the schemes that read the materialised scores (the
normaliser, logit product and score-transform seams of the explicit and per-block paths): known
values by hand, the exact chunked PaTH product against itself at every chunk size, float64 gradients
against finite differences, fp32 against the float64 reference forward and backward, one-line config
errors, and a tiny grid of the four presets through the CLI. The float64 reference on every backend,
with memory, padding, windows and explicit positions: tests/model/test_newer_schemes.py (SCHEMES).
Run: pytest tests/model/test_materialised_schemes.py -q"""

import math

import pytest
import torch
from torch.func import functional_call

from fixtures.attention import randomize
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config import ConfigError
from relpos_ablate.model.schemes.path import path_logits
from relpos_ablate.model.schemes.stick_breaking import stick_breaking

SCHEMES = {
    "stick_breaking": dict(terms="a", normaliser="stick_breaking"),
    "path": dict(terms="a", path=True),
    "dape": dict(terms="a", bias="kerple_log", dape="v1", dape_width=4),
    "dape_v2": dict(terms="a", bias="kerple_log", dape="v2", dape_width=3),
}


def test_stick_breaking_by_hand():
    """Three earlier keys with z = 0 (β = 1/2) and the query's own key: the nearest takes 1/2, the
    next 1/4, the first 1/8, the own key the remaining 1/8; a key outside the window breaks
    nothing."""
    scores = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    own = torch.tensor([[False, False, False, True]])
    weights = stick_breaking(scores, torch.ones(1, 4, dtype=torch.bool), own)
    torch.testing.assert_close(
        weights[0, 0, 0], torch.tensor([1 / 8, 1 / 4, 1 / 2, 1 / 8], dtype=torch.float64)
    )
    windowed = stick_breaking(scores, torch.tensor([[False, True, True, True]]), own)
    torch.testing.assert_close(
        windowed[0, 0, 0], torch.tensor([0, 1 / 4, 1 / 2, 1 / 4], dtype=torch.float64)
    )
    # z = log 3 on the nearest key (β = 3/4): it takes 3/4, the one before 1/4·1/2
    scores[..., 2] = math.log(3)
    weights = stick_breaking(scores, torch.ones(1, 4, dtype=torch.bool), own)
    torch.testing.assert_close(
        weights[0, 0, 0], torch.tensor([1 / 16, 1 / 8, 3 / 4, 1 / 16], dtype=torch.float64)
    )


def test_stick_breaking_keeps_far_keys_in_fp32():
    """A long row of large negative logs: the suffix sums are formed as sums, never as a difference
    of two large totals, so a key far back keeps its tiny weight to fp32 precision."""
    z = torch.full((1, 1, 1, 2001), 3.0)  # each nearer key keeps σ(-3) ≈ 0.047 of the stick
    own = torch.zeros(1, 2001, dtype=torch.bool)
    own[0, -1] = True
    weights = stick_breaking(z, torch.ones(1, 2001, dtype=torch.bool), own)
    expected = torch.sigmoid(torch.tensor(3.0, dtype=torch.float64)) * torch.sigmoid(
        torch.tensor(-3.0, dtype=torch.float64)
    ) ** torch.arange(1999, -1, -1)
    near = expected > 1e-30
    torch.testing.assert_close(
        weights[0, 0, 0, :-1][near].double(), expected[near], rtol=1e-4, atol=0
    )


def test_path_product_by_hand():
    """K = 3, the query at index 2: H_1 a reflection of e_1 (β = 2), H_2 = I - e_2e_2ᵀ (β = 1). With
    q = e_1: key 0 = e_1 meets H_2 H_1 e_1 = -e_1 (logit -1); key 1 = e_2 meets H_2 e_2 = 0 (logit
    0); key 2 = e_1 itself (logit 1)."""
    e = torch.eye(3, dtype=torch.float64)
    q = e[0].view(1, 1, 1, 3)
    k = torch.stack([e[0], e[1], e[0]]).view(1, 1, 3, 3)
    w = torch.stack([e[2], e[0], e[1]]).view(1, 1, 3, 3)
    beta = torch.tensor([0.7, 2.0, 1.0], dtype=torch.float64).view(1, 1, 3)
    for chunk in (1, 2, 3):
        torch.testing.assert_close(
            path_logits(q, k, w, beta, chunk)[0, 0, 0],
            torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64),
        )


def test_path_chunks_give_the_same_logits():
    """Every chunk size (1 .. K and beyond) gives the same visible logits: the chunked carry is
    exact."""
    gen = torch.Generator().manual_seed(0)
    b, h, n_keys, n_queries, dh = 2, 3, 13, 9, 5
    q, k, w = (
        torch.randn(b, h, n, dh, generator=gen, dtype=torch.float64)
        for n in (n_queries, n_keys, n_keys)
    )
    w = torch.nn.functional.normalize(w, dim=-1)
    beta = 2 * torch.rand(b, h, n_keys, generator=gen, dtype=torch.float64)
    visible = torch.arange(n_keys)[None, :] <= torch.arange(n_keys - n_queries, n_keys)[:, None]
    logits = [path_logits(q, k, w, beta, chunk) * visible for chunk in range(1, 16)]
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-12, atol=1e-12)


def test_dape_by_hand():
    """One head, width 1: f = 2·LeakyReLU(X + B) (v1); X = 1, B = -3 gives 1 - 3 + 2·(-0.02) =
    -2.04. v2 with kernel 1 is the same map (no neighbours), with the hidden entries' inputs set
    to 0."""
    for version in ("v1", "v2"):
        attn = RelPosAttention(
            4,
            1,
            4,
            AttentionConfig(terms="a", bias="alibi", dape=version, dape_width=1, dape_kernel=1),
        ).double()
        first, second = attn.dape.net[0], attn.dape.net[2]
        with torch.no_grad():
            first.weight.copy_(torch.ones_like(first.weight))
            first.bias.zero_()
            second.weight.fill_(2.0)
            second.bias.zero_()
        other = torch.tensor([[[[1.0, 5.0]]]], dtype=torch.float64)
        bias = torch.tensor([[[[-3.0, 1.0]]]], dtype=torch.float64)
        out = attn.dape(other, bias, torch.tensor([[True, version == "v1"]]))
        # v2: the hidden pair's f reads zeros
        hidden = 5.0 + 1.0 + (12.0 if version == "v1" else 0.0)
        torch.testing.assert_close(out[0, 0, 0], torch.tensor([-2.04, hidden], dtype=torch.float64))


def make(fields, backend="sdpa", seed=0, dtype=torch.float64):
    attn = RelPosAttention(
        8, 2, 4, AttentionConfig(**{"query_chunk": 2, **fields, "backend": backend})
    )
    randomize(attn.double(), seed)
    return attn.to(dtype)


@pytest.mark.parametrize("name", SCHEMES)
def test_gradients_equal_finite_differences(name):
    """float64 gradcheck of the per-block path's output against the input, the memory-free input and
    every parameter (the schemes' own included)."""
    attn = make(SCHEMES[name])
    gen = torch.Generator().manual_seed(1)
    x, mems = (
        torch.randn(1, 4, 8, generator=gen, dtype=torch.float64),
        torch.randn(1, 2, 8, generator=gen, dtype=torch.float64),
    )
    names = [n for n, _ in attn.named_parameters()]

    def output(x_, *params):
        return functional_call(attn, dict(zip(names, params)), (x_, mems))[0]

    inputs = (x.requires_grad_(), *(p.detach().clone().requires_grad_() for p in attn.parameters()))
    assert torch.autograd.gradcheck(output, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize("name", SCHEMES)
def test_float32_matches_the_float64_reference_forward_and_backward(name, backend):
    """fp32 within 1e-5 of the float64 reference (forward) and of float64 autograd (every gradient),
    relative to the largest entry (or absolute below 1: DAPE's output bias adds a constant per row,
    which the softmax ignores, so its float64 gradient is rounding, ~1e-15), at 12 queries with 6
    memory keys."""
    fields = SCHEMES[name]
    gen = torch.Generator().manual_seed(2)
    x, mems = (
        torch.randn(2, 12, 8, generator=gen, dtype=torch.float64),
        torch.randn(2, 6, 8, generator=gen, dtype=torch.float64),
    )
    attn64 = make(fields, backend, seed=2)
    attn32 = make(fields, backend, seed=2, dtype=torch.float32)
    expected, _ = reference_attention(attn64, x, mems)
    grads = []
    for attn, dtype in ((attn64, torch.float64), (attn32, torch.float32)):
        xx = x.to(dtype).requires_grad_()
        out, _ = attn(xx, mems.to(dtype))
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
        grads.append(torch.autograd.grad((out * weights).sum(), [xx, *attn.parameters()]))
        if dtype == torch.float32:
            assert within(out.double(), expected)
    names = ["x", *(n for n, _ in attn32.named_parameters())]
    for name_, slow, fast in zip(names, *grads):
        assert within(fast.double(), slow), name_


def within(value, expected, tolerance=1e-5):
    return (value - expected).abs().max() <= tolerance * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(normaliser="sparsemax"), "normaliser"),
        (dict(normaliser="stick_breaking", causal=False), "normaliser"),
        (dict(normaliser="stick_breaking", sinks=2), "sinks"),
        (dict(path=True, terms="ab"), "path"),
        (dict(path=True, absolute="rope"), "path"),
        (dict(path=True, cope_positions=4), "path"),
        (dict(dape="v3", bias="alibi"), "dape"),
        (dict(dape="v1"), "dape"),
        (dict(dape="v2", bias="alibi", dape_kernel=4), "dape_kernel"),
        (dict(dape="v1", bias="alibi", dape_width=0), "dape_width"),
        (dict(path=True, backend="blocks"), "backend"),
        (dict(normaliser="stick_breaking", backend="flex"), "backend"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_bad_settings_get_one_line_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as err:
        AttentionConfig(**{"terms": "a", **fields})
    assert err.value.field == field and "\n" not in str(err.value)


def test_the_four_presets_train_in_a_tiny_grid_through_the_cli(tmp_path):
    """`relpos-ablate grid` on a spec of the presets stick_breaking, path, dape, dape_v2 (2 steps
    each, a worker process each, two at a time), then `table`: a row per preset with a finite
    perplexity at both evaluation lengths."""
    from fixtures.runner import write_spec
    from relpos_ablate.analysis import collect
    from relpos_ablate.cli import main

    spec = write_spec(
        tmp_path, name="materialised", encodings=list(SCHEMES), seeds=(0,), max_steps=2
    )
    results = tmp_path / "results"
    assert main(["grid", str(spec), "--results", str(results), "--slots", "2"]) == 0
    frame = collect(results / "materialised")
    assert set(frame["encoding"]) == set(SCHEMES)
    # two eval lengths a run
    assert (frame["status"] == "done").all() and len(frame) == 2 * len(SCHEMES)
    assert frame["loss"].map(math.isfinite).all() and frame["acc"].between(0, 1).all()
    assert main(["table", str(results / "materialised")]) == 0


def test_every_newer_preset_is_a_row_of_the_benchmark():
    """The presets of the 2024-25 schemes share their names with rows of benchmarks/attention.py
    (--schemes), each row the preset's fields."""
    import importlib.util
    from pathlib import Path

    from relpos_ablate.config.presets import presets

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"
    spec = importlib.util.spec_from_file_location("attention_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name in ("p_rope", "ssmax", *SCHEMES):
        row = dict(bench.SCHEMES[name])
        row.pop("log_n_length", None)  # the benchmark's length for SSMax; a run fills it in
        assert {
            k: v
            for k, v in presets()[name].items()
            if AttentionConfig.__dataclass_fields__[k].default != v
        } == row, name
