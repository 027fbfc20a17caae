"""TransformerLM with explicit and randomized positions (Ruoss et al. 2023).

Randomized positions: every training forward draws L distinct positions from [0, max_position),
sorted, shared by the batch, by queries and keys and by every layer; the absolute baselines add
their table or sinusoid at those positions; evaluation draws too only when asked
(`eval_positions`, by default as in training). Run: pytest tests/test_lm_positions.py -q"""

import pytest
import torch

from reference import sinusoid_row
from relpos_ablate import AttentionConfig, ConfigError, ModelConfig, TransformerLM
from relpos_ablate.model.lm import randomized_positions

V, L = 13, 6


def lm(**attention):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, d_head=8, d_inner=32, dropout=0.0,
                         attention=AttentionConfig(**attention))
    return TransformerLM(config)


def tokens(batch=3):
    return torch.randint(0, V, (batch, L), generator=torch.Generator().manual_seed(1))


def test_randomized_positions_are_a_sorted_draw_without_replacement():
    draws = [randomized_positions(8, 20, generator=torch.Generator().manual_seed(s)) for s in range(200)]
    for p in draws:
        assert p.shape == (8,) and p.unique().numel() == 8 and bool((p.diff() > 0).all())
        assert 0 <= int(p.min()) and int(p.max()) < 20
    # every position of [0, 20) is drawn, each about 8/20 of the time
    counts = torch.bincount(torch.cat(draws), minlength=20).double() / len(draws)
    assert counts.min() > 0.25 and counts.max() < 0.55
    with pytest.raises(ValueError, match=r"max_position: randomized positions draw 21 distinct positions from \[0, 20\)"):
        randomized_positions(21, 20)


@pytest.mark.parametrize("encoding", [dict(terms="abcd", bias="t5"), dict(terms="a", absolute="rope"),
                                      dict(terms="a", absolute="sinusoid"), dict(terms="a", absolute="learned"),
                                      dict(terms="a", absolute="learned_per_layer"), dict(terms="a", bias="alibi")])
def test_training_forward_uses_one_draw_for_every_layer_and_the_input(encoding):
    """A training forward equals a forward at the explicit positions the same RNG state draws."""
    model = lm(positions="randomized", max_position=64, **encoding).train()
    torch.manual_seed(5)
    randomized, _ = model(tokens())
    torch.manual_seed(5)
    positions = randomized_positions(L, 64)
    explicit, _ = model(tokens(), positions=positions)
    torch.testing.assert_close(randomized, explicit, rtol=0, atol=0)
    sequential, _ = model(tokens(), positions=torch.arange(L))
    assert not torch.allclose(randomized, sequential), "positions 0..L-1 would give another result"


def test_evaluation_draws_as_in_training_unless_eval_positions_says_otherwise():
    """eval_positions null: as in training (Ruoss et al.'s code draws at test time too)."""
    for eval_positions in (None, "randomized"):
        model = lm(positions="randomized", eval_positions=eval_positions, max_position=64, terms="a",
                   absolute="rope").eval()
        torch.manual_seed(2)
        drawn, _ = model(tokens())
        torch.manual_seed(2)
        torch.testing.assert_close(drawn, model(tokens(), positions=randomized_positions(L, 64))[0], rtol=0, atol=0)
    model = lm(positions="randomized", eval_positions="sequential", max_position=64, terms="a", absolute="rope").eval()
    torch.testing.assert_close(model(tokens())[0], model(tokens(), positions=torch.arange(L))[0], rtol=0, atol=0)
    model = lm(positions="sequential", eval_positions="randomized", max_position=64, terms="a", absolute="rope").train()
    torch.testing.assert_close(model(tokens())[0], model(tokens(), positions=torch.arange(L))[0], rtol=0, atol=0)


def test_absolute_sinusoid_is_added_at_the_given_positions():
    """sqrt(d_model)·E[token] + P(p_t), P the sinusoid of docs/formulas.md (the embedding scaled as Vaswani
    et al.'s): one layer's input, built by hand."""
    model = lm(terms="a", absolute="sinusoid")
    positions = torch.tensor([3, 9, 10, 17, 30, 31])
    expected = model.embed(tokens()) * 16 ** 0.5 + torch.tensor([sinusoid_row(float(p), 16) for p in positions]).float()
    torch.testing.assert_close(model._embed(tokens(), positions), expected, rtol=1e-6, atol=1e-6)


def test_learned_tables_are_indexed_at_the_given_positions():
    model = lm(terms="a", absolute="learned", max_position=40)
    positions = torch.tensor([0, 2, 5, 11, 30, 39])
    expected = model.embed(tokens()) + model.input_positions.table.weight[positions]
    torch.testing.assert_close(model._embed(tokens(), positions), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"max_position: learned absolute positions cover 0..39; got positions 0..40"):
        model._embed(tokens(), torch.tensor([0, 1, 2, 3, 4, 40]))
    per_layer = lm(terms="a", absolute="learned_per_layer", max_position=40)
    layer = per_layer.layers[1]
    h = torch.randn(3, L, 16)
    torch.testing.assert_close(layer.layer_input(h, positions), h + layer.positions.table.weight[positions])


def test_randomized_positions_need_a_model_without_memory():
    with pytest.raises(ConfigError, match="mem_len: randomized positions are drawn per segment"):
        ModelConfig(vocab_size=V, mem_len=8, attention=AttentionConfig(positions="randomized"))
    with pytest.raises(ConfigError, match="positions: 'shuffled' is not allowed; choose one of sequential, randomized"):
        AttentionConfig(positions="shuffled")
    with pytest.raises(ConfigError, match="eval_positions: 'random' is not allowed"):
        AttentionConfig(eval_positions="random")
    model = lm(terms="a", eval_positions="randomized").eval()
    _, mems = lm(terms="a").eval()(tokens())
    with pytest.raises(ValueError, match="memory keys would keep another draw's"):
        model(tokens(), [torch.zeros(3, 2, 16)] * 2)
    assert mems is None
