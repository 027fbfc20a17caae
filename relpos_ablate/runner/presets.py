"""Named encodings for the `encoding:` grid axis: each word sets the attention fields of one scheme.

A preset overrides only the `model.attention` fields it lists; every other field stays as in the
grid's base config (so `max_position`, `num_buckets`, ... keep the base's values). Explicit key-path
axes are applied after the preset, so `model.attention.clamp_len: [8, 32]` next to `encoding: [shaw]`
varies Shaw's clamp. Adding a scheme is one line in PRESETS.
"""

from __future__ import annotations

from typing import Any

from relpos_ablate.config import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # Transformer-XL (Dai et al. 2019): all four terms, sinusoidal R, no absolute positions.
    "xl": {"terms": "abcd", "rel": "sinusoid", "bias": "none", "absolute": "none"},
    # Shaw et al. 2018: content + a learned table of relative keys clipped at 20.
    "shaw": {"terms": "ab", "rel": "learned", "clamp_len": 20, "bias": "none", "absolute": "none"},
    "vaswani": {"terms": "a", "absolute": "sinusoid", "bias": "none"},
    "learned": {"terms": "a", "absolute": "learned", "bias": "none"},
    # Al-Rfou et al. 2019: learned absolute positions added at every layer.
    "al_rfou": {"terms": "a", "absolute": "learned_per_layer", "bias": "none"},
    "nope": {"terms": "a", "absolute": "none", "bias": "none"},
    "rope": {"terms": "a", "absolute": "rope", "bias": "none"},
    "t5": {"terms": "a", "absolute": "none", "bias": "t5"},
    "alibi": {"terms": "a", "absolute": "none", "bias": "alibi"},
    "alibi_learned": {"terms": "a", "absolute": "none", "bias": "alibi_learned"},
    "kerple_log": {"terms": "a", "absolute": "none", "bias": "kerple_log"},
    "kerple_power": {"terms": "a", "absolute": "none", "bias": "kerple_power"},
    "fire": {"terms": "a", "absolute": "none", "bias": "fire"},
    "dynamic": {"terms": "a", "absolute": "none", "bias": "dynamic"},
    "xl_table": {"terms": "a", "absolute": "none", "bias": "xl_table"},
}


def preset_fields(name: Any, field: str = "encoding") -> dict[str, Any]:
    """The `model.attention` fields preset `name` sets; a one-line error naming the allowed words."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(field, f"unknown encoding {name!r}; allowed: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
