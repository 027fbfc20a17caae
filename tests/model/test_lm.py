"""TransformerLM: segment memory is exact, causal, translation invariant for relative schemes, no
gradient into memory, evaluation at 4x the training length. Run: pytest tests/model/test_lm.py -q"""

import pytest
import torch

from fixtures.attention import randomize
from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM

RELATIVE = [
    dict(terms="abcd"),
    dict(terms="ab", rel="learned", clamp_len=3),
    dict(terms="bd", clamp_len=4),
    dict(terms="a", bias="t5", num_buckets=8, max_distance=10),
    dict(terms="a", bias="alibi"),
    dict(terms="a", bias="xl_table", max_distance=5),
    dict(terms="a", bias="kerple_log"),
    dict(terms="a", bias="kerple_power"),
    dict(terms="a", bias="dynamic"),
    dict(terms="a", bias="alibi_learned"),
    dict(terms="a", absolute="rope"),
    dict(terms="ac", bias="fire"),
    dict(terms="ab", rel="learned", clamp_len=3, shaw_values=True),
]
ALL = RELATIVE + [
    dict(terms="a"),
    dict(terms="a", absolute="sinusoid"),
    dict(terms="a", absolute="learned"),
    dict(terms="a", absolute="learned_per_layer"),
]


def ids(cases):
    return ["-".join(f"{v}" for v in c.values()) for c in cases]


def model(attention, mem_len=0, norm="pre", seed=0, **kw):
    cfg = ModelConfig(
        vocab_size=13,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        mem_len=mem_len,
        norm=norm,
        attention=AttentionConfig(**attention),
        **kw,
    )
    m = TransformerLM(cfg).double().eval()
    randomize(m, seed, scale=0.3)
    return m


