"""The length-generalization study's main figure, `plot --kind lengthgen`: exact match against the
task length n, one panel per task, a line per variant (its mean over seeds, the seeds' min-max as a
band) and the training lengths shaded, so that in-distribution and out-of-distribution accuracy read
at a glance (Kazemnejad et al.'s Fig. 3 draws their tasks so). A colour and a marker per
encoding, solid for sequential and dashed for randomized positions; each test bin is drawn at its
middle n (the depth tasks: averaged over their depths). Lines that lie on each other past the
training lengths, at the floor or at the ceiling, are named under their panel.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from relpos_ablate.analysis.plots import save_figure
from relpos_ablate.analysis.table_options import default_metric
from relpos_ablate.studies.length_generalization.table import (
    example_rows,
    per_run_bins,
    task_order,
    train_range,
    variant_order,
)
from relpos_ablate.studies.length_generalization.variants import (
    POSITIONS,
    TASK,
    variant_styles,
    variant_words,
    with_variants,
)

SHADE = "0.9"
"""Grey of the training lengths."""
FLAT = 0.01
"""A variant whose mean stays below FLAT (or above 1 - FLAT) in every bin past the training lengths
draws a line on the zero line (or on the 1.0 line), under the others there: each panel names those
variants, since their lines hide each other."""


def curves(df: pd.DataFrame, metric: str) -> tuple[pd.DataFrame, list[str], list[tuple]]:
    """One row per (run, bin): task, variant, seed, the bin's bounds and middle n, the run's metric
    there and its training lengths; the variant keys and the variants in order."""
    data = example_rows(df, metric)
    bins = per_run_bins(data, metric)
    runs = data.drop_duplicates("run_dir").set_index("run_dir")
    lengths = runs.apply(train_range, axis=1)
    bins["train_min"], bins["train_max"] = (bins["run_dir"].map(lengths.str[k]) for k in (0, 1))
    keys = [
        k
        for k in runs.columns
        if k in (TASK, "seed", *df.attrs.get("variant_axes", []), "encoding", POSITIONS)
    ]
    frame = bins.join(runs[keys], on="run_dir")
    frame["n"] = (frame["length_min"] + frame["length_max"]) / 2
    frame, variant_keys, variants = with_variants(frame, df)
    # the study's order, spec or not
    if set(variant_keys) <= {"encoding", POSITIONS} and "encoding" in variant_keys:
        variants.sort(
            key=lambda v: variant_order(
                *(dict(zip(variant_keys, v)).get(k) for k in ("encoding", POSITIONS))
            )
        )
    return frame, variant_keys, variants


def lengthgen_figure(df: pd.DataFrame, metric: str | None = None) -> Figure:
    metric = metric or default_metric(df)
    frame, keys, variants = curves(df, metric)
    tasks = sorted(set(frame[TASK]), key=task_order) if TASK in frame else [None]
    ncols = min(2, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig = Figure(figsize=(4.6 * ncols + 2.6, 3.3 * nrows + 0.5), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    styles = variant_styles(keys, variants)
    words = metric.replace("_", " ")
    for ax, task in zip(axes, tasks):
        part = frame if task is None else frame[frame[TASK] == task]
        lo, hi = part["train_min"].min(), part["train_max"].max()
        ax.axvspan(lo - 0.5, hi + 0.5, color=SHADE, zorder=0)
        for value in variants:
            runs = part[part["variant"] == value]
            if runs.empty:
                continue
            by_bin = runs.groupby("n")[metric]
            xs, mean, low, high = by_bin.mean().index, by_bin.mean(), by_bin.min(), by_bin.max()
            color, dashes, marker = styles[value]
            ax.plot(xs, mean, color=color, ls=dashes, marker=marker, ms=3, lw=1.3)
            if runs["seed"].nunique() > 1:
                ax.fill_between(xs, low, high, color=color, alpha=0.12, lw=0)
        edges = sorted(set(zip(part["length_min"], part["length_max"])))
        ax.set_xticks(
            [(a + b) / 2 for a, b in edges],
            [f"{a:g}-{b:g}" if a != b else f"{a:g}" for a, b in edges],
            fontsize=7,
            rotation=30,
        )
        hidden = "".join(
            "\n" + line
            for where, flat in (
                (f"below {FLAT:g}", _flat(part, metric, hi, variants, top=False)),
                (f"above {1 - FLAT:g}", _flat(part, metric, hi, variants, top=True)),
            )
            if len(flat) > 1
            for line in textwrap.wrap(
                f"{where} past the training lengths, lines on each other: "
                + ", ".join(variant_words(keys, v) for v in flat),
                width=62,
            )
        )
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(task or "", fontsize=10)
        ax.set_xlabel("task length n (test bin)" + hidden, fontsize=8)
        ax.set_ylabel(words, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    seeds = frame.groupby("variant")["seed"].nunique()
    handles = [
        Line2D(
            [],
            [],
            color=styles[v][0],
            ls=styles[v][1],
            marker=styles[v][2],
            ms=3,
            label=variant_words(keys, v),
        )
        for v in variants
    ]
    handles.append(Patch(color=SHADE, label="training lengths"))
    fig.legend(
        handles=handles,
        loc="outside right upper",
        fontsize=8,
        title=f"mean over {_seeds(seeds)}\nband: min-max over seeds",
        title_fontsize=8,
    )
    fig.suptitle(
        f"Length generalization: {words} against task length, trained on the shaded lengths",
        fontsize=11,
    )
    return fig


def _flat(
    part: pd.DataFrame, metric: str, train_max: float, variants: list[tuple], top: bool
) -> list[tuple]:
    """The variants (in drawing order) whose mean over seeds is below FLAT (top: above 1 - FLAT) in
    every bin past train_max."""
    beyond = part[part["length_min"] > train_max]
    means = beyond.groupby(["variant", "n"])[metric].mean()
    return [
        v
        for v in variants
        if v in means.index.get_level_values(0)
        and ((means.loc[v] > 1 - FLAT) if top else (means.loc[v] < FLAT)).all()
    ]


def _seeds(counts: pd.Series) -> str:
    low, high = int(counts.min()), int(counts.max())
    return f"{low} seed{'s' if high > 1 else ''}" if low == high else f"{low}-{high} seeds"


def save_lengthgen(
    df: pd.DataFrame,
    out: Path,
    metric: str | None = None,
    formats: tuple[str, ...] = ("png", "pdf"),
) -> list[Path]:
    return save_figure(lengthgen_figure(df, metric), Path(out) / "lengthgen", formats)
