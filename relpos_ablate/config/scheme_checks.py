"""The checks of AttentionConfig that span several fields of the newer schemes (RoPE variants, FoX,
CoPE, windows, chunks, sinks, length-aware scaling) and of the schemes that read the scores
(stick-breaking, PaTH, DAPE): each a one-line ConfigError naming the field and what is allowed.
AttentionConfig.__post_init__ runs them on itself (the `config` they read; they import no config
class)."""

from __future__ import annotations

from typing import Any

from relpos_ablate import planner
from relpos_ablate.config.base import ConfigError, check_choice, check_range
from relpos_ablate.config.registry import bias_forms, slot_forms, switched_terms, term_forms

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
    if config.chunk is not None and (config.randomized or reads_query_position(config)):
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
    for name, on in (("path", config.path), ("dape", config.dape == "v2")):
        if on and config.chunk is not None:
            # found in issue 57: both differ from the float64 reference on chunked rows (PaTH by up
            # to 1.1; DAPE v2's convolution along the keys at a chunk's padded edge)
            raise ConfigError(
                "chunk",
                f"{name}={getattr(config, name)!r} on chunked rows does not match its float64 "
                "reference; use window, or no chunk",
            )
    if config.dape != "none" and config.bias == "none":
        raise ConfigError(
            "dape", "adjusts a bias-type encoding; set bias (the `dape` presets use kerple_log)"
        )
    if config.backend == "low_rank" and not planner.low_rank(plan(config)):
        raise ConfigError(
            "backend",
            "'low_rank' takes causal attention whose every position part is a key offset (a "
            "bias and score terms with the key_offsets form, no term b or d: "
            f"{_forms(config)}), no sinks, window or score scaling; use auto",
        )
    if config.backend == "band" and not planner.band(plan(config)):
        raise ConfigError(
            "backend",
            "'band' takes causal attention whose position parts are constant from a distance on "
            "(terms b/d with clamp_len set and a bias with the band form, or score terms that "
            f"all have it: {_forms(config)}), no sinks, window or score scaling; use auto",
        )
    if config.needs_scores and config.backend in ("blocks", "flex"):
        raise ConfigError(
            "backend",
            f"{config.backend!r} never materialises the scores that stick-breaking, PaTH "
            "and DAPE read; use auto, sdpa (per query block) or explicit",
        )


def plan(config: Any) -> planner.Plan:
    """What the kernel planner reads of an attention config (relpos_ablate/planner.py): the
    geometry a config fixes, the forms of its per-distance parts and of its score terms (from the
    registry: no torch)."""
    plain = (
        config.causal
        and not slot_forms(config)
        and config.window is None
        and config.score_scale in ("sqrt_d", "none")
        and not config.learned_temperature
        and not config.randomized
        and not config.shaw_values
    )
    bias = bias_forms(config.bias) if config.bias != "none" else None
    pair_bias = bias is not None and "query_position" in bias
    term_d, distance_bias = "d" in config.terms, bias is not None and not pair_bias
    # one curve over distances: term d, a bias of distance alone, or both summed (no slope then)
    curve = (bias if not term_d else frozenset()) if distance_bias or term_d else None
    saturates = (not config.uses_r or config.clamp_len is not None) and (
        bias is None or pair_bias or "band" in bias
    )
    terms = [bias] if pair_bias else []
    terms += [term_forms(name) for name in (*switched_terms(config), *config.term_schemes)]
    return planner.Plan(
        plain_causal=plain,
        product="b" in config.terms,
        curve=curve,
        saturates=saturates,
        terms=tuple(terms),
        reads_scores=config.needs_scores,
    )


def _forms(config: Any) -> str:
    """The forms of the config's bias and score terms, for an error message."""
    parts = [("bias " + config.bias, bias_forms(config.bias))] if config.bias != "none" else []
    parts += [(name, term_forms(name)) for name in config.active_terms]
    if not parts:
        return "no bias or score term"
    return "; ".join(f"{name}: {' '.join(sorted(forms)) or 'none'}" for name, forms in parts)


