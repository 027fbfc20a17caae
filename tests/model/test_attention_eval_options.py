"""Evaluation-time options: clamp_len overrides reach keys and Shaw values alike, and a learned
table asked for a longer clamp is rejected when the run config is validated.
Run: pytest tests/model/test_attention_eval_options.py -q"""

import pytest
import torch

from fixtures.attention import randomize
from fixtures.reference import reference_attention, reference_mask
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.config import load_run_config
from relpos_ablate.model import AttentionOptions


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_shaw_values_honour_the_evaluation_clamp(causal):
    """Keys (term b) and values (a^V) index the same clipped distance: clamp 1 at evaluation changes
    both."""
    attn = RelPosAttention(
        16,
        2,
        8,
        AttentionConfig(terms="ab", rel="learned", clamp_len=3, shaw_values=True, causal=causal),
    ).double()
    randomize(attn, 4)
    gen = torch.Generator().manual_seed(5)
    x, mems = (
        torch.randn(2, 5, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 3, 16, generator=gen, dtype=torch.float64),
    )
    out, _ = attn(x, mems, AttentionOptions(clamp_len=1))
    ref, _ = reference_attention(attn, x, mems, clamp_len=1)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-9)


def test_learned_table_is_checked_against_evaluation_clamps_at_validation():
    base = [
        "model.attention.terms=ab",
        "model.attention.rel=learned",
        "model.attention.clamp_len=4",
    ]
    # within the table: fine
    load_run_config(None, [*base, "eval.settings=[{segment_len: 8, clamp_len: 4}]"])
    with pytest.raises(ConfigError) as err:
        load_run_config(
            None, [*base, "eval.settings=[{segment_len: 8}, {segment_len: 8, clamp_len: 6}]"]
        )
    text = str(err.value)
    assert (
        text.startswith("eval.settings[1].clamp_len: 6 ") and "model.attention.clamp_len=4" in text
    )
    assert "\n" not in text
    # a sinusoid R has no table: any clamp is allowed
    load_run_config(
        None, ["model.attention.clamp_len=4", "eval.settings=[{segment_len: 8, clamp_len: 40}]"]
    )


def xl_same_length_mask(qlen: int, mlen: int, mem_len: int) -> torch.Tensor:
    """Transformer-XL's evaluation mask, as written in kimiyoung/transformer-xl
    (pytorch/mem_transformer.py): 1 = masked there; returned here as True = visible, [qlen, mlen +
    qlen]."""
    klen = mlen + qlen
    ones = torch.ones(qlen, klen)
    mask_len = klen - mem_len
    mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
    masked = torch.triu(ones, 1 + mlen) + torch.tril(ones, -mask_shift_len)
    return masked == 0


def test_xl_mask_replays_the_published_counts():
    """The replay in the Transformer-XL code: qlen 4, mem_len 6 -> 6,6,6,6 keys with full memory,
    3,4,5,6 while the memory holds 2."""
    assert xl_same_length_mask(4, 6, 6).sum(1).tolist() == [6, 6, 6, 6]
    assert xl_same_length_mask(4, 2, 6).sum(1).tolist() == [3, 4, 5, 6]


def lm(mem_len, backend="explicit"):
    from relpos_ablate import ModelConfig, TransformerLM

    cfg = ModelConfig(
        vocab_size=11,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        mem_len=mem_len,
        attention=AttentionConfig(terms="abcd", bias="alibi", backend=backend),
    )
    model = TransformerLM(cfg).double().eval()
    randomize(model, 6, scale=0.3)
    return model


