"""TransformerLM with explicit and randomized positions (Ruoss et al. 2023).

Randomized positions, randomized_draw per_layer (the default, as the authors' code): the absolute
baselines add their table or sinusoid at one draw of L sorted distinct positions from [0,
max_position); every layer draws its own RoPE positions and its own relative distances (d_0 = 0,
then sorted distinct draws from [1, max_position)); the ALiBi bias then is -m·d_(i-j).
shared_positions: one draw of positions for every layer and encoding. Draws are shared by the batch;
evaluation draws too only when asked (`eval_positions`, by default as in training). The attention's
arithmetic at drawn distances against the float64 reference:
tests/model/test_attention_positions.py. Run: pytest tests/model/test_lm_positions.py -q"""

import pytest
import torch

from fixtures.reference import sinusoid_row
from relpos_ablate import AttentionConfig, ConfigError, ModelConfig, TransformerLM
from relpos_ablate.model import AttentionOptions, RelPosAttention
from relpos_ablate.model.schemes.absolute import randomized_distances, randomized_positions

V, L = 13, 6


def lm(**attention):
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=V,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        attention=AttentionConfig(**attention),
    )
    return TransformerLM(config)


def tokens(batch=3):
    return torch.randint(0, V, (batch, L), generator=torch.Generator().manual_seed(1))


def test_randomized_positions_are_a_sorted_draw_without_replacement():
    draws = [
        randomized_positions(8, 20, generator=torch.Generator().manual_seed(s)) for s in range(200)
    ]
    for p in draws:
        assert p.shape == (8,) and p.unique().numel() == 8 and bool((p.diff() > 0).all())
        assert 0 <= int(p.min()) and int(p.max()) < 20
    # every position of [0, 20) is drawn, each about 8/20 of the time
    counts = torch.bincount(torch.cat(draws), minlength=20).double() / len(draws)
    assert counts.min() > 0.25 and counts.max() < 0.55
    with pytest.raises(
        ValueError,
        match=r"max_position: randomized positions draw 21 distinct positions from \[0, 20\)",
    ):
        randomized_positions(21, 20)


@pytest.mark.parametrize(
    "encoding",
    [
        dict(terms="abcd", bias="t5"),
        dict(terms="a", absolute="rope"),
        dict(terms="a", absolute="sinusoid"),
        dict(terms="a", absolute="learned"),
        dict(terms="a", absolute="learned_per_layer"),
        dict(terms="a", bias="alibi"),
    ],
)
def test_shared_positions_use_one_draw_for_every_layer_and_the_input(encoding):
    """A training forward equals a forward at the explicit positions the same RNG state draws."""
    model = lm(
        positions="randomized", randomized_draw="shared_positions", max_position=64, **encoding
    ).train()
    torch.manual_seed(5)
    randomized, _ = model(tokens())
    torch.manual_seed(5)
    positions = randomized_positions(L, 64)
    explicit, _ = model(tokens(), positions=positions)
    torch.testing.assert_close(randomized, explicit, rtol=0, atol=0)
    sequential, _ = model(tokens(), positions=torch.arange(L))
    assert not torch.allclose(randomized, sequential), "positions 0..L-1 would give another result"


def test_randomized_distances_are_zero_then_a_sorted_draw_from_one_up():
    draws = [
        randomized_distances(8, 20, generator=torch.Generator().manual_seed(s)) for s in range(200)
    ]
    for d in draws:
        assert (
            d.shape == (8,) and int(d[0]) == 0 and bool((d.diff() > 0).all()) and int(d.max()) < 20
        )
    counts = torch.bincount(torch.cat([d[1:] for d in draws]), minlength=20).double() / len(draws)
    # each of 1..19 about 7/19
    assert counts[0] == 0 and counts[1:].min() > 0.2 and counts[1:].max() < 0.55
    with pytest.raises(
        ValueError,
        match=r"max_position: randomized distances draw 20 distinct distances from \[1, 20\)",
    ):
        randomized_distances(21, 20)


@pytest.mark.parametrize(
    "encoding",
    [
        dict(terms="a", absolute="rope"),
        dict(terms="a", bias="alibi"),
        dict(terms="abcd", bias="t5", share_bias=False),
        dict(terms="a", absolute="sinusoid"),
        dict(terms="a", absolute="learned"),
    ],
)
def test_per_layer_draws_follow_the_authors_order(encoding):
    """A training forward equals the forward whose every layer gets, by hand, what the authors' code
    draws from the same generator state: the input's positions (absolute encodings), then per layer
    RoPE's positions or the relative distances."""
    model = lm(positions="randomized", max_position=64, **encoding).train()
    torch.manual_seed(5)
    randomized, _ = model(tokens())
    torch.manual_seed(5)
    absolute = encoding.get("absolute") in ("sinusoid", "learned")
    at_input = randomized_positions(L, 64) if absolute else None
    layers = [
        AttentionOptions(
            positions=randomized_positions(L, 64) if encoding.get("absolute") == "rope" else None,
            distances=None if absolute or "bias" not in encoding else randomized_distances(L, 64),
        )
        for _ in model.layers
    ]
    if encoding.get("absolute") == "rope" or "bias" in encoding:
        assert not torch.equal(
            *[o.positions if o.positions is not None else o.distances for o in layers]
        )
    by_hand, _, _, _ = model._run(tokens(), None, 0, at_input, layers)
    torch.testing.assert_close(randomized, by_hand, rtol=0, atol=0)


