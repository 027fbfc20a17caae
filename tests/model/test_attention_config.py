"""Every invalid attention/model config fails at construction with one line naming the field.
Run: pytest tests/model/test_attention_config.py -q"""

import pytest

from relpos_ablate import AttentionConfig, ConfigError, ModelConfig, RelPosAttention, TransformerLM
from relpos_ablate.model import AttentionOptions

INVALID_ATTENTION = [
    (dict(terms=""), "terms", "non-empty subset"),
    (dict(terms="abx"), "terms", "only the letters a, b, c, d"),
    (dict(terms="ba"), "terms", "in the order abcd"),
    (dict(terms="aab"), "terms", "each letter once"),
    (dict(bias="t6"), "bias", "'t6' is not registered; registered: none, xl_table, t5"),
    (dict(rel="cosine"), "rel", "sinusoid, learned"),
    (dict(clamp_len=-1), "clamp_len", "out of range"),
    (dict(clamp_len=0), "clamp_len", "out of range"),
    (dict(rel="learned"), "clamp_len", "needs a table size"),
    (dict(bias="t5", num_buckets=1), "num_buckets", "out of range"),
    (dict(bias="t5", num_buckets=3, causal=False), "num_buckets", "out of range"),
    (dict(bias="t5", num_buckets=32, max_distance=16), "max_distance", "max_distance > 16"),
    (dict(max_distance=0), "max_distance", "out of range"),
    (dict(absolute="alibi"), "absolute", "none, sinusoid, learned, learned_per_layer, rope"),
    (dict(absolute="rope"), "absolute", "use terms='a'"),
    (dict(shaw_values=True), "shaw_values", "rel='learned'"),
    (dict(score_scale="sqrt"), "score_scale", "sqrt_d, none"),
    (dict(backend="cuda"), "backend", "auto, blocks, sdpa, flex, explicit"),
    (dict(query_chunk=-4), "query_chunk", "out of range"),
    (dict(max_position=0), "max_position", "out of range"),
    (dict(rope_base=0.5), "rope_base", "out of range"),
]


@pytest.mark.parametrize(
    "fields, field, message", INVALID_ATTENTION, ids=[str(f) for f, _, _ in INVALID_ATTENTION]
)
def test_invalid_attention_configs(fields, field, message):
    with pytest.raises(ConfigError) as err:
        AttentionConfig(**fields)
    text = str(err.value)
    assert text.startswith(f"{field}: ") and message in text and "\n" not in text


INVALID_MODEL = [
    (dict(d_model=0), "d_model"),
    (dict(n_heads=0), "n_heads"),
    (dict(dropout=1.5), "dropout"),
    (dict(norm="sandwich"), "norm"),
    (dict(mem_len=-1), "mem_len"),
    (dict(d_model=15), "d_model"),  # sinusoid R needs an even width
    (dict(d_head=7, attention=AttentionConfig(terms="a", absolute="rope")), "d_head"),
]


@pytest.mark.parametrize("fields, field", INVALID_MODEL, ids=[f for _, f in INVALID_MODEL])
def test_invalid_model_configs(fields, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        ModelConfig(**fields)


def test_module_level_checks():
    with pytest.raises(ConfigError, match="^d_head: rope needs an even d_head"):
        RelPosAttention(16, 2, 7, AttentionConfig(terms="a", absolute="rope"))
    with pytest.raises(ConfigError, match="^d_model: sinusoid R needs an even d_model"):
        RelPosAttention(15, 2, 8, AttentionConfig())
    with pytest.raises(ConfigError, match="^vocab_size: must be >= 1"):
        TransformerLM(ModelConfig())
    with pytest.raises(
        ValueError, match=r"window \(same_length\) applies to causal attention only"
    ):
        import torch

        RelPosAttention(16, 2, 8, AttentionConfig(causal=False))(
            torch.zeros(1, 2, 16), None, AttentionOptions(window=2)
        )


@pytest.mark.parametrize("fields", [dict(path=True), dict(bias="kerple_log", dape="v2")])
def test_chunks_refuse_the_score_readers_that_do_not_match_their_reference_there(fields):
    """PaTH and DAPE v2 on chunked rows differ from the float64 reference (found with issue 57):
    refused in one line, not run wrong."""
    with pytest.raises(ConfigError, match="chunk: .* does not match its float64 reference"):
        AttentionConfig(terms="a", chunk=4, **fields)
