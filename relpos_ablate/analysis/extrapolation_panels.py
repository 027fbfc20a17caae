"""One row of panels of the extrapolation figure (extrapolation.py lays them out): the row's y
range, the lines that coincide, each panel's lines and axes, and the row's legend.

- `row_limits`: the y range from the seed means of the row's lines (never the ± std bands), with the
  ratio's 1, or a reference level (unigram, chance) within one span of them; a log axis where the
  means span more than a factor 2 (ratio) or 10 (perplexity).
- Two lines coincide when they share their lengths and their means differ by at most OVERLAP of the
  row's y span (on the log scale for a log axis) at every length: drawn once, named together in the
  legend where they coincide in every panel (`overlaps_everywhere`), else in the panel's corner.
- A line style per encoding family (FAMILY_STYLES), the training length dotted, the reference level
  dashed, plain tick labels on a log y axis (TICKS).
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from relpos_ablate.analysis.extrapolation_lines import Layout, Line
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import metric_direction

FAMILY_STYLES = {
    "absolute": ":",
    "rotary": "--",
    "bias": "-",
    "data-dependent": "-.",
    "other": (0, (5, 1.5, 1, 1.5, 1, 1.5)),
}
OVERLAP = 0.005
"""Lines whose means differ by less than this share of the panel's y span at every length hide each
other: drawn once, the legend (or the panel) names them."""
X_LABELS = {
    "segment_len": "evaluation length (tokens per segment)",
    "attn_len": "attention length (keys per query)",
}
TICKS = (
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    0.95,
    1.0,
    1.05,
    1.1,
    1.2,
    1.3,
    1.5,
    1.75,
    2,
    2.5,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    40,
    50,
    70,
    100,
    200,
    500,
    1000,
)
"""Tick values of a log y axis (plain numbers: a reader reads 1.5, not 10^0.18)."""


def row_limits(layout: Layout, lines: list[Line]) -> tuple[float, float, bool]:
    """(low, high, log) of a row's y axis from the seed means of its lines (never the bands); the
    ratio's 1 and a reference level (unigram, chance) within one span of the lines are included."""
    means = np.concatenate([ln.mean for ln in lines]) if lines else np.array([1.0])
    means = means[np.isfinite(means)]
    low, high = float(means.min()), float(means.max())
    extra = (
        [1.0]
        if layout.y == "ratio"
        else [
            v
            for v in _reference_levels(layout)
            if min(abs(v - low), abs(v - high)) <= max(high - low, 1e-9)
        ]
    )
    low, high = min([low, *extra]), max([high, *extra])
    log = low > 0 and (
        high / low > 2 if layout.y == "ratio" else layout.metric == "ppl" and high / low > 10
    )
    if log:
        pad = (high / low) ** 0.06 if high > low else 1.02
        return low / pad, high * pad, True
    pad = 0.06 * (high - low) if high > low else 0.05 * max(abs(high), 1.0)
    return low - pad, high + pad, False


def _reference_levels(layout: Layout) -> list[float]:
    """The runs' shared reference level (unigram, chance) in the metric's units: none for a
    ratio."""
    if layout.y == "ratio":
        return []
    column = f"reference_{layout.metric}"
    values = layout.data[column].dropna().unique() if column in layout.data else []
    return [float(values[0])] if len(values) == 1 else []


def _close(a: Line, b: Line, limits: tuple[float, float, bool]) -> bool:
    """Whether two lines hide each other: the same lengths, means within OVERLAP of the y span
    everywhere."""
    if a.xs != b.xs:
        return False
    low, high, log = limits
    scale = np.log if log else (lambda v: v)
    tolerance = OVERLAP * (scale(high) - scale(low))
    with np.errstate(divide="ignore", invalid="ignore"):
        return bool(np.all(np.abs(scale(a.mean) - scale(b.mean)) <= tolerance))


def _overlap_groups(lines: list[Line], limits) -> list[list[Line]]:
    groups: list[list[Line]] = []
    for line in lines:
        for group in groups:
            if _close(group[0], line, limits):
                group.append(line)
                break
        else:
            groups.append([line])
    return groups


def overlaps_everywhere(lines: list[Line], limits) -> list[tuple]:
    """Groups of identities that coincide in every panel where they are drawn: one legend entry
    each."""
    panels = {ln.panel for ln in lines}
    together = None
    for panel in panels:
        groups = {
            frozenset(ln.identity for ln in g)
            for g in _overlap_groups([ln for ln in lines if ln.panel == panel], limits)
        }
        pairs = {(a, b) for g in groups for a in g for b in g if a != b}
        together = pairs if together is None else together & pairs
    identities = list(dict.fromkeys(ln.identity for ln in lines))
    merged, seen = [], set()
    for identity in identities:
        if identity in seen:
            continue
        group = [identity] + [
            o for o in identities if (identity, o) in (together or set()) and o not in seen
        ]
        seen.update(group)
        if len(group) > 1:
            merged.append(tuple(group))
    return merged