def test_randomized_alibi_is_the_slope_times_the_drawn_distance():
    """Ruoss et al.'s noisy ALiBi (compute_noisy_alibi_encodings_biases): offset r >= 1 reads
    -m·d_r, the r-th smallest drawn distance; 0 on the diagonal. (Their +0.5 on keys before the
    query breaks left/right symmetry in their bidirectional encoder; in a causal decoder it is not
    part of ALiBi, here or there.)"""
    attn = RelPosAttention(16, 4, 4, AttentionConfig(terms="a", bias="alibi"))
    d = torch.tensor([0, 3, 4, 9, 17, 30])
    bias = attn.score_terms(torch.randn(1, L, 16), None, AttentionOptions(distances=d))["bias"][0]
    slopes = torch.tensor([2.0 ** (-8 * h / 4) for h in range(1, 5)])
    for i in range(L):
        for j in range(i + 1):
            torch.testing.assert_close(bias[:, i, j], -slopes * float(d[i - j]))


def test_fire_reads_the_query_position_so_per_layer_distances_are_refused():
    with pytest.raises(
        ConfigError,
        match="randomized_draw: per_layer draws the distances of relative encodings, "
        "and 'fire' also reads the query position; use shared_positions",
    ):
        AttentionConfig(bias="fire", positions="randomized")
    AttentionConfig(bias="fire", positions="randomized", randomized_draw="shared_positions")
    attn = RelPosAttention(16, 2, 8, AttentionConfig(terms="a", bias="fire"))
    with pytest.raises(ValueError, match="randomized_draw: 'fire' reads the query position"):
        attn(torch.randn(1, L, 16), None, AttentionOptions(distances=torch.arange(L)))


def test_evaluation_draws_as_in_training_unless_eval_positions_says_otherwise():
    """eval_positions null: as in training (Ruoss et al.'s code draws at test time too)."""
    for eval_positions in (None, "randomized"):
        model = lm(
            positions="randomized",
            eval_positions=eval_positions,
            max_position=64,
            terms="a",
            absolute="rope",
            randomized_draw="shared_positions",
        ).eval()
        torch.manual_seed(2)
        drawn, _ = model(tokens())
        torch.manual_seed(2)
        torch.testing.assert_close(
            drawn, model(tokens(), positions=randomized_positions(L, 64))[0], rtol=0, atol=0
        )
    model = lm(
        positions="randomized",
        eval_positions="sequential",
        max_position=64,
        terms="a",
        absolute="rope",
    ).eval()
    torch.testing.assert_close(
        model(tokens())[0], model(tokens(), positions=torch.arange(L))[0], rtol=0, atol=0
    )
    model = lm(
        positions="sequential",
        eval_positions="randomized",
        max_position=64,
        terms="a",
        absolute="rope",
    ).train()
    torch.testing.assert_close(
        model(tokens())[0], model(tokens(), positions=torch.arange(L))[0], rtol=0, atol=0
    )


def test_absolute_sinusoid_is_added_at_the_given_positions():
    """sqrt(d_model)·E[token] + P(p_t), P the sinusoid of docs/schemes/index.md (the embedding
    scaled as Vaswani et al.'s): one layer's input, built by hand."""
    model = lm(terms="a", absolute="sinusoid")
    positions = torch.tensor([3, 9, 10, 17, 30, 31])
    expected = (
        model.embed(tokens()) * 16**0.5
        + torch.tensor([sinusoid_row(float(p), 16) for p in positions]).float()
    )
    torch.testing.assert_close(model._embed(tokens(), positions), expected, rtol=1e-6, atol=1e-6)


def test_learned_tables_are_indexed_at_the_given_positions():
    model = lm(terms="a", absolute="learned", max_position=40)
    positions = torch.tensor([0, 2, 5, 11, 30, 39])
    expected = model.embed(tokens()) + model.input_positions.table.weight[positions]
    torch.testing.assert_close(model._embed(tokens(), positions), expected, rtol=0, atol=0)
    with pytest.raises(
        ValueError,
        match=r"max_position: learned absolute positions cover 0..39; got positions 0..40",
    ):
        model._embed(tokens(), torch.tensor([0, 1, 2, 3, 4, 40]))
    per_layer = lm(terms="a", absolute="learned_per_layer", max_position=40)
    layer = per_layer.layers[1]
    h = torch.randn(3, L, 16)
    torch.testing.assert_close(
        layer.layer_input(h, positions), h + layer.positions.table.weight[positions]
    )


def test_randomized_positions_need_a_model_without_memory():
    with pytest.raises(ConfigError, match="mem_len: randomized positions are drawn per segment"):
        ModelConfig(vocab_size=V, mem_len=8, attention=AttentionConfig(positions="randomized"))
    with pytest.raises(
        ConfigError,
        match="positions: 'shuffled' is not allowed; choose one of sequential, randomized",
    ):
        AttentionConfig(positions="shuffled")
    with pytest.raises(ConfigError, match="eval_positions: 'random' is not allowed"):
        AttentionConfig(eval_positions="random")
    model = lm(terms="a", eval_positions="randomized").eval()
    _, mems = lm(terms="a").eval()(tokens())
    with pytest.raises(ValueError, match="memory keys would keep another draw's"):
        model(tokens(), [torch.zeros(3, 2, 16)] * 2)
    assert mems is None
