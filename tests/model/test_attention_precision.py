"""Mixed precision: every backend × every term set × every bias type runs forward + backward under
`torch.autocast("cpu", torch.bfloat16)` with results close to float32, and a `bf16-mixed` training
run finishes. Run: pytest tests/model/test_attention_precision.py -q

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

from fixtures.attention import BACKENDS, RTOL, forward_backward, randomize, relative_error
from fixtures.training import tiny
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.train.run import train_run

TERM_SUBSETS = ["".join(c) for n in range(1, 5) for c in itertools.combinations("abcd", n)]


def make(terms, bias, **fields):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(terms=terms, bias=bias, query_chunk=2, **fields)
    )
    randomize(attn, 0, scale=0.2)
    return attn


def inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)


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
