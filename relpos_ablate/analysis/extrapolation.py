"""`plot --kind extrapolation`: the metric against evaluation length, from `collect` alone.

A figure for a paper as it is: one panel per protocol (or another field), a colour per line and a
line style per family of encodings (absolute, rotary, bias, data-dependent, other), at most
MAX_LINES lines a panel (more: the families go to rows of panels, each row with its own legend and y
range), optionally as the ratio to each run's metric at its training length (`y="ratio"`), which
puts every line at 1 where training stopped and shows how each encoding degrades or improves
whatever its level there. The y range is set by the seed means, never by a seed band (a wild seed
would squeeze the lines that matter); lines that coincide are drawn once and said so. This module
lays the figure out; extrapolation_lines.py computes the lines, extrapolation_panels.py draws a row.
"""

from __future__ import annotations

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from relpos_ablate.analysis.collect import run_names
from relpos_ablate.analysis.extrapolation_lines import (
    FAMILIES,
    ZOOM,
    extrapolation_lines,
    group_rows,
    panel_setting,
    set_identities,
    zoomed,
)
from relpos_ablate.analysis.extrapolation_panels import (
    X_LABELS,
    draw_panel,
    legend_handles,
    overlaps_everywhere,
    row_limits,
)
from relpos_ablate.analysis.settings import label, short_name


def extrapolation_figure(
    df: pd.DataFrame,
    metric: str | None = None,
    x: str = "segment_len",
    y: str = "value",
    panels: str | None = None,
    split_families: bool = False,
    where: tuple[str, ...] | None = None,
) -> Figure:
    """The figure (see the module docstring); build_extrapolation also returns the notes."""
    return build_extrapolation(df, metric, x, y, panels, split_families, where)[0]


def build_extrapolation(
    df: pd.DataFrame,
    metric: str | None = None,
    x: str = "segment_len",
    y: str = "value",
    panels: str | None = None,
    split_families: bool = False,
    where: tuple[str, ...] | None = None,
) -> tuple[Figure, list[str]]:
    """(figure, notes): a column of panels per panel value, a row per family group (family_rows),
    and with y='ratio' a last row zooming on the lines that stay within ZOOM of their
    training-length value."""
    layout = extrapolation_lines(df, metric, x, y, panels, where)
    set_identities(layout)
    groups = group_rows(layout.lines, split_families)
    colors = {
        identity: color for group in groups for identity, color in zip(group, _colors(len(group)))
    }
    zoom = zoomed(layout)
    if zoom:
        groups.append(zoom)
        colors.update(_distinct([colors[identity] for identity in zoom], zoom))
    panel_values = list(dict.fromkeys(ln.panel for ln in layout.lines))
    fig = Figure(
        figsize=(max(6.4, 3.9 * len(panel_values) + 2.9), 3.3 * len(groups) + 0.5),
        layout="constrained",
    )
    axes = fig.subplots(len(groups), len(panel_values), squeeze=False)
    heading = ", ".join(short_name(name) for name in layout.rows)
    for r, group in enumerate(groups):
        mine = [ln for ln in layout.lines if ln.identity in group]
        limits = row_limits(layout, mine)
        merged = overlaps_everywhere(mine, limits)
        for c, panel in enumerate(panel_values):
            ax = axes[r][c]
            draw_panel(ax, layout, [ln for ln in mine if ln.panel == panel], colors, limits, merged)
            if c:  # one y label a row, one x label a column
                ax.set_ylabel("")
            if r < len(groups) - 1:
                ax.set_xlabel("")
            what = (
                f"within ×{ZOOM:g} of the training length (zoom)"
                if zoom and r == len(groups) - 1
                else ", ".join(f for f in FAMILIES if any(ln.family == f for ln in mine))
                if len(groups) > 1
                else ""
            )
            title = ", ".join(
                filter(None, [label(v) for v in panel] + [panel_setting(layout, panel)])
            )
            ax.set_title(" — ".join(filter(None, [title, what])), fontsize=9)
        handles = legend_handles(layout, group, mine, colors, merged, limits)
        if len(groups) == 1:
            fig.legend(
                handles=handles,
                loc="outside right center",
                fontsize=7,
                title=heading,
                title_fontsize=7,
            )
        else:  # a legend per row, beside its last panel
            axes[r][-1].legend(
                handles=handles,
                fontsize=7,
                title=heading,
                title_fontsize=7,
                loc="upper left",
                bbox_to_anchor=(1.02, 1.0),
                borderaxespad=0.0,
            )
    what = (
        f"{layout.metric} / {layout.metric} at the training length"
        if layout.y == "ratio"
        else layout.metric
    )
    fig.suptitle(
        f"{run_names(layout.data)}: {what} vs {X_LABELS.get(x, x).split(' (')[0]}", fontsize=10
    )
    return fig, layout.notes


def _distinct(colors: list, identities: list[tuple]) -> dict:
    """The given colours (each line's colour in its family row), a free tab10 colour where two would
    repeat."""
    free = [c for c in _colors(10) if c not in colors]
    chosen: dict[tuple, object] = {}
    for identity, color in zip(identities, colors):
        chosen[identity] = free.pop(0) if color in chosen.values() and free else color
    return chosen


def _colors(count: int) -> list:
    return [colormaps["tab10"](k % 10) for k in range(count)]
