"""What the fair-baselines study compares (fair_baselines.py reports it, fair_baselines_figure.py
draws it): the finished rows at the training length L (`at_training_length`), the learning-rate
sweep apart from the longer budgets (`by_budget`), and per preset its pick and scores
(`preset_summary`): best_lr, the rate with the lowest mean valid ppl over seeds; its seeds' test
ppl; ratio = mean test ppl / the best preset's; the same at DEFAULT_LR, untuned. A preset that
encodes position and ends more than TOLERANCE above the best is not a fair baseline
(`over_tolerance`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.best_over import pick_values
from relpos_ablate.analysis.settings import normalized, table_settings
from relpos_ablate.analysis.tables import sort_key
from relpos_ablate.config import ConfigError
from relpos_ablate.config.run import TrainConfig

TOLERANCE = 0.10
"""A preset more than this above the best preset's test perplexity (ratio > 1.10) is not a fair
baseline."""
UNJUDGED = ("nope",)
"""Presets that encode no position: reported, not held to the tolerance."""
NEAR_TIE = 0.005
"""A pick whose runner-up rate's mean valid ppl lies within this fraction of its own is marked: on
validation the pick is not clearly better than that rate."""
KEY, ROW, METRIC = "train.lr", "encoding", "ppl"
SELECT, REPORT = "valid", "test"
DEFAULT_LR = TrainConfig().lr
"""The learning rate every preset gets untuned (TrainConfig's default)."""


def at_training_length(df: pd.DataFrame) -> pd.DataFrame:
    """The finished rows evaluated at the training length, non_overlapping, without RECL's ladder (a
    subset of the targets): what the study compares (one line naming what is missing otherwise)."""
    missing = [
        c for c in (ROW, KEY, "split", "segment_len", "train.segment_len", METRIC) if c not in df
    ]
    if missing:
        raise ConfigError(
            "report",
            f"fair_baselines needs the columns {', '.join(missing)} (runs of "
            "experiments/fair_baselines.yaml, collected)",
        )
    df = table_settings(df)
    data = df[
        np.isfinite(pd.to_numeric(df[METRIC], errors="coerce"))
        & (df["segment_len"] == df["train.segment_len"])
    ]
    if "protocol" in data:
        data = data[data["protocol"].fillna("non_overlapping") == "non_overlapping"]
    if data.empty:
        raise ConfigError("report", f"no {METRIC} at the training length in these runs")
    return data


STEPS = "train.max_steps"


def by_budget(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[int, pd.DataFrame]]:
    """The learning-rate sweep's runs (the training budget most runs have) and, per other budget,
    its runs (experiments/fair_baselines_2000.yaml: some presets at their pick, trained longer)."""
    if STEPS not in df or df[STEPS].isna().all():
        return df, {}
    steps = pd.to_numeric(df[STEPS], errors="coerce")
    sweep = (
        int(steps[df.drop_duplicates("run_dir").index].value_counts().idxmax())
        if "run_dir" in df
        else int(steps.value_counts().idxmax())
    )
    others = {int(n): df[steps == n] for n in sorted(set(steps.dropna().astype(int))) if n != sweep}
    return df[steps == sweep], others


def preset_summary(df: pd.DataFrame, orders: dict[str, list] | None = None) -> pd.DataFrame:
    """One row per preset (in `orders`' order, else by name): best_lr (valid's pick), valid (its
    mean valid ppl), test (its seeds' test ppl, {run dir: ppl}), mean, std, n, ratio (mean / the
    best preset's mean), and the same at DEFAULT_LR: default_mean, default_ratio (NaN where the
    sweep lacks it); runner_up: how far the second-best rate's mean valid ppl lies above the pick's
    (a fraction; NaN with one rate)."""
    orders = orders or {}
    data = at_training_length(df)
    split = data["split"].map(normalized)
    select, report = data[split == SELECT], data[split == REPORT]
    picks = pick_values(select, KEY, [ROW], [], METRIC, orders)
    lines = []
    for (preset,), lr in picks.items():
        test = values_at(report, preset, lr)
        valid = values_at(select, preset, lr)
        default = values_at(report, preset, DEFAULT_LR)
        values = list(test.values())
        rates = select[select[ROW] == preset].groupby(KEY)[METRIC].mean().sort_values()
        runner_up = rates.iloc[1] / rates.iloc[0] - 1 if len(rates) > 1 else math.nan
        lines.append(
            {
                "preset": preset,
                "best_lr": lr,
                "valid": np.mean(list(valid.values())),
                "test": test,
                "mean": np.mean(values) if values else math.nan,
                "std": np.std(values, ddof=1) if len(values) > 1 else math.nan,
                "n": len(values),
                "default_mean": np.mean(list(default.values())) if default else math.nan,
                "runner_up": runner_up,
            }
        )
    table = pd.DataFrame(lines)
    table["ratio"] = table["mean"] / table["mean"].min()
    table["default_ratio"] = table["default_mean"] / table["default_mean"].min()
    rank = table["preset"].map(lambda p: sort_key((p,), [ROW], orders))
    return (
        table.assign(_rank=rank).sort_values("_rank").drop(columns="_rank").reset_index(drop=True)
    )


def values_at(frame: pd.DataFrame, preset: str, lr: float) -> dict[str, float]:
    """{run dir: metric} of every seed of `preset` at learning rate `lr` in `frame`."""
    rows = frame[(frame[ROW] == preset) & np.isclose(frame[KEY].astype(float), lr)]
    return dict(zip(rows["run_dir"], rows[METRIC].astype(float)))


def over_tolerance(summary: pd.DataFrame, column: str = "ratio") -> list[str]:
    """The judged presets (UNJUDGED aside) whose `column` ratio is above 1 + TOLERANCE, worst
    first."""
    judged = summary[~summary["preset"].isin(UNJUDGED) & (summary[column] > 1 + TOLERANCE)]
    return judged.sort_values(column, ascending=False)["preset"].tolist()