def tokens(length, seed=0, batch=2):
    return torch.randint(0, 13, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", RELATIVE, ids=ids(RELATIVE))
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_memory_reproduces_the_full_sequence(attention, norm):
    """With mem_len >= the first segment, segment 2 with memory == the last tokens of one long
    causal pass: memory holds exactly the layer inputs and the distances to it are right (FIRE too:
    its query positions are the same in both passes)."""
    m = model(attention, mem_len=6, norm=norm)
    seq = tokens(10)
    full, _ = m(seq)
    _, mems = m(seq[:, :6])
    second, new_mems = m(seq[:, 6:], mems)
    torch.testing.assert_close(second, full[:, 6:], rtol=1e-9, atol=1e-9)
    assert all(t.shape == (2, 6, 16) for t in new_mems)


def test_memory_is_fifo_of_layer_inputs():
    m = model(dict(terms="abcd"), mem_len=4)
    seq = tokens(7)
    _, mems = m(seq[:, :3])
    assert mems[0].shape[1] == 3  # fewer tokens than mem_len so far
    _, mems2 = m(seq[:, 3:], mems)
    torch.testing.assert_close(mems2[0], m.embed(seq)[:, 3:7])  # layer 0's input is the embedding
    _, long = m(seq[:, 3:], mems, mem_len=6)
    assert long[0].shape[1] == 6


@pytest.mark.parametrize("attention", ALL, ids=ids(ALL))
def test_causality(attention):
    m = model(attention, mem_len=3)
    a, b = tokens(8, 1), tokens(8, 1)
    b[:, 5:] = (b[:, 5:] + 1) % 13
    mems = [torch.randn(2, 3, 16, dtype=torch.float64) for _ in range(2)]
    out_a, _ = m(a, mems)
    out_b, _ = m(b, mems)
    torch.testing.assert_close(out_a[:, :5], out_b[:, :5])
    assert not torch.allclose(out_a[:, 5:], out_b[:, 5:])


@pytest.mark.parametrize(
    "attention",
    [c for c in RELATIVE if c.get("bias") != "fire"],
    ids=ids([c for c in RELATIVE if c.get("bias") != "fire"]),
)
@pytest.mark.parametrize("causal", [True, False])
def test_relative_schemes_are_translation_invariant(attention, causal):
    """Shifting every position by M (M masked-out memory keys in front) changes nothing."""
    from relpos_ablate import RelPosAttention
    from relpos_ablate.model import AttentionOptions

    attn = RelPosAttention(16, 2, 8, AttentionConfig(causal=causal, **attention)).double()
    randomize(attn, 3)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    junk = torch.randn(2, 4, 16, dtype=torch.float64)
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[:, :4] = True
    plain, _ = attn(x)
    shifted, _ = attn(x, junk, AttentionOptions(key_padding_mask=padding))
    torch.testing.assert_close(shifted, plain)


def test_absolute_positions_are_not_translation_invariant():
    m = model(dict(terms="a", absolute="sinusoid"))
    seq = tokens(6)
    out1, _ = m(seq)
    out2, _ = m(torch.cat([seq[:, :1], seq], dim=1))
    assert not torch.allclose(out1[:, 1:], out2[:, 2:])


def test_no_gradient_reaches_memory():
    m = model(dict(terms="abcd"), mem_len=4).train()
    mems = [torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    logits, new_mems = m(tokens(5), mems)
    logits.sum().backward()
    assert all(t.grad is None for t in mems)
    assert all(not t.requires_grad for t in new_mems)
    assert m.embed.weight.grad is not None


@pytest.mark.parametrize("attention", RELATIVE, ids=ids(RELATIVE))
def test_trained_at_l_evaluates_at_4l(attention):
    m = model(attention, mem_len=4).float().train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(3):
        seq = tokens(9, step)
        logits, _ = m(seq[:, :-1])
        loss = m.loss(logits, seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    long = tokens(33, 99)
    with torch.no_grad():
        logits, mems = m(long[:, :-1], mem_len=32)
        logits2, _ = m(long[:, :-1], mems)  # a second long segment with 32 tokens of memory
    assert torch.isfinite(logits).all() and torch.isfinite(logits2).all()
    assert m.loss(logits, long[:, 1:]) < 10


def test_learned_absolute_positions_beyond_their_table_fail_clearly():
    m = model(dict(terms="a", absolute="learned", max_position=8))
    m(tokens(8))
    with pytest.raises(
        ValueError, match=r"max_position: learned absolute positions cover 0\.\.7; a segment of 9"
    ):
        m(tokens(9))


@pytest.mark.parametrize("share", [True, False])
def test_sharing_across_layers(share):
    attention = dict(terms="abcd", bias="t5", share_uv=share, share_bias=share)
    m = model(attention)
    a, b = m.attention_layers()
    assert (a.content_bias_u is b.content_bias_u) == share
    assert (a.position_bias_v is b.position_bias_v) == share
    assert (a.bias_scheme is b.bias_scheme) == share
    n_bias = sum(p.numel() for n, p in m.named_parameters() if "table" in n)
    assert n_bias == 32 * 2 * (1 if share else 2)


def test_inspect_returns_probs_and_terms_per_layer():
    m = model(dict(terms="abcd", bias="alibi"), mem_len=3)
    _, mems = m(tokens(3))
    details = m.inspect(tokens(4), mems)
    assert len(details["probs"]) == 2 and details["probs"][0].shape == (2, 2, 4, 7)
    torch.testing.assert_close(
        details["probs"][1].sum(-1), torch.ones(2, 2, 4, dtype=torch.float64)
    )
    terms = details["terms"][0]
    assert set(terms) == {"a", "b", "c", "d", "bias", "visible"}
    total = sum(terms[k] for k in "abcd") + terms["bias"]
    torch.testing.assert_close(
        total.masked_fill(~terms["visible"], float("-inf")).softmax(-1), details["probs"][0]
    )


def test_tied_output_and_masked_loss():
    m = model(dict(terms="a"))
    assert m.head.weight is m.embed.weight
    logits = torch.randn(1, 3, 13, dtype=torch.float64)
    targets = torch.tensor([[1, 2, 3]])
    mask = torch.tensor([[False, True, False]])
    expected = torch.nn.functional.cross_entropy(logits[0, 1:2], targets[0, 1:2])
    torch.testing.assert_close(m.loss(logits, targets, mask), expected)
