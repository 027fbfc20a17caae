"""A run: model + data + train + eval + seed. One YAML file describes it completely."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from relpos_ablate.config.base import (
    ConfigError, apply_overrides, check_choice, check_range, from_dict, read_yaml, to_plain,
)
from relpos_ablate.config.data import DataConfig
from relpos_ablate.config.model import ModelConfig
from relpos_ablate.config.registry import import_modules

OPTIMIZERS = ("adamw", "adam")
SCHEDULES = ("cosine", "constant")
LOSS_ON = ("full", "half")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ROPE_SCALINGS = ("pi", "ntk", "yarn")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    segment_len: int = 64
    """Tokens per segment (the backprop length, XL's tgt_len)."""
    batch_size: int = 16
    """Contiguous streams per batch (each row carries its own memory)."""
    max_steps: int = 300
    """Optimizer steps."""
    optimizer: str = "adamw"
    """adamw | adam (XL uses Adam)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (ignored by adam)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """cosine (to 0 at max_steps) | constant, after warm-up."""
    grad_clip: float = 1.0
    """Clip gradient norm (0: off; XL uses 0.25)."""
    loss_on: str = "full"
    """Loss on the 'full' segment or only its most recent 'half' (XL Table 6)."""
    precision: str = "32-true"
    """Lightning precision: 32-true | bf16-mixed | 16-mixed."""
    accelerator: str = "auto"
    """Lightning accelerator: auto | cpu | gpu."""
    deterministic: bool = False
    """torch deterministic algorithms (slower)."""
    log_every: int = 10
    """Log training metrics every N steps."""
    checkpoint_every: int = 100
    """Save checkpoints/last.ckpt every N steps (and at the end)."""
    val_every: int = 0
    """Evaluate the first eval setting every N steps during training, logged as val_* (0: only at
    the end, where every setting is evaluated)."""

    def __post_init__(self):
        for name in ("segment_len", "batch_size", "max_steps", "log_every", "checkpoint_every"):
            check_range(name, getattr(self, name), low=1)
        check_range("val_every", self.val_every, low=0)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_range("lr", self.lr, low=0.0)
        check_range("weight_decay", self.weight_decay, low=0.0)
        check_range("warmup_steps", self.warmup_steps, low=0)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_range("grad_clip", self.grad_clip, low=0.0)
        check_choice("loss_on", self.loss_on, LOSS_ON)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("accelerator", self.accelerator, ("auto", "cpu", "gpu"))


@dataclass(frozen=True)
class EvalSetting:
    """One evaluation: segment length, memory, clamp, same_length."""

    segment_len: int
    """Tokens per evaluated segment."""
    mem_len: int | None = None
    """Memory at evaluation (null: the model's training mem_len)."""
    clamp_len: int | None = None
    """Clamp of R at evaluation (null: the model's)."""
    same_length: bool = False
    """Every query attends to the same number of keys, as in Transformer-XL's evaluation: with M = this
    setting's mem_len (else the model's), query i sees the M most recent keys, itself included
    (i - M < j <= i); fewer only while the stream has fewer (the first segment is causal up to that
    window). Needs M > 0."""
    rope_scaling: str | None = None
    """RoPE context extension at this evaluation: pi (position interpolation, Chen et al. 2023) | ntk
    (NTK-aware base) | yarn (Peng et al. 2023: per-frequency ramp and attention temperature) | null: the
    trained RoPE (docs/formulas.md#rope-context-extension). A model without RoPE (or with xPos) skips the
    setting, with the reason in eval.json."""
    rope_scale: float | str = "auto"
    """rope_scaling's factor s >= 1 (target / training context): a number, or auto = this setting's attention
    length / the training one, (segment_len + mem_len) / (train.segment_len + model.mem_len), at least 1.
    Fixed per setting: the same (i, j) pair always gets the same score."""

    def __post_init__(self):
        check_range("segment_len", self.segment_len, low=1)
        if self.mem_len is not None:
            check_range("mem_len", self.mem_len, low=0)
        if self.clamp_len is not None:
            check_range("clamp_len", self.clamp_len, low=1)
        if self.rope_scaling is not None:
            check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if isinstance(self.rope_scale, str):
            check_choice("rope_scale", self.rope_scale, ("auto",))
        else:
            check_range("rope_scale", self.rope_scale, low=1.0)
            if self.rope_scaling is None:
                raise ConfigError("rope_scale", f"{self.rope_scale} scales RoPE only with rope_scaling: "
                                  "pi | ntk | yarn")

    def rope_factor(self, train_attn_len: int, attn_len: int) -> float:
        """s: rope_scale, or auto: attn_len / train_attn_len (at least 1)."""
        return max(1.0, attn_len / train_attn_len) if self.rope_scale == "auto" else float(self.rope_scale)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation at many lengths (extrapolation)."""

    settings: tuple[EvalSetting, ...] = ()
    """Evaluation settings; empty means 1x, 2x and 4x the training segment length with the training
    mem_len."""
    split: str = "valid"
    """Which split to evaluate: valid | test."""
    batch_size: int = 8
    """Streams per evaluation batch."""

    def __post_init__(self):
        check_choice("split", self.split, ("valid", "test"))
        check_range("batch_size", self.batch_size, low=1)


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
    """Python modules imported before the rest of the config is read: your own bias schemes, registered
    with @register_bias (e.g. [my_schemes]; found on PYTHONPATH or in the working directory)."""

    @staticmethod
    def before_fields(data: dict, prefix: str) -> None:
        """`from_dict` hook: import `imports:` first, so the schemes they register are known when
        `model.attention.bias` is validated."""
        import_modules(data.get("imports", ()), f"{prefix}.imports" if prefix else "imports")

    def __post_init__(self):
        check_range("seed", self.seed, low=0)
        import_modules(self.imports)
        data = self.data
        if data.source == "synthetic" and data.task == "offset_copy" and data.offset >= self.train.segment_len:
            raise ConfigError(
                "data.offset", f"{data.offset} leaves no target inside a segment; use < train.segment_len "
                f"({self.train.segment_len})")
        if data.source == "synthetic" and data.train_tokens < self.train.segment_len:
            raise ConfigError("data.train_tokens", f"{data.train_tokens} is shorter than one segment "
                              f"(train.segment_len={self.train.segment_len})")
        if data.source == "synthetic":
            for i, setting in enumerate(self.eval_settings()):
                if setting.segment_len > data.eval_tokens:
                    raise ConfigError(f"eval.settings[{i}].segment_len", f"{setting.segment_len} is longer than "
                                      f"the evaluation streams (data.eval_tokens={data.eval_tokens})")
        attention = self.model.attention
        for i, setting in enumerate(self.eval_settings()):
            if attention.rel == "learned" and setting.clamp_len is not None and setting.clamp_len > attention.clamp_len:
                raise ConfigError(f"eval.settings[{i}].clamp_len", f"{setting.clamp_len} exceeds the learned position "
                                  f"table (model.attention.rel='learned' covers distances up to "
                                  f"model.attention.clamp_len={attention.clamp_len}); use at most {attention.clamp_len}")
            mem_len = self.model.mem_len if setting.mem_len is None else setting.mem_len
            if setting.same_length and (mem_len == 0 or not attention.causal):
                raise ConfigError(f"eval.settings[{i}].same_length", "needs causal attention and memory (mem_len > 0): "
                                  "each query sees its mem_len most recent keys")
        if data.source == "text" and data.train_file and self.eval.split == "test" and not data.test_file:
            raise ConfigError("eval.split", "'test' with local files needs data.test_file")

    @property
    def train_attn_len(self) -> int:
        """Keys the last training query sees: train.segment_len + model.mem_len (L_train of log-n scaling
        and of RoPE context extension)."""
        return self.train.segment_len + self.model.mem_len

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        """The configured settings, or the documented default (1x, 2x, 4x the training length)."""
        if self.eval.settings:
            return self.eval.settings
        return tuple(EvalSetting(segment_len=self.train.segment_len * k) for k in (1, 2, 4))


def _non_default(value: dict, default: dict) -> dict:
    """The parts of a plain config that differ from the defaults (recursively)."""
    out = {}
    for key, item in value.items():
        base = default.get(key)
        if isinstance(item, dict) and isinstance(base, dict):
            sub = _non_default(item, base)
            if sub:
                out[key] = sub
        elif item != base:
            out[key] = item
    return out


def resolve_log_n_length(config: RunConfig) -> RunConfig:
    """score_scale log_n with log_n_length 0: fill in the training attention length (when the run starts)."""
    attention = config.model.attention
    if attention.score_scale != "log_n" or attention.log_n_length:
        return config
    attention = dataclasses.replace(attention, log_n_length=max(2, config.train_attn_len))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, attention=attention))


def run_id(config: RunConfig) -> str:
    """Short hash of the fields that differ from the defaults: the same run always gets the same id,
    and adding a config field (with a default) later does not rename finished runs."""
    canonical = json.dumps(_non_default(to_plain(config), to_plain(RunConfig())), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def load_run_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or defaults) plus `key.path=value` overrides."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(RunConfig, apply_overrides(data, overrides))


__all__ = [
    "ConfigError", "EvalConfig", "EvalSetting", "RunConfig", "TrainConfig", "load_run_config", "resolve_log_n_length",
    "run_id",
]
