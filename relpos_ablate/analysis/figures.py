"""Figures of one trained model: per-head bias curves, attention heatmaps, the four score terms.

Every function takes a model (and, for heatmaps, `model.inspect` output) and returns a matplotlib
Figure built without pyplot, so it works headless and in notebooks alike. Distances are i - j
(query minus key): positive = the key is in the past; negative keys exist only bidirectionally.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from relpos_ablate.config import ConfigError

TERM_NAMES = {
    "a": "(a) content: q·k",
    "b": "(b) content-position: q·W_R R",
    "c": "(c) global content: u·k",
    "d": "(d) global position: v·W_R R",
    "bias": "bias B_h(i, j)",
    "decay": "FoX decay D_ij",
    "cope": "CoPE s·q·e[p_ij]",
}
MAX_HEATMAP_HEADS = 8
"""Attention grids show at most this many heads per layer (readable panels)."""


def bias_sources(model) -> list[str]:
    """'bias' when the attention adds a bias-type encoding, 'd' when term d is on, 'decay' with
    FoX's forget gate (its curve is read from a sample: `decay_curves`), 'xpos' with xPos."""
    return [s for s in SOURCES if any(_has(attn.config, s) for attn in model.attention_layers())]


SOURCES = ("bias", "d", "decay", "xpos")


def _has(cfg, source: str) -> bool:
    """Whether one layer's attention has this curve (a layer pattern may give it to some layers
    only)."""
    return {
        "bias": cfg.bias != "none",
        "d": "d" in cfg.terms,
        "decay": cfg.forget_gate,
        "xpos": cfg.xpos_scale_base is not None,
    }[source]


def check_has_bias(model, name: str) -> list[str]:
    sources = bias_sources(model)
    if not sources:
        cfg = model.attention_layers()[0].config
        raise ConfigError(
            "kind",
            f"{name} has no bias curve: bias='none' and term d is off "
            f"(terms={cfg.terms!r}), no FoX gate, no xPos; try --kind attention or terms",
        )
    return sources


def bias_panels(model, source: str) -> list[tuple[str, object]]:
    """(title, attention layer) per panel: the shared bias module once, else one per layer; xPos's
    parameter-free decay once."""
    named = [
        (name, attn)
        for name, attn in zip(model.layer_names(), model.attention_layers())
        if _has(attn.config, source)
    ]
    every = len(named) == len(model.attention_layers())
    if source == "bias" and all(attn.bias_scheme is named[0][1].bias_scheme for _, attn in named):
        where = "all layers" if every else ", ".join(name for name, _ in named)
        return [(f"bias, {where} (shared)", named[0][1])]
    if source == "xpos":
        return [
            (f"xPos decay per rotary pair, {'all layers' if every else named[0][0]}", named[0][1])
        ]
    what = {"bias": "bias", "d": "term d", "decay": "FoX decay on a sample"}[source]
    return [(f"{what}, {name}", attn) for name, attn in named]


