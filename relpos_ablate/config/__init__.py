"""Frozen, validated dataclasses for every part of a run (see base.py for the machinery, yaml_io.py
for YAML files and --set overrides)."""

from relpos_ablate.config.attention import BIAS_TYPES, AttentionConfig
from relpos_ablate.config.base import ConfigError, describe, from_dict, to_plain
from relpos_ablate.config.data import DataConfig
from relpos_ablate.config.model import ModelConfig
from relpos_ablate.config.run import (
    HOW_TO_RUN,
    EvalConfig,
    EvalSetting,
    RunConfig,
    TrainConfig,
    check_streams_split,
    check_world_size,
    load_run_config,
    run_id,
    unsupported_reason,
    what_to_run,
)
from relpos_ablate.config.yaml_io import apply_overrides, read_yaml

__all__ = [
    "AttentionConfig",
    "BIAS_TYPES",
    "ConfigError",
    "HOW_TO_RUN",
    "DataConfig",
    "EvalConfig",
    "EvalSetting",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "describe",
    "from_dict",
    "load_run_config",
    "read_yaml",
    "check_streams_split",
    "check_world_size",
    "run_id",
    "to_plain",
    "unsupported_reason",
    "what_to_run",
]
