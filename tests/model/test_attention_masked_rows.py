"""A query that sees no key at all (every key it could see is padded) behaves the same on every
backend: its output and probabilities are 0, and it adds nothing (and no NaN) to any gradient.
Run: pytest tests/model/test_attention_masked_rows.py -q"""

import pytest
import torch

from fixtures.attention import randomize
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model import AttentionOptions

CASES = [
    dict(terms="abcd", bias="alibi"),
    dict(terms="bd", bias="fire"),
    dict(terms="a", absolute="rope"),
]
BACKENDS = ["explicit", "blocks", "sdpa", "auto"]


def make(backend, **fields):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(backend=backend, query_chunk=2, **fields)
    ).double()
    randomize(attn, 1)
    return attn


def inputs():
    """x [2, 5, 16] and a padding mask hiding key 0 of example 0: causal query 0 there sees
    nothing."""
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 0] = True
    return x, padding


@pytest.mark.parametrize("fields", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_query_gives_zero_output_and_clean_gradients(backend, fields):
    attn = make(backend, **fields)
    x, padding = inputs()
    x.requires_grad_(True)
    out, _ = attn(x, None, AttentionOptions(key_padding_mask=padding))
    assert out[0, 0].abs().max() == 0
    ref, _ = reference_attention(attn, x.detach(), padding=padding)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-6, atol=1e-9)
    params = [x, *attn.parameters()]
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
    others = torch.ones_like(out)
    others[0, 0] = 0  # the same loss without the masked row: its gradients must be identical
    out2, _ = attn(x, None, AttentionOptions(key_padding_mask=padding))
    grads_without = torch.autograd.grad((out2 * weights * others).sum(), params, allow_unused=True)
    for g, g2 in zip(grads, grads_without):
        if g is None:
            continue
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, g2, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fields", CASES, ids=[str(c) for c in CASES])
def test_fully_masked_query_has_zero_probabilities(fields):
    attn = make("explicit", **fields)
    x, padding = inputs()
    _, probs = attn(x, None, AttentionOptions(key_padding_mask=padding), need_weights=True)
    assert probs[0, :, 0].abs().max() == 0
    torch.testing.assert_close(probs[0, :, 1:].sum(-1), torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("fields", CASES, ids=[str(c) for c in CASES])
def test_fully_masked_query_on_flex(fields):
    """FlexAttention has no backward on CPU: forward only."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    attn = make("flex", **fields)
    x, padding = inputs()
    with torch.no_grad():
        out, _ = attn(x, None, AttentionOptions(key_padding_mask=padding))
    assert out[0, 0].abs().max() == 0
    torch.testing.assert_close(
        out, reference_attention(attn, x, padding=padding)[0], rtol=1e-6, atol=1e-9
    )
