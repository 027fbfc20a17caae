"""The fair-baselines figure, `plot --kind lr-sweep` (fair_baselines.py's FIGURES): each preset's
mean valid ppl against the learning rate, over the best preset's valid ppl at its pick, a panel for
the baselines and one for the bias types (`preset_groups`); beside them each preset's test ppl at
its best rate over the best preset's, against the tolerance, with the untuned rate's as a cross."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import normalized
from relpos_ablate.analysis.table_options import axis_orders, read_spec
from relpos_ablate.analysis.tables import variant_colors
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
"""lr-sweep figure: the bar colour of the presets of each left panel (baselines, bias types)."""


def lr_figure(df: pd.DataFrame, orders: dict[str, list] | None = None):
    """Left: each preset's mean valid ppl against the learning rate over the best preset's valid ppl
    at its pick (one denominator for every line, so the lines show both level and shape; each pick
    starred), a panel for the presets without a bias table (the baselines) and one for the bias
    types (at most ~10 lines a panel, a colour each within the panel, the legend beside it). Right:
    each preset's test ppl at its best rate over the best preset's, mean ± std, a bar colour per
    panel, against the tolerance; each preset's test ppl at the default rate over the same
    denominator as a cross (so a cross on its bar's end: tuning did not change it)."""
    from matplotlib.figure import Figure  # figures only: `report` needs no matplotlib
    from matplotlib.patches import Patch

    df = by_budget(df)[0]  # the sweep: a longer budget's few runs have no curve over the rates
    summary = preset_summary(df, orders)
    data = at_training_length(df)
    valid = data[data["split"].map(normalized) == SELECT]
    groups = preset_groups(data, list(summary["preset"]))
    fig = Figure(figsize=(13, 3.5 + 2.6 * len(groups)), layout="constrained")
    grid = fig.add_gridspec(len(groups), 2, width_ratios=[1, 1.05])
    lrs = sorted({float(v) for v in data[KEY]})
    best_valid = summary["valid"].min()
    lefts, bar_colors = [], {}
    for k, (title, names) in enumerate(groups):
        left = fig.add_subplot(grid[k, 0], sharex=lefts[0] if lefts else None)
        lefts.append(left)
        rows = list(summary[summary["preset"].isin(names)].itertuples())
        for row, color in zip(rows, variant_colors(len(rows))):
            means = valid[valid[ROW] == row.preset].groupby(KEY)[METRIC].mean()
            left.plot(
                means.index.astype(float),
                means.values / best_valid,
                marker="o",
                markersize=4,
                color=color,
                label=row.preset,
                linestyle=":" if row.preset in UNJUDGED else "-",
            )
            left.plot(
                [row.best_lr],
                [row.valid / best_valid],
                marker="*",
                markersize=11,
                color=color,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
            )
            bar_colors[row.preset] = GROUP_COLORS[k % 2]
        left.set(
            ylabel=f"mean {SELECT} ppl / the best preset's",
            title=f"{SELECT} ppl against the learning rate "
            f"(★ each preset's pick){': ' + title if title else ''}",
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
    where = ("upper left", "lower left") if len(groups) == 2 else ("left",)
    handles = [
        Patch(color=color, alpha=0.85, label=f"{title} ({place} panel)")
        for (title, _), color, place in zip(groups, GROUP_COLORS, where)
        if title
    ]
    right.legend(
        handles=[*right.get_legend_handles_labels()[0], *handles], fontsize=8, loc="upper right"
    )
    return fig


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
