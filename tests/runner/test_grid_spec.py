"""Grid specs: expansion (product, zip, exclude, seeds, presets), run ids, and every spec error
reported at once, one line each, before anything launches. Pure Python, about a second.
Run: pytest tests/runner/test_grid_spec.py -q
"""

import copy
from pathlib import Path

import pytest
import yaml

from fixtures.runner import tiny_base
from relpos_ablate.cli import main
from relpos_ablate.config import RunConfig, from_dict, run_id, to_plain
from relpos_ablate.config.presets import presets
from relpos_ablate.config.registry import BUILTIN_BIASES
from relpos_ablate.runner.grid import GridSpecError, LauncherConfig, load_grid, parse_grid

REPO = Path(__file__).resolve().parents[2]

# The presets as the project's contract states them (independent of presets.py): the baselines, and
# one preset per registered bias type (term a plus that bias), whose names come from the registry.
CONTRACT = {
    "xl": {"terms": "abcd", "rel": "sinusoid", "bias": "none", "absolute": "none"},
    "shaw": {"terms": "ab", "rel": "learned", "clamp_len": 20, "bias": "none", "absolute": "none"},
    "vaswani": {"terms": "a", "absolute": "sinusoid", "bias": "none"},
    "learned": {"terms": "a", "absolute": "learned", "bias": "none"},
    "al_rfou": {"terms": "a", "absolute": "learned_per_layer", "bias": "none"},
    "nope": {"terms": "a", "absolute": "none", "bias": "none"},
    "rope": {"terms": "a", "absolute": "rope", "bias": "none"},
    "p_rope": {"terms": "a", "absolute": "rope", "rope_p": 0.75, "bias": "none"},
    "rope_xpos": {"terms": "a", "absolute": "rope", "xpos_scale_base": 512.0, "bias": "none"},
    "fox": {"terms": "a", "absolute": "none", "bias": "none", "forget_gate": True},
    "cope": {"terms": "a", "absolute": "none", "bias": "none", "cope_positions": 64},
    "ssmax": {"terms": "a", "absolute": "none", "bias": "none", "score_scale": "ssmax"},
    "stick_breaking": {
        "terms": "a",
        "absolute": "none",
        "bias": "none",
        "normaliser": "stick_breaking",
    },
    "path": {"terms": "a", "absolute": "none", "bias": "none", "path": True},
    "dape": {"terms": "a", "absolute": "none", "bias": "kerple_log", "dape": "v1"},
    "dape_v2": {"terms": "a", "absolute": "none", "bias": "kerple_log", "dape": "v2"},
    "pope": {"terms": "a", "absolute": "none", "bias": "none", "pope": True},
    "grape_a": {"terms": "a", "absolute": "none", "bias": "none", "grape": "a", "qk_norm": "rms"},
    "grape_ap": {"terms": "a", "absolute": "none", "bias": "none", "grape": "ap", "qk_norm": "rms"},
    "mla_rope": {"terms": "a", "absolute": "none", "bias": "none", "qk_rope_dim": 8},
    **{name: {"terms": "a", "absolute": "none", "bias": name} for name in BUILTIN_BIASES},
}


def expected_config(base: dict, encoding: str | None = None, **paths) -> RunConfig:
    """The config a variant should resolve to, built by hand: base, preset fields, then key
    paths."""
    data = copy.deepcopy(base)
    attention = data.setdefault("model", {}).setdefault("attention", {})
    attention.update(CONTRACT[encoding] if encoding else {})
    for path, value in paths.items():
        node = data
        *parents, leaf = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return from_dict(RunConfig, data)


def test_product_runs_seeds_outermost_with_config_hash_ids():
    base = tiny_base()
    spec = parse_grid(
        {
            "name": "p",
            "base": base,
            "grid": {"encoding": ["xl", "rope"], "model.mem_len": [0, 8]},
            "seeds": [3, 4],
        }
    )
    expected = [(enc, mem, seed) for seed in (3, 4) for enc in ("xl", "rope") for mem in (0, 8)]
    assert [tuple(r.variant.values()) for r in spec.runs] == expected
    assert spec.axes == ("encoding", "model.mem_len", "seed")
    for run, (enc, mem, seed) in zip(spec.runs, expected):
        config = expected_config(base, enc, model__mem_len=mem, seed=seed)
        assert run.config == config
        assert run.run_id == run_id(config)
    assert len({r.run_id for r in spec.runs}) == 8


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_each_preset_sets_only_its_attention_fields(name):
    base = tiny_base()
    base["model"]["attention"] = {
        "max_position": 512,
        "num_buckets": 16,
        "max_distance": 64,
        "causal": True,
    }
    (run,) = parse_grid({"name": "p", "base": base, "grid": {"encoding": [name]}}).runs
    attention = to_plain(run.config.model.attention)
    for field, value in {**base["model"]["attention"], **CONTRACT[name]}.items():
        assert attention[field] == value, field


