"""Figures of trained runs as `plot --kind bias | attention | terms` draws them: one run's figure
(`run_figure`, on a training-length sample of the run's own data, memory filled first) and the
overview of several (`overview_figure`): bias curves per variant with the seeds overlaid (a line
style each) and one y scale per scheme family, the head-mean attention of a layer per run, or the
enabled score terms of a head per run. The drawing itself is figures.py's."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from relpos_ablate import rundir
from relpos_ablate.analysis import figures
from relpos_ablate.analysis.run_labels import run_title, variant_label
from relpos_ablate.analysis.settings import label

LINE_STYLES = ("-", "--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 4)))
"""The line style of each seed in a bias overview panel, in the order the seeds are drawn."""


def attention_lengths(config, run_dir: Path | None = None) -> tuple[int, int]:
    """(training attention length, longest evaluated attention length): the bias plot's x range.
    With the run dir, the settings its eval.json holds count too (`evaluate` adds settings
    config.yaml does not list)."""
    mem = config.model.mem_len
    train = config.train.segment_len + mem
    recorded = (rundir.read_eval(run_dir) or {}).get("settings", []) if run_dir is not None else []
    longest = max(
        [s.attn_len(mem) for s in config.eval_settings()]
        + [
            r["attn_len"]
            for r in recorded
            if isinstance(r, dict) and isinstance(r.get("attn_len"), int)
        ]
    )
    return train, max(train, longest)


def inspect_run(config, model, sampler: Callable) -> tuple[dict, int]:
    """model.inspect on a training-length segment of the run's data, memory filled first."""
    seg, mem = config.train.segment_len, config.model.mem_len
    tokens = sampler(config, figures.sample_length(seg, mem))
    return figures.inspect_sample(model, tokens, seg, mem)


def sample_decays(config, model, sampler: Callable) -> dict | None:
    """FoX's decay curves on a training-length sample of the run's data (None without a forget
    gate)."""
    if "decay" not in figures.bias_sources(model):
        return None
    return figures.decay_curves(model, *inspect_run(config, model, sampler))


def run_figure(
    kind: str,
    config,
    model,
    title: str,
    layer: int,
    head: int,
    sampler: Callable,
    run_dir: Path | None = None,
) -> Figure:
    if kind == "bias":
        train, longest = attention_lengths(config, run_dir)
        return figures.bias_figure(
            model, longest, train, title, sample_decays(config, model, sampler)
        )
    details, n_mem = inspect_run(config, model, sampler)
    if kind == "attention":
        return figures.attention_figure(details, n_mem, title, model.layer_names())
    layer = figures.resolve_index(layer, len(details["terms"]), "layer")
    return figures.terms_figure(
        details, layer, head, n_mem, f"{title} — {model.layer_names()[layer]}, head {head}"
    )


def overview_figure(
    kind: str,
    drawn: list[tuple[pd.Series, object, object]],
    keys: list[str],
    layer: int,
    head: int,
    sampler,
    left_out: list[tuple[str, str, str]] = (),
    titles: dict | None = None,
) -> Figure:
    """All drawn runs together: bias curves per variant (seeds overlaid, one y scale per scheme
    family), head-mean last-layer attention per run, or the enabled terms per run. The runs left out
    are counted in the title and their variants named under it by reason (the notes
    save_model_figures returns give the seeds)."""
    titles = titles or {}
    named = [
        (titles.get(run["run_dir"]) or run_title(run, keys), config, model)
        for run, config, model in drawn
    ]
    if kind == "bias":
        fig = _bias_overview(drawn, keys, sampler)
        where = "layer 0 or the shared module; seeds overlaid, one y scale per scheme"
    elif kind == "terms":
        fig = _terms_overview(named, layer, head, sampler)
        where = f"{_layer_name(layer)}, head {head}"
    else:
        fig = _attention_overview(named, layer, sampler)
        where = f"{_layer_name(layer)}, mean over heads"
    title = f"{kind}: {len(drawn)} runs ({where})"
    if left_out:
        by_reason: dict[str, list[str]] = {}
        for variant, _, reason in left_out:
            variants = by_reason.setdefault(reason.split(":")[0], [])
            variants += [] if variant in variants else [variant]
        title += f"; {len(left_out)} not drawn\n" + "; ".join(
            f"{reason}: {' | '.join(variants)}" for reason, variants in sorted(by_reason.items())
        )
    fig.suptitle(title, fontsize=9)
    return fig


def left_out_note(left_out: list[tuple[str, str, str]]) -> str:
    """'left out: encoding=nope (seeds 0, 1), ...: no bias curve ...' from (variant, seed, reason)
    triples, the runs grouped by reason."""
    by_reason: dict[str, dict[str, list[str]]] = {}
    for variant, seed, reason in left_out:
        by_reason.setdefault(reason, {}).setdefault(variant, []).append(seed)
    parts = []
    for reason, variants in by_reason.items():
        runs = "; ".join(
            f"{variant} (seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)})"
            for variant, seeds in variants.items()
        )
        parts.append(f"{runs}: {reason}")
    return "left out: " + ". ".join(parts) + "."


