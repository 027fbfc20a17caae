"""The checks of AttentionConfig that span several fields of the newer schemes (RoPE variants, FoX,
CoPE, windows, chunks, sinks, length-aware scaling) and of the schemes that read the scores
(stick-breaking, PaTH, DAPE): each a one-line ConfigError naming the field and what is allowed.
AttentionConfig.__post_init__ runs them on itself (the `config` they read; they import no config
class)."""

from __future__ import annotations

from typing import Any

from relpos_ablate.config.base import ConfigError, check_choice, check_range

#: Built-in bias types that read the query position besides the distance (FIRE's normaliser).
QUERY_DEPENDENT_BIASES = ("fire",)
DAPE_VERSIONS = ("none", "v1", "v2")
NORMALISERS = ("softmax", "stick_breaking")


def check_newer_schemes(config: Any) -> None:
    """RoPE variants, FoX, CoPE, windows, sinks and length-aware scaling (docs/schemes/index.md)."""
    check_range("rope_fraction", config.rope_fraction, low=1e-9, high=1.0)
    check_range("rope_p", config.rope_p, low=1e-9, high=1.0)
    if config.xpos_scale_base is not None:
        check_range("xpos_scale_base", config.xpos_scale_base, low=1e-9)
    check_range("cope_positions", config.cope_positions, low=0)
    if config.window is not None:
        check_range("window", config.window, low=1)
    if config.chunk is not None:
        check_range("chunk", config.chunk, low=1)
    check_range("temperature_floor_scale", config.temperature_floor_scale, low=1e-9)
    check_range("temperature_scale", config.temperature_scale, low=0.0)
    check_range("sinks", config.sinks, low=0)
    if config.log_n_length:
        check_range("log_n_length", config.log_n_length, low=2)
    for name, on in (
        ("rope_fraction", config.rope_fraction != 1.0),
        ("rope_p", config.rope_p != 1.0),
        ("xpos_scale_base", config.xpos_scale_base),
    ):
        if on and config.absolute != "rope":
            raise ConfigError(
                name, f"is a RoPE variant; set absolute='rope' (got {config.absolute!r})"
            )
    causal_only = (
        ("xpos_scale_base", config.xpos_scale_base is not None),
        ("forget_gate", config.forget_gate),
        ("cope_positions", config.cope_positions),
        ("window", config.window is not None),
        ("chunk", config.chunk is not None),
    )
    for name, on in causal_only:
        if on and not config.causal:
            raise ConfigError(
                name, "is defined for causal attention only (keys up to the query); set causal=true"
            )
    if config.chunk is not None and (config.randomized or config.bias in QUERY_DEPENDENT_BIASES):
        raise ConfigError(
            "chunk",
            f"every chunk is computed at the positions of the first (only distances differ "
            f"between chunks), which "
            f"{'randomized positions' if config.randomized else repr(config.bias)} would see; use "
            f"sequential positions and a distance-only bias",
        )
    if config.xpos_scale_base is not None and config.rope_p != 1.0:
        raise ConfigError(
            "rope_p",
            "p-RoPE leaves its lowest-frequency pairs unrotated, and xPos's decay is "
            "defined per rotating pair; use one of rope_p and xpos_scale_base",
        )
    if config.xpos_scale_base is not None and (config.sinks or config.cope_positions):
        raise ConfigError(
            "xpos_scale_base",
            "xPos scales a query and a key by ζ^(±position/B), which means "
            "something only in their product; sinks and CoPE's q·e[p] have no key position to "
            "pair with",
        )
    if config.cope_positions and "a" not in config.terms:
        raise ConfigError(
            "cope_positions",
            f"CoPE's gates read the content score; include term a (terms={config.terms!r})",
        )
    if config.cope_positions and config.backend == "flex":
        raise ConfigError(
            "backend",
            "'flex' cannot run CoPE (its positions sum gates over a query's whole row of "
            "keys before the softmax); use auto, blocks, sdpa or explicit",
        )


