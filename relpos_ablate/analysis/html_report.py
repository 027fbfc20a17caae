"""One self-contained HTML page per grid (`relpos-ablate report DIR --html OUT.html`): the runs'
status and cost, the table with its tests, the extrapolation figure, the training curves, and every
run's per-head bias curves and attention heatmaps with a choice of variant, seed, layer and head.

Drawn by the project's own figure code (tables via analysis/layouts + render's Table,
extrapolation.py, curves.py, figures.py), each figure a PNG embedded as a base64 data URI; the only
script is inline and the page names no other file or address, so it opens offline. A figure that
cannot be drawn leaves its section with the one-line reason instead. The status and table
sections are html_sections.py's; this module holds the figures, the per-run explorers and the page.

The explorers hold one pre-rendered image per (run, layer, head): their cost grows with the grid
(about 40 kB an image; experiments/tour.yaml's 9 runs: 122 images, 5 MB, docs/guide/plots.md);
MAX_IMAGES bounds it and the page says where it stopped.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate.analysis import figures
from relpos_ablate.analysis.html_sections import esc, notes_html, status_section, table_section
from relpos_ablate.analysis.model_figures import attention_lengths, inspect_run, sample_decays
from relpos_ablate.analysis.settings import label
from relpos_ablate.config import ConfigError

SECTIONS = {
    "status": "Runs: status and cost",
    "table": "Table and tests",
    "extrapolation": "Extrapolation",
    "curves": "Training curves",
    "bias": "Bias curves per head",
    "attention": "Attention heatmaps",
}
"""Section id -> heading, in page order (the tests look for every id)."""
DPI = 100
"""Resolution of the embedded PNGs: readable on a screen at half the bytes of save_figure's 150."""
MAX_IMAGES = 400
"""Images per explorer (bias, attention) at most; the rest of the runs are named on the page."""
CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
nav a { margin-right: 1em; }
section { border-top: 1px solid #ccc; margin-top: 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }
td.label, th.label { text-align: left; }
.note { color: #8a4b00; }
img { max-width: 100%; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
.controls label { margin-right: 1em; }
"""
SCRIPT = """
document.querySelectorAll('.explorer').forEach(function (box) {
  var selects = Array.prototype.slice.call(box.querySelectorAll('select'));
  var items = Array.prototype.slice.call(box.querySelectorAll('figure[data-key]'));
  var empty = box.querySelector('.empty');
  var reasons = JSON.parse(box.querySelector('.reasons').textContent);
  function show() {
    var values = selects.map(function (s) { return s.value; });
    var key = values.join('|');
    var found = false;
    items.forEach(function (item) {
      var on = item.getAttribute('data-key') === key;
      item.hidden = !on;
      found = found || on;
    });
    box.setAttribute('data-shown', found ? key : '');
    empty.hidden = found;
    empty.textContent = found ? '' : (reasons[values.slice(0, 2).join('|')] ||
      'no figure for this choice (the run has no such layer or head, or none in this layer)');
  }
  selects.forEach(function (s) { s.addEventListener('change', show); });
  show();
});
"""


def png_uri(fig: Figure) -> str:
    """The figure as a PNG data URI."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------- figures of the collected frame


def figure_section(draw: Callable[[], tuple[Figure, list[str]]], alt: str) -> tuple[str, list]:
    """One figure, or the one-line reason it cannot be drawn; its notes under it."""
    try:
        fig, notes = draw()
    except ConfigError as err:
        return notes_html([f"not drawn: {err}"]), [f"{alt}: not drawn: {err}"]
    return f'<img alt="{esc(alt)}" src="{png_uri(fig)}">' + notes_html(notes), notes


# ---------------------------------------------------------------- per-run explorers


class Explorer:
    """The pre-rendered images of one explorer, keyed by (variant, seed, layer, head) indices, and
    why a run has none."""

    def __init__(self):
        self.images: dict[tuple[int, int, int, int], tuple[str, str]] = {}
        self.reasons: dict[str, str] = {}
        self.notes: list[str] = []

    def full(self) -> bool:
        return len(self.images) >= MAX_IMAGES

    def add(self, key: tuple[int, int, int, int], fig: Figure, caption: str) -> None:
        self.images[key] = (png_uri(fig), caption)

    def html(self, choices: dict[str, list[str]]) -> str:
        """The menus, preset to the first image's choice (so the page opens on a figure, also
        without its script), the images and the reasons runs have none."""
        first = next(iter(self.images), (0, 0, 0, 0))
        selects = "".join(
            f'<label>{axis} <select aria-label="{axis}">'
            + "".join(
                f'<option value="{k}"{" selected" if k == chosen else ""}>{esc(v)}</option>'
                for k, v in enumerate(values)
            )
            + "</select></label>"
            for (axis, values), chosen in zip(choices.items(), first)
        )
        items = "".join(
            f'<figure data-key="{"|".join(map(str, key))}"{" hidden" if k else ""}>'
            f'<img alt="{esc(caption)}" src="{uri}"><figcaption>{esc(caption)}</figcaption>'
            "</figure>"
            for k, (key, (uri, caption)) in enumerate(self.images.items())
        )
        # </ cannot end the script element early: every < is escaped in the JSON text
        reasons = json.dumps(self.reasons).replace("<", "\\u003c")
        return (
            f'<div class="explorer"><div class="controls">{selects}</div>'
            f'<script type="application/json" class="reasons">{reasons}</script>'
            f'<p class="empty note" hidden></p>{items}</div>' + notes_html(self.notes)
        )


def run_explorers(
    variants: dict[str, list[pd.Series]],
    loader: Callable | None = None,
    sampler: Callable | None = None,
) -> tuple[str, str, list[str]]:
    """(bias section, attention section, notes): every finished run's bias curves per (layer, head)
    and its attention probabilities per (layer, head) on a training-length sample of its data."""
    from relpos_ablate.analysis import plots
    from relpos_ablate.analysis.trained import load_drawable

    loader, sampler = loader or plots.load_trained, sampler or plots.sample_tokens
    bias, attention = Explorer(), Explorer()
    seeds = list(
        dict.fromkeys(label(run.get("seed")) for runs in variants.values() for run in runs)
    )
    layers, heads = 0, 0
    for v, (name, runs) in enumerate(variants.items()):
        for run in runs:
            s = seeds.index(label(run.get("seed")))
            run_key = f"{v}|{s}"
            title = f"{name}, seed {label(run.get('seed'))}"
            if run.get("status") != "done":
                why = f"{title}: not drawn, the run is {run.get('status')}"
                bias.reasons[run_key] = attention.reasons[run_key] = why
                continue
            if bias.full() and attention.full():
                why = f"{title}: not drawn, the page holds {MAX_IMAGES} images per explorer"
                bias.reasons[run_key] = attention.reasons[run_key] = why
                continue
            try:
                config, model = load_drawable(Path(run["run_dir"]), "attention", loader)
            except ConfigError as err:
                bias.reasons[run_key] = attention.reasons[run_key] = f"{title}: {err.message}"
                continue
            details, n_mem = inspect_run(config, model, sampler)
            layers = max(layers, len(details["probs"]))
            heads = max(heads, details["probs"][0].shape[1])
            draw_run_bias(bias, (v, s), title, config, model, run, sampler)
            draw_run_attention(attention, (v, s), title, details, n_mem, model.layer_names())
    shown_heads = min(heads, figures.MAX_HEATMAP_HEADS)
    if heads > shown_heads:
        for explorer in (bias, attention):
            explorer.notes.append(f"heads 0..{shown_heads - 1} of {heads} shown")
    choices = {
        "variant": list(variants),
        "seed": seeds,
        "layer": [f"layer {k}" for k in range(layers)],
        "head": [f"head {h}" for h in range(shown_heads)],
    }
    return bias.html(choices), attention.html(choices), bias.notes + attention.notes


def draw_run_bias(
    explorer: Explorer, key: tuple[int, int], title: str, config, model, run, sampler
) -> None:
    """Per layer, a panel per curve source of that layer (figures.bias_sources), every head's curve
    drawn and the chosen head's in bold: one image per (layer, head)."""
    sources = figures.bias_sources(model)
    if not sources:
        try:
            figures.check_has_bias(model, title)
        except ConfigError as err:
            explorer.reasons["|".join(map(str, key))] = err.message.split("; try")[0]
        return
    train, longest = attention_lengths(config, Path(run["run_dir"]))
    decays = sample_decays(config, model, sampler)
    names = model.layer_names()
    heads = min(model.attention_layers()[0].n_heads, figures.MAX_HEATMAP_HEADS)
    every = {source: figures.bias_panels(model, source) for source in sources}
    for k, attn in enumerate(model.attention_layers()):
        # this layer's own panel, or the one panel of a module all its layers share (a shared
        # bias, xPos's parameter-free decay) where this layer has that source
        panels = [
            (source, panel)
            for source, source_panels in every.items()
            for panel in source_panels
            if figures._has(attn.config, source) and (panel[1] is attn or len(source_panels) == 1)
        ]
        if not panels or explorer.full():
            continue
        fig = Figure(figsize=(4.6 * len(panels), 3.4), layout="constrained")
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (source, (panel_title, panel_attn)) in zip(axes, panels):
            distances = figures.distance_range(panel_attn.config.causal, longest)
            figures.draw_bias_curves(
                ax, panel_attn, source, distances, train, legend=True, decays=decays
            )
            ax.set_title(panel_title, fontsize=9)
        for h in range(heads):
            _highlight_head(axes, h)
            fig.suptitle(f"{title} — {names[k]}, head {h} in bold", fontsize=10)
            explorer.add((*key, k, h), fig, f"bias curves: {title}, {names[k]}, head {h}")


def _highlight_head(axes, head: int) -> None:
    """Head `head`'s curves bold, the other heads' faint (xPos's per-pair curves stay as drawn)."""
    for ax in axes:
        for line in ax.get_lines():
            name = str(line.get_label())
            if name.startswith("head "):
                mine = name == f"head {head}" or name.startswith(f"head {head}:")
                line.set_linewidth(2.6 if mine else 0.9)
                line.set_alpha(1.0 if mine else 0.35)


def draw_run_attention(
    explorer: Explorer,
    key: tuple[int, int],
    title: str,
    details: dict,
    n_mem: int,
    names: list[str],
) -> None:
    """One heatmap per (layer, head) of the sample's attention probabilities (figures.draw_map),
    memory keys left of the red line, masked pairs blank."""
    probs = details["probs"]
    for k, layer_probs in enumerate(probs):
        visible = details["terms"][k].get("visible") if details.get("terms") else None
        for h in range(min(layer_probs.shape[1], figures.MAX_HEATMAP_HEADS)):
            if explorer.full():
                return
            fig = Figure(figsize=(4.8, 3.9), layout="constrained")
            ax = fig.subplots()
            image = figures.draw_map(
                ax, figures.masked(layer_probs[0, h], visible), n_mem, "viridis"
            )
            fig.colorbar(image, ax=ax, shrink=0.85, label="attention probability")
            ax.set_title(f"{title}\n{names[k]}, head {h}", fontsize=9)
            explorer.add((*key, k, h), fig, f"attention: {title}, {names[k]}, head {h}")


# ---------------------------------------------------------------- the page


def html_report(
    df: pd.DataFrame,
    source: str = "",
    loader: Callable | None = None,
    sampler: Callable | None = None,
    layouts: Mapping | None = None,
) -> tuple[str, list[str]]:
    """The page's HTML and the notes of its sections (figures not drawn, runs left out); loader and
    sampler as plots.save_model_figures takes them, layouts as table_section."""
    from relpos_ablate.analysis.curves import curves_figure, variant_runs
    from relpos_ablate.analysis.extrapolation import build_extrapolation
    from relpos_ablate.analysis.sources import one_copy_per_run, planned_by_their_specs

    # the runs `relpos-ablate table DIR` reads: those their spec still plans, each run once
    df, notes = planned_by_their_specs(df)
    df, merged = one_copy_per_run(df)
    notes += merged
    variants = variant_runs(df)
    sections = {"status": notes_html(notes) + status_section(variants)}
    try:
        sections["table"], table_notes = table_section(df, layouts)
    except ConfigError as err:
        sections["table"], table_notes = notes_html([f"no table: {err}"]), [f"table: {err}"]
    notes += table_notes
    for name, draw in (
        ("extrapolation", lambda: build_extrapolation(df)),
        ("curves", lambda: curves_figure(df)),
    ):
        sections[name], figure_notes = figure_section(draw, name)
        notes += figure_notes
    try:
        sections["bias"], sections["attention"], run_notes = run_explorers(
            variants, loader, sampler
        )
    except ConfigError as err:  # no run loadable (a module under imports: missing here)
        sections["bias"] = sections["attention"] = notes_html([f"not drawn: {err}"])
        run_notes = [f"bias, attention: not drawn: {err}"]
    notes += run_notes
    names = sorted({str(e) for e in df.get("experiment", pd.Series(dtype=object)).dropna()})
    heading = f"relpos-ablate: {', '.join(names) or source}"
    nav = "".join(f'<a href="#{sid}">{esc(title)}</a>' for sid, title in SECTIONS.items())
    body = "".join(
        f'<section id="{sid}"><h2>{esc(title)}</h2>{sections[sid]}</section>'
        for sid, title in SECTIONS.items()
    )
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(heading)}</title><style>{CSS}</style></head><body>"
        f"<h1>{esc(heading)}</h1><p>From {esc(source)}.</p><nav>{nav}</nav>{body}"
        f"<script>{SCRIPT}</script></body></html>\n"
    )
    return page, notes


def write_html_report(
    df: pd.DataFrame,
    out: Path,
    source: str = "",
    loader: Callable | None = None,
    sampler: Callable | None = None,
    layouts: Mapping | None = None,
) -> list[str]:
    """The page written atomically to `out`; returns its notes."""
    from relpos_ablate.io import atomic_write_text

    page, notes = html_report(df, source, loader, sampler, layouts)
    atomic_write_text(Path(out), page)
    return notes