def reads_query_position(config: Any) -> bool:
    """Whether a part of the attention reads the query position besides the distance."""
    return config.bias != "none" and "query_position" in bias_forms(config.bias)


def check_widths(attention: Any, d_model: int, d_head: int) -> None:
    """The widths an attention layer's sinusoids need: RoPE rotates pairs of a head's dimensions,
    and R_{i-j} has a sine and a cosine half. (ModelConfig and a bare RelPosAttention both check
    them.)"""
    if attention.absolute == "rope" and d_head % 2:
        raise ConfigError("d_head", f"rope needs an even d_head (got {d_head})")
    if attention.absolute == "rope" and rotary_width(attention, d_head) < 2:
        raise ConfigError(
            "rope_fraction",
            f"{attention.rope_fraction} of d_head {d_head} rotates no pair of dimensions",
        )
    if (
        attention.absolute == "rope"
        and rotating_pairs(attention, rotary_width(attention, d_head)) < 1
    ):
        raise ConfigError(
            "rope_p",
            f"{attention.rope_p} of the {rotary_width(attention, d_head) // 2} rotary pairs "
            "rotates none of them",
        )
    if attention.uses_r and attention.rel == "sinusoid" and d_model % 2:
        raise ConfigError("d_model", f"sinusoid R needs an even d_model (got {d_model})")
    attention.check_option_widths(d_model, d_head)


def check_randomized_range(attention: Any, lengths: dict[str, tuple[int, int]]) -> None:
    """Randomized positions draw each segment's positions from [0, max_position) without replacement
    and keep no memory: every {field: (segment_len, mem_len)} of a run must fit (RunConfig calls
    this)."""
    if not attention.randomized:
        return
    for field_name, (segment_len, mem_len) in lengths.items():
        if mem_len:
            raise ConfigError(
                field_name,
                f"mem_len {mem_len} with randomized positions (drawn per segment, memory "
                "would keep another draw's); use mem_len 0",
            )
        if segment_len > attention.max_position:
            raise ConfigError(
                "model.attention.max_position",
                f"{attention.max_position} is below the {segment_len} "
                f"tokens of {field_name}: randomized positions draw that many distinct positions "
                f"from [0, max_position)",
            )


def rope_scaling_conflict(attention: Any) -> str | None:
    """Why a RoPE context extension (an evaluation setting's rope_scaling: PI, NTK, YaRN) cannot
    apply to this attention, or None when it can: it rescales RoPE's frequencies, and xPos has no
    published extension. The model refuses such a call; an evaluation skips such a setting and
    records this reason."""
    if attention.absolute == "rope" and attention.xpos_scale_base is None:
        return None
    xpos = (
        ""
        if attention.xpos_scale_base is None
        else " with xPos (xpos_scale_base), which has no published extension"
    )
    return f"extends RoPE; this model has absolute={attention.absolute!r}{xpos}"


def rotary_width(attention: Any, d_head: int) -> int:
    """d_rot: how many of a head's dimensions RoPE rotates, int(rope_fraction·d_head) rounded down
    to even."""
    return int(attention.rope_fraction * d_head) // 2 * 2


def rotating_pairs(attention: Any, d_rot: int) -> int:
    """How many of the d_rot/2 rotary pairs p-RoPE rotates: int(rope_p·d_rot/2) (all of them at
    rope_p 1)."""
    return int(attention.rope_p * d_rot // 2)


def document_refusal(config) -> str | None:
    """Why an attention config cannot honour packed documents (data.documents packed_reset:
    model/documents.py), or None: what reads a query's place in the stream besides distances and
    has no per-document form."""
    if config.chunk is not None:
        return "chunked attention cuts its chunks by index, not by the document's positions"
    if config.bias != "none" and "query_position" in bias_forms(config.bias):
        return (
            f"bias {config.bias!r} reads the query's position in the stream besides the "
            "distance, which packing moves"
        )
    if config.randomized:
        return "randomized positions are drawn over the whole row, not per document"
    if config.dape == "v2":
        return (
            "DAPE v2's convolutions along the keys carry their hidden layer's bias from the "
            "other documents' (hidden) keys into the document's first ones"
        )
    return None
