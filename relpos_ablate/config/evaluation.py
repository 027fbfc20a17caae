"""Evaluation settings: the protocol, length, memory and RoPE context extension of each evaluation,
and RECL's context ladder (docs/guide/evaluation.md#evaluation-protocols)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, check_range, reject

ROPE_SCALINGS = ("pi", "ntk", "yarn", "llama3", "dynamic", "longrope")
#: the settings' fields of one RoPE extension kind (eval.json records them only where set)
ROPE_EXTENSION_FIELDS = (
    "rope_long_factor",
    "rope_short_factor",
    "rope_mscale",
    "rope_mscale_all_dim",
    "rope_truncate",
)
"""The RoPE context extensions (eval.settings[i].rope_scaling; RopeScaling's kinds)."""
PROTOCOLS = ("non_overlapping", "sliding", "xl")
RECL_PROTOCOLS = ("auto", "sliding", "xl")
SPLITS = ("valid", "test")
"""The text splits an evaluation can score (eval.split, and eval.settings[i].split)."""


@dataclass(frozen=True)
class EvalSetting:
    """One evaluation: protocol, segment (window) length, memory, clamp
    (docs/guide/evaluation.md#evaluation-protocols)."""

    segment_len: int
    """Tokens per evaluated segment (the window length for `sliding`)."""
    protocol: str = "non_overlapping"
    """non_overlapping: consecutive segments, each target scored once, memory carried when there is
    one | sliding: windows of segment_len moved by `stride`, each scoring only its last `stride`
    targets (the first window all of its own), no memory (ALiBi's evaluation) | xl: consecutive
    segments with memory carried and same_length, every query seeing the mem_len most recent keys
    (Transformer-XL's evaluation). Every protocol goes over the same targets of the split
    (offset_copy and recall count those determined inside the segment or window, so their counts
    depend on the protocol and length)."""
    stride: int | None = None
    """sliding: targets scored per window, 1..segment_len (each then has segment_len - stride + 1 to
    segment_len tokens of context; stride = segment_len is non_overlapping without memory)."""
    mem_len: int | None = None
    """Memory at evaluation (null: the model's training mem_len; sliding uses none)."""
    clamp_len: int | None = None
    """Clamp of R at evaluation (null: the model's)."""
    same_length: bool = False
    """Set by protocol xl (every query sees the M most recent keys, itself included, i - M < j <= i,
    with M this setting's mem_len, else the model's; fewer only while the stream has fewer). Kept
    for configs written before `protocol`: true is accepted only with protocol xl."""
    max_targets: int = 0
    """Score only the first max_targets // eval.batch_size targets of each evaluation stream (0:
    all): a subset that is the same for every model and protocol, for costly evaluations (sliding,
    stride 1)."""
    token_losses: bool = False
    """Save every scored target's loss in the run dir (token_losses.npz): what RECL reads."""
    rope_scaling: str | None = None
    """RoPE context extension at this evaluation: pi (position interpolation, Chen et al. 2023) |
    ntk (NTK-aware base) | yarn (Peng et al. 2023: per-frequency ramp and attention temperature) |
    llama3 (Llama 3.1's NTK-by-parts: θ/s for wavelengths above the training context, θ kept below a
    quarter of it, a blend between; no temperature) | dynamic (dynamic NTK: the ntk base grown with
    each call's length) | longrope (Phi-3's LongRoPE: θ divided per pair by rope_long_factor or
    rope_short_factor) | null: the trained RoPE
    (docs/schemes/rope-scaling.md#rope-context-extension). A model without RoPE (or with xPos) skips
    the setting, with the reason in eval.json."""
    rope_scale: float | str = "auto"
    """rope_scaling's factor s >= 1 (target / training context): a number, or auto = this setting's
    attention length (attn_len: the keys a query sees under its protocol) / the training one,
    train.segment_len + model.mem_len; at least 1.
    Fixed per setting: the same (i, j) pair always gets the same score (dynamic and longrope also
    read each call's length: docs/schemes/rope-scaling.md#dynamic)."""
    rope_long_factor: tuple[float, ...] | None = None
    """rope_scaling longrope: θ_p divided by the p-th of these, one per rotary pair (d_rot/2 values,
    each > 0), when a call's keys reach beyond the training context (Phi-3's long_factor)."""
    rope_short_factor: tuple[float, ...] | None = None
    """rope_scaling longrope: as rope_long_factor, for calls within the training context (Phi-3's
    short_factor)."""
    rope_mscale: float | None = None
    """rope_scaling yarn, with rope_mscale_all_dim (DeepSeek's yarn): the rotated dimensions of q
    and of k are multiplied by m(s, rope_mscale)/m(s, rope_mscale_all_dim), m(s, c) = 0.1·c·ln s +
    1, instead of 0.1 ln s + 1 (null: that default). > 0."""
    rope_mscale_all_dim: float | None = None
    """rope_scaling yarn: the divisor's c of rope_mscale; set both or neither. > 0."""
    rope_truncate: bool = True
    """rope_scaling yarn: round the ramp's end pairs outwards to whole pairs (YaRN's code, Hugging
    Face's default) | false: keep them as real numbers (gpt-oss)."""
    split: str | None = None
    """The text split this setting scores: valid | test | null (eval.split). One run can so be
    scored on both (papers pick a learning rate on valid and report test: `table --best-over`);
    eval.json records the resolved split. Text only: a synthetic task draws one evaluation stream
    from the seed, so it leaves split unset."""

    def __post_init__(self):
        check_range("segment_len", self.segment_len, low=1)
        check_choice("protocol", self.protocol, PROTOCOLS)
        if self.split is not None:
            check_choice("split", self.split, SPLITS)
        if self.mem_len is not None:
            check_range("mem_len", self.mem_len, low=0)
        if self.clamp_len is not None:
            check_range("clamp_len", self.clamp_len, low=1)
        check_range("max_targets", self.max_targets, low=0)
        if self.protocol == "sliding":
            if self.stride is None:
                raise ConfigError(
                    "stride",
                    f"protocol 'sliding' needs a stride (1..segment_len={self.segment_len})",
                )
            check_range("stride", self.stride, low=1, high=self.segment_len)
            if self.mem_len:
                raise ConfigError(
                    "mem_len",
                    "protocol 'sliding' scores each window on its own, without memory; "
                    "leave mem_len unset (or 0), or use protocol 'xl'",
                )
        elif self.stride is not None:
            raise ConfigError(
                "stride", f"is read only by protocol 'sliding' (protocol is {self.protocol!r})"
            )
        if self.same_length and self.protocol != "xl":
            raise ConfigError(
                "same_length",
                "is Transformer-XL's evaluation: write protocol: xl (memory carried, "
                "every query sees mem_len keys)",
            )
        if self.rope_scaling is not None:
            check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if isinstance(self.rope_scale, str):
            check_choice("rope_scale", self.rope_scale, ("auto",))
        else:
            check_range("rope_scale", self.rope_scale, low=1.0)
            if self.rope_scaling is None:
                raise ConfigError(
                    "rope_scale",
                    f"{self.rope_scale} scales RoPE only with rope_scaling: "
                    + " | ".join(ROPE_SCALINGS),
                )
        check_rope_extension(
            self.rope_scaling,
            self.rope_long_factor,
            self.rope_short_factor,
            self.rope_mscale,
            self.rope_mscale_all_dim,
            self.rope_truncate,
        )

    @property
    def uses_memory(self) -> bool:
        """Memory carried from segment to segment (non_overlapping with a memory, xl); sliding has
        none."""
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
        return {
            "non_overlapping": self.segment_len + memory,
            "sliding": self.segment_len,
            "xl": memory,
        }[self.protocol]

    def split_of(self, default: str) -> str:
        """The split this setting scores: its own, else `default` (eval.split)."""
        return self.split or default

    def rope_factor(self, train_attn_len: int, attn_len: int) -> float:
        """s: rope_scale, or auto: attn_len / train_attn_len (at least 1)."""
        return (
            max(1.0, attn_len / train_attn_len)
            if self.rope_scale == "auto"
            else float(self.rope_scale)
        )


def check_rope_extension(
    kind: str | None,
    long_factor: tuple[float, ...] | None,
    short_factor: tuple[float, ...] | None,
    mscale: float | None,
    mscale_all_dim: float | None,
    truncate: bool,
) -> None:
    """The fields only some RoPE context extensions read, against `kind` (rope_scaling), named as
    eval.settings[i] names them: longrope needs both factor lists, each value > 0 (their length
    needs the model's d_rot: the model checks it); yarn's mscale pair is set together, each > 0;
    none is set for another kind. EvalSetting's and RopeScaling's one rule."""
    for name, factors in (("rope_long_factor", long_factor), ("rope_short_factor", short_factor)):
        if kind == "longrope" and factors is None:
            reject(name, "rope_scaling longrope needs it: one rescale factor per rotary pair")
        elif factors is not None and kind != "longrope":
            reject(name, f"is read only by rope_scaling longrope (rope_scaling is {kind!r})")
        for i, factor in enumerate(factors or ()):
            _check_positive(f"{name}[{i}]", factor)
    yarn_only = (
        ("rope_mscale", mscale is not None),
        ("rope_mscale_all_dim", mscale_all_dim is not None),
        ("rope_truncate", not truncate),
    )
    for name, given in yarn_only:
        if given and kind != "yarn":
            reject(name, f"is read only by rope_scaling yarn (rope_scaling is {kind!r})")
    if kind == "yarn" and (mscale is None) != (mscale_all_dim is None):
        missing = "rope_mscale" if mscale is None else "rope_mscale_all_dim"
        reject(
            missing,
            "yarn's factor m(s, rope_mscale)/m(s, rope_mscale_all_dim) needs both; "
            "set both or neither",
        )
    for name, value in (("rope_mscale", mscale), ("rope_mscale_all_dim", mscale_all_dim)):
        if value is not None:
            _check_positive(name, value)


def _check_positive(field: str, value: float) -> None:
    if not 0 < value < math.inf:
        reject(field, f"{value!r} is out of range; allowed (0, inf)")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation at many lengths (extrapolation), protocols, and RECL's context ladder."""

    settings: tuple[EvalSetting, ...] = ()
    """Evaluation settings, a list of mappings with the fields eval.settings[i].*
    (docs/guide/evaluation.md#evaluation-protocols); empty means 1x, 2x and 4x the training segment
    length, non_overlapping, with the training mem_len."""
    split: str = "valid"
    """Which split to evaluate: valid | test; a setting's own `split` overrides it for that
    setting."""
    batch_size: int = 8
    """Evaluation streams: the split is cut into this many contiguous streams (the remainder
    dropped; each stream's first token is never a target); non_overlapping and xl evaluate one
    segment of each per forward."""
    sliding_batch_tokens: int = 8192
    """Tokens per forward for protocol sliding: as many windows as fit (at least one) are batched;
    the windows are independent, so the result does not depend on it."""
    recl_contexts: tuple[int, ...] = ()
    """RECL's ladder (docs/guide/evaluation.md#recl): for each context length c, an extra setting
    that scores every target with exactly c tokens of context (recl_protocol: a sliding window of c,
    or memory of c keys) and saves each target's loss."""
    recl_targets: int = 4096
    """max_targets of the RECL settings: sliding with stride 1 costs one forward per target."""
    recl_protocol: str = "auto"
    """How the RECL ladder gives a target exactly c tokens of context: sliding (a window of c
    tokens, stride 1: the context is in the input) | xl (memory with same_length, mem_len c: every
    query sees c keys, and the memory supplies them, as the paper measures recurrent models) | auto:
    xl for a model with memory (model.mem_len > 0), sliding without
    (docs/guide/evaluation.md#recl)."""
    diagnostics: bool = False
    """Also record per layer and head the attention's entropy, sink mass, mean attended distance and
    mass on distances unseen in training (docs/guide/evaluation.md#attention-diagnostics), from the
    same forward: probabilities are then computed per query block instead of by fused kernels."""

    def __post_init__(self):
        check_choice("split", self.split, SPLITS)
        check_range("batch_size", self.batch_size, low=1)
        check_range("sliding_batch_tokens", self.sliding_batch_tokens, low=1)
        check_range("recl_targets", self.recl_targets, low=1)
        check_choice("recl_protocol", self.recl_protocol, RECL_PROTOCOLS)
        for i, context in enumerate(self.recl_contexts):
            check_range(f"recl_contexts[{i}]", context, low=1)
        if list(self.recl_contexts) != sorted(set(self.recl_contexts)):
            raise ConfigError(
                "recl_contexts",
                f"{list(self.recl_contexts)}: list each context length once, "
                "in increasing order (the search steps from one to the next)",
            )

    def recl_settings(self, recurrent: bool, segment_len: int) -> tuple[EvalSetting, ...]:
        """The ladder's settings: exactly c tokens of context for every target used by RECL, by
        recl_protocol (`recurrent`: the model has memory; xl evaluates segments of `segment_len`,
        the training one)."""
        memory = self.recl_protocol == "xl" or (self.recl_protocol == "auto" and recurrent)
        if memory:
            return tuple(
                EvalSetting(
                    segment_len=segment_len,
                    protocol="xl",
                    mem_len=c,
                    max_targets=self.recl_targets,
                    token_losses=True,
                )
                for c in self.recl_contexts
            )
        return tuple(
            EvalSetting(
                segment_len=c,
                protocol="sliding",
                stride=1,
                max_targets=self.recl_targets,
                token_losses=True,
            )
            for c in self.recl_contexts
        )
