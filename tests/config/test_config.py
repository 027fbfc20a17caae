"""Config machinery: YAML/dict -> frozen dataclasses with one-line errors. Run: pytest
tests/config/test_config.py"""

import dataclasses

import pytest

from relpos_ablate.config import (
    AttentionConfig,
    ConfigError,
    EvalSetting,
    ModelConfig,
    RunConfig,
    describe,
    from_dict,
    load_run_config,
    run_id,
    to_plain,
)
from relpos_ablate.config.base import check_choice, check_range


def test_round_trip_and_overrides():
    cfg = load_run_config(
        None, ["model.attention.terms=ac", "seed=3", "eval.settings=[{segment_len: 8}]"]
    )
    assert cfg.model.attention.terms == "ac" and cfg.seed == 3
    assert cfg.eval.settings[0].segment_len == 8
    assert from_dict(RunConfig, to_plain(cfg)) == cfg


def test_run_id_is_a_function_of_the_config():
    a = load_run_config(None, ["seed=1"])
    assert run_id(a) == run_id(load_run_config(None, ["seed=1"]))
    assert run_id(a) != run_id(load_run_config(None, ["seed=2"]))


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttentionConfig().terms = "a"


def test_every_field_is_documented():
    undocumented = [path for path, _default, doc in describe(RunConfig) if not doc]
    assert undocumented == []


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.attention.bais=t5", "model.attention.bais"),
        ("model.d_model=1.5", "model.d_model"),
        ("model.dropout=true", "model.dropout"),
        ("train.loss_on=quarter", "train.loss_on"),
        ("eval.settings=[{segment_len: 0}]", "eval.settings[0].segment_len"),
        ("model.attention=3", "model.attention"),
    ],
)
def test_bad_values_name_the_key(override, field):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert str(err.value).startswith(field + ":")
    assert "\n" not in str(err.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'bias'"):
        load_run_config(None, ["model.attention.bais=t5"])


def test_model_config_nested_errors_name_the_path():
    with pytest.raises(ConfigError, match=r"^model\.attention\.terms:"):
        from_dict(RunConfig, {"model": {"attention": {"terms": "abx"}}})
    with pytest.raises(ConfigError, match=r"^d_head: rope needs an even d_head"):
        ModelConfig(d_head=7, attention=AttentionConfig(terms="a", absolute="rope"))


def test_exponent_floats_are_numbers():
    """PyYAML alone reads 3e-3 as a string; overrides and files must not."""
    assert load_run_config(None, ["train.lr=3e-3"]).train.lr == 0.003
    assert load_run_config(None, ["train.lr=1E-4"]).train.lr == 0.0001


def test_run_id_ignores_fields_left_at_their_defaults():
    """Spelling out a default, or a field added later with a default, keeps the id."""
    assert run_id(load_run_config(None, ["seed=0"])) == run_id(RunConfig())
    assert run_id(load_run_config(None, ["model.attention.terms=abcd"])) == run_id(RunConfig())
    assert run_id(load_run_config(None, ["model.attention.terms=ac"])) != run_id(RunConfig())


def test_run_id_ignores_defaults_inside_evaluation_settings_too():
    """An eval.settings item is compared field by field with EvalSetting's defaults, so a field
    added to EvalSetting later (with its default) keeps the ids of runs that list settings."""
    short = load_run_config(
        None, ["eval.settings=[{segment_len: 32}, {segment_len: 64, mem_len: 16}]"]
    )
    spelt = load_run_config(
        None,
        [
            "eval.settings=[{segment_len: 32, protocol: non_overlapping, clamp_len: null},"
            " {segment_len: 64, mem_len: 16, stride: null, max_targets: 0}]"
        ],
    )
    assert run_id(short) == run_id(spelt)
    other = load_run_config(
        None, ["eval.settings=[{segment_len: 32}, {segment_len: 64, mem_len: 8}]"]
    )
    assert run_id(other) != run_id(short)


def test_atomic_writes_are_readable_by_the_group(tmp_path):
    import os

    from relpos_ablate.io import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "status.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "status.json").stat().st_mode & 0o777 == 0o644
    assert list(tmp_path.iterdir()) == [tmp_path / "status.json"]


@dataclasses.dataclass(frozen=True)
class LaterSection:
    """A config section as someone may add one later: field checks with the package's helpers and a
    contradiction between two fields."""

    width: int = 4
    """A size."""
    kind: str = "a"
    """a | b."""
    low: float = 0.0
    """Lower end."""
    high: float = 1.0
    """Upper end."""

    def __post_init__(self):
        check_range("width", self.width, low=1)
        check_choice("kind", self.kind, ("a", "b"))
        if self.low > self.high:
            raise ConfigError("low", f"{self.low} is above high ({self.high})")
        # a later computation that a bad width breaks (its check must be the report)
        8 // self.width


def problems(cls, data) -> list[str]:
    with pytest.raises(ConfigError) as err:
        from_dict(cls, data)
    assert "\n" not in str(err.value)
    return [str(problem) for problem in err.value.errors]


def test_every_failed_check_of_a_section_is_reported_at_once_in_field_order():
    assert problems(LaterSection, {"high": -1.0, "kind": "c", "width": 0}) == [
        "width: 0 is out of range; allowed [1, inf]",
        "kind: 'c' is not allowed; choose one of a, b",
        "low: 0.0 is above high (-1.0)",
    ]


def test_a_wrong_type_is_reported_with_other_fields_checks_but_no_contradiction_with_a_stand_in():
    """low='x' is dropped (its default stands in), so only the checks of the fields given are
    judged."""
    assert problems(LaterSection, {"low": "x", "high": -1.0, "kind": "c"}) == [
        "kind: 'c' is not allowed; choose one of a, b",
        "low: expected a number, got 'x'",
    ]


def test_a_crash_caused_by_a_value_a_check_let_through_reports_the_check():
    assert problems(LaterSection, {"width": 0}) == ["width: 0 is out of range; allowed [1, inf]"]


def test_direct_construction_still_raises_at_the_first_failed_check():
    with pytest.raises(ConfigError, match=r"^width: 0 is out of range"):
        LaterSection(width=0, kind="c")
    problems(LaterSection, {"width": 0})
    # nothing is left recording after from_dict
    with pytest.raises(ConfigError, match=r"^kind: 'c'"):
        LaterSection(kind="c")


def test_every_section_of_a_run_config_reports_all_its_problems():
    data = {
        "model": {
            "dropout": "0",
            "n_layers": 0,
            "d_modle": 3,
            "attention": {"bias": "foo", "backend": "x"},
        },
        "train": {"max_steps": 150.5, "lr": -1},
        "eval": {"settings": [{"mem_len": 2}, {"segment_len": 0}]},
        "seed": -1,
    }
    expected = [  # the start of each line (the lists of allowed names grow with the package)
        "model.n_layers: 0 is out of range; allowed [1, inf]",
        "model.dropout: expected a number, got '0'",
        "model.attention.bias: 'foo' is not registered; registered: ",
        "model.attention.backend: 'x' is not allowed; choose one of ",
        "model.d_modle: unknown key; did you mean 'd_model'? allowed: ",
        "train.max_steps: expected an integer, got 150.5",
        "train.lr: -1.0 is out of range; allowed [0.0, inf]",
        "eval.settings[0].segment_len: missing; this field has no default",
        "eval.settings[1].segment_len: 0 is out of range; allowed [1, inf]",
        "seed: -1 is out of range; allowed [0, inf]",
    ]
    lines = problems(RunConfig, data)
    assert len(lines) == len(expected) and all(
        line.startswith(start) for line, start in zip(lines, expected)
    ), lines


def test_a_misspelt_required_key_is_one_problem():
    (line,) = problems(EvalSetting, {"segmnt_len": 8})
    assert line.startswith("segmnt_len: unknown key; did you mean 'segment_len'?")
