"""Named encodings for the `encoding:` grid axis: each word sets the attention fields of one scheme,
or (the schedules) the layer kinds and pattern of a hybrid model.

A preset overrides only the `model.attention` fields it lists; every other field stays as in the
grid's base config (so `max_position`, `num_buckets`, ... keep the base's values). Explicit key-path
axes are applied after the preset, so `model.attention.clamp_len: [8, 32]` next to `encoding:
[shaw]` varies Shaw's clamp. The baselines are written out below; every registered bias type (the
registry, relpos_ablate/config/registry/builtins.py, your own schemes included) is a preset of
its own name: term a plus that bias, nothing else.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from relpos_ablate.config.base import ConfigError
from relpos_ablate.config.registry import SCHEME_PRESETS, bias_types

#: Encodings that are not one bias type: Transformer-XL, Shaw, absolute and rotary baselines,
#: p-RoPE, xPos, FoX, CoPE, SSMax, stick-breaking, PaTH, DAPE.
BASELINES: dict[str, dict[str, Any]] = {
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
    # p-RoPE (Barbero et al. 2025): RoPE whose lowest-frequency quarter of pairs does not turn (p =
    # 0.75).
    "p_rope": {"terms": "a", "absolute": "rope", "rope_p": 0.75, "bias": "none"},
    # xPos (Sun et al. 2022): RoPE with a per-pair exponential decay, scale base 512 as the paper.
    "rope_xpos": {"terms": "a", "absolute": "rope", "xpos_scale_base": 512.0, "bias": "none"},
    # FoX (Lin et al. 2025): a data-dependent forget gate on NoPE, as the paper's default model.
    "fox": {"terms": "a", "absolute": "none", "bias": "none", "forget_gate": True},
    # CoPE (Golovneva et al. 2024): contextual positions on NoPE, 64 of them (the authors' code
    # default is the training block size + 1: set model.attention.cope_positions for that).
    "cope": {"terms": "a", "absolute": "none", "bias": "none", "cope_positions": 64},
    # SSMax (Nakanishi 2025): every score × s_h·log n, s_h learned per head, on NoPE (the scheme
    # alone).
    "ssmax": {"terms": "a", "absolute": "none", "bias": "none", "score_scale": "ssmax"},
    # Stick-breaking attention (Tan et al. 2025): no softmax and no position encoding, as the
    # paper's model.
    "stick_breaking": {
        "terms": "a",
        "absolute": "none",
        "bias": "none",
        "normaliser": "stick_breaking",
    },
    # PaTH (Yang et al. 2025): data-dependent Householder transforms in place of RoPE, no forget
    # gate.
    "path": {"terms": "a", "absolute": "none", "bias": "none", "path": True},
    # DAPE (Zheng et al. 2024) on KERPLE (log), with the authors' mlp_width 32; DAPE v2 with their
    # 1×3 kernel.
    "dape": {"terms": "a", "absolute": "none", "bias": "kerple_log", "dape": "v1"},
    "dape_v2": {"terms": "a", "absolute": "none", "bias": "kerple_log", "dape": "v2"},
}


def bias_preset(name: str) -> dict[str, Any]:
    """The preset of a bias type: content attention (term a) plus that bias, no absolute
    positions."""
    return {"terms": "a", "absolute": "none", "bias": name}


def presets() -> dict[str, dict[str, Any]]:
    """Every encoding word: the baselines, then one per registered bias type."""
    biases = bias_types()[1:]  # without 'none'
    clash = sorted((set(BASELINES) | set(SCHEME_PRESETS) | set(SCHEDULES)) & set(biases))
    if clash:
        raise ConfigError(
            "encoding",
            f"bias type {clash[0]!r} has the name of a baseline or schedule preset; register it "
            "under another name",
        )
    return {**BASELINES, **SCHEME_PRESETS, **{name: bias_preset(name) for name in biases}}


def preset_fields(name: Any, field: str = "encoding") -> dict[str, Any]:
    """The `model.attention` fields preset `name` sets; a one-line error naming the allowed
    words."""
    table = presets()
    if not isinstance(name, str) or name not in table:
        raise unknown_encoding(name, list(table), field)
    return dict(table[name])


def unknown_encoding(name: Any, words: list[str], field: str) -> ConfigError:
    """The one-line error for a word `encoding:` does not take: the closest word, then all."""
    close = difflib.get_close_matches(str(name), words, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(field, f"unknown encoding {name!r}; {hint}allowed: {', '.join(words)}")


#: Published per-layer schedules (docs/schemes/schedules.md#layer-schedules): each sets
#: model.layer_kinds and model.layer_pattern, with one kind named `local` and one `global`, so that
#: one grid can scale the local kind's window or chunk for all of them
#: (`model.layer_kinds.local.window`). Sizes are the published ones.
SCHEDULES: dict[str, dict[str, Any]] = {
    # Cohere, "Rope to Nope and Back Again" (arXiv 2501.18795), RNoPE-SWA as Command A ships it:
    # three RoPE layers with a sliding window of 4096, then one NoPE layer with full attention.
    "rnope": {
        "layer_kinds": {
            "local": {"encoding": "rope", "window": 4096},
            "global": {"encoding": "nope"},
        },
        "layer_pattern": ["local", "local", "local", "global"],
    },
    # Llama 4 (Hugging Face configuration_llama4.py): NoPE every 4th layer
    # (no_rope_layer_interval 4) with full attention and attention temperature tuning; the RoPE
    # layers chunked (attention_chunk_size 8192), theta 500000.
    "llama4_like": {
        "layer_kinds": {
            "local": {"encoding": "rope", "chunk": 8192, "rope_base": 500000.0},
            "global": {"encoding": "nope", "temperature_tuning": True},
        },
        "layer_pattern": ["local", "local", "local", "global"],
    },
    # Gemma 3 (technical report, arXiv 2503.19786): five local layers (sliding window 1024, RoPE
    # base 10k) per global layer (full attention, RoPE base 1M).
    "gemma3_like": {
        "layer_kinds": {
            "local": {"encoding": "rope", "window": 1024, "rope_base": 10000.0},
            "global": {"encoding": "rope", "rope_base": 1000000.0},
        },
        "layer_pattern": ["local", "local", "local", "local", "local", "global"],
    },
}


def encoding_words() -> list[str]:
    """Every word `encoding:` takes: the attention presets, then the schedules."""
    return [*presets(), *SCHEDULES]


def encoding_fields(name: Any, field: str = "encoding") -> dict[str, Any]:
    """The run config key paths an `encoding:` word sets: `model.attention.<field>` for an attention
    preset, model.layer_kinds and model.layer_pattern for a schedule; a one-line error naming the
    allowed words."""
    if isinstance(name, str) and name in SCHEDULES:
        return {f"model.{key}": copy.deepcopy(value) for key, value in SCHEDULES[name].items()}
    if not isinstance(name, str) or name not in presets():
        raise unknown_encoding(name, encoding_words(), field)
    return {f"model.attention.{key}": value for key, value in preset_fields(name, field).items()}
