"""Each finished run of the length-generalization study as one row of scores (`run_scores`): its
task, variant, seed, the steps it trained and why it stopped (status.json: the threshold of
train.stop_at_exact_match or the max_steps cap), and its exact match averaged over its
in-distribution bins (ID: n within data.train_lengths) and over its out-of-distribution bins (OOD:
bins that start beyond them), passkey bins first averaged over their depths. Also how the report
writes them: `stat` (mean ± std (n) over seeds), `joined`, `counted`, `variants_in_order`."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.config import ConfigError
from relpos_ablate.studies.length_generalization.table import (
    TASK,
    example_rows,
    per_run_bins,
    variant_name,
    variant_order,
)

METRIC = "exact_match"
ENCODING, POSITIONS = "encoding", "model.attention.positions"
THRESHOLD = "train.stop_at_exact_match"


def run_scores(df: pd.DataFrame, metric: str = METRIC) -> pd.DataFrame:
    """One row per finished run: task, encoding, positions, seed, step, stopped, max_steps,
    threshold, and its `id` and `ood` mean of `metric` (NaN without such bins)."""
    data = example_rows(df, metric)
    for column in (ENCODING, TASK):
        if column not in data:
            raise ConfigError(
                "report", f"length_generalization needs a {column!r} column (the study's grid axis)"
            )
    bins = per_run_bins(data, metric)
    runs = data.drop_duplicates("run_dir").set_index("run_dir")
    scores = pd.DataFrame(
        {
            "task": runs[TASK],
            "encoding": runs[ENCODING],
            "positions": runs[POSITIONS] if POSITIONS in runs else "sequential",
            "seed": runs["seed"],
            "step": _numbers(runs, "step"),
            "max_steps": _numbers(runs, "max_steps"),
            "stopped": runs["stopped"] if "stopped" in runs else None,
            "threshold": _numbers(runs, THRESHOLD),
            "id": bins[bins["iid"]].groupby("run_dir")[metric].mean(),
            "ood": bins[bins["ood"]].groupby("run_dir")[metric].mean(),
        }
    )
    scores["variant"] = [
        variant_name(e, p) for e, p in zip(scores["encoding"], scores["positions"])
    ]
    scores["order"] = [variant_order(e, p) for e, p in zip(scores["encoding"], scores["positions"])]
    return scores.rename_axis("run_dir").reset_index()


def _numbers(runs: pd.DataFrame, column: str) -> pd.Series | float:
    return pd.to_numeric(runs[column], errors="coerce") if column in runs else math.nan


def by_run(scores: pd.DataFrame, measure: str) -> dict[str, float]:
    return {
        run: float(v)
        for run, v in zip(scores["run_dir"], scores[measure])
        if not math.isnan(float(v))
    }


def stat(values) -> str:
    values = [float(v) for v in values if not math.isnan(float(v))]
    if not values:
        return "-"
    std = f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else ""
    return f"{np.mean(values):.3f}{std} ({len(values)})"


def variants_in_order(scores: pd.DataFrame) -> list[str]:
    firsts = scores.sort_values("order", kind="stable").drop_duplicates("variant")
    return firsts["variant"].tolist()


def joined(values, kind=float) -> str:
    return ", ".join(f"{kind(v):g}" for v in sorted(values)) or "-"


def counted(variants: pd.Series) -> list[str]:
    return [f"{name} ({count})" for name, count in variants.value_counts(sort=False).items()]
