"""The newer schemes inside the language model and the run: memory equivalence and causality, sinks
that memory does not count, presets, one-line config errors, RoPE context extension as an evaluation
setting (a pure function of the setting), log-n's training length filled in when the run starts.
Run: pytest tests/model/test_newer_lm.py -q"""

import json

import pytest
import torch

from fixtures.attention import assert_memory_and_causality_exact, randomize
from fixtures.training import short
from relpos_ablate import AttentionConfig, ConfigError, ModelConfig, TransformerLM
from relpos_ablate.config import EvalSetting, load_run_config, unsupported_reason
from relpos_ablate.config.presets import preset_fields
from relpos_ablate.config.run import resolve_log_n_length
from relpos_ablate.train.module import rope_scale, rope_scaling
from relpos_ablate.train.run import train_run

LM_SCHEMES = {
    "rope_xpos": dict(terms="a", absolute="rope", xpos_scale_base=8.0),
    "rope_partial": dict(terms="a", absolute="rope", rope_fraction=0.5),
    "fox": dict(terms="a", forget_gate=True),
    "cope": dict(terms="a", cope_positions=5),
    "window": dict(terms="abcd", window=4),
    "sinks": dict(terms="ac", sinks=2, bias="t5", num_buckets=8, max_distance=6),
    "log_n_tau": dict(
        terms="a", score_scale="log_n", log_n_length=8, learned_temperature=True, bias="sandwich"
    ),
}


def lm(fields, mem_len, **model):
    config = ModelConfig(
        vocab_size=11,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        mem_len=mem_len,
        attention=AttentionConfig(**fields),
        **model,
    )
    net = TransformerLM(config).double().eval()
    randomize(net, 2, scale=0.3)
    return net


@pytest.mark.parametrize("name", LM_SCHEMES)
def test_memory_equals_one_long_pass_and_the_future_never_leaks(name):
    """Segment 2 with memory (FoX's gates recomputed from it, CoPE counting over it, the window
    reaching into it) is the tail of one pass over both; changing later tokens leaves earlier
    outputs alone."""
    assert_memory_and_causality_exact(lm(LM_SCHEMES[name], mem_len=6))


def test_memory_holds_stream_tokens_only_sinks_are_not_counted():
    model = lm(LM_SCHEMES["sinks"], mem_len=4)
    _, mems = model(torch.randint(0, 11, (2, 7)))
    assert [m.shape for m in mems] == [torch.Size([2, 4, 16])] * 2


def test_rope_scaling_reaches_every_layer_through_the_model():
    model = lm(dict(terms="a", absolute="rope"), mem_len=0)
    tokens = torch.randint(0, 11, (1, 9))
    scaled = model(
        tokens,
        rope_scaling=rope_scaling(
            load_run_config(None, ["train.segment_len=4", "data.offset=2"]),
            EvalSetting(segment_len=8, rope_scaling="pi"),
        ),
    )[0]
    assert not torch.allclose(scaled, model(tokens)[0])
    maps = model.inspect(
        tokens,
        rope_scaling=rope_scaling(
            load_run_config(None, ["train.segment_len=9"]),
            EvalSetting(segment_len=9, rope_scaling="pi"),
        ),
    )
    # auto: 9 / 9 -> s = 1, the trained RoPE
    torch.testing.assert_close(maps["logits"], model(tokens)[0])


# ------------------------------------------------------------------ presets and configs
def test_presets_of_the_newer_encodings():
    assert preset_fields("rope_xpos") == {
        "terms": "a",
        "absolute": "rope",
        "xpos_scale_base": 512.0,
        "bias": "none",
    }
    assert preset_fields("fox") == {
        "terms": "a",
        "absolute": "none",
        "bias": "none",
        "forget_gate": True,
    }
    assert preset_fields("cope") == {
        "terms": "a",
        "absolute": "none",
        "bias": "none",
        "cope_positions": 64,
    }
    assert preset_fields("sandwich") == {"terms": "a", "absolute": "none", "bias": "sandwich"}
    for name in ("rope_xpos", "fox", "cope", "sandwich"):
        TransformerLM(ModelConfig(vocab_size=5, attention=AttentionConfig(**preset_fields(name))))


