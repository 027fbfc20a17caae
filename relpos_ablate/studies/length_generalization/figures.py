"""Figures that explain length generalization, from a results dir (collect's frame + eval.json):

- `plot --kind diagnostics`: the attention diagnostics of every evaluation setting (entropy, sink
  mass, mean attended distance, mass on unseen distances;
  docs/guide/evaluation.md#attention-diagnostics) as heatmaps of (layer, head) x evaluation length,
  one panel per statistic with its colour bar under it: one figure for a run; for a grid, per task,
  the appendix figure (each panel stacks every variant's layers, each the mean over its heads and
  the seeds: heads are not comparable across seeds, layers are) and a summary of the head means
  against length, one line per variant (mean over seeds);
- `plot --kind passkey`: the accuracy of passkey and the other depth tasks (niah_*,
  variable_tracking: data.DEPTH_TASKS) as a depth x length heatmap, one panel per variant (mean over
  seeds), a row of panels per task: passkey.py.
Evaluation length is the test-length bin of n for example tasks (depths averaged), else segment_len.
Variants are named in words (`variant_words`, variants.py). The study's main figure, exact match
against n: curves.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate import rundir
from relpos_ablate.analysis.collect import RUN_COLUMNS
from relpos_ablate.analysis.plots import save_figure
from relpos_ablate.analysis.settings import layer_names
from relpos_ablate.config import ConfigError
from relpos_ablate.studies.length_generalization.passkey import (  # noqa: F401 (API)
    passkey_figure,
    save_passkey,
)
from relpos_ablate.studies.length_generalization.variants import (
    POSITIONS,
    TASK,
    finished_runs_frame,
    variant_styles,
    variant_words,
    with_variants,
)

STATISTIC_LABELS = {
    "entropy": "entropy (nats)",
    "sink": "mass on the first key",
    "distance": "mean distance (tokens)",
    "unseen": "mass on unseen distances",
}


def collect_diagnostics(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, evaluation setting, layer, head) with each statistic as a column, read from
    the eval.json of every run in collect's frame; `length` is the setting's evaluation length
    label."""
    axes = df.attrs.get("variant_axes", [])
    keep = [
        c
        for c in df.columns
        if c in (*RUN_COLUMNS, "run_dir", *axes) or (isinstance(c, str) and "." in c)
    ]
    rows = []
    for _, run in df.drop_duplicates("run_dir").iterrows():
        for setting in (rundir.read_eval(run["run_dir"]) or {}).get("settings") or []:
            diagnostics = setting.get("diagnostics") if isinstance(setting, dict) else None
            if not isinstance(diagnostics, dict):
                continue
            arrays = {name: np.asarray(values, dtype=float) for name, values in diagnostics.items()}
            n_layers, n_heads = next(iter(arrays.values())).shape
            base = {
                **{c: run[c] for c in keep},
                "length": _length(setting),
                "order": _order(setting),
            }
            rows += [
                {
                    **base,
                    "layer": layer,
                    "head": head,
                    **{name: a[layer, head] for name, a in arrays.items()},
                }
                for layer in range(n_layers)
                for head in range(n_heads)
            ]
    if not rows:
        raise ConfigError(
            "kind", "no run has attention diagnostics: evaluate with eval.diagnostics: true"
        )
    return pd.DataFrame(rows)


def _length(setting: dict) -> str:
    if setting.get("length_min") is not None:
        lo, hi = setting["length_min"], setting["length_max"]
        return f"n={lo}" if lo == hi else f"n={lo}-{hi}"
    return f"L={setting.get('segment_len')}"


def _order(setting: dict) -> float:
    return float(
        setting["length_min"]
        if setting.get("length_min") is not None
        else setting.get("segment_len") or 0
    )


def _row_names(mine: pd.DataFrame, rows_of: list, by_head: bool) -> list[str]:
    """`L3` (or `L3 h1`) per row, with the layer's kind where the variant has a layer pattern (`L3
    global`)."""
    layers = layer_names(mine.iloc[0], max(u[0] if by_head else u for u in rows_of) + 1, prefix="L")
    return [f"{layers[u[0]]} h{u[1]}" if by_head else layers[u] for u in rows_of]


