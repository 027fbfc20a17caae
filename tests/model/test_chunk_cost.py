"""A chunk at least as long as the segment costs nothing over full attention (issue 57): the chunked
layer's rows are min(C, L) tokens wide (relpos_ablate/model/chunks.py), never padded to C (Llama 4's
8192 on a 32-token segment was one call of 8192 per row). Checked by the shapes of the inner call,
not by wall time; and the outputs still equal the float64 reference's chunk mask (floor(i / C) =
floor((j - M) / C), no memory key) for chunks longer, as long as and shorter than the segment.

Run: .venv/bin/python -m pytest tests/test_chunk_cost.py -q
"""

import math

import pytest
import torch

from fixtures.attention import randomize
from fixtures.reference import reference_attention, reference_mask
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model.chunks import Chunks
from relpos_ablate.model.lm import TransformerLM
from relpos_ablate.runner.grid import resolve_variant

# the local kind of llama4_like (RoPE, temperature tuning on the way), a bias on the block kernel,
# the four XL terms with a bucketed bias, and the materialised path
SCHEMES = {
    "rope-tuned": dict(terms="a", absolute="rope", rope_base=500000.0, temperature_tuning=True),
    "blocks-kerple": dict(backend="blocks", terms="a", bias="kerple_log", query_chunk=3),
    "xl-t5": dict(terms="abcd", bias="t5", num_buckets=8, max_distance=6),
    "explicit-alibi": dict(backend="explicit", terms="a", bias="alibi"),
}
L, M = 11, 3
# longer than the segment (Llama 4's own), longer, as long as, shorter and dividing 8 of it, shorter
# and not dividing it
CHUNKS = [8192, 16, 11, 4, 3]


def make(chunk, **fields):
    attn = RelPosAttention(16, 2, 8, AttentionConfig(chunk=chunk, **fields)).double()
    randomize(attn, 3)
    return attn


def inputs(n_mem=M, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None


def inner_rows(attn, x, mems, **kwargs):
    """The shapes of x at every call of the layer (the outer call, then the chunks' call)."""
    seen = []
    hook = attn.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    try:
        attn(x, mems, **kwargs)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_match_the_materialised_chunk_mask(scheme, chunk):
    """Output, input gradient and probabilities equal the float64 reference's, which sums every
    term over the whole [L, M + L] map and masks it with the chunk rule."""
    attn = make(chunk, **SCHEMES[scheme])
    x, mems = inputs()
    ref, ref_probs = reference_attention(attn, x, mems)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    out, _ = attn(x, mems)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        _, probs = attn(x, mems, need_weights=True)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-9, atol=1e-10)
    visible = attn.score_terms(x, mems)["visible"]
    assert torch.equal(visible, reference_mask(L, M, True, chunk=chunk))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("chunk", [8192, 16, 11])
