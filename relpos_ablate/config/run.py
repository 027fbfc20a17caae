"""A run: model + data + train + eval + seed. One YAML file describes it completely.

The `train:` block (`TrainConfig`, `HOW_TO_RUN`): config/train.py, importable from here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relpos_ablate.config.attention import LENGTH_AWARE_SCALES
from relpos_ablate.config.base import ConfigError, check_range, from_dict, to_plain
from relpos_ablate.config.data import EXAMPLE_TASKS, DataConfig, check_example_run
from relpos_ablate.config.evaluation import PROTOCOLS, EvalConfig, EvalSetting
from relpos_ablate.config.model import ModelConfig
from relpos_ablate.config.registry import import_modules
from relpos_ablate.config.scheme_checks import (
    check_randomized_range,
    document_refusal,
    rope_scaling_conflict,
    rotary_width,
)
from relpos_ablate.config.train import HOW_TO_RUN, TrainConfig, check_streams_split
from relpos_ablate.config.yaml_io import apply_overrides, read_yaml


def check_world_size(config: RunConfig, world: int) -> None:
    """A one-line ConfigError unless `world` processes can share the run's streams: the training
    streams evenly (per micro-batch too), the evaluation streams at least one each."""
    check_streams_split("train.batch_size", config.train.batch_size, world, config.train.accumulate)
    if config.eval.batch_size < world:
        raise ConfigError(
            "eval.batch_size",
            f"{config.eval.batch_size} streams cannot give each of {world} "
            f"processes one; use at least {world}",
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; its hash is the run id."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (see ModelConfig)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data (see DataConfig)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training (see TrainConfig)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation (see EvalConfig)."""
    seed: int = 0
    """Seed for parameters, data order and synthetic data."""
    imports: tuple[str, ...] = ()
    """Python modules imported before the rest of the config is read: your own bias schemes,
    registered with @register_bias (e.g. [my_schemes]; found on PYTHONPATH or in the working
    directory)."""

    @staticmethod
    def before_fields(data: dict, prefix: str) -> None:
        """`from_dict` hook: import `imports:` first, so the schemes they register are known when
        `model.attention.bias` is validated."""
        import_modules(data.get("imports", ()), f"{prefix}.imports" if prefix else "imports")

    def __post_init__(self):
        check_range("seed", self.seed, low=0)
        import_modules(self.imports)
        data = self.data
        check_example_run(data, self.model, self.train.segment_len, self.eval.settings)
        if data.documents == "packed_reset":
            for k, layer in enumerate(self.model.layer_attentions):
                reason = document_refusal(layer)
                if reason:
                    at = f" (layer {k})" if self.model.layer_pattern else ""
                    raise ConfigError("data.documents", f"packed_reset{at}: {reason}")
        if self.train.stop_at_exact_match is not None and not data.example_task:
            raise ConfigError(
                "train.stop_at_exact_match",
                f"needs an example task (data.task one of "
                f"{', '.join(EXAMPLE_TASKS)}): {data.task!r} has no exact match",
            )
        streams = data.source == "synthetic" and not data.example_task
        if streams and data.task == "offset_copy" and data.offset >= self.train.segment_len:
            raise ConfigError(
                "data.offset",
                f"{data.offset} leaves no target inside a segment; use < train.segment_len "
                f"({self.train.segment_len})",
            )
        if streams and data.train_tokens < self.train.segment_len:
            raise ConfigError(
                "data.train_tokens",
                f"{data.train_tokens} is shorter than one segment "
                f"(train.segment_len={self.train.segment_len})",
            )
        if streams:
            for i, setting in enumerate(self.eval_settings()):
                if setting.segment_len > data.eval_tokens:
                    raise ConfigError(
                        f"eval.settings[{i}].segment_len",
                        f"{setting.segment_len} is longer than "
                        f"the evaluation streams (data.eval_tokens={data.eval_tokens})",
                    )
        attention = self.model.attention
        where = "data.test_lengths[{}]" if data.example_task else "eval.settings[{}].segment_len"
        check_randomized_range(
            attention,
            {
                "train.segment_len": (self.train.segment_len, self.model.mem_len),
                **{
                    where.format(i): (
                        s.segment_len,
                        self.model.mem_len if s.mem_len is None else s.mem_len,
                    )
                    for i, s in enumerate(self.eval_settings())
                },
            },
        )
        for i, setting in enumerate(self.eval_settings()):
            if (
                attention.rel == "learned"
                and setting.clamp_len is not None
                and setting.clamp_len > attention.clamp_len
            ):
                raise ConfigError(
                    f"eval.settings[{i}].clamp_len",
                    f"{setting.clamp_len} exceeds the learned position table "
                    f"(model.attention.rel='learned' covers distances up to "
                    f"model.attention.clamp_len={attention.clamp_len}); use at most "
                    f"{attention.clamp_len}",
                )
            if setting.protocol == "xl" and (
                setting.memory(self.model.mem_len) == 0 or not attention.causal
            ):
                raise ConfigError(
                    f"eval.settings[{i}].protocol",
                    "'xl' needs causal attention and memory (this "
                    "setting's mem_len, else model.mem_len, > 0): each query sees its mem_len most "
                    "recent keys",
                )
        self._check_eval_subsets()
        self._check_splits()

    def _check_splits(self) -> None:
        """Every split asked for exists: local files have a test split only with data.test_file; a
        synthetic task has one evaluation stream, drawn from the seed, so its settings name no
        split."""
        data = self.data
        if (
            data.source == "text"
            and data.train_file
            and self.eval.split == "test"
            and not data.test_file
        ):
            raise ConfigError("eval.split", "'test' with local files needs data.test_file")
        for i, setting in enumerate(self.eval.settings):
            if setting.split is None:
                continue
            if data.source == "synthetic":
                raise ConfigError(
                    f"eval.settings[{i}].split",
                    "synthetic tasks have one evaluation stream (drawn "
                    "from the seed), no valid/test splits; leave split unset",
                )
            if data.train_file and setting.split == "test" and not data.test_file:
                raise ConfigError(
                    f"eval.settings[{i}].split", "'test' with local files needs data.test_file"
                )

    def _check_eval_subsets(self) -> None:
        """A target subset leaves each stream at least one target, and RECL some with its longest
        context."""
        streams = self.eval.batch_size
        for i, setting in enumerate(self.eval.settings):
            if 0 < setting.max_targets < streams:
                raise ConfigError(
                    f"eval.settings[{i}].max_targets",
                    f"{setting.max_targets} leaves no target in "
                    f"some of the eval.batch_size={streams} streams; use 0 (all) or >= {streams}",
                )
        if (
            self.eval.recl_contexts
            and self.eval.recl_targets // streams < self.eval.recl_contexts[-1]
        ):
            raise ConfigError(
                "eval.recl_targets",
                f"{self.eval.recl_targets} targets in eval.batch_size={streams} streams leave "
                f"none with {self.eval.recl_contexts[-1]} tokens of context (the longest of "
                f"recl_contexts); use >= {streams * self.eval.recl_contexts[-1]}",
            )

    @property
    def train_attn_len(self) -> int:
        """Keys the last training query sees: train.segment_len + model.mem_len (L_train of log-n
        scaling and of RoPE context extension)."""
        return self.train.segment_len + self.model.mem_len

    def eval_setting_field(self, i: int, name: str = "segment_len") -> str:
        """The key a problem with field `name` of eval_settings()[i] is reported under: its
        eval.settings entry, eval.settings itself for the default settings, or the RECL context it
        comes from."""
        configured = len(self.eval.settings)
        if i < configured:
            return f"eval.settings[{i}].{name}"
        defaults = 0 if configured else len(self.eval_settings()) - len(self.eval.recl_contexts)
        return (
            "eval.settings" if i < defaults else f"eval.recl_contexts[{i - configured - defaults}]"
        )

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        """The configured settings (or the documented default: 1x, 2x, 4x the training length), then
        the RECL ladder's. Example tasks: one per bin of data.test_lengths, as long as its longest
        example."""
        if self.data.example_task:
            return tuple(
                EvalSetting(segment_len=self.data.input_length(hi))
                for _, hi in self.data.test_lengths
            )
        settings = self.eval.settings or tuple(
            EvalSetting(segment_len=self.train.segment_len * k) for k in (1, 2, 4)
        )
        return settings + self.eval.recl_settings(self.model.mem_len > 0, self.train.segment_len)