def test_preset_table_is_the_contract():
    assert presets() == CONTRACT


def test_key_path_axis_applies_after_the_preset():
    spec = parse_grid(
        {
            "name": "p",
            "base": tiny_base(),
            "grid": {"encoding": ["shaw"], "model.attention.clamp_len": [4, 8]},
        }
    )
    assert [r.config.model.attention.clamp_len for r in spec.runs] == [4, 8]
    assert all(r.config.model.attention.rel == "learned" for r in spec.runs)


def test_zip_varies_axes_together_and_exclude_drops_combinations():
    base = tiny_base()
    spec = parse_grid(
        {
            "name": "z",
            "base": base,
            "grid": {"encoding": ["xl", "alibi"]},
            "zip": [{"train.segment_len": [16, 32], "data.offset": [4, 12]}],
            "exclude": [{"encoding": "alibi", "train.segment_len": 32}],
            "seeds": [0],
        }
    )
    got = [
        (r.variant["encoding"], r.config.train.segment_len, r.config.data.offset) for r in spec.runs
    ]
    assert got == [("xl", 16, 4), ("xl", 32, 12), ("alibi", 16, 4)]
    assert spec.runs[1].config == expected_config(
        base, "xl", train__segment_len=32, data__offset=12, seed=0
    )


def test_zip_columns_may_repeat_values_when_rows_differ():
    spec = parse_grid(
        {
            "name": "z",
            "base": tiny_base(),
            "zip": {
                "encoding": ["xl", "xl", "alibi"],
                "model.attention.terms": ["abcd", "ab", "a"],
            },
        }
    )
    got = [(r.config.model.attention.terms, r.config.model.attention.bias) for r in spec.runs]
    assert got == [("abcd", "none"), ("ab", "none"), ("a", "alibi")]


def test_zip_accepts_a_single_mapping():
    spec = parse_grid(
        {"name": "z", "base": tiny_base(), "zip": {"model.mem_len": [0, 4], "train.lr": [0.1, 0.2]}}
    )
    assert [(r.config.model.mem_len, r.config.train.lr) for r in spec.runs] == [(0, 0.1), (4, 0.2)]


def test_seed_as_grid_axis_and_no_axes():
    spec = parse_grid({"name": "s", "base": tiny_base(), "grid": {"seed": [5, 6]}})
    assert [r.config.seed for r in spec.runs] == [5, 6]
    (only,) = parse_grid({"name": "s", "base": tiny_base()}).runs
    assert only.config == from_dict(RunConfig, tiny_base()) and only.variant == {}


def test_two_specs_producing_one_config_share_the_run_id():
    base = tiny_base()
    by_preset = parse_grid({"name": "a", "base": base, "grid": {"encoding": ["nope"]}})
    by_paths = parse_grid(
        {
            "name": "b",
            "base": base,
            "grid": {"model.attention.terms": ["a"], "model.attention.absolute": ["none"]},
        }
    )
    assert by_preset.runs[0].run_id == by_paths.runs[0].run_id


def test_base_may_be_a_file_next_to_the_spec(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_base()))
    spec_path = tmp_path / "g.yaml"
    spec_path.write_text(yaml.safe_dump({"base": "base.yaml", "seeds": [1]}))
    spec = load_grid(spec_path)
    assert spec.name == "g" and spec.runs[0].config == expected_config(tiny_base(), seed=1)


def test_launcher_block():
    spec = parse_grid(
        {"name": "l", "base": tiny_base(), "launcher": {"partition": "gpu", "time": 30}}
    )
    assert spec.launcher == LauncherConfig(partition="gpu", time=30)


