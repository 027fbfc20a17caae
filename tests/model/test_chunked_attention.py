"""Chunked attention (attention.chunk, Llama 4's attention_chunk_size) and Llama 4's temperature
tuning, against the float64 reference's explicit mask (tests/fixtures/reference.py: floor(i / C) =
floor((j - M) / C), no memory key) on every backend, forward and backward. Run: pytest
tests/model/test_chunked_attention.py -q"""

import math

import pytest
import torch

from fixtures.attention import randomize
from fixtures.reference import reference_attention, reference_mask
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config import ConfigError
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.schemes.temperature import tuned_temperature

# each backend with a scheme it takes (low_rank: ALiBi; flex: forward only on CPU, as
# tests/model/test_attention_flex.py)
BACKENDS = [
    ("auto", dict(terms="abcd", bias="t5", num_buckets=8, max_distance=6)),
    ("blocks", dict(terms="a", bias="kerple_log", query_chunk=3)),
    ("sdpa", dict(terms="ab", rel="learned", clamp_len=3)),
    ("explicit", dict(terms="abcd", bias="xl_table", max_distance=3)),
    ("low_rank", dict(terms="a", bias="alibi")),
    (
        "auto",
        dict(
            terms="a",
            absolute="rope",
            rope_base=500.0,
            temperature_tuning=True,
            temperature_floor_scale=2.0,
        ),
    ),
    ("auto", dict(terms="a", forget_gate=True)),
    ("auto", dict(terms="a", cope_positions=4, sinks=2)),
]


def make(backend, chunk, window=None, **fields):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(backend=backend, chunk=chunk, window=window, **fields)
    ).double()
    randomize(attn, 3)
    return attn


def inputs(length=11, n_mem=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None


@pytest.mark.parametrize(
    "backend,fields", BACKENDS, ids=[f"{b}-{'-'.join(map(str, f.values()))}" for b, f in BACKENDS]
)
@pytest.mark.parametrize("chunk,window", [(4, None), (3, 2), (16, None)])
def test_chunks_match_the_explicit_mask(backend, fields, chunk, window):
    """11 queries after 3 memory keys in chunks of 4 (the last one short), 3 with a window of 2, 16
    (one chunk): output and input gradient equal the float64 reference's."""
    if backend == "low_rank" and window:
        pytest.skip("low_rank takes no window (a config error, tests/model/test_low_rank.py)")
    attn = make(backend, chunk, window, **fields)
    x, mems = inputs()
    ref, ref_probs = reference_attention(attn, x, mems)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    out, _ = attn(x, mems)  # the backend's kernel (need_weights would take the explicit path)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    with torch.no_grad():  # [B, H, L, M + L]: nothing outside the chunks, memory included
        _, probs = attn(x, mems, need_weights=True)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-9, atol=1e-10)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_chunks_on_flex_match_the_explicit_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    attn = make("flex", 4, **dict(terms="abcd", bias="t5", num_buckets=8, max_distance=6))
    x, mems = inputs()
    ref, _ = reference_attention(attn, x, mems)
    with torch.no_grad():
        out, _ = attn(x, mems)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-9)


def test_reference_mask_of_chunks_by_hand():
    """The reference's rule, written out for L = 5 after M = 2 in chunks of 2: rows see their
    chunk's keys only."""
    expected = torch.tensor(
        [
            [0, 0, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(reference_mask(5, 2, True, chunk=2), expected)


def test_chunked_score_terms_show_the_chunks():
    """inspect's maps of a chunked layer: 'visible' is the chunk mask, the bias map its chunks'
    blocks."""
    attn = make("auto", 4, **dict(terms="a", bias="alibi"))
    x, mems = inputs()
    maps = attn.score_terms(x, mems)
    assert torch.equal(maps["visible"], reference_mask(11, 3, True, chunk=4))
    slopes = -torch.tensor([2**-4, 2**-8])  # ALiBi with 2 heads: 2^(-8h/2)
    block = slopes[:, None, None] * (torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs()
    torch.testing.assert_close(maps["bias"][0, :, 4:8, 7:11], block.double())


def test_chunk_statistics_count_the_chunks_keys():
    """Diagnostics of a chunked layer: the first key a query sees is its chunk's first (sink share =
    1 for the first query of each chunk), distances within the chunk."""
    from relpos_ablate.model.diagnostics import AttentionStatistics

    attn = make("auto", 4, **dict(terms="a"))
    x, mems = inputs(length=8)
    stats = AttentionStatistics(1, 2, torch.ones(2, 8), max_seen_distance=100)
    with torch.no_grad():
        _, probs = attn(x, mems, need_weights=True)
        attn(x, mems, AttentionOptions(statistics=stats.layer(0)))
    ref_probs = probs
    # the key index of each query's chunk start (after 3 memory keys)
    first = torch.tensor([3, 3, 3, 3, 7, 7, 7, 7])
    sink = ref_probs.gather(-1, first.view(1, 1, 8, 1).expand(2, 2, 8, 1)).squeeze(-1).sum((0, 2))
    torch.testing.assert_close(stats.sums[1, 0], sink)


def test_temperature_tuning_at_fixed_positions():
    """1 + 0.1·log(floor((p + 1)/8192) + 1): 1 up to p = 8190, 1 + 0.1·ln 2 at 8191, 1 + 0.1·ln 3 at
    16383, 1 + 0.1·ln 13 at 100000 (floor(100001/8192) = 12)."""
    p = torch.tensor([0, 8190, 8191, 16383, 100000])
    expected = torch.tensor(
        [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3), 1 + 0.1 * math.log(13)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(
        tuned_temperature(p, AttentionConfig(temperature_tuning=True)), expected
    )


def test_temperature_tuning_scales_the_query_only():
    """With floor scale 2 the query at position p is multiplied by 1 + 0.1·log(floor((p+1)/2) + 1):
    term a's map is the untuned one times that factor per row, and the bias is untouched."""
    plain = make("auto", None, terms="a", bias="alibi")
    tuned = make(
        "auto", None, terms="a", bias="alibi", temperature_tuning=True, temperature_floor_scale=2.0
    )
    x, mems = inputs(length=6)
    a0, a1 = plain.score_terms(x, mems), tuned.score_terms(x, mems)
    factor = torch.tensor(
        [1 + 0.1 * math.log((p + 1) // 2 + 1) for p in range(3, 9)], dtype=torch.float64
    )
    torch.testing.assert_close(a1["a"], a0["a"] * factor[:, None])
    torch.testing.assert_close(a1["bias"], a0["bias"])


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(chunk=0), "chunk: 0 is out of range"),
        (dict(chunk=4, causal=False), "chunk: is defined for causal attention only"),
        (
            dict(chunk=4, bias="fire"),
            "chunk: every chunk is computed at the positions of the first",
        ),
        (
            dict(chunk=4, positions="randomized"),
            "chunk: every chunk is computed at the positions of the first",
        ),
        (dict(temperature_floor_scale=0.0), "temperature_floor_scale: 0.0 is out of range"),
    ],
)
def test_bad_chunk_settings_fail_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        AttentionConfig(**fields)
    assert "\n" not in str(err.value)


def test_explicit_positions_are_refused_by_a_chunked_layer():
    attn = make("auto", 4, terms="a")
    x, mems = inputs()
    with pytest.raises(ValueError, match="chunk: a chunked layer computes every chunk"):
        attn(x, mems, AttentionOptions(positions=torch.arange(14)))
