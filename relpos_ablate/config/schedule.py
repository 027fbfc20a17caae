"""Per-layer attention: named layer kinds and the pattern that repeats them over the layers.

Layer l reads `layer_pattern[l % len(layer_pattern)]`, a kind of `layer_kinds` or an encoding
preset's word. A kind starts from the model's `attention`, applies its `encoding` preset (only the
fields the preset lists, as the `encoding:` grid axis does), then its own fields; a field a kind
leaves unset keeps the model's value. So `layer_pattern: [rope, rope, rope, nope]` is "NoPE every
4th layer" without any kind, and

    layer_kinds:
      local: {encoding: rope, window: 64}
      global: {encoding: nope, temperature_tuning: true}
    layer_pattern: [local, local, local, global]

is an RNoPE / Llama-4 style model (docs/schemes/schedules.md#layer-schedules). Without a pattern
every layer uses the model's attention, as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from relpos_ablate.config.base import ConfigError, check_range
from relpos_ablate.config.presets import SCHEDULES, preset_fields, presets

#: Absolute encodings added once, at the model's input: the model's attention decides them for every
#: layer.
INPUT_POSITIONS = frozenset({"sinusoid", "learned"})


@dataclass(frozen=True)
class LayerKind:
    """One named kind of layer: an encoding and the visibility and scaling settings of its
    attention."""

    name: str
    """The kind's name, used in layer_pattern (in YAML the key of its mapping)."""
    encoding: str = ""
    """An encoding preset (the words of the `encoding:` grid axis, e.g. rope, nope, alibi, t5)
    applied on top of the model's attention; '': the model's encoding."""
    window: int | None = None
    """Sliding window of this kind's layers (attention.window); 0: none (full attention); null: the
    model's."""
    chunk: int | None = None
    """Chunked attention of this kind's layers (attention.chunk); 0: none; null: the model's."""
    rope_base: float | None = None
    """RoPE base of this kind's layers (attention.rope_base); null: the model's."""
    sinks: int | None = None
    """Learned sink slots of this kind's layers (attention.sinks); null: the model's."""
    temperature_tuning: bool | None = None
    """Llama 4's attention temperature on this kind's layers (attention.temperature_tuning); null:
    the model's."""
    score_scale: str | None = None
    """Score scale of this kind's layers (attention.score_scale: sqrt_d, none, log_n, ssmax); null:
    the model's."""

    @staticmethod
    def field_choices(name: str) -> tuple[str, ...] | None:
        """The encoding words (`--help` appends them)."""
        return tuple(presets()) if name == "encoding" else None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", f"{self.name!r}: give each layer kind a non-empty name")
        if self.encoding and self.encoding not in presets():
            extra = " (a schedule, not a layer's encoding)" if self.encoding in SCHEDULES else ""
            raise ConfigError(
                "encoding",
                f"{self.encoding!r}{extra} is not an encoding preset; choose one of "
                f"{', '.join(presets())}",
            )
        for name in ("window", "chunk", "sinks"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), low=0)

    def overrides(self) -> dict[str, Any]:
        """The attention fields this kind sets: its preset's, then its own (0 window / chunk:
        None)."""
        fields = preset_fields(self.encoding) if self.encoding else {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "encoding") or value is None:
                continue
            fields[f.name] = None if f.name in ("window", "chunk") and value == 0 else value
        return fields


def bias_key(layer: Any, model: Any) -> Any:
    """What tells two layers' bias settings apart: their attention with a kind's own fields (window,
    chunk, ...) set back to the model's. Layers with equal keys share one bias module under
    share_bias."""
    own = [f.name for f in dataclasses.fields(LayerKind) if f.name not in ("name", "encoding")]
    return dataclasses.replace(layer, **{name: getattr(model, name) for name in own})


def layer_overrides(word: str, kinds: dict[str, LayerKind]) -> dict[str, Any]:
    """The attention fields a pattern word sets: a kind's, else an encoding preset's."""
    return kinds[word].overrides() if word in kinds else preset_fields(word)


def check_pattern(pattern: tuple[str, ...], kinds: tuple[LayerKind, ...]) -> dict[str, LayerKind]:
    """{name: kind}, after checking that names are unique and every pattern word is a kind or a
    preset."""
    by_name: dict[str, LayerKind] = {}
    for kind in kinds:
        if kind.name in by_name:
            raise ConfigError(
                f"layer_kinds.{kind.name}", "is defined twice; give each kind one entry"
            )
        by_name[kind.name] = kind
    words = presets()
    for i, word in enumerate(pattern):
        if word not in by_name and word not in words:
            defined = ", ".join(by_name) or "none defined"
            raise ConfigError(
                f"layer_pattern[{i}]",
                f"{word!r} is neither a layer kind ({defined}) nor an encoding "
                f"preset ({', '.join(words)})",
            )
    return by_name


def pattern_label(pattern: tuple[str, ...] | list[str]) -> str:
    """A pattern in words, runs of one word counted: [local, local, local, global] -> 'local×3
    global'."""
    parts: list[list[Any]] = []
    for word in pattern:
        if parts and parts[-1][0] == word:
            parts[-1][1] += 1
        else:
            parts.append([word, 1])
    return " ".join(word if n == 1 else f"{word}×{n}" for word, n in parts)


def shown_value(value: Any) -> str:
    """A variant's value in a line of text: a list of words (a layer pattern) as `[rope×3 nope]`."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return f"[{pattern_label(value)}]"
    return str(value)