def draw_panel(
    ax, layout: Layout, lines: list[Line], colors: dict, limits, merged: list[tuple]
) -> None:
    """The panel's lines (seed mean, ± std band), each coinciding group drawn once (named in the
    legend when it coincides in every panel, else in a note in the panel's corner); axes as
    _format_axes."""
    low, high, log = limits
    hidden = {identity for group in merged for identity in group[1:]}
    local = [
        g
        for g in _overlap_groups(lines, limits)
        if len(g) > 1 and not any({ln.identity for ln in g} <= set(m) for m in merged)
    ]
    hidden |= {ln.identity for g in local for ln in g[1:]}
    for line in lines:
        if line.identity in hidden:
            continue
        color, style = colors[line.identity], FAMILY_STYLES[line.family]
        mean, std = line.mean, line.std
        ax.plot(
            line.xs,
            mean,
            color=color,
            ls=style,
            lw=1.6,
            marker="o",
            ms=3.5,
            label=_name(layout, line.identity),
        )
        if any(s.size > 1 for s in line.samples):
            ax.fill_between(
                line.xs,
                np.maximum(mean - std, low if log else -np.inf),
                mean + std,
                color=color,
                alpha=0.15,
                lw=0,
            )
    if local:
        text = "; ".join(" = ".join(_name(layout, ln.identity) for ln in g) for g in local)
        ax.text(
            0.99,
            0.02,
            f"overlap: {text}",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=6,
            color="0.3",
        )
    _format_axes(ax, layout, limits)


def _format_axes(ax, layout: Layout, limits) -> None:
    """Log-2 x for length sweeps with the training length dotted; y from `limits` (plain tick labels
    on a log axis); the ratio's 1 or the reference level dashed."""
    low, high, log = limits
    xs = sorted({v for ln in layout.lines for v in ln.xs})
    if xs and xs[0] > 0 and xs[-1] / xs[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [label(v) for v in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    if log:
        ax.set_yscale("log")
        ticks: list[float] = []
        # at most ~8, evenly spread on the log scale
        step = math.log(high / low) / 8
        inside = [t for t in TICKS if low <= t <= high]
        for tick in inside:
            if not ticks or math.log(tick / ticks[-1]) >= step:
                ticks.append(tick)
        # the highest tick the range holds is always labelled: the top lines are read off it
        if inside and ticks[-1] != inside[-1]:
            close = len(ticks) > 1 and math.log(inside[-1] / ticks[-1]) < step / 2
            ticks[-1:] = [inside[-1]] if close else [ticks[-1], inside[-1]]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)
    trains = layout.data["_train"].unique()
    if len(trains) == 1:
        ax.axvline(float(trains[0]), color="k", ls=":", lw=1)
    if layout.y == "ratio":
        ax.axhline(1.0, color="0.5", ls="--", lw=0.8)
    for level in _reference_levels(layout):
        if low <= level <= high:
            ax.axhline(level, color="0.4", ls="--", lw=1)
    better = "higher" if metric_direction(layout.metric) == "max" else "lower"
    what = (
        f"{layout.metric} / {layout.metric} at training length"
        if layout.y == "ratio"
        else layout.metric
    )
    ax.set_ylabel(f"{what} ({better} is better)", fontsize=8)
    ax.set_xlabel(X_LABELS.get(layout.x, layout.x), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _name(layout: Layout, identity: tuple) -> str:
    return layout.names[identity]


def legend_handles(
    layout: Layout,
    group: list[tuple],
    lines: list[Line],
    colors: dict,
    merged: list[tuple],
    limits: tuple[float, float, bool],
):
    """A legend entry per identity of the row (coinciding ones as one, 'A / B (overlap)'), then the
    marks the row's panels draw (the training length when the runs share one, the reference level
    within the y range)."""
    families = {ln.identity: ln.family for ln in lines}
    hidden = {identity for g in merged for identity in g[1:]}
    handles = []
    for identity in group:
        if identity in hidden:
            continue
        members = next((g for g in merged if g[0] == identity), (identity,))
        name = _overlap_name(layout, members) if len(members) > 1 else _name(layout, identity)
        handles.append(
            Line2D(
                [],
                [],
                color=colors[identity],
                ls=FAMILY_STYLES[families[identity]],
                marker="o",
                ms=3.5,
                label=name,
            )
        )
    if layout.data["_train"].nunique() == 1:
        handles.append(Line2D([], [], color="k", ls=":", lw=1, label="training length"))
    for level in (v for v in _reference_levels(layout) if limits[0] <= v <= limits[1]):
        name = (
            label(layout.data["reference"].dropna().iloc[0])
            if "reference" in layout.data
            else "reference"
        )
        handles.append(Line2D([], [], color="0.4", ls="--", lw=1, label=f"{name} ({level:.3g})"))
    return handles


def _overlap_name(layout: Layout, members: tuple) -> str:
    """`encoding=xl, terms=abcd / ab / ad (overlap)`: the first line's label, then what differs in
    the others."""
    first = _name(layout, members[0]).split(", ")
    rest = []
    for identity in members[1:]:
        parts = _name(layout, identity).split(", ")
        rest.append(
            ", ".join(p.split("=", 1)[-1] for p, q in zip(parts, first) if p != q)
            or ", ".join(parts)
        )
    return " / ".join([", ".join(first), *rest]) + " (overlap)"
