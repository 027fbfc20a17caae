"""Per-layer attention (model.layer_kinds, model.layer_pattern): a two-layer model with a different
encoding per layer against a float64 reference written out here layer by layer, the config's
resolution and errors, the schedule presets, and a grid over three patterns through the CLI. Run:
pytest tests/config/test_layer_schedules.py -q"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from fixtures.attention import randomize
from fixtures.reference import reference_attention
from relpos_ablate import TransformerLM
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError, ModelConfig, describe, from_dict
from relpos_ablate.config.presets import SCHEDULES, encoding_fields
from relpos_ablate.config.schedule import pattern_label
from relpos_ablate.runner.grid import load_grid, resolve_variant

TWO_LAYERS = {
    "vocab_size": 13,
    "d_model": 16,
    "n_layers": 2,
    "n_heads": 2,
    "d_head": 8,
    "d_inner": 32,
    "dropout": 0.0,
    "layer_kinds": {
        "local": {"encoding": "t5", "window": 3},
        "global": {"encoding": "rope", "rope_base": 50.0, "temperature_tuning": True, "chunk": 4},
    },
    "layer_pattern": ["local", "global"],
    "attention": {"num_buckets": 8, "max_distance": 6, "temperature_floor_scale": 2.0},
}


def reference_lm(model: TransformerLM, tokens, mems=None):
    """Logits [B, L, V] in float64: embedding, then per layer pre-LN attention
    (tests/fixtures/reference.py, with the layer's own config) and feed-forward, each with its
    residual, the final LN and the tied head; and the new memory."""
    ln = lambda t, norm: F.layer_norm(t, t.shape[-1:], norm.weight.double(), norm.bias.double())  # noqa: E731
    h = model.embed.weight.double()[tokens]
    new_mems = []
    for i, layer in enumerate(model.layers):
        mem = None if mems is None else mems[i].double()
        new_mems.append((h if mem is None else torch.cat([mem, h], 1))[:, -model.config.mem_len :])
        out, _ = reference_attention(
            layer.attn, ln(h, layer.norm_attn), None if mem is None else ln(mem, layer.norm_attn)
        )
        h = h + out
        ff = layer.ff
        hidden = torch.relu(ln(h, layer.norm_ff) @ ff[0].weight.double().T + ff[0].bias.double())
        h = h + hidden @ ff[3].weight.double().T + ff[3].bias.double()
    return ln(h, model.final_norm) @ model.head.weight.double().T, new_mems


@pytest.mark.parametrize("mem_len", [0, 4])
def test_two_layers_with_their_own_encodings_match_the_reference(mem_len):
    """Layer 0: T5 with a window of 3; layer 1: RoPE base 50, chunks of 4, Llama 4's temperature
    (floor scale 2). Two segments, so that the second reads memory (which the chunked layer never
    sees)."""
    config = from_dict(ModelConfig, {**TWO_LAYERS, "mem_len": mem_len})
    model = TransformerLM(config).double().eval()
    randomize(model, 7, scale=0.3)
    assert [type(layer.attn.bias_scheme).__name__ for layer in model.layers] == [
        "T5Bias",
        "NoneType",
    ]
    assert (model.layers[0].attn.config.window, model.layers[1].attn.config.chunk) == (3, 4)
    tokens = torch.randint(0, 13, (2, 18), generator=torch.Generator().manual_seed(1))
    mems = ref_mems = None
    for segment in tokens.split(9, dim=1):
        with torch.no_grad():
            logits, mems = model(segment, mems)
        ref, ref_mems = reference_lm(model, segment, ref_mems if mem_len else None)
        torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-10)


def test_layers_of_one_bias_setting_share_one_module():
    """share_bias: the layers of one bias setting share a module whatever their windows; another
    setting has its own."""
    config = from_dict(
        ModelConfig,
        {
            "vocab_size": 5,
            "n_layers": 4,
            "layer_kinds": {
                "local": {"encoding": "alibi_learned", "window": 4},
                "global": {"encoding": "alibi_learned"},
                "t5": {"encoding": "t5"},
            },
            "layer_pattern": ["local", "global", "t5", "nope"],
        },
    )
    model = TransformerLM(config)
    schemes = [layer.attn.bias_scheme for layer in model.layers]
    assert schemes[0] is schemes[1] is model.shared_bias_scheme
    assert schemes[2] is model.other_bias_schemes[0] and schemes[3] is None
    # learned slopes, T5 table
    assert sum(1 for name, _ in model.named_parameters() if "bias_scheme" in name) == 2


def test_a_pattern_repeats_and_a_kind_keeps_the_models_other_fields():
    config = from_dict(
        ModelConfig,
        {
            "n_layers": 5,
            "attention": {"sinks": 2, "rope_base": 77.0},
            "layer_kinds": {"g": {"encoding": "rope", "rope_base": 1e6, "window": 0}},
            "layer_pattern": ["rope", "rope", "g"],
        },
    )
    layers = config.layer_attentions
    assert [a.absolute for a in layers] == ["rope"] * 5
    assert [a.rope_base for a in layers] == [77.0, 77.0, 1e6, 77.0, 77.0]
    assert all(a.sinks == 2 for a in layers)
    assert [config.layer_word(i) for i in range(5)] == ["rope", "rope", "g", "rope", "rope"]
    assert pattern_label(["local", "local", "local", "global"]) == "local×3 global"


@pytest.mark.parametrize(
    "model,message",
    [
        ({"layer_pattern": ["nope", "locl"]}, "layer_pattern[1]: 'locl' is neither a layer kind"),
        (
            {"layer_kinds": {"x": {"encoding": "rnope"}}, "layer_pattern": ["x"]},
            "layer_kinds.x.encoding: 'rnope' (a schedule",
        ),
        (
            {"layer_kinds": {"x": {"windw": 3}}},
            "layer_kinds.x.windw: unknown key; did you mean 'window'?",
        ),
        (
            {"layer_kinds": {"x": {"encoding": "vaswani"}}, "layer_pattern": ["x"]},
            "layer_kinds.x: absolute 'sinusoid'",
        ),
        (
            {
                "layer_kinds": {"x": {"chunk": 4}},
                "attention": {"causal": False},
                "layer_pattern": ["x"],
            },
            "layer_kinds.x.chunk: is defined for causal attention only",
        ),
        ({"layer_kinds": [{"name": "x"}, {"name": "x"}]}, "layer_kinds.x: is defined twice"),
    ],
)
def test_bad_schedules_fail_in_one_line_naming_the_field(model, message):
    with pytest.raises(ConfigError) as err:
        from_dict(ModelConfig, model)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_help_documents_the_pattern_and_chunks():
    rows = {path: doc for path, _, doc in describe(ModelConfig)}
    assert "layer l uses word l mod len(pattern)" in rows["layer_pattern"]
    assert "layer_kinds.<name>.window" in rows and "layer_kinds.<name>.chunk" in rows
    assert "Llama 4's attention_chunk_size" in rows["attention.chunk"]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_presets_resolve_to_valid_models(name):
    """Each preset is a valid 6-layer model, its sizes the published ones (config/presets.py cites
    them)."""
    data = {"model": {"n_layers": 6, "vocab_size": 7}}
    config = resolve_variant(data, {"encoding": name}).model
    layers = config.layer_attentions
    published = {  # (absolute, window, chunk, rope_base, temperature_tuning) per layer
        "rnope": [("rope", 4096, None, 10000.0, False)] * 3
        + [("none", None, None, 10000.0, False)]
        + [("rope", 4096, None, 10000.0, False)] * 2,
        "llama4_like": [("rope", None, 8192, 500000.0, False)] * 3
        + [("none", None, None, 10000.0, True)]
        + [("rope", None, 8192, 500000.0, False)] * 2,
        "gemma3_like": [("rope", 1024, None, 10000.0, False)] * 5
        + [("rope", None, None, 1e6, False)],
    }[name]
    assert [
        (a.absolute, a.window, a.chunk, a.rope_base, a.temperature_tuning) for a in layers
    ] == published
    scaled = resolve_variant(data, {"encoding": name, "model.layer_kinds.local.window": 8}).model
    assert scaled.layer_attention(0).window == 8  # a grid reaches into a kind by its name


def tiny_base(steps: int, lengths: tuple[int, ...]) -> dict:
    """A 4-layer model of width 16 on offset_copy, trained at 16 tokens for `steps` steps, evaluated
    at `lengths`."""
    return {
        "model": {
            "d_model": 16,
            "n_layers": 4,
            "n_heads": 2,
            "d_head": 8,
            "d_inner": 32,
            "dropout": 0.0,
        },
        "data": {
            "source": "synthetic",
            "task": "offset_copy",
            "num_symbols": 6,
            "offset": 2,
            "train_tokens": 1024,
            "eval_tokens": 256,
        },
        "train": {
            "segment_len": 16,
            "batch_size": 4,
            "max_steps": steps,
            "warmup_steps": 1,
            "log_every": 2,
            "checkpoint_every": steps,
        },
        "eval": {"settings": [{"segment_len": n} for n in lengths], "batch_size": 4},
    }


def test_grid_over_three_patterns_trains_evaluates_and_labels_them(tmp_path):
    """NoPE never / every 2nd / every 4th layer as one grid axis, through the CLI; the table names
    each pattern."""
    spec = {
        "name": "patterns",
        "base": tiny_base(steps=6, lengths=(16, 32)),
        "grid": {
            "model.layer_pattern": [["rope"], ["rope", "nope"], ["rope", "rope", "rope", "nope"]]
        },
        "seeds": [0],
        "table": {"rows": ["model.layer_pattern"], "cols": ["segment_len"], "metric": "acc"},
    }
    path = tmp_path / "patterns.yaml"
    path.write_text(yaml.safe_dump(spec))
    results = tmp_path / "results"
    assert main(["grid", str(path), "--results", str(results), "--slots", "2"]) == 0
    runs = load_grid(path).runs
    for run in runs:
        evaluation = json.loads((results / "patterns" / run.run_id / "eval.json").read_text())
        assert [s["segment_len"] for s in evaluation["settings"]] == [16, 32]
        assert all(math.isfinite(s["metrics"]["loss"]) for s in evaluation["settings"])
    out = tmp_path / "table.md"
    assert main(["table", str(results / "patterns"), "--out", str(out)]) == 0
    table = out.read_text()
    for label in ("rope", "rope nope", "rope×3 nope"):
        assert f"| {label} |" in table


def test_schedule_presets_train_through_the_cli(tmp_path):
    """`encoding: [rnope, llama4_like, gemma3_like]` with the local kind's window and chunk scaled
    to the segment."""
    spec = {
        "name": "schedules",
        "base": tiny_base(steps=4, lengths=(32,)),
        "zip": {
            "encoding": ["rnope", "llama4_like", "gemma3_like"],
            "model.layer_kinds.local.window": [4, 0, 4],
            "model.layer_kinds.local.chunk": [0, 8, 0],
        },
        "seeds": [0],
    }
    path = tmp_path / "schedules.yaml"
    path.write_text(yaml.safe_dump(spec))
    results = tmp_path / "results"
    assert main(["grid", str(path), "--results", str(results), "--slots", "2"]) == 0
    for run in load_grid(path).runs:
        config = yaml.safe_load((results / "schedules" / run.run_id / "config.yaml").read_text())
        assert (
            config["model"]["layer_pattern"]
            == encoding_fields(run.variant["encoding"])["model.layer_pattern"]
        )
        assert (results / "schedules" / run.run_id / "eval.json").exists()


def test_a_schedule_trains_with_memory_evaluates_again_and_every_plot_names_its_layers(tmp_path):
    """A 4-layer pattern (T5 with a window, RoPE chunked, NoPE tuned) trained in-process with XL
    memory and diagnostics; `evaluate` again, and the bias, attention, terms and diagnostics
    figures, each naming the kinds."""
    from fixtures.report_runs import TINY_TRAINING
    from relpos_ablate.analysis import figures
    from relpos_ablate.config import load_run_config, run_id
    from relpos_ablate.io import atomic_write_json
    from relpos_ablate.train.run import load_run, train_run

    kinds = (
        "{local: {encoding: t5, window: 6}, chunked: {encoding: rope, chunk: 8}, "
        "global: {encoding: nope, temperature_tuning: true}}"
    )
    config = load_run_config(
        None,
        [
            *TINY_TRAINING,
            "model.n_layers=4",
            "model.mem_len=8",
            "eval.diagnostics=true",
            f"model.layer_kinds={kinds}",
            "model.layer_pattern=[local, chunked, local, global]",
        ],
    )
    run_dir = tmp_path / "sched" / run_id(config)
    atomic_write_json(
        run_dir / "run.json",
        {"run_id": run_id(config), "experiment": "sched", "variant": {}, "spec": None},
    )
    assert train_run(config, run_dir) == "done"
    evaluation = json.loads((run_dir / "eval.json").read_text())
    # one row per layer
    assert all(len(s["diagnostics"]["entropy"]) == 4 for s in evaluation["settings"])
    assert main(["evaluate", str(run_dir), "--replace"]) == 0
    _, model = load_run(run_dir)
    assert model.layer_names() == [
        "layer 0 local",
        "layer 1 chunked",
        "layer 2 local",
        "layer 3 global",
    ]
    assert [title for title, _ in figures.bias_panels(model, "bias")] == [
        "bias, layer 0 local, layer 2 local (shared)"
    ]
    for kind in ("bias", "attention", "terms", "diagnostics"):
        assert (
            main(
                [
                    "plot",
                    str(run_dir),
                    "--kind",
                    kind,
                    "--out",
                    str(tmp_path / kind),
                    "--formats",
                    "png",
                ]
            )
            == 0
        )
        assert list((tmp_path / kind).glob("*.png")), kind