def unsupported_reason(config: RunConfig, setting: EvalSetting) -> str | None:
    """Why the model cannot be evaluated at `setting` (None when it can). Training records such a
    setting in eval.json with this reason; `evaluate` reports it before computing anything."""
    found = unsupported(config, setting)
    return None if found is None else found[1]


def unsupported(config: RunConfig, setting: EvalSetting) -> tuple[str, str] | None:
    """(the setting's field at fault, why) when the model cannot take `setting`: learned absolute
    tables end; a RoPE context extension needs RoPE (and has no published form for xPos)."""
    a = config.model.attention
    if a.absolute in ("learned", "learned_per_layer") and setting.segment_len > a.max_position:
        return "segment_len", (
            f"learned absolute positions cover {a.max_position} tokens "
            f"(model.attention.max_position); segment_len {setting.segment_len} does not fit"
        )
    # it extends the RoPE layers; a layer with xPos has no published form
    if setting.rope_scaling is not None:
        conflicts = [rope_scaling_conflict(layer) for layer in config.model.layer_attentions]
        xpos = [
            c
            for c, layer in zip(conflicts, config.model.layer_attentions)
            if c and layer.absolute == "rope"
        ]
        if xpos or all(conflicts):
            return "rope_scaling", f"rope_scaling {setting.rope_scaling!r} {(xpos or conflicts)[0]}"
        # longrope: one factor per rotary pair of every RoPE layer
        pairs = {
            rotary_width(layer, config.model.d_head) // 2
            for layer, conflict in zip(config.model.layer_attentions, conflicts)
            if conflict is None
        }
        for name in ("rope_long_factor", "rope_short_factor"):
            factors = getattr(setting, name)
            if factors is not None and {len(factors)} != pairs:
                return name, (
                    f"{len(factors)} values given; this model's RoPE has d_rot/2 = "
                    f"{', '.join(map(str, sorted(pairs)))} rotary pairs, one factor each"
                )
    return None


