"""`plot --kind passkey`: the accuracy of passkey and the other depth tasks (niah_*,
variable_tracking: data.DEPTH_TASKS) as a depth x test-length heatmap, one panel per variant (mean
over seeds), a row of panels per task, each cell's value written in it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate.analysis.plots import save_figure
from relpos_ablate.analysis.table_options import default_metric, finished
from relpos_ablate.config import ConfigError
from relpos_ablate.config.data import DEPTH_TASKS
from relpos_ablate.studies.length_generalization.variants import (
    TASK,
    variant_words,
    with_variants,
)


def passkey_figure(df: pd.DataFrame, metric: str | None = None) -> Figure:
    """Accuracy of the depth tasks (data.DEPTH_TASKS: passkey, niah_*, variable_tracking), depth x
    test length, one panel per variant (mean over seeds); a row of panels per task when there are
    several."""
    data = (
        df[df[TASK].isin(list(DEPTH_TASKS)) & df["depth"].notna()]
        if TASK in df and "depth" in df
        else df.iloc[:0]
    )
    if data.empty:
        raise ConfigError(
            "kind",
            f"no passkey runs with depths (nor of the other depth tasks: "
            f"{', '.join(t for t in DEPTH_TASKS if t != 'passkey')}): train one and evaluate",
        )
    metric = metric or default_metric(data)
    data, keys, variants = with_variants(finished(data, metric), df)
    tasks = [t for t in DEPTH_TASKS if t in set(data[TASK])]
    ncols = min(4, len(variants))
    per_task = math.ceil(len(variants) / ncols)  # rows of panels
    fig = Figure(figsize=(3.6 * ncols + 1, 3.0 * per_task * len(tasks)), layout="constrained")
    grid_axes = fig.subplots(per_task * len(tasks), ncols, squeeze=False)
    drawn = []
    for k, task in enumerate(tasks):
        axes = grid_axes[k * per_task : (k + 1) * per_task].ravel()
        for ax, value in zip(axes, variants):
            mine = data[(data["variant"] == value) & (data[TASK] == task)]
            if mine.empty:
                continue
            image = _depth_map(ax, mine, metric)
            words = variant_words(keys, value)
            ax.set_title(words if len(tasks) == 1 else f"{task}: {words}", fontsize=8)
            ax.set_ylabel(f"depth of {DEPTH_TASKS[task]}", fontsize=8)
            drawn.append(ax)
    for ax in grid_axes.ravel():
        ax.set_visible(ax in drawn)
    fig.colorbar(image, ax=drawn, shrink=0.6, label=metric)
    fig.suptitle(
        f"{'passkey' if tasks == ['passkey'] else 'needle'} retrieval: {metric}, mean over seeds"
    )
    return fig


def _depth_map(ax, runs: pd.DataFrame, metric: str):
    """One variant's depth x test-length map of `metric` (mean over its seeds), each cell written in
    it."""
    grid = runs.pivot_table(
        index="depth", columns=["length_min", "length_max"], values=metric, aggfunc="mean"
    )
    image = ax.imshow(
        grid.to_numpy(), aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0
    )
    ax.set_xticks(
        range(grid.shape[1]), [f"{lo}-{hi}" for lo, hi in grid.columns], rotation=45, fontsize=7
    )
    ax.set_yticks(range(grid.shape[0]), [f"{d:g}" for d in grid.index], fontsize=7)
    for (i, j), v in np.ndenumerate(grid.to_numpy()):
        ax.text(
            j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.5 else "k"
        )
    ax.set_xlabel("filler length n", fontsize=8)
    return image


def save_passkey(
    df: pd.DataFrame,
    out: Path,
    metric: str | None = None,
    formats: tuple[str, ...] = ("png", "pdf"),
) -> list[Path]:
    return save_figure(passkey_figure(df, metric), Path(out) / "passkey", formats)