def test_a_chunk_as_long_as_the_segment_is_full_attention_without_memory(scheme, chunk):
    """C >= L: one chunk holding the segment, memory unseen; the same numbers as the unchunked layer
    given no memory, every score map entry included (the masked ones too: the call is the same)."""
    chunked = make(chunk, **SCHEMES[scheme])
    plain = make(None, **SCHEMES[scheme])
    plain.load_state_dict(chunked.state_dict())
    x, mems = inputs()
    with torch.no_grad():
        out, probs = chunked(x, mems, need_weights=True)
        ref, ref_probs = plain(x, None, need_weights=True)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(probs[..., M:], ref_probs, rtol=1e-12, atol=1e-13)
        assert not probs[..., :M].any()
        maps, ref_maps = chunked.score_terms(x, mems), plain.score_terms(x)
    assert not maps["visible"][..., :M].any()
    for name, ref_map in ref_maps.items():
        torch.testing.assert_close(maps[name][..., M:], ref_map, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_chunks_call_is_never_wider_than_the_segment(chunk):
    """The chunks' call sees [B·n, W] tokens with W = min(C, L): one row of the L tokens present
    when C >= L (whatever C), ceil(L / C) rows of C otherwise; score_terms the same."""
    attn = make(chunk, terms="a", absolute="rope", temperature_tuning=True)
    x, mems = inputs()
    width = min(chunk, L)
    rows = 2 * math.ceil(L / width)
    inner = [(rows, width, 16)]
    assert inner_rows(attn, x, mems) == [(2, L, 16), *inner]
    assert inner_rows(attn, x, mems, need_weights=True) == [(2, L, 16), *inner]
    seen = []
    score_terms = attn._score_terms

    def spy(x, *args):
        seen.append(tuple(x.shape))
        return score_terms(x, *args)

    attn._score_terms = spy
    maps = attn.score_terms(x, mems)
    assert seen == inner
    assert maps["a"].shape == (2, 2, L, M + L)


@pytest.mark.parametrize(
    "size,n_queries,width,count,padding",
    [(8192, 32, 32, 1, 0), (32, 32, 32, 1, 0), (33, 32, 32, 1, 0), (16, 32, 16, 2, 0)]
    + [(12, 32, 12, 3, 4), (31, 32, 31, 2, 30), (1, 5, 1, 5, 0), (8, 1, 1, 1, 0)],
)
def test_chunk_rows(size, n_queries, width, count, padding):
    """W = min(C, L), n = ceil(L / C), padding only in the last of several chunks (< C tokens)."""
    chunks = Chunks(size, n_queries, n_mem=3)
    assert (chunks.width, chunks.count, chunks.padding) == (width, count, padding)
    t = torch.arange(2 * n_queries).view(2, n_queries)
    assert chunks.split(t).shape == (2 * count, width)
    assert torch.equal(chunks.merge(chunks.split(t)), t)


def test_llama4_like_model_calls_no_wider_than_its_segment():
    """A 4-layer llama4_like model (chunk 8192 on its RoPE layers) at segment 32 with memory 32:
    every attention call of a training forward has at most 32 queries per row (the chunked layers'
    inner call one row of 32 tokens per sequence, the NoPE layer its 32 queries after 32 memory
    keys), and the chunks' key padding, if any, as wide as its queries."""
    base = {"model": {"vocab_size": 16, "d_model": 32, "n_layers": 4, "n_heads": 2, "d_head": 16}}
    base["model"]["mem_len"] = 32
    config = resolve_variant(base, {"encoding": "llama4_like"}).model
    assert [layer.chunk for layer in config.layer_attentions] == [8192, 8192, 8192, None]
    model = TransformerLM(config)
    seen = []

    def record(module, args, kwargs):
        x, mems = args[0], args[1] if len(args) > 1 else kwargs.get("mems")
        seen.append((module.config.chunk, x.shape[:2], 0 if mems is None else mems.shape[1]))

    hooks = [
        m.register_forward_pre_hook(record, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, RelPosAttention)
    ]
    tokens = torch.randint(16, (3, 32), generator=torch.Generator().manual_seed(0))
    _, mems = model(tokens)
    seen.clear()
    logits, _ = model(tokens, mems)
    for hook in hooks:
        hook.remove()
    logits.sum().backward()
    assert len(seen) == 3 * 2 + 1  # each chunked layer: the outer call and its chunks' call
    assert all(shape[1] <= 32 for _, shape, _ in seen), seen
    # the three chunked layers: [B, L] after 32 memory keys, then their chunks' call, one row of the
    # 32 tokens per sequence and no memory; the NoPE layer: its 32 queries after 32 memory keys
    chunked = [(shape, n_mem) for chunk, shape, n_mem in seen if chunk is not None]
    assert chunked == [((3, 32), 32), ((3, 32), 0)] * 3
    assert [(shape, n_mem) for chunk, shape, n_mem in seen if chunk is None] == [((3, 32), 32)]