def check_materialised_schemes(config: Any) -> None:
    """Stick-breaking, PaTH and DAPE (docs/schemes/index.md)."""
    check_choice("normaliser", config.normaliser, NORMALISERS)
    check_choice("dape", config.dape, DAPE_VERSIONS)
    check_range("dape_width", config.dape_width, low=1)
    check_range("dape_kernel", config.dape_kernel, low=1)
    if config.dape_kernel % 2 == 0:
        raise ConfigError(
            "dape_kernel",
            f"{config.dape_kernel}: must be odd (a centred convolution along the keys)",
        )
    for name, on in (("normaliser", config.normaliser != "softmax"), ("path", config.path)):
        if on and not config.causal:
            raise ConfigError(
                name, "is defined for causal attention only (keys up to the query); set causal=true"
            )
    if config.normaliser == "stick_breaking" and config.sinks:
        raise ConfigError(
            "sinks",
            "stick-breaking breaks the stick over the stream's keys by distance; sink "
            "slots have no place in that order (set sinks=0)",
        )
    if config.path and (config.terms != "a" or config.absolute == "rope"):
        raise ConfigError(
            "path",
            "PaTH replaces term a's product and carries the positions itself; use "
            f"terms='a' and no RoPE (got terms={config.terms!r}, absolute={config.absolute!r})",
        )
    if config.path and config.cope_positions:
        raise ConfigError(
            "path",
            "CoPE's gates read the plain content score q·k, which PaTH replaces; use one "
            "of path and cope_positions",
        )
    if config.dape != "none" and config.bias == "none":
        raise ConfigError(
            "dape", "adjusts a bias-type encoding; set bias (the `dape` presets use kerple_log)"
        )
    if config.backend == "low_rank" and not low_rank_form(config):
        raise ConfigError(
            "backend",
            "'low_rank' takes causal attention whose only position term is a key offset "
            "(bias alibi or alibi_learned, and/or forget_gate) with terms='a', no CoPE, sinks, "
            "window or score scaling; use auto",
        )
    if config.backend == "band" and not band_form(config):
        raise ConfigError(
            "backend",
            "'band' takes causal attention whose position terms are constant from a distance on "
            "(terms b/d with clamp_len set, bias xl_table or t5, or CoPE alone) with no FoX, "
            "sinks, window or score scaling; use auto",
        )
    if config.needs_scores and config.backend in ("blocks", "flex"):
        raise ConfigError(
            "backend",
            f"{config.backend!r} never materialises the scores that stick-breaking, PaTH "
            "and DAPE read; use auto, sdpa (per query block) or explicit",
        )


def _plain_causal(config: Any, cope: bool = False) -> bool:
    """Causal attention over the whole stream with the plain softmax of the scaled scores: no CoPE
    (unless `cope`), sinks, window, length-aware or learned scale, scheme that reads the scores, or
    randomized positions (what the low-rank and band kernels need beside their own position
    terms)."""
    return (
        config.causal
        and (cope or not config.cope_positions)
        and not config.sinks
        and config.window is None
        and config.score_scale in ("sqrt_d", "none")
        and not config.learned_temperature
        and not config.needs_scores
        and not config.randomized
    )


def low_rank_form(config: Any) -> bool:
    """Whether every position term is a key offset up to a per-query constant
    (kernels/low_rank.py)."""
    offsets = config.bias in ("alibi", "alibi_learned") or (
        config.bias == "none" and config.forget_gate
    )
    return offsets and config.terms == "a" and _plain_causal(config)


def band_form(config: Any) -> bool:
    """Whether every position term is constant from a distance on, up to a per-query constant: R
    clamped at clamp_len for terms b/d, the bias xl_table or t5, or CoPE alone, whose clamped count
    is (kernels/band.py)."""
    if config.cope_positions:
        return (
            not config.uses_r
            and config.bias == "none"
            and _plain_causal(config, cope=True)
            and not config.forget_gate
            and not config.shaw_values
        )
    saturating = (not config.uses_r or config.clamp_len is not None) and config.bias in (
        "none",
        "xl_table",
        "t5",
    )
    return (
        saturating
        and (config.uses_r or config.bias != "none")
        and _plain_causal(config)
        and not config.forget_gate
        and not config.shaw_values
    )