def _panels(count: int, width: float, height: float):
    """A figure of `count` panels, at most 4 a row, at least 8 inches wide (room for its title)."""
    ncols = min(4, count)
    fig = Figure(
        figsize=(max(8.0, width * ncols), height * math.ceil(count / ncols)), layout="constrained"
    )
    axes = fig.subplots(math.ceil(count / ncols), ncols, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes


def _bias_overview(
    drawn: list[tuple[pd.Series, object, object]], keys: list[str], sampler
) -> Figure:
    """One panel per variant with every seed's curves (a line style per seed); panels of one scheme
    family (the same bias type, or term d) share their y scale."""
    variants: dict[str, list] = {}
    for run, config, model in drawn:
        variants.setdefault(variant_label(run, keys), []).append((run, config, model))
    fig, axes = _panels(len(variants), 4.2, 3.4)
    families: dict[str, list] = {}
    for ax, (name, runs) in zip(axes, variants.items()):
        for k, (run, config, model) in enumerate(runs):
            source = figures.bias_sources(model)[0]
            panel, attn = figures.bias_panels(model, source)[0]
            train, longest = attention_lengths(config, Path(run["run_dir"]))
            figures.draw_bias_curves(
                ax,
                attn,
                source,
                figures.distance_range(attn.config.causal, longest),
                train,
                legend=False,
                linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                first=k == 0,
                decays=sample_decays(config, model, sampler),
            )
        families.setdefault(f"{source}:{attn.config.bias if source == 'bias' else ''}", []).append(
            ax
        )
        seeds = ", ".join(label(run.get("seed")) for run, _, _ in runs)
        ax.set_title(f"{name}\n{panel}; seed{'s' if len(runs) > 1 else ''} {seeds}", fontsize=8)
        if len(runs) > 1:
            ax.legend(
                handles=[
                    Line2D(
                        [],
                        [],
                        color="0.3",
                        ls=LINE_STYLES[k % len(LINE_STYLES)],
                        label=f"seed {label(run.get('seed'))}",
                    )
                    for k, (run, _, _) in enumerate(runs)
                ],
                fontsize=7,
            )
    for members in families.values():
        low = min(ax.get_ylim()[0] for ax in members)
        high = max(ax.get_ylim()[1] for ax in members)
        for ax in members:
            ax.set_ylim(low, high)
    entries: dict[
        str, object
    ] = {}  # every panel's heads and marks (a bucket edge in one panel only), once each
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if not name.startswith("seed "):
                entries.setdefault(name, handle)
    fig.legend(
        list(entries.values()),
        list(entries),
        loc="outside lower center",
        ncol=min(8, len(entries)),
        fontsize=7,
    )
    return fig


def _attention_overview(items: list[tuple[str, object, object]], layer: int, sampler) -> Figure:
    fig, axes = _panels(len(items), 4.0, 3.2)
    images = []
    for ax, (title, config, model) in zip(axes, items):
        ax.set_title(title, fontsize=8)
        details, n_mem = inspect_run(config, model, sampler)
        k = figures.resolve_index(layer, len(details["probs"]), "layer")
        probs = details["probs"][k][0].mean(0)  # (L, M + L), mean over heads
        images.append(
            figures.draw_map(
                ax, figures.masked(probs, details["terms"][k].get("visible")), n_mem, "viridis"
            )
        )
    figures.shared_colorbar(fig, images, axes, "attention probability (mean over heads)")
    return fig


def _terms_overview(items, layer: int, head: int, sampler) -> Figure:
    """One row per run: the terms enabled in any run (a disabled one marked off), and the bias when
    any has one."""
    inspected = [(title, *inspect_run(config, model, sampler)) for title, config, model in items]
    maps = [
        details["terms"][figures.resolve_index(layer, len(details["terms"]), "layer")]
        for _, details, _ in inspected
    ]
    present = dict.fromkeys(name for terms in maps for name in figures.enabled_terms(terms))
    names = [n for n in figures.TERM_NAMES if n in present] + [
        n for n in present if n not in figures.TERM_NAMES
    ]
    fig = Figure(figsize=(2.8 * len(names), 2.6 * len(items)), layout="constrained")
    axes = fig.subplots(len(items), len(names), squeeze=False)
    for r, ((title, _details, n_mem), terms) in enumerate(zip(inspected, maps)):
        for c, name in enumerate(names):
            ax = axes[r][c]
            ax.set_title(
                f"{title}\n{figures.term_title(name)}" if c == 0 else figures.term_title(name),
                fontsize=7,
            )
            if name in terms:
                values = figures.masked(terms[name][0, head], terms.get("visible"))
                figures.draw_map(
                    ax, values, n_mem, "RdBu_r", figures.diverging(values), labels=c == 0
                )
            else:
                figures.mark_off(ax, "off")
    return fig


def _layer_name(layer: int) -> str:
    return "the last layer" if layer == -1 else f"layer {layer}"