INVALID = [
    (dict(rope_fraction=0.5), "rope_fraction", "set absolute='rope'"),
    (dict(terms="a", absolute="rope", rope_fraction=0.0), "rope_fraction", "out of range"),
    (dict(terms="a", absolute="rope", rope_fraction=1.5), "rope_fraction", "out of range"),
    (dict(xpos_scale_base=512.0), "xpos_scale_base", "set absolute='rope'"),
    (
        dict(terms="a", absolute="rope", xpos_scale_base=512.0, causal=False),
        "xpos_scale_base",
        "causal",
    ),
    (
        dict(terms="a", absolute="rope", xpos_scale_base=512.0, sinks=1),
        "xpos_scale_base",
        "in their product",
    ),
    (dict(forget_gate=True, causal=False), "forget_gate", "causal attention only"),
    (dict(cope_positions=4, causal=False), "cope_positions", "causal attention only"),
    (dict(cope_positions=4, terms="cd"), "cope_positions", "include term a"),
    (dict(cope_positions=4, backend="flex"), "backend", "use auto, blocks, sdpa or explicit"),
    (dict(cope_positions=-1), "cope_positions", "out of range"),
    (dict(window=0), "window", "out of range"),
    (dict(window=4, causal=False), "window", "causal attention only"),
    (dict(sinks=-1), "sinks", "out of range"),
    (dict(score_scale="log_n", log_n_length=1), "log_n_length", "out of range"),
    (dict(score_scale="sqrt"), "score_scale", "sqrt_d, none, log_n"),
]


@pytest.mark.parametrize("fields, field, phrase", INVALID, ids=[f for _, f, _ in INVALID])
def test_bad_fields_are_one_line_errors_naming_the_field(fields, field, phrase):
    with pytest.raises(ConfigError) as err:
        AttentionConfig(**fields)
    assert (
        str(err.value).startswith(f"{field}: ")
        and phrase in str(err.value)
        and "\n" not in str(err.value)
    )


def test_a_rotary_width_of_no_pair_is_an_error():
    with pytest.raises(ConfigError, match="^rope_fraction: 0.1 of d_head 8 rotates no pair"):
        ModelConfig(
            d_head=8, attention=AttentionConfig(terms="a", absolute="rope", rope_fraction=0.1)
        )


BAD_SETTINGS = [
    (
        "eval.settings=[{segment_len: 8, rope_scaling: linear}]",
        "eval.settings[0].rope_scaling",
        "pi, ntk, yarn",
    ),
    (
        "eval.settings=[{segment_len: 8, rope_scaling: pi, rope_scale: 0.5}]",
        "eval.settings[0].rope_scale",
        "range",
    ),
    (
        "eval.settings=[{segment_len: 8, rope_scale: 2}]",
        "eval.settings[0].rope_scale",
        "only with rope_scaling",
    ),
    (
        "eval.settings=[{segment_len: 8, rope_scaling: pi, rope_scale: autox}]",
        "eval.settings[0].rope_scale",
        "auto",
    ),
]


@pytest.mark.parametrize("override, field, phrase", BAD_SETTINGS, ids=[b[2] for b in BAD_SETTINGS])
def test_bad_rope_scaling_settings_name_the_setting(override, field, phrase):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert str(err.value).startswith(f"{field}: ") and phrase in str(err.value)


def test_auto_rope_scale_is_the_attention_length_ratio_and_never_below_one():
    config = load_run_config(
        None,
        [
            "train.segment_len=16",
            "model.mem_len=16",
            "model.attention.terms=a",
            "model.attention.absolute=rope",
        ],
    )
    assert rope_scale(config, EvalSetting(segment_len=64, rope_scaling="yarn")) == (64 + 16) / 32
    assert rope_scale(config, EvalSetting(segment_len=64, mem_len=64, rope_scaling="ntk")) == 4.0
    assert rope_scale(config, EvalSetting(segment_len=8, rope_scaling="pi")) == 1.0
    assert rope_scale(config, EvalSetting(segment_len=64, rope_scaling="pi", rope_scale=3)) == 3.0
    assert rope_scale(config, EvalSetting(segment_len=64)) is None
    assert (
        rope_scaling(config, EvalSetting(segment_len=64, rope_scaling="yarn")).original_length == 32
    )


