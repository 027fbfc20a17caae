"""The cells of an analysis plan (config/plan.py) on a collected frame: FIELD=VALUE conditions
selecting rows (`select`, on the narrowed, labelled frame `labelled` makes once per plan), one row
per run and no runs pooled across a variant's values (`per_run`), and the plan's `learned`
threshold (`lowest_in_distribution`, `not_learned`). analysis/planned.py runs the plan on them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import yaml

from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import resolve_column
from relpos_ablate.config import ConfigError
from relpos_ablate.config.plan import Plan, split_condition


def labels_of(df: pd.DataFrame, column: str) -> pd.Series:
    """A field's values as a table labels them: `labelled`'s column where it made one."""
    return df[("label", column)] if ("label", column) in df else df[column].map(label)


def select(df: pd.DataFrame, conditions: tuple[str, ...], what: str) -> pd.DataFrame:
    """The rows meeting every FIELD=VALUE (FIELD!=VALUE) condition, values compared as a table
    labels them (from `labelled`'s columns where it made them); an unknown field is a one-line
    error."""
    keep = np.ones(len(df), dtype=bool)
    for condition in conditions:
        key, negate, value = split_condition(condition)
        column = resolve_column(df, key, what)
        labels = labels_of(df, column)
        keep &= (labels.to_numpy(dtype=object) == canonical(value)) != negate
    return df[keep] if conditions else df


def labelled(df: pd.DataFrame, plan: Plan) -> pd.DataFrame:
    """The frame a plan reads: the run, setting and metric columns and the fields the plan names
    (no other config field), with each named field's labels computed once, as a column
    ("label", FIELD) that no field name resolves to."""
    fields = list(dict.fromkeys(resolve_column(df, n, "analysis") for n in plan.fields()))
    axes = [a for a in df.attrs.get("variant_axes", ()) if a in df and a != "seed"]
    config = ("model.", "data.", "train.", "eval.")
    kept = [c for c in df.columns if not str(c).startswith(config) or c in (*fields, *axes)]
    # plain objects: a boolean selection of arrow-backed strings costs a take per column
    frame = df[kept].astype(object)
    for column in dict.fromkeys([*fields, *axes]):
        frame[("label", column)] = frame[column].map(label)
    # pandas copies attrs deeply into every selection: only what the plan reads
    frame.attrs = {"variant_axes": axes}
    return frame


def per_run(rows: pd.DataFrame, column: str, cell: str) -> pd.DataFrame:
    """A cell's rows, one per run, with a finite value; a run with two rows makes the cell
    ambiguous (one line naming the fields its rows differ in)."""
    twice = rows[rows.duplicated("run_dir", keep=False)]
    if len(twice):
        first = twice[twice["run_dir"] == twice["run_dir"].iloc[0]]
        differ = [
            str(c)
            for c in first.columns
            if isinstance(c, str)
            and c not in ("eval_setting", "token_losses")
            and first[c].map(label).nunique() > 1
        ]
        raise ConfigError(
            "analysis",
            f"cell {cell}: {len(first)} rows for run {first['run_id'].iloc[0]} (they differ in "
            f"{', '.join(differ[:4])}); add the field to the cell, the family's where or its by",
        )
    not_pooled(rows, cell)
    return rows[np.isfinite(rows[column].astype(float))]


def lowest_in_distribution(df: pd.DataFrame, plan: Plan) -> pd.Series:
    """run dir -> the lowest value of the plan's `learned` metric over the run's rows where its
    `where` holds (e.g. over depths); empty without a `learned` entry."""
    rule = plan.learned
    if rule is None:
        return pd.Series(dtype=float)
    rows = select(df, rule.where, "learned.where")
    return rows.groupby("run_dir")[rule.metric].min().astype(float)


def not_learned(lowest: pd.Series, plan: Plan, runs: pd.DataFrame) -> str:
    """Empty when every run of a side learned the task in distribution (the plan's `learned`: its
    metric ≥ min in every row of the run where `where` holds; `lowest` from
    lowest_in_distribution), else why not."""
    rule = plan.learned
    if rule is None or runs.empty:
        return ""
    worst = lowest.reindex(runs["run_dir"].unique())
    if not (worst >= rule.min).all():
        shown = ", ".join("none" if np.isnan(v) else f"{v:.2f}" for v in worst)
        where = f" at {', '.join(rule.where)}" if rule.where else ""
        return (
            f"did not learn the task in distribution ({rule.metric}{where}, lowest per run: "
            f"{shown}; the plan needs ≥ {rule.min} in every run)"
        )
    return ""


def not_pooled(rows: pd.DataFrame, cell: str) -> None:
    """One line naming the variant axis whose values a cell's runs differ in (its runs would be
    pooled: e.g. `encoding=alibi` over two learning rates)."""
    labels = {
        axis: labels_of(rows, axis)
        for axis in ("experiment", *rows.attrs.get("variant_axes", ()))
        if axis in rows and axis != "seed"
    }
    pooled = [str(axis) for axis, values in labels.items() if values.nunique() > 1]
    if pooled:
        values = ", ".join(sorted(labels[pooled[0]].unique()))
        raise ConfigError(
            "analysis",
            f"cell {cell}: its runs differ in {', '.join(pooled)} ({pooled[0]}: {values}); name "
            "the value in the cell, the family's where or its by, so that no runs are pooled",
        )


def canonical(value: str) -> str:
    """A condition's value as a table labels it, whatever its spelling: 16.0 and 16, 1e-5 and
    1e-05, True and true read alike."""
    text = value.strip()
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(parsed, str):
        try:
            parsed = float(parsed)
        except ValueError:
            return text
    return label(parsed) if isinstance(parsed, (bool, int, float)) else text


def missing_values(df: pd.DataFrame, plan: Plan) -> list[str]:
    """The FIELD=VALUE conditions of the plan (its cells, `where`s, a rule's `vs` and `values`,
    `learned.where`) whose value no run has, one line each naming what the field has: a
    misspelling, or runs not done yet."""
    lines = []
    for condition in plan.conditions():
        key, negated, value = split_condition(condition)
        if negated:  # a value no run has excludes nothing: not a mistake
            continue
        column = resolve_column(df, key, "analysis")
        have = set(labels_of(df, column))
        if canonical(value) not in have:
            shown = ", ".join(sorted(have)[:8]) + (", ..." if len(have) > 8 else "")
            lines.append(f"{condition}: no run has it ({column} has: {shown})")
    return lines