@pytest.mark.parametrize("segment_len", [4, 8, 3], ids=["seg<mem", "seg>mem", "seg<<mem"])
@pytest.mark.parametrize("eval_mem_len", [None, 3], ids=["model-mem", "eval-mem"])
def test_same_length_gives_every_query_the_configured_memory_window(segment_len, eval_mem_len):
    """Segment after segment from empty memory (empty, partly filled, full): every layer's mask is
    XL's with M = the call's mem_len (else the model's), never the memory that happens to be
    present."""
    model = lm(mem_len=6)
    m = 6 if eval_mem_len is None else eval_mem_len
    stream = torch.randint(0, 11, (2, 4 * segment_len), generator=torch.Generator().manual_seed(7))
    mems, seen = None, []
    for start in range(0, stream.shape[1], segment_len):
        n_mem = 0 if mems is None else mems[0].shape[1]
        out = model.inspect(
            stream[:, start : start + segment_len], mems, mem_len=eval_mem_len, same_length=True
        )
        expected = xl_same_length_mask(segment_len, n_mem, m)
        for terms, probs in zip(out["terms"], out["probs"]):
            assert torch.equal(terms["visible"].reshape(expected.shape), expected)
            assert probs.masked_select(~expected).abs().max() == 0
        mems, seen = out["mems"], seen + [n_mem]
    assert seen[0] == 0 and seen[-1] == m  # empty, (partly filled,) full memory all occurred


# (segment L, memory present, configured memory M): empty, partly filled and full memory, L > M and
# L < M
WINDOW_CASES = [
    (4, 0, 6),
    (4, 2, 6),
    (4, 6, 6),
    (8, 0, 6),
    (8, 6, 6),
    (3, 0, 6),
    (3, 3, 6),
    (3, 6, 6),
]
WINDOW_SCHEMES = [
    dict(terms="abcd"),
    dict(terms="ac", bias="fire"),
    dict(terms="a", bias="t5", num_buckets=8, max_distance=6),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("fields", WINDOW_SCHEMES, ids=[str(f) for f in WINDOW_SCHEMES])
@pytest.mark.parametrize("backend", ["explicit", "blocks", "sdpa", "auto", "flex"])
def test_same_length_window_on_every_backend(backend, fields):
    """The attention with window M equals the float64 reference under Transformer-XL's mask (built
    above from XL's formula, independently of the reference's own mask)."""
    for n_queries, n_mem, mem_len in WINDOW_CASES:
        expected = xl_same_length_mask(n_queries, n_mem, mem_len)
        assert torch.equal(reference_mask(n_queries, n_mem, True, mem_len), expected)
        attn = RelPosAttention(
            16, 2, 8, AttentionConfig(backend=backend, query_chunk=2, **fields)
        ).double()
        randomize(attn, 8)
        gen = torch.Generator().manual_seed(n_queries * 10 + n_mem)
        x = torch.randn(2, n_queries, 16, generator=gen, dtype=torch.float64)
        mems = torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None
        with torch.set_grad_enabled(backend != "flex"):  # FlexAttention has no backward on CPU
            out, _ = attn(x, mems, AttentionOptions(window=mem_len))
        ref, ref_probs = reference_attention(attn, x, mems, window=mem_len)
        assert ref_probs.masked_select(~expected).abs().max() == 0
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-9)


def test_same_length_without_memory_is_an_error():
    with pytest.raises(ValueError, match=r"^same_length: .*mem_len is 0"):
        lm(mem_len=0)(torch.zeros(1, 4, dtype=torch.long), same_length=True)
    with pytest.raises(
        ConfigError, match=r"^eval\.settings\[0\]\.protocol: 'xl' needs causal attention and memory"
    ):
        load_run_config(None, ["eval.settings=[{segment_len: 8, protocol: xl}]"])
    with pytest.raises(ConfigError, match=r"^eval\.settings\[0\]\.protocol: "):
        load_run_config(
            None,
            [
                "model.mem_len=4",
                "model.attention.causal=false",
                "eval.settings=[{segment_len: 8, protocol: xl}]",
            ],
        )
    with pytest.raises(
        ConfigError,
        match=r"^eval\.settings\[0\]\.same_length: is Transformer-XL's evaluation: "
        r"write protocol: xl",
    ):
        load_run_config(None, ["eval.settings=[{segment_len: 8, mem_len: 8, same_length: true}]"])
    load_run_config(None, ["eval.settings=[{segment_len: 8, mem_len: 8, protocol: xl}]"])
    with pytest.raises(ValueError, match=r"^window: 0 is out of range"):
        AttentionOptions(window=0)
