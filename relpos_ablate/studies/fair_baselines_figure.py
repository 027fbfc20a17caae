"""The fair-baselines figure, `plot --kind lr-sweep` (fair_baselines.py's FIGURES): each preset's
mean valid ppl against the learning rate, over the best preset's valid ppl at its pick, panels for
the baselines and for the bias types (`preset_groups`, a kind split where its picks lie far apart:
`panels`), every line of a panel in its own colour, marker and style (`line_styles`); beside them
each preset's test ppl at its best rate over the best preset's, against the tolerance, with the
untuned rate's as a cross."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import normalized
from relpos_ablate.analysis.table_options import axis_orders, read_spec
from relpos_ablate.studies.fair_baselines_summary import (
    DEFAULT_LR,
    KEY,
    METRIC,
    REPORT,
    ROW,
    SELECT,
    TOLERANCE,
    UNJUDGED,
    at_training_length,
    by_budget,
    preset_summary,
)

GROUP_COLORS = ("0.45", "tab:orange")
"""lr-sweep figure: the bar colour of the presets of each kind (baselines, bias types)."""
LINE_COLORS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")
"""The left panels' line colours: matplotlib's ten distinct hues less its grey (the baselines' bar
colour). In tab20's paired light and dark hues, 14 lines could not be told apart (issue 58)."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
"""Seven marker shapes against nine colours: the k-th line and the (k + 9)-th, which share a colour,
differ in marker and line style."""


def line_styles(count: int) -> list[tuple[str, str, str]]:
    """(colour, marker, line style) for each of `count` lines of a panel, no two alike: a colour
    each for the first nine, solid; beyond, the colours again, dashed, with another marker."""
    return [
        (LINE_COLORS[k % len(LINE_COLORS)], MARKERS[k % len(MARKERS)], "-" if k < 9 else "--")
        for k in range(count)
    ]


def lr_figure(df: pd.DataFrame, orders: dict[str, list] | None = None):
    """Left: each preset's mean valid ppl against the learning rate over the best preset's valid ppl
    at its pick (one denominator for every line, so the lines show both level and shape; each pick
    starred), a panel for the presets without a bias table (the baselines) and one for the bias
    types, each split in two where some of its picks lie more than FAR above the best
    (`panels`: each on its own scale), no two lines of a panel alike (`line_styles`; the legend
    beside it in the order of the stars, highest first). Right: each preset's test ppl at its best
    rate over the best preset's, mean ± std, a bar colour per kind, against the tolerance; each
    preset's test ppl at the default rate over the same denominator as a cross (so a cross on its
    bar's end: tuning did not change it)."""
    from matplotlib.figure import Figure  # figures only: `report` needs no matplotlib
    from matplotlib.patches import Patch

    df = by_budget(df)[0]  # the sweep: a longer budget's few runs have no curve over the rates
    summary = preset_summary(df, orders)
    data = at_training_length(df)
    valid = data[data["split"].map(normalized) == SELECT]
    groups = preset_groups(data, list(summary["preset"]))
    best_valid = summary["valid"].min()
    ratios = dict(zip(summary["preset"], summary["valid"] / best_valid))
    shown = panels(groups, ratios)
    fig = Figure(figsize=(13, 3.5 + 2.6 * len(shown)), layout="constrained")
    grid = fig.add_gridspec(len(shown), 2, width_ratios=[1, 1.05])
    lrs = sorted({float(v) for v in data[KEY]})
    lefts, bar_colors = [], {}
    for k, (kind, title, names) in enumerate(shown):
        left = fig.add_subplot(grid[k, 0], sharex=lefts[0] if lefts else None)
        lefts.append(left)
        # highest pick first: the legend lists the lines in the order their stars stand
        rows = sorted(names, key=lambda name: -ratios[name])
        for name, (color, marker, style) in zip(rows, line_styles(len(rows))):
            means = valid[valid[ROW] == name].groupby(KEY)[METRIC].mean()
            left.plot(
                means.index.astype(float),
                means.values / best_valid,
                marker=marker,
                markersize=4,
                color=color,
                label=name,
                linestyle=":" if name in UNJUDGED else style,
            )
            pick = summary[summary["preset"] == name].iloc[0]
            left.plot(
                [pick["best_lr"]],
                [ratios[name]],
                marker="*",
                markersize=11,
                color=color,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
            )
            bar_colors[name] = GROUP_COLORS[kind % 2]
        left.set_ylabel(f"mean {SELECT} ppl / the best preset's")
        left.set_title(
            f"{title or SELECT + ' ppl against the learning rate'} (★ each preset's pick)",
            fontsize=10,
        )
        left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    lefts[0].set_xscale("log", base=2)
    lefts[0].set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    lefts[0].minorticks_off()
    lefts[-1].set_xlabel("learning rate")
    right = fig.add_subplot(grid[:, 1])
    order = summary.sort_values("ratio").reset_index(drop=True)
    ys = np.arange(len(order))
    right.barh(
        ys,
        order["ratio"] - 1,
        left=1,
        xerr=order["std"] / order["mean"].min(),
        color=[bar_colors[p] for p in order["preset"]],
        alpha=0.85,
        error_kw={"elinewidth": 0.8},
    )
    right.scatter(
        order["default_mean"] / order["mean"].min(),
        ys,
        marker="x",
        color="black",
        zorder=3,
        label=f"at lr {DEFAULT_LR:g} (untuned), over the same best",
    )
    # the best preset's bar is 1 - 1 = 0 wide: a mark at 1 shows its row is drawn, not missing
    best = order["ratio"] == order["ratio"].min()
    right.scatter(
        np.ones(int(best.sum())),
        ys[best.to_numpy()],
        marker="D",
        s=30,
        color=[bar_colors[p] for p in order.loc[best, "preset"]],
        edgecolors="black",
        linewidths=0.5,
        zorder=3,
        label="the best (its bar has no length)",
    )
    right.axvline(
        1 + TOLERANCE, color="grey", linestyle="--", linewidth=1, label=f"best + {TOLERANCE:.0%}"
    )
    right.set_yticks(
        ys, [f"{p}  (lr {lr:g})" for p, lr in zip(order["preset"], order["best_lr"])], fontsize=8
    )
    right.invert_yaxis()
    right.set(
        xlabel=f"{REPORT} ppl / the best preset's", title=f"{REPORT} ppl at each preset's best rate"
    )
    handles = [
        Patch(color=color, alpha=0.85, label=f"{title} ({_where(shown, kind)})")
        for kind, ((title, _), color) in enumerate(zip(groups, GROUP_COLORS))
        if title
    ]
    right.legend(
        handles=[*right.get_legend_handles_labels()[0], *handles], fontsize=8, loc="upper right"
    )
    return fig


