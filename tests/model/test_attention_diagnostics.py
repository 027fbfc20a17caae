"""Attention statistics (model/diagnostics.py) against a float64 computation, query by query.

The reference takes the float64 probabilities of tests/fixtures/reference.py and evaluates each
statistic by its definition with Python loops: entropy -Σ p log p, the mass on the first key the
query sees, the mean |i' - j|, the mass where |p_query - p_key| exceeds the training range; weighted
by the query mask and summed. The attention's own statistics come from the same forward that gives
its output, which they must not change. Run: pytest tests/model/test_attention_diagnostics.py -q"""

import math

import pytest
import torch

from fixtures.attention import randomize, reference_statistics
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, ModelConfig, RelPosAttention, TransformerLM
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.diagnostics import STATISTICS, AttentionStatistics

D_MODEL, HEADS, LQ, MEM = 16, 2, 6, 3


CASES = [
    (dict(terms="abcd", bias="t5", num_buckets=8, max_distance=6), {}),
    (dict(terms="a", bias="alibi"), {"window": 3}),
    (dict(terms="a", absolute="rope"), {"positions": True}),
    (dict(terms="bd", bias="fire"), {"padding": True}),
    (dict(terms="ab", rel="learned", clamp_len=4, shaw_values=True), {"positions": True}),
    (dict(terms="a", causal=False), {}),
]


@pytest.mark.parametrize("fields, options", CASES, ids=[f"{f}-{sorted(o)}" for f, o in CASES])
@pytest.mark.parametrize("backend", ["explicit", "sdpa", "blocks"])
def test_statistics_match_their_definitions(fields, options, backend):
    attn = RelPosAttention(
        D_MODEL, HEADS, 8, AttentionConfig(backend=backend, query_chunk=2, **fields)
    ).double()
    randomize(attn, 3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, LQ, D_MODEL, generator=gen, dtype=torch.float64)
    mems = torch.randn(2, MEM, D_MODEL, generator=gen, dtype=torch.float64)
    positions = torch.tensor([0, 2, 3, 7, 8, 11, 15, 16, 20]) if options.get("positions") else None
    padding = None
    if options.get("padding"):
        padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
        padding[1, :2] = True
    weight = (torch.rand(2, LQ, generator=gen) > 0.3).double()
    max_seen = 4
    stats = AttentionStatistics(1, HEADS, weight, max_seen)
    call_options = AttentionOptions(
        window=options.get("window"), positions=positions, key_padding_mask=padding
    )
    with torch.no_grad():
        plain, _ = attn(x, mems, call_options)
        out, _ = attn(
            x,
            mems,
            AttentionOptions(
                window=options.get("window"),
                positions=positions,
                key_padding_mask=padding,
                statistics=stats.layer(0),
            ),
        )
    torch.testing.assert_close(out, plain, rtol=1e-9, atol=1e-12)
    _, probs = reference_attention(
        attn, x, mems, positions=positions, window=options.get("window"), padding=padding
    )
    visible = attn.score_terms(x, mems, call_options)["visible"]
    expected = reference_statistics(probs, MEM, weight, max_seen, positions, visible)
    torch.testing.assert_close(stats.sums[:, 0], expected, rtol=1e-9, atol=1e-12)
    means = stats.means()
    assert set(means) == set(STATISTICS)
    torch.testing.assert_close(means["entropy"][0], expected[0] / weight.sum())


def test_known_values_of_uniform_and_one_hot_attention():
    """Uniform attention over K visible keys: entropy log K, sink 1/K, mean distance (K - 1)/2; a
    query attending to itself only: entropy 0, distance 0."""
    attn = RelPosAttention(D_MODEL, HEADS, 8, AttentionConfig(terms="a", backend="blocks"))
    with torch.no_grad():
        attn.q_net.weight.zero_()  # every score 0: uniform over the visible keys
    x = torch.randn(1, LQ, D_MODEL)
    weight = torch.zeros(1, LQ)
    weight[0, LQ - 1] = 1.0  # count only the last query: it sees K = LQ keys
    stats = AttentionStatistics(1, HEADS, weight, max_seen_distance=2)
    with torch.no_grad():
        attn(x, None, AttentionOptions(statistics=stats.layer(0)))
    k = LQ
    expected = torch.tensor([math.log(k), 1 / k, (k - 1) / 2, (k - 3) / k], dtype=torch.float64)
    torch.testing.assert_close(
        stats.sums[:, 0], expected[:, None].expand(4, HEADS), rtol=1e-6, atol=1e-6
    )
    first = torch.zeros(1, LQ)
    first[0, 0] = 1.0  # the first query sees only itself
    stats = AttentionStatistics(1, HEADS, first, max_seen_distance=0)
    with torch.no_grad():
        attn(x, None, AttentionOptions(statistics=stats.layer(0)))
    torch.testing.assert_close(
        stats.sums[:, 0],
        torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)[:, None].expand(4, HEADS),
    )


def test_the_lm_gathers_every_layer_in_its_one_forward():
    """TransformerLM(statistics=...) gives each layer its slot; the sums equal those of inspect()'s
    probabilities, and the logits are the plain forward's."""
    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(
            vocab_size=11,
            d_model=16,
            n_layers=3,
            n_heads=2,
            d_head=8,
            d_inner=32,
            dropout=0.0,
            attention=AttentionConfig(terms="a", bias="alibi"),
        )
    ).eval()
    tokens = torch.randint(0, 11, (2, 7))
    weight = torch.ones(2, 7)
    stats = AttentionStatistics(3, 2, weight, max_seen_distance=3)
    with torch.no_grad():
        logits, _ = model(tokens, statistics=stats)
        plain, _ = model(tokens)
    torch.testing.assert_close(logits, plain)
    details = model.inspect(tokens)
    for layer, probs in enumerate(details["probs"]):
        expected = reference_statistics(
            probs.double(), 0, weight, 3, None, details["terms"][layer]["visible"]
        )
        torch.testing.assert_close(stats.sums[:, layer], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"sums: expected shape \[4, 3, 2\], got \[4, 2, 2\]"):
        AttentionStatistics(3, 2, weight, 3, sums=torch.zeros(4, 2, 2))
