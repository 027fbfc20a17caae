"""Mixed precision: every backend × every term set × every bias type runs forward + backward under
`torch.autocast("cpu", torch.bfloat16)` with results close to float32, and a `bf16-mixed` training
run finishes. Run: pytest tests/test_attention_precision.py -q

Tolerance: bfloat16 keeps 8 significant bits (unit roundoff 2^-9 ≈ 0.2%). Under autocast the
projections, the score products and the output product round their results to bf16, so a gradient
goes through ~10 such roundings; the worst relative error measured here over all 540 cases is
~0.9% (weights drawn at scale 0.2, logits of order 1). We accept 2.5% of the norm of the whole
gradient (all parameters and the input together, so a parameter whose true gradient is ~0, such as
a per-head constant bias under softmax, is not compared against its own rounding noise). A missing
or mis-scaled term moves the result by tens of percent.
"""

import itertools

import pytest
import torch

from conftest import randomize
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.model import BIAS_TYPES
from relpos_ablate.train.run import train_run
from test_train_module import tiny

TERM_SUBSETS = ["".join(c) for n in range(1, 5) for c in itertools.combinations("abcd", n)]
RTOL = 0.025


def make(terms, bias, **fields):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(terms=terms, bias=bias, query_chunk=2, **fields)
    )
    randomize(attn, 0, scale=0.2)
    return attn


def inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)


def relative_error(got, want) -> float:
    got = torch.cat([g.float().flatten() for g in got])
    want = torch.cat([w.flatten() for w in want])
    return ((got - want).norm() / want.norm()).item()


def forward_backward(attn, x, mems, autocast: bool):
    x = x.clone().requires_grad_(True)
    params = [p for p in attn.parameters() if p.requires_grad]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out, _ = attn(x, mems)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    grads = torch.autograd.grad((out.float() * weights).sum(), [x, *params], allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip([x, *params], grads)]


# backend 'auto' with max_stored_scores_mb=0 takes the rebuild-in-backward path, as long maps do
BACKENDS = {"explicit": {}, "blocks": {}, "sdpa": {}, "auto": {"max_stored_scores_mb": 0}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", BIAS_TYPES)
def test_bf16_autocast_forward_backward_matches_float32(backend, bias):
    x, mems = inputs()
    for terms in TERM_SUBSETS:
        attn = make(terms, bias, backend=backend, **BACKENDS[backend])
        out32, grads32 = forward_backward(attn, x, mems, autocast=False)
        out16, grads16 = forward_backward(attn, x, mems, autocast=True)
        assert relative_error([out16], [out32]) < RTOL, terms
        assert relative_error(grads16, grads32) < RTOL, terms


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("bias", ["none", "t5", "fire"])
def test_bf16_autocast_flex_forward_matches_float32(bias):
    """FlexAttention has no backward on CPU: forward only, and (slow in eager mode) the term sets
    that exercise each of its score_mod inputs: term b's product, the per-distance curve, u
    alone."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    x, mems = inputs()
    for terms in ("a", "abcd", "bd", "c"):
        attn = make(terms, bias, backend="flex")
        with torch.no_grad():
            out32, _ = attn(x, mems)
            with torch.autocast("cpu", torch.bfloat16):
                out16, _ = attn(x, mems)
        assert relative_error([out16], [out32]) < RTOL, terms


def test_bf16_mixed_training_run_end_to_end(tmp_path):
    """Terms b and d through the rebuild-in-backward kernel, with memory, trained and evaluated."""
    cfg = tiny(
        "train.precision=bf16-mixed",
        "model.attention.backend=blocks",
        "model.attention.bias=fire",
        "model.mem_len=8",
        "train.max_steps=4",
        "train.log_every=1",
        "eval.settings=[{segment_len: 16}]",
    )
    assert train_run(cfg, tmp_path) == "done"
    metrics = (tmp_path / "eval.json").read_text()
    assert "NaN" not in metrics and "Infinity" not in metrics
