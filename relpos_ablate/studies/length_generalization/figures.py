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
  seeds), a row of panels per task.
Evaluation length is the test-length bin of n for example tasks (depths averaged), else segment_len.
Variants are named in words (`variant_words`). The study's main figure, exact match against n:
length_curves.py.
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
from relpos_ablate.analysis.settings import label, layer_names
from relpos_ablate.analysis.table_options import (
    axis_orders,
    default_metric,
    default_rows,
    finished,
    read_spec,
)
from relpos_ablate.analysis.tables import row_key, sort_key, variant_colors
from relpos_ablate.config import ConfigError
from relpos_ablate.config.data import DEPTH_TASKS
from relpos_ablate.studies.length_generalization.table import variant_name

TASK = "data.task"
POSITIONS = "model.attention.positions"
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


def with_variants(
    frame: pd.DataFrame, df: pd.DataFrame
) -> tuple[pd.DataFrame, list[str], list[tuple]]:
    """`frame` with a `variant` column (the values of the fields that tell runs apart, the task
    excluded), those fields, and the variants in the spec's order."""
    runs = finished_runs_frame(df).drop_duplicates("run_dir")
    # one variant: named by its encoding
    keys = (
        [k for k in default_rows(runs) if k not in (TASK, "experiment")]
        or [k for k in ("encoding", POSITIONS) if k in runs]
        or ["experiment"]
    )
    # fields an encoding fixes (T5's buckets, zipped with it) name no variant of their own
    if "encoding" in keys:
        keys = [
            k
            for k in keys
            if k in ("encoding", POSITIONS)
            or k not in runs
            or runs.groupby("encoding")[k].nunique(dropna=False).max() > 1
        ]
        keys = [k for k in ("encoding", POSITIONS) if k in keys] + [
            k for k in keys if k not in ("encoding", POSITIONS)
        ]
    frame = frame.assign(
        variant=[row_key(r, keys) for _, r in frame[[k for k in keys if k in frame]].iterrows()]
    )
    orders = axis_orders(read_spec(df))
    return frame, keys, sorted(set(frame["variant"]), key=lambda v: sort_key(v, keys, orders))


def finished_runs_frame(df: pd.DataFrame) -> pd.DataFrame:
    runs = df[df["status"] == "done"] if "status" in df else df
    if runs.empty:
        raise ConfigError("kind", "no finished runs to draw")
    return runs


def _variant_label(keys: list[str], value: tuple) -> str:
    return (
        ", ".join(label(v) for v in value)
        if len(keys) == 1
        else ", ".join(f"{k.rsplit('.', 1)[-1]}={label(v)}" for k, v in zip(keys, value))
    )


def variant_words(keys: list[str], value: tuple) -> str:
    """A variant as titles and legends name it: the study's (encoding, positions) in words ('RoPE
    (randomized)'), other fields as field=value."""
    fields = dict(zip(keys, value))
    if "encoding" in fields and set(keys) <= {"encoding", POSITIONS}:
        return variant_name(fields["encoding"], fields.get(POSITIONS))
    return _variant_label(keys, value)


def variant_styles(keys: list[str], variants: list[tuple]) -> dict[tuple, tuple]:
    """(colour, line style) per variant: a colour per encoding and dashes for randomized positions
    when the variants are (encoding, positions); else a colour each."""
    if keys and keys[0] == "encoding":
        encodings = list(dict.fromkeys(v[0] for v in variants))
        colors = variant_colors(len(encodings))
        randomized = [dict(zip(keys, v)).get(POSITIONS) == "randomized" for v in variants]
        return {
            v: (colors[encodings.index(v[0])], "--" if r else "-")
            for v, r in zip(variants, randomized)
        }
    return dict(zip(variants, ((c, "-") for c in variant_colors(len(variants)))))


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
    variant (styled as the main figure: a colour per encoding, dashed for randomized positions)."""
    statistics = [s for s in STATISTIC_LABELS if s in frame]
    fig = Figure(figsize=(3.4 * len(statistics) + 2.5, 3.4), layout="constrained")
    axes = fig.subplots(1, len(statistics), squeeze=False)[0]
    lengths = frame.drop_duplicates("length").sort_values("order")["length"].tolist()
    styles = variant_styles(keys, variants)
    for value in variants:
        mine = frame[frame["variant"] == value]
        means = mine.groupby("length")[statistics].mean()
        color, dashes = styles[value]
        for ax, statistic in zip(axes, statistics):
            ax.plot(
                range(len(lengths)),
                [means[statistic].get(x, math.nan) for x in lengths],
                marker="o",
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