def decay_curves(model, details: dict, n_mem: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """FoX's decay read from `model.inspect` output: per attention layer (by id), the mean of D_ij
    over the sample's (query, key) pairs at each distance r = i' - j, [H, n], and each head's mean
    log-gate per token (the slope of that curve, D_{i,i-1} = log f_i), [H]."""
    curves = {}
    for attn, terms in zip(model.attention_layers(), details["terms"]):
        decay = terms["decay"].double()  # (B, H, L, M + L)
        lq, n_keys = decay.shape[-2:]
        distance = (n_mem + torch.arange(lq))[:, None] - torch.arange(n_keys)[None]  # (L, K)
        seen = distance >= 0
        per_pair = decay[..., seen].mean(0)  # (H, pairs), mean over the batch
        r = distance[seen]
        sums = torch.zeros(per_pair.shape[0], n_keys, dtype=torch.float64).index_add_(
            1, r, per_pair
        )
        counts = torch.zeros(n_keys, dtype=torch.float64).index_add_(
            0, r, torch.ones_like(r, dtype=torch.float64)
        )
        mean = sums / counts.clamp(min=1)
        curves[id(attn)] = (mean.numpy(), mean[:, 1].numpy() if n_keys > 1 else np.zeros(len(mean)))
    return curves


def _xpos_curves(attn, distances: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """ζ_p^(r/B) for five rotary pairs from the fastest to the slowest: [5, n] and their labels."""
    from relpos_ablate.config.scheme_checks import rotary_width
    from relpos_ablate.model.schemes import xpos_decay

    zeta = xpos_decay(rotary_width(attn.config, attn.d_head)).numpy()
    pairs = sorted({round(k * (len(zeta) - 1) / 4) for k in range(5)})
    r = np.abs(distances) / attn.config.xpos_scale_base
    return zeta[pairs][:, None] ** r[None], [f"pair {p} (ζ = {zeta[p]:.3f})" for p in pairs]


def distance_range(causal: bool, max_distance: int) -> np.ndarray:
    return np.arange(0 if causal else -max_distance, max_distance + 1)


def marks(attn, source: str) -> list[float]:
    """Distances where the scheme changes regime: bucket edges and table clamps, or R's
    clamp_len."""
    if source == "bias":
        return list(attn.bias_scheme.boundaries())
    clamp = attn.config.clamp_len
    if clamp is None:
        return []
    return [float(clamp)] + ([] if attn.config.causal else [-float(clamp)])


DISTANCE_LABEL = "distance i − j"
"""The x label of every bias-curve panel (log_distance finds them by it)."""


def log_distance(fig: Figure) -> Figure:
    """Every bias-curve panel's distance axis on a symmetric log scale, linear within ±1 (distance 0
    and a bidirectional model's negative distances stay): a bias's far tail reads beside its first
    distances."""
    for ax in fig.axes:
        if ax.get_xlabel() == DISTANCE_LABEL:
            ax.set_xscale("symlog", linthresh=1.0)
    return fig


def draw_bias_curves(
    ax,
    attn,
    source: str,
    distances: np.ndarray,
    train_len: int | None,
    legend: bool,
    linestyle: str = "-",
    first: bool = True,
    decays: dict | None = None,
) -> None:
    """One curve per head of `attn`'s bias (or term d, or FoX's decay on a sample: `decays` from
    decay_curves) against distance, or per rotary pair of xPos's decay; boundaries marked.
    Overlaying several seeds: a linestyle each, and `first` only for the first (it labels the heads
    and marks)."""
    if source == "xpos":
        curves, labels = _xpos_curves(attn, distances)
    elif source == "decay":
        if decays is None:
            raise ConfigError(
                "decays",
                "FoX's decay is read on a sample: pass decays=decay_curves(model, "
                "*inspect_sample(model, tokens, segment_len, mem_len))",
            )
        mean, slope = decays[id(attn)]
        # the sample's distances
        distances = distances[(distances >= 0) & (distances < mean.shape[1])]
        curves = mean[:, distances]
        labels = [f"head {h}: mean log f = {s:.2f}" for h, s in enumerate(slope)]
    else:
        with torch.no_grad():
            # (H, n)
            curves = (
                attn.bias_curve(torch.as_tensor(distances), source=source).float().cpu().numpy()
            )
        labels = [f"head {h}" for h in range(len(curves))]
    colors = _head_colors(len(curves))
    for h, curve in enumerate(curves):
        ax.plot(
            distances,
            curve,
            color=colors[h],
            lw=1.2,
            ls=linestyle,
            label=labels[h] if first else None,
        )
    if first:
        _mark_lengths(ax, attn, source, distances, train_len)
    ax.set_xlabel(DISTANCE_LABEL)
    ax.set_ylabel("weight of a pair's q·k" if source == "xpos" else "added score")
    if legend:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 4 else 1)


def _mark_lengths(ax, attn, source: str, distances: np.ndarray, train_len: int | None) -> None:
    """Bucket edges and clamps (dashed), the training attention length (dotted)."""
    for k, x in enumerate(m for m in marks(attn, source) if distances[0] <= m <= distances[-1]):
        ax.axvline(x, color="0.6", ls="--", lw=0.7, label="bucket / clamp edge" if k == 0 else None)
    if train_len:
        for k, x in enumerate([train_len] if attn.config.causal else [train_len, -train_len]):
            ax.axvline(
                x, color="k", ls=":", lw=1.0, label="training attention length" if k == 0 else None
            )


def _head_colors(n: int) -> list:
    """Distinct colours for up to 10 heads (tab10), a dark-to-light ramp beyond."""
    if n <= 10:
        return [colormaps["tab10"](k) for k in range(n)]
    return [colormaps["viridis"](0.9 * k / (n - 1)) for k in range(n)]


def bias_figure(
    model,
    max_distance: int,
    train_len: int | None = None,
    title: str = "",
    decays: dict | None = None,
) -> Figure:
    """Every layer's (or the shared module's) per-head bias and term-d curves, FoX's decay on a
    sample (`decays`, from decay_curves; needed with a forget gate) and xPos's decay, one row per
    source."""
    rows = [
        (source, bias_panels(model, source))
        for source in check_has_bias(model, title or "this model")
    ]
    ncols = max(len(panels) for _, panels in rows)
    fig = Figure(figsize=(4.2 * ncols, 3.2 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), ncols, squeeze=False)
    causal = model.attention_layers()[0].config.causal
    distances = distance_range(causal, max_distance)
    for r, (source, panels) in enumerate(rows):
        for c in range(ncols):
            if c >= len(panels):
                axes[r][c].set_visible(False)
                continue
            name, attn = panels[c]
            draw_bias_curves(
                axes[r][c],
                attn,
                source,
                distances,
                train_len,
                legend=(r, c) == (0, 0) or source in ("decay", "xpos"),
                decays=decays,
            )
            axes[r][c].set_title(name, fontsize=10)
    if title:
        fig.suptitle(title)
    return fig


def masked(tensor: torch.Tensor, visible: torch.Tensor | None) -> np.ndarray:
    """A [L, K] map as float numpy with invisible (masked) entries NaN, drawn blank."""
    values = tensor.float().cpu().numpy().copy()
    if visible is not None:
        values[~visible.cpu().numpy().astype(bool)] = np.nan
    return values


def diverging(values: np.ndarray) -> TwoSlopeNorm:
    """A colour scale symmetric around 0 (blue negative, red positive) for score maps."""
    limit = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    return TwoSlopeNorm(0.0, -(limit or 1.0), limit or 1.0)


def draw_map(ax, values: np.ndarray, n_mem: int, cmap: str, norm=None, labels: bool = True):
    """A query x key map; masked (NaN) entries blank; a red line between memory and segment keys."""
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    if n_mem:
        ax.axvline(n_mem - 0.5, color="r", lw=0.8)
    if labels:
        ax.set_xlabel("key j" + (f" (first {n_mem}: memory)" if n_mem else ""), fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
    return image


def shared_colorbar(fig: Figure, images: list, axes, label: str) -> None:
    """One colour scale for every map (0 to the largest value of any), and its bar beside them: the
    colours of two panels then compare."""
    top = max((float(np.nanmax(np.ma.filled(i.get_array(), np.nan))) for i in images), default=1.0)
    for image in images:
        image.set_clim(0.0, top)
    if images:
        fig.colorbar(images[-1], ax=list(axes), shrink=0.6, label=label)


def attention_figure(
    details: dict, n_mem: int, title: str = "", names: list[str] | None = None
) -> Figure:
    """Attention probabilities for sample 0: a layer x head grid, memory columns left of the red
    line; names: each layer's title (TransformerLM.layer_names; default `layer k`)."""
    probs = details["probs"]  # per layer [B, H, L, M + L]
    n_layers, n_heads = len(probs), min(probs[0].shape[1], MAX_HEATMAP_HEADS)
    fig = Figure(figsize=(2.3 * n_heads + 1, 2.1 * n_layers + 0.6), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    vmax = max(float(p[0, :n_heads].max()) for p in probs)
    for layer, p in enumerate(probs):
        for h in range(n_heads):
            ax = axes[layer][h]
            visible = details["terms"][layer].get("visible") if details.get("terms") else None
            image = draw_map(ax, masked(p[0, h], visible), n_mem, "viridis", labels=False)
            image.set_clim(0.0, vmax)
            ax.set_title(f"{names[layer] if names else f'layer {layer}'}, head {h}", fontsize=8)
            ax.tick_params(labelsize=6)
            if h == 0:
                ax.set_ylabel("query i")
            if layer == n_layers - 1:
                ax.set_xlabel("key j" + (f" (first {n_mem}: memory)" if n_mem else ""), fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability")
    shown = (
        f" (heads 0..{n_heads - 1} of {probs[0].shape[1]})" if probs[0].shape[1] > n_heads else ""
    )
    if title or shown:
        fig.suptitle(title + shown)
    return fig


def enabled_terms(terms: dict) -> list[str]:
    """The score terms (a-d, then the bias, decay, cope) present in one layer's `inspect` maps, in
    that order, then any other score term (a scheme of your own, titled by its name)."""
    known = [name for name in TERM_NAMES if name in terms]
    return known + [name for name in terms if name not in TERM_NAMES and name != "visible"]


def term_title(name: str) -> str:
    """How a score term's map is titled: its description, or its name for a term of your own."""
    return TERM_NAMES.get(name, name)


def terms_figure(details: dict, layer: int, head: int, n_mem: int, title: str = "") -> Figure:
    """The enabled score terms among a, b, c, d (and the bias, FoX's decay, CoPE's term) of one head
    as separate maps, as they enter the scores (scaled), with masked entries blank; the title names
    the disabled ones."""
    layer = resolve_index(layer, len(details["terms"]), "layer")
    head = resolve_index(head, details["probs"][0].shape[1], "head")
    terms = details["terms"][layer]
    visible = terms.get("visible")  # [L, M + L] bool
    names = enabled_terms(terms)
    fig = Figure(figsize=(3.3 * len(names) + 0.4, 3.4), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        ax.set_title(term_title(name), fontsize=9)
        values = masked(terms[name][0, head], visible)
        image = draw_map(ax, values, n_mem, "RdBu_r", diverging(values))
        fig.colorbar(image, ax=ax, shrink=0.8)
    off = [name for name in "abcd" if name not in terms]
    fig.suptitle(
        (title or f"score terms, layer {layer}, head {head}")
        + (f" (terms {', '.join(off)} off)" if off else "")
    )
    return fig


def mark_off(ax, text: str) -> None:
    """An empty panel saying why it is empty (a disabled term)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def resolve_index(index: int, count: int, field: str) -> int:
    """A Python-style index (-1 = last) as 0..count-1, or a one-line error naming the range."""
    if not -count <= index < count:
        raise ConfigError(field, f"{index} is out of range; this model has {field}s 0..{count - 1}")
    return index % count


def inspect_sample(model, tokens: torch.Tensor, segment_len: int, mem_len: int) -> tuple[dict, int]:
    """`model.inspect` on the last segment of `tokens` [1, T], with memory filled from the segments
    before it (so memory columns show what the model really attends to). Returns (details, M)."""
    model.eval()
    mems = None
    prefix = tokens.shape[1] - segment_len
    with torch.no_grad():
        for start in range(0, prefix, segment_len):
            _, mems = model(
                tokens[:, start : min(start + segment_len, prefix)], mems, mem_len=mem_len
            )
    details = model.inspect(tokens[:, prefix:], mems, mem_len=mem_len)
    n_mem = 0 if mems is None else mems[0].shape[1]
    return details, n_mem


def sample_length(segment_len: int, mem_len: int) -> int:
    """Tokens to draw so that memory is full when the last segment is inspected."""
    return segment_len * (1 + math.ceil(mem_len / segment_len)) if mem_len else segment_len
