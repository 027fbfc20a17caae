"""Config machinery: YAML/dict -> frozen dataclasses with one-line errors. Run: pytest tests/test_config.py"""

import dataclasses

import pytest

from relpos_ablate.config import (
    AttentionConfig, ConfigError, ModelConfig, RunConfig, describe, from_dict, load_run_config, run_id, to_plain,
)


def test_round_trip_and_overrides():
    cfg = load_run_config(None, ["model.attention.terms=ac", "seed=3", "eval.settings=[{segment_len: 8}]"])
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
