"""Frozen, validated dataclasses for every part of a run (see base.py for the machinery)."""

from relpos_ablate.config.base import ConfigError, apply_overrides, describe, from_dict, read_yaml, to_plain
from relpos_ablate.config.data import DataConfig
from relpos_ablate.config.model import BIAS_TYPES, AttentionConfig, ModelConfig
from relpos_ablate.config.run import (
    EvalConfig, EvalSetting, RunConfig, TrainConfig, load_run_config, run_id,
)

__all__ = [
    "AttentionConfig", "BIAS_TYPES", "ConfigError", "DataConfig", "EvalConfig", "EvalSetting", "ModelConfig",
    "RunConfig", "TrainConfig", "apply_overrides", "describe", "from_dict", "load_run_config", "read_yaml",
    "run_id", "to_plain",
]
