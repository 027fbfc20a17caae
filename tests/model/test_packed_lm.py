"""Packed documents through the whole LM (TransformerLM.forward(..., document_ids=...)): a document
packed after another gives the logits and gradients of the document alone, for the absolute
encodings (restarted per document at the input and, Al-Rfou's, at every layer), RoPE, a bias, FoX,
Canon and Transformer-XL's terms; with memory, a document continuing from the previous segment
keeps its memory and another document's memory is dropped (float64)."""

import pytest
import torch

from fixtures.attention import randomize
from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM
from relpos_ablate.model.documents import document_positions

VOCAB = 11
MODELS = {
    "nope": dict(),
    "sinusoid": dict(absolute="sinusoid"),
    "learned": dict(absolute="learned", max_position=32),
    "learned_per_layer": dict(absolute="learned_per_layer", max_position=32),
    "rope": dict(absolute="rope"),
    "alibi_fox": dict(bias="alibi", forget_gate=True),
    "canon": dict(canon_width=3, absolute="rope"),
    "xl": dict(terms="abcd"),
    "temperature_tuning": dict(
        absolute="rope", temperature_tuning=True, temperature_floor_scale=2.0
    ),
}


def _model(name: str, mem_len: int = 0) -> TransformerLM:
    attention = AttentionConfig(**{"terms": "a", **MODELS[name]})
    config = ModelConfig(
        vocab_size=VOCAB, n_layers=2, d_model=16, n_heads=2, d_head=8, d_inner=32,
        dropout=0.0, mem_len=mem_len, attention=attention,
    )  # fmt: skip
    model = TransformerLM(config).double()
    randomize(model, 3)
    return model.eval()


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_document_is_the_document_alone(name):
    model = _model(name)
    a, b = _tokens(5, 0), _tokens(7, 1)
    ids = torch.tensor([[3] * 5 + [4] * 7])
    logits, _ = model(torch.cat([a, b], 1), document_ids=ids)
    weights = torch.linspace(-1, 1, logits.numel(), dtype=torch.float64).view_as(logits)
    packed = torch.autograd.grad(
        (logits * weights).sum(), list(model.parameters()), allow_unused=True
    )
    alone_a, _ = model(a, document_ids=torch.zeros_like(a))
    alone_b, _ = model(b, document_ids=torch.zeros_like(b))
    torch.testing.assert_close(logits[:, :5], alone_a, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(logits[:, 5:], alone_b, rtol=1e-7, atol=1e-10)
    loss = (alone_a * weights[:, :5]).sum() + (alone_b * weights[:, 5:]).sum()
    alone = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for (param, _), p, q in zip(model.named_parameters(), packed, alone):
        if p is None or q is None:
            assert p is None and q is None, param
            continue
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-10, msg=lambda m, n=param: f"{n}: {m}")


@pytest.mark.parametrize("name", ["rope", "xl", "canon"])
def test_memory_carries_a_document_and_drops_another(name):
    """Segment 1: document 0 (4 tokens), then the first 2 of document 1; segment 2: document 1's
    next 3, then document 2 (3 tokens). Document 1 alone, cut the same way, gives segment 2's first
    3 logits; document 2 alone its last 3 (its memory: none of its own)."""
    model = _model(name, mem_len=6)
    tokens = _tokens(12, 2)
    ids = torch.tensor([[0] * 4 + [1] * 5 + [2] * 3])
    _, mems = model(tokens[:, :6], document_ids=ids[:, :6])
    logits, _ = model(tokens[:, 6:], mems, document_ids=ids)
    doc1 = tokens[:, 4:9]
    zeros = torch.zeros(1, 5, dtype=torch.long)
    _, own = model(doc1[:, :2], document_ids=zeros[:, :2])
    alone, _ = model(doc1[:, 2:], own, document_ids=zeros)
    torch.testing.assert_close(logits[:, :3], alone, rtol=1e-7, atol=1e-10)
    last, _ = model(tokens[:, 9:], document_ids=zeros[:, :3])
    torch.testing.assert_close(logits[:, 3:], last, rtol=1e-7, atol=1e-10)


def test_positions_restart_at_each_document():
    ids = torch.tensor([[7, 7, 8, 8, 8, 9], [1, 1, 1, 1, 2, 2]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]])
    assert torch.equal(document_positions(ids), expected)


def test_bad_document_ids_get_one_line():
    model = _model("rope", mem_len=4)
    tokens = _tokens(6, 0)
    _, mems = model(tokens)
    with pytest.raises(
        ValueError,
        match=r"^document_ids: expected integer ids \[B, M \+ L\] = \[1, 10\].*memory's ids first",
    ):
        model(tokens, mems, document_ids=torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^document_ids: expected integer ids"):
        model(tokens, document_ids=torch.zeros(1, 6))
    fire = TransformerLM(
        ModelConfig(
            vocab_size=VOCAB,
            n_layers=1,
            d_model=16,
            n_heads=2,
            d_head=8,
            attention=AttentionConfig(terms="a", bias="fire"),
        )
    )
    with pytest.raises(ValueError, match=r"^document_ids: bias 'fire' reads the query's position"):
        fire(tokens, document_ids=torch.zeros(1, 6, dtype=torch.long))