def _non_default(config: Any) -> Any:
    """The parts of a config that differ from their declared defaults, as plain data: a dataclass
    keeps the fields that differ (recursively), and so does every dataclass inside a list
    (eval.settings items: a field added to EvalSetting later, with its default, leaves them
    unchanged). The how-to-run fields (HOW_TO_RUN) are left out."""
    if isinstance(config, (list, tuple)):
        return [_non_default(item) for item in config]
    if not dataclasses.is_dataclass(config):
        return to_plain(config)
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(config, TrainConfig) and f.name in HOW_TO_RUN:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default:
            continue
        differs = _non_default(value)
        if dataclasses.is_dataclass(value) and not differs:  # it differs in how-to-run fields only
            continue
        out[f.name] = differs
    return out


def what_to_run(config: RunConfig) -> dict:
    """The plain config without the how-to-run fields (HOW_TO_RUN): what identifies a run."""
    plain = to_plain(config)
    for name in HOW_TO_RUN:
        del plain["train"][name]
    return plain


def resolve_log_n_length(config: RunConfig) -> RunConfig:
    """score_scale log_n or ssmax with log_n_length 0: fill in the training attention length (when
    the run starts)."""
    attention = config.model.attention
    scaled = any(
        layer.score_scale in LENGTH_AWARE_SCALES for layer in config.model.layer_attentions
    )
    # a layer kind takes log_n_length from the model's attention
    if not scaled or attention.log_n_length:
        return config
    attention = dataclasses.replace(attention, log_n_length=max(2, config.train_attn_len))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, attention=attention))


def run_id(config: RunConfig) -> str:
    """Short hash of the what-to-run fields that differ from the defaults: the same run always gets
    the same id, on any hardware (HOW_TO_RUN), and adding a config field (with a default) later does
    not rename finished runs."""
    canonical = json.dumps(_non_default(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def load_run_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or defaults) plus `key.path=value` overrides."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(RunConfig, apply_overrides(data, overrides))


__all__ = [
    "HOW_TO_RUN",
    "PROTOCOLS",
    "ConfigError",
    "EvalConfig",
    "EvalSetting",
    "RunConfig",
    "TrainConfig",
    "check_streams_split",
    "check_world_size",
    "load_run_config",
    "resolve_log_n_length",
    "run_id",
    "unsupported",
    "unsupported_reason",
    "what_to_run",
]
