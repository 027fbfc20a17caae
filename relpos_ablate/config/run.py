"""A run: model + data + train + eval + seed. One YAML file describes it completely."""

from __future__ import annotations

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


PROTOCOLS = ("non_overlapping", "sliding", "xl")


@dataclass(frozen=True)
class EvalSetting:
    """One evaluation: protocol, segment (window) length, memory, clamp (docs/formulas.md#evaluation-protocols)."""

    segment_len: int
    """Tokens per evaluated segment (the window length for `sliding`)."""
    protocol: str = "non_overlapping"
    """non_overlapping: consecutive segments, each target scored once, memory carried when there is one |
    sliding: windows of segment_len moved by `stride`, each scoring only its last `stride` targets (the
    first window all of its own), no memory (ALiBi's evaluation) | xl: consecutive segments with memory
    carried and same_length, every query seeing the mem_len most recent keys (Transformer-XL's evaluation).
    Every protocol scores the same targets of the split."""
    stride: int | None = None
    """sliding: targets scored per window, 1..segment_len (each then has segment_len - stride + 1 to
    segment_len tokens of context; stride = segment_len is non_overlapping without memory)."""
    mem_len: int | None = None
    """Memory at evaluation (null: the model's training mem_len; sliding uses none)."""
    clamp_len: int | None = None
    """Clamp of R at evaluation (null: the model's)."""
    same_length: bool = False
    """Set by protocol xl (every query sees the M most recent keys, itself included, i - M < j <= i, with M
    this setting's mem_len, else the model's; fewer only while the stream has fewer). Kept for configs
    written before `protocol`: true is accepted only with protocol xl."""
    max_targets: int = 0
    """Score only the first max_targets // eval.batch_size targets of each evaluation stream (0: all): a
    subset that is the same for every model and protocol, for costly evaluations (sliding, stride 1)."""
    token_losses: bool = False
    """Save every scored target's loss in the run dir (token_losses.npz): what RECL reads."""

    def __post_init__(self):
        check_range("segment_len", self.segment_len, low=1)
        check_choice("protocol", self.protocol, PROTOCOLS)
        if self.mem_len is not None:
            check_range("mem_len", self.mem_len, low=0)
        if self.clamp_len is not None:
            check_range("clamp_len", self.clamp_len, low=1)
        check_range("max_targets", self.max_targets, low=0)
        if self.protocol == "sliding":
            if self.stride is None:
                raise ConfigError("stride", f"protocol 'sliding' needs a stride (1..segment_len={self.segment_len})")
            check_range("stride", self.stride, low=1, high=self.segment_len)
            if self.mem_len:
                raise ConfigError("mem_len", "protocol 'sliding' scores each window on its own, without memory; "
                                  "leave mem_len unset (or 0), or use protocol 'xl'")
        elif self.stride is not None:
            raise ConfigError("stride", f"is read only by protocol 'sliding' (protocol is {self.protocol!r})")
        if self.same_length and self.protocol != "xl":
            raise ConfigError("same_length", "is Transformer-XL's evaluation: write protocol: xl (memory carried, "
                              "every query sees mem_len keys)")

    @property
    def uses_memory(self) -> bool:
        """Memory carried from segment to segment (non_overlapping with a memory, xl); sliding has none."""
        return self.protocol != "sliding"

    def memory(self, model_mem_len: int) -> int:
        """The memory this setting evaluates with, given the model's training mem_len."""
        if not self.uses_memory:
            return 0
        return model_mem_len if self.mem_len is None else self.mem_len

    def attn_len(self, model_mem_len: int) -> int:
        """Keys a query sees: segment_len + memory at most (non_overlapping, at a segment's end),
        segment_len (sliding), the memory length (xl: every query, same_length)."""
        memory = self.memory(model_mem_len)
        return {"non_overlapping": self.segment_len + memory, "sliding": self.segment_len, "xl": memory}[self.protocol]


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation at many lengths (extrapolation), protocols, and RECL's context ladder."""

    settings: tuple[EvalSetting, ...] = ()
    """Evaluation settings, each {segment_len, protocol: non_overlapping | sliding | xl, stride (sliding),
    mem_len, clamp_len, max_targets, token_losses} (docs/formulas.md#evaluation-protocols); empty means
    1x, 2x and 4x the training segment length, non_overlapping, with the training mem_len."""
    split: str = "valid"
    """Which split to evaluate: valid | test."""
    batch_size: int = 8
    """Evaluation streams: the split is cut into this many contiguous streams (the remainder dropped; each
    stream's first token is never a target); non_overlapping and xl evaluate one segment of each per forward."""
    sliding_batch_tokens: int = 8192
    """Tokens per forward for protocol sliding: as many windows as fit (at least one) are batched; the
    windows are independent, so the result does not depend on it."""
    recl_contexts: tuple[int, ...] = ()
    """RECL's ladder (docs/formulas.md#recl): for each context length c, an extra setting that scores every
    target with exactly c tokens of context (sliding, segment_len c, stride 1) and saves each target's loss."""
    recl_targets: int = 4096
    """max_targets of the RECL settings: sliding with stride 1 costs one forward per target."""

    def __post_init__(self):
        check_choice("split", self.split, ("valid", "test"))
        check_range("batch_size", self.batch_size, low=1)
        check_range("sliding_batch_tokens", self.sliding_batch_tokens, low=1)
        check_range("recl_targets", self.recl_targets, low=1)
        for i, context in enumerate(self.recl_contexts):
            check_range(f"recl_contexts[{i}]", context, low=1)
        if list(self.recl_contexts) != sorted(set(self.recl_contexts)):
            raise ConfigError("recl_contexts", f"{list(self.recl_contexts)}: list each context length once, "
                              "in increasing order (the search steps from one to the next)")

    def recl_settings(self) -> tuple[EvalSetting, ...]:
        """The ladder's settings: exactly c tokens of context for every target used by RECL."""
        return tuple(EvalSetting(segment_len=c, protocol="sliding", stride=1, max_targets=self.recl_targets,
                                 token_losses=True) for c in self.recl_contexts)


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
            if setting.protocol == "xl" and (setting.memory(self.model.mem_len) == 0 or not attention.causal):
                raise ConfigError(f"eval.settings[{i}].protocol", "'xl' needs causal attention and memory (this "
                                  "setting's mem_len, else model.mem_len, > 0): each query sees its mem_len most "
                                  "recent keys")
        self._check_eval_subsets()
        if data.source == "text" and data.train_file and self.eval.split == "test" and not data.test_file:
            raise ConfigError("eval.split", "'test' with local files needs data.test_file")

    def _check_eval_subsets(self) -> None:
        """A target subset leaves each stream at least one target, and RECL some with its longest context."""
        streams = self.eval.batch_size
        for i, setting in enumerate(self.eval.settings):
            if 0 < setting.max_targets < streams:
                raise ConfigError(f"eval.settings[{i}].max_targets", f"{setting.max_targets} leaves no target in "
                                  f"some of the eval.batch_size={streams} streams; use 0 (all) or >= {streams}")
        if self.eval.recl_contexts and self.eval.recl_targets // streams < self.eval.recl_contexts[-1]:
            raise ConfigError("eval.recl_targets", f"{self.eval.recl_targets} targets in eval.batch_size={streams} "
                              f"streams leave none with {self.eval.recl_contexts[-1]} tokens of context (the longest "
                              f"of recl_contexts); use >= {streams * self.eval.recl_contexts[-1]}")

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        """The configured settings (or the documented default: 1x, 2x, 4x the training length), then the
        RECL ladder's."""
        settings = self.eval.settings or tuple(EvalSetting(segment_len=self.train.segment_len * k) for k in (1, 2, 4))
        return settings + self.eval.recl_settings()


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
    "PROTOCOLS", "ConfigError", "EvalConfig", "EvalSetting", "RunConfig", "TrainConfig", "load_run_config", "run_id",
]