FAR = 0.2
"""A kind's presets whose pick lies more than this above the best preset's valid ppl get a panel of
their own: on one scale with them (up to 1.9x), the presets near the best (within ~1.1x) were a
tangle."""
PLACES = {2: ("upper", "lower"), 3: ("top", "middle", "bottom")}


def panels(
    groups: list[tuple[str, list[str]]], ratios: dict[str, float]
) -> list[tuple[int, str, list[str]]]:
    """(kind index, title, presets) of each left panel: each kind of `preset_groups`, split into
    the presets whose pick lies within FAR of the best (`ratios`: pick's valid ppl / the best's)
    and those beyond, where it has both."""
    out = []
    for kind, (title, names) in enumerate(groups):
        near = [n for n in names if ratios[n] <= 1 + FAR]
        far = [n for n in names if n not in near]
        if near and far:
            prefix = f"{title}, " if title else ""
            out += [
                (kind, f"{prefix}pick within {FAR:.0%} of the best", near),
                (kind, f"{prefix}pick more than {FAR:.0%} above the best", far),
            ]
        else:
            out.append((kind, title, names))
    return out


def _where(shown: list[tuple[int, str, list[str]]], kind: int) -> str:
    """Where a kind's panels stand on the left: 'upper left panel', 'top and middle left
    panels'."""
    if len(shown) == 1:
        return "left panel"
    places = PLACES.get(len(shown)) or tuple(f"#{k + 1}" for k in range(len(shown)))
    own = [places[k] for k, (of, _, _) in enumerate(shown) if of == kind]
    return f"{' and '.join(own)} left panel{'s' if len(own) > 1 else ''}"


def preset_groups(data: pd.DataFrame, names: list[str]) -> list[tuple[str, list[str]]]:
    """The presets without a bias table (the baselines) and those with one (the bias types), in
    `names`' order, when the runs record model.attention.bias and both groups are there; else one
    group of all."""
    if "model.attention.bias" not in data:
        return [("", names)]
    bias = data.groupby(ROW)["model.attention.bias"].first().map(normalized)
    baselines = [n for n in names if bias.get(n) in (None, "none")]
    tables = [n for n in names if n not in baselines]
    return (
        [("baselines", baselines), ("bias types", tables)]
        if baselines and tables
        else [("", names)]
    )


def save_lr_figure(
    df: pd.DataFrame,
    out: Path,
    formats: tuple[str, ...] = ("png", "pdf"),
    orders: dict[str, list] | None = None,
) -> tuple[list[Path], list[str]]:
    """lr_sweep.<fmt> in `out`; returns (written files, notes)."""
    from relpos_ablate.analysis.plots import save_figure  # plots pulls in the trained-model figures

    return save_figure(lr_figure(df, orders), Path(out) / "lr_sweep", formats), []


def plot_lr_sweep(
    frame: pd.DataFrame, out: Path, formats: tuple[str, ...], args
) -> tuple[list[Path], list[str]]:
    return save_lr_figure(frame, out, formats, axis_orders(read_spec(frame)))