def test_models_without_rope_skip_rope_scaled_settings_with_the_reason():
    setting = EvalSetting(segment_len=32, rope_scaling="pi")
    assert (
        unsupported_reason(
            load_run_config(None, ["model.attention.terms=a", "model.attention.absolute=rope"]),
            setting,
        )
        is None
    )
    assert "absolute='none'" in unsupported_reason(
        load_run_config(None, ["model.attention.bias=alibi"]), setting
    )
    xpos = load_run_config(
        None,
        [
            "model.attention.terms=a",
            "model.attention.absolute=rope",
            "model.attention.xpos_scale_base=512",
        ],
    )
    assert "with xPos" in unsupported_reason(xpos, setting)


def test_log_n_length_is_the_training_attention_length_unless_given():
    config = load_run_config(
        None, ["train.segment_len=24", "model.mem_len=8", "model.attention.score_scale=log_n"]
    )
    assert resolve_log_n_length(config).model.attention.log_n_length == 32
    given = load_run_config(
        None, ["model.attention.score_scale=log_n", "model.attention.log_n_length=100"]
    )
    assert resolve_log_n_length(given) is given


def test_a_run_records_rope_scaling_per_setting_and_fills_in_log_n(tmp_path):
    settings = (
        "eval.settings=[{segment_len: 16}, {segment_len: 32, rope_scaling: yarn}, "
        "{segment_len: 32, rope_scaling: pi, rope_scale: 4}]"
    )
    config = short(
        "model.attention.terms=a",
        "model.attention.absolute=rope",
        "model.attention.score_scale=log_n",
        "train.max_steps=4",
        "data.eval_tokens=256",
        settings,
    )
    assert train_run(config, tmp_path) == "done"
    records = json.loads((tmp_path / "eval.json").read_text())["settings"]
    assert [(r["rope_scaling"], r["rope_scale"]) for r in records] == [
        (None, None),
        ("yarn", 2.0),
        ("pi", 4.0),
    ]
    assert all("error" not in r and r["metrics"]["loss"] > 0 for r in records)
    assert "log_n_length: 16" in (tmp_path / "config.yaml").read_text()


def test_a_table_splits_the_settings_by_rope_scaling(tmp_path):
    """cols [segment_len, rope_scaling] (bias_types.yaml): RoPE rows get a cell per extension; a
    model that skipped those settings (its eval.json says why) has blanks there, not a mix of
    settings."""
    from fixtures.report_runs import make_run
    from relpos_ablate.analysis import collect
    from relpos_ablate.analysis.render import render
    from relpos_ablate.analysis.table_options import TableOptions
    from relpos_ablate.studies import make_table

    settings = [(32, None, 0.9), (64, None, 0.5), (64, "pi", 0.7), (64, "yarn", 0.8)]
    for encoding, overrides in (
        ("rope", ["model.attention.terms=a", "model.attention.absolute=rope"]),
        ("alibi", ["model.attention.terms=a", "model.attention.bias=alibi"]),
    ):
        run_dir = make_run(
            tmp_path,
            [*overrides, "train.segment_len=32"],
            main_metric="acc",
            variant={"encoding": encoding, "seed": 0},
        )
        records = [
            {
                "segment_len": n,
                "mem_len": 0,
                "clamp_len": None,
                "same_length": False,
                "attn_len": n,
                "rope_scaling": kind,
                "rope_scale": None if kind is None else n / 32,
                **(
                    {"metrics": {"acc": acc}}
                    if encoding == "rope" or kind is None
                    else {
                        "metrics": {},
                        "error": "rope_scaling extends RoPE; this model has absolute='none'",
                    }
                ),
            }
            for n, kind, acc in settings
        ]
        (run_dir / "eval.json").write_text(json.dumps({"main_metric": "acc", "settings": records}))
    table, _ = make_table(
        collect(tmp_path), TableOptions(rows=("encoding",), cols=("segment_len", "rope_scaling"))
    )
    lines = render(table, "markdown").splitlines()
    assert lines[0] == (
        "| encoding | eval len 32 | eval len 64 | "
        "eval len 64, rope_scaling pi | eval len 64, rope_scaling yarn |"
    )
    rope = next(line for line in lines if line.startswith("| rope "))
    alibi = next(line for line in lines if line.startswith("| alibi "))
    assert (
        "0.700" in rope and "0.800" in rope and alibi.count("0.900") == 1 and "0.700" not in alibi
    )