# Invalid specs: (spec changes over a valid one, the error's key path, a phrase of its message).
BAD_SPECS = [
    (
        {"grid": {"model.atention.terms": ["a"]}},
        "grid.model.atention.terms",
        "did you mean 'attention'",
    ),
    ({"grid": {"model.mem_len.x": [1]}}, "grid.model.mem_len.x", "is a value, not a section"),
    ({"grid": {"model.mem_len": []}}, "grid.model.mem_len", "empty axis"),
    ({"grid": {"model.mem_len": 4}}, "grid.model.mem_len", "expected a list"),
    ({"grid": {"model.mem_len": [4, 4]}}, "grid.model.mem_len", "listed twice"),
    ({"grid": {"encoding": ["xl", "xll"]}}, "grid.encoding", "allowed: xl, shaw"),
    ({"grid": {"model.mem_len": [-1]}}, "model.mem_len", "out of range"),
    (
        {"grid": {"model.attention.terms": ["ax"]}},
        "model.attention.terms",
        "only the letters a, b, c, d",
    ),
    (
        {"grid": {"encoding": ["rope"], "model.attention.terms": ["ab"]}},
        "model.attention.absolute",
        "use terms='a'",
    ),
    # valid: one run
    (
        {
            "grid": {
                "encoding": ["nope"],
                "model.attention.absolute": ["none"],
                "model.attention.terms": ["a"],
            },
            "seeds": [0],
        },
        "",
        None,
    ),
    (
        {"grid": {"encoding": ["nope", "vaswani"], "model.attention.absolute": ["none"]}},
        "grid",
        "same config",
    ),
    ({"zip": [{"model.mem_len": [0, 4], "train.lr": [0.1]}]}, "zip[0]", "equal lengths"),
    ({"zip": [{"model.mem_len": [0, 0], "train.lr": [0.1, 0.1]}]}, "zip[0]", "row 1"),
    ({"zip": "x"}, "zip", "expected a mapping"),
    ({"seeds": []}, "seeds", "empty axis"),
    ({"seeds": [0], "grid": {"seed": [1]}}, "seeds", "already a grid/zip axis"),
    (
        {"grid": {"model.mem_len": [0]}, "zip": {"model.mem_len": [1]}},
        "zip[0]",
        "also varied in grid.model.mem_len",
    ),
    ({"exclude": [{"encoding": "xl"}]}, "exclude[0].encoding", "not an axis"),
    (
        {"grid": {"encoding": ["xl"]}, "exclude": [{"encoding": "rope"}]},
        "exclude[0].encoding",
        "not a value",
    ),
    (
        {"grid": {"encoding": ["xl"]}, "exclude": [{"encoding": "xl"}]},
        "exclude",
        "every combination is excluded",
    ),
    ({"grdi": {}}, "grdi", "did you mean 'grid'"),
    ({"name": "a b"}, "name", "directory name"),
    ({"base": 3}, "base", "expected a run config mapping"),
    ({"base": {"model": {"d_modle": 32}}}, "model.d_modle", "did you mean 'd_model'"),
    ({"launcher": {"time": 0}}, "launcher.time", "out of range"),
    ({"launcher": {"partiton": "gpu"}}, "launcher.partiton", "did you mean 'partition'"),
]


@pytest.mark.parametrize("change, field, phrase", BAD_SPECS)
def test_bad_spec_names_the_field_in_one_line(change, field, phrase):
    spec = {"name": "bad", "base": tiny_base(), **change}
    if phrase is None:
        assert len(parse_grid(spec).runs) == 1
        return
    with pytest.raises(GridSpecError) as err:
        parse_grid(spec)
    (problem,) = err.value.errors
    assert problem.field == field and phrase in str(problem), str(problem)
    assert "\n" not in str(problem)


def test_all_errors_are_reported_together_and_nothing_launches(tmp_path, capsys):
    spec = {
        "name": "bad",
        "base": tiny_base(),
        "grid": {
            "encoding": ["xl", "nonsense"],
            "model.atention.terms": ["a"],
            "model.mem_len": [],
        },
        "seeds": [0, 1],
        "exclude": [{"foo": 1}],
        "launcher": {"gpus": -1},
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(GridSpecError) as err:
        load_grid(path)
    fields = sorted(e.field for e in err.value.errors)
    assert fields == [
        "exclude[0].foo",
        "grid.encoding",
        "grid.model.atention.terms",
        "grid.model.mem_len",
        "launcher.gpus",
    ]
    code = main(["grid", str(path), "--results", str(tmp_path / "results"), "--slots", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 + len(fields)
    assert all(line.startswith("error: ") for line in lines)
    assert not (tmp_path / "results").exists()


def test_value_errors_are_grouped_per_distinct_message():
    spec = {
        "name": "v",
        "base": tiny_base(),
        "grid": {"encoding": ["rope"], "model.attention.terms": ["ab", "abcd"]},
        "seeds": [0, 1, 2],
    }
    with pytest.raises(GridSpecError) as err:
        parse_grid(spec)
    assert len(err.value.errors) == 2  # one per distinct message, not one per run
    assert all("and 2 more" in str(e) for e in err.value.errors)


def test_smoke_spec_is_two_encodings_by_two_seeds():
    spec = load_grid(REPO / "experiments" / "smoke.yaml")
    assert len(spec.runs) >= 4
    assert (
        len({r.variant["encoding"] for r in spec.runs}) >= 2
        and len({r.config.seed for r in spec.runs}) >= 2
    )
    assert all(
        r.config.data.source == "synthetic" and r.config.data.task == "offset_copy"
        for r in spec.runs
    )