def diagnostics_figure(
    frame: pd.DataFrame, keys: list[str], variants: list[tuple], title: str, by_head: bool = False
) -> Figure:
    """The appendix figure of a task: one heatmap per statistic, its columns the evaluation lengths,
    its rows every layer of every variant (mean over the layer's heads and the variant's seeds: a
    head is not the same head across seeds, a layer is), grouped by variant (named at the left,
    white lines between, layers numbered at the right); `by_head`: a row per (layer, head) instead
    (one run). Each statistic has its own units, so its own colour bar, under its panel."""
    statistics = [s for s in STATISTIC_LABELS if s in frame]
    unit = ["layer", "head"] if by_head else ["layer"]
    rows_of = (
        sorted(set(zip(*(frame[u] for u in unit)))) if by_head else sorted(set(frame["layer"]))
    )
    grids = {}  # statistic -> [variant rows stacked] x (order, length)
    for statistic in statistics:
        blocks = []
        for value in variants:
            mine = frame[frame["variant"] == value]
            block = (
                mine.groupby([*unit, "order", "length"])[statistic]
                .mean()
                .unstack(["order", "length"])
            )
            blocks.append(block.reindex(rows_of))
        grids[statistic] = pd.concat(blocks)
    per = len(rows_of)
    fig = Figure(
        figsize=(2.9 * len(statistics) + 1.6, 0.16 * per * len(variants) + 2.4),
        layout="constrained",
    )
    axes = fig.subplots(1, len(statistics), squeeze=False)[0]
    for ax, statistic in zip(axes, statistics):
        grid = grids[statistic]
        image = ax.imshow(grid.to_numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
        for k in range(1, len(variants)):
            ax.axhline(k * per - 0.5, color="white", lw=1.5)
        ax.set_xticks(
            range(grid.shape[1]),
            [length for _, length in grid.columns],
            rotation=45,
            fontsize=7,
            ha="right",
        )
        centers = [(k + 0.5) * per - 0.5 for k in range(len(variants))]
        ax.set_yticks(
            centers, [variant_words(keys, v) for v in variants] if ax is axes[0] else [], fontsize=8
        )
        ax.tick_params(axis="y", length=0)
        if ax is axes[-1]:  # the layer (and head) of each row, at the right
            right = ax.secondary_yaxis("right")
            names = [
                name
                for value in variants
                for name in _row_names(frame[frame["variant"] == value], rows_of, by_head)
            ]
            right.set_yticks(range(len(names)), names, fontsize=5 if by_head else 6)
            right.tick_params(length=0)
        ax.set_title(STATISTIC_LABELS[statistic], fontsize=9)
        bar = fig.colorbar(image, ax=ax, location="bottom", fraction=0.04, pad=0.01, aspect=30)
        bar.ax.tick_params(labelsize=6)
    what = "each (layer, head)" if by_head else "each layer, mean over its heads and the seeds"
    fig.suptitle(
        f"{title}\nrows: {what}; a colour scale per statistic, under its panel", fontsize=9
    )
    return fig


def summary_figure(
    frame: pd.DataFrame, keys: list[str], variants: list[tuple], title: str
) -> Figure:
    """Each statistic's mean over layers, heads and seeds against evaluation length, one line per
    variant (styled as the main figure: a colour and marker per encoding, dashed for randomized
    positions)."""
    statistics = [s for s in STATISTIC_LABELS if s in frame]
    fig = Figure(figsize=(3.4 * len(statistics) + 2.5, 3.4), layout="constrained")
    axes = fig.subplots(1, len(statistics), squeeze=False)[0]
    lengths = frame.drop_duplicates("length").sort_values("order")["length"].tolist()
    styles = variant_styles(keys, variants)
    for value in variants:
        mine = frame[frame["variant"] == value]
        means = mine.groupby("length")[statistics].mean()
        color, dashes, marker = styles[value]
        for ax, statistic in zip(axes, statistics):
            ax.plot(
                range(len(lengths)),
                [means[statistic].get(x, math.nan) for x in lengths],
                marker=marker,
                ms=4,
                color=color,
                ls=dashes,
                label=variant_words(keys, value),
            )
    for ax, statistic in zip(axes, statistics):
        ax.set_xticks(range(len(lengths)), lengths, rotation=45, fontsize=7, ha="right")
        ax.set_title(STATISTIC_LABELS[statistic], fontsize=9)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    fig.suptitle(title)
    return fig


def save_diagnostics(
    df: pd.DataFrame, out: Path, formats: tuple[str, ...] = ("png", "pdf")
) -> list[Path]:
    """diagnostics.<fmt> for one run; for a grid, diagnostics_<task>.<fmt> and
    diagnostics_summary_<task>.<fmt>."""
    frame = collect_diagnostics(finished_runs_frame(df))
    if frame["run_dir"].nunique() == 1:
        run = frame.iloc[0]
        # the run in words; its id only when nothing else names it
        named = isinstance(run.get("encoding"), str)
        keys, value = (
            (["encoding", POSITIONS], (run["encoding"], run.get(POSITIONS)))
            if named
            else (["run_id"], (run["run_id"],))
        )
        title = (
            f"attention diagnostics: {variant_words(keys, value)}"
            + (f" on {run[TASK]}" if TASK in frame else "")
            + (f", seed {run['seed']}" if "seed" in frame else "")
        )
        figure = diagnostics_figure(
            frame.assign(variant=[value] * len(frame)), keys, [value], title, by_head=True
        )
        return save_figure(figure, Path(out) / "diagnostics", formats)
    frame, keys, variants = with_variants(frame, df)
    written = []
    tasks = frame[TASK].unique() if TASK in frame else [None]
    for task in tasks:
        part = frame if task is None else frame[frame[TASK] == task]
        mine = [v for v in variants if v in set(part["variant"])]
        name = "" if task is None else f"_{task}"
        what = "" if task is None else f" on {task}"
        written += save_figure(
            diagnostics_figure(part, keys, mine, f"attention diagnostics{what}"),
            Path(out) / f"diagnostics{name}",
            formats,
        )
        written += save_figure(
            summary_figure(
                part, keys, mine, f"attention diagnostics{what}: mean over layers, heads and seeds"
            ),
            Path(out) / f"diagnostics_summary{name}",
            formats,
        )
    return written
