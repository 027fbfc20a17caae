"""The runs of a table from one or more sources, each run once, every evaluation it has.

`relpos-ablate table A B` pools the frames of its sources (results dirs, summary.csv files). The
same run can be in two of them: a run dir and the summary.csv collected from it, or two specs that
hold the same runs under different run ids (an `imports:` entry enters the run id, and so do the
evaluation settings, which `evaluate` may extend later without retraining). Counted twice, such a
run is pseudo-replication: n doubles, the seeds do not, and the tests' p-values are too small. Two
copies are one run when their run ids are equal or when they train the same model
(`effective_key`): the what-to-run configuration and seed, without what does not change the
trained model (RUN_ID_NOT_THE_MODEL). Its evaluations are merged over the copies (union of
settings); a setting that two copies scored differently is ambiguous and left out, with one line.

A results dir may also hold runs of an earlier version of its spec (the same spec name, rerun after
changing a field): `planned_by_their_specs` keeps the runs each run's recorded spec (run.json
`spec`, collect's `spec` column) still plans.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from relpos_ablate.analysis.collect import RUN_COLUMNS
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import spec_files
from relpos_ablate.config.run import HOW_TO_RUN

CONFIG_SECTIONS = ("model.", "data.", "train.", "eval.")
"""Prefixes of the flattened config columns collect writes (beside `seed` and `imports`)."""
RUN_ID_NOT_THE_MODEL = (
    "imports",
    "eval.",
    "data.test_lengths",
    "data.eval_examples",
    "data.passkey_depths",
    "data.cache_dir",
    *(f"train.{name}" for name in HOW_TO_RUN),
)
"""Config columns (or prefixes, ending in '.') left out of a run's identity: `imports` (modules
that register schemes; the scheme is named by model.attention.bias), what `evaluate --set` may
change on a trained run (train/evaluate_run.py EVALUATION_KEYS and EXAMPLE_KEYS: every eval.*
field, an example task's test sets), where the data is cached, and the how-to-run fields
(config/run.py HOW_TO_RUN, not in the run id either). A copy that evaluated with another
eval.batch_size or other test sets, and so got other numbers for one setting, is then the ambiguous
case, said, not a second seed."""
RESULT_COLUMNS = ("ladder_loss", "ladder_targets", "eval_setting", "token_losses", "eval_error")
"""Per-setting columns that hold what an evaluation found (besides the metrics)."""
RUN_LEVEL = ("run_dir", "spec", "main_metric", "reference")
"""Per-run columns beside RUN_COLUMNS, the variant axes and the config."""
RTOL = 1e-12
"""Two copies' values of one metric are the same number within this relative tolerance (a
summary.csv round trip may move the last bit)."""


def is_config_column(name: str) -> bool:
    return name in ("seed", "imports") or name.startswith(CONFIG_SECTIONS)


def identity_columns(columns) -> list[str]:
    """The config columns that say which model a run trains (sorted: frames may order them
    differently)."""
    return sorted(
        c
        for c in columns
        if is_config_column(c)
        and not any(c.startswith(x) if x.endswith(".") else c == x for x in RUN_ID_NOT_THE_MODEL)
    )


def _canonical(value: Any) -> Any:
    """A hashable value equal for the same config value read from a run dir or a summary.csv (200
    and 200.0, NaN and None)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


def effective_key(row: pd.Series, columns: list[str]) -> tuple | None:
    """What a copy trains: its identity columns' values; None when its config was not read (no
    seed, or no config column at all)."""
    values = tuple(_canonical(row.get(c)) for c in columns)
    if _canonical(row.get("seed")) is None or all(v is None for v in values):
        return None
    return values


def _roles(frame: pd.DataFrame) -> tuple[list[str], list[str], list[str]]:
    """(the run's columns its copies share: RUN_COLUMNS, run_dir, spec, variant axes; the metric
    columns; the setting columns) of a collected frame: a setting is named by every column that is
    neither about the run (those, its config, its reference) nor a result (SETTING_FIELDS and the
    fields an example task's records add)."""
    axes = [a for a in frame.attrs.get("variant_axes", []) if a in frame]
    metrics = [m for m in (*frame.attrs.get("metrics", []), "ladder_loss") if m in frame]
    run_level = [
        c
        for c in frame.columns
        if c in (*RUN_COLUMNS, *RUN_LEVEL, *axes, "_source")
        or c.startswith("reference_")
        or is_config_column(c)
    ]
    settings = [c for c in frame.columns if c not in (*run_level, *metrics, *RESULT_COLUMNS)]
    shown_runs = [c for c in (*RUN_COLUMNS, "run_dir", "spec", *axes) if c in frame]
    return shown_runs, metrics, settings


def one_copy_per_run(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The frame with each run once (copies: the rows of one run dir in one source; one run: the
    same run id or the same effective_key) and its evaluations merged over its copies; and the lines
    to show (how many runs were merged; the settings left out as ambiguous)."""
    if frame.empty or "run_dir" not in frame:
        return frame, []
    source = frame["_source"].astype(str) if "_source" in frame else pd.Series("", frame.index)
    copy_of = list(zip(source, frame["run_dir"].astype(str)))
    copies: dict[tuple, list[int]] = {}
    for position, copy in enumerate(copy_of):
        copies.setdefault(copy, []).append(position)
    groups = _same_runs(frame, copies)
    if all(len(group) == 1 for group in groups):
        return frame, []
    shown_runs, metrics, settings = _roles(frame)
    parts, ambiguous, merged = [], [], []
    for group in groups:
        rows = [frame.iloc[copies[c]] for c in group]
        if len(group) == 1:
            parts.append(rows[0])
            continue
        merged.append(group)
        parts.append(_merge_copies(rows, shown_runs, metrics, settings, ambiguous))
    # rows taken apart and put together hold objects: numbers become numbers again
    out = pd.concat(parts, ignore_index=True).infer_objects()
    out.attrs.update(frame.attrs)
    return out, [_merged_line(merged), *_ambiguous_line(ambiguous)]


def _same_runs(frame: pd.DataFrame, copies: dict[tuple, list[int]]) -> list[list[tuple]]:
    """The copies grouped by run (same run id or same effective_key, transitively), each group in
    the order of its copies' first rows."""
    columns = identity_columns(frame.columns)
    parent = {copy: copy for copy in copies}

    def root(copy):
        while parent[copy] != copy:
            copy = parent[copy]
        return copy

    seen: dict[Any, tuple] = {}
    for copy, positions in copies.items():
        first = frame.iloc[positions[0]]
        key = effective_key(first, columns)
        # a run trained by `train` alone (no experiment) goes by its folder's name, not its hash
        run_id = _canonical(first.get("run_id") if _canonical(first.get("experiment")) else None)
        for name in (("run_id", run_id), ("config", key)):
            if name[1] is None:
                continue
            if name in seen:
                parent[root(copy)] = root(seen[name])
            else:
                seen[name] = copy
    groups: dict[tuple, list[tuple]] = {}
    for copy in copies:
        groups.setdefault(root(copy), []).append(copy)
    return list(groups.values())


def _evaluated(rows: pd.DataFrame, metrics: list[str]) -> pd.Series:
    if not metrics:
        return pd.Series(False, index=rows.index)
    return rows[metrics].apply(pd.to_numeric, errors="coerce").notna().any(axis=1)


def _order(rows: list[pd.DataFrame], metrics: list[str]) -> list[pd.DataFrame]:
    """A run's copies, the one that stands for it first: the most evaluations, done, then by source
    and run dir (never by argument order)."""

    def rank(part: pd.DataFrame):
        first = part.iloc[0]
        return (
            -int(_evaluated(part, metrics).sum()),
            first.get("status") != "done",
            str(first.get("_source", "")),
            str(first.get("run_dir")),
        )

    return sorted(rows, key=rank)


def _merge_copies(
    rows: list[pd.DataFrame],
    shown_runs: list[str],
    metrics: list[str],
    settings: list[str],
    ambiguous: list[str],
) -> pd.DataFrame:
    """One run's rows from its copies: the first copy's (see _order) run fields on every row, each
    evaluation setting once (from the copy with the most metrics); a setting two copies scored
    differently is left out and described in `ambiguous`."""
    rows = _order(rows, metrics)
    by_setting: dict[tuple, list[pd.Series]] = {}
    for part in rows:
        evaluated = _evaluated(part, metrics)
        for (_, row), has_metrics in zip(part.iterrows(), evaluated):
            key = tuple(_canonical(row.get(c)) for c in settings)
            if all(v is None for v in key) and not has_metrics:
                continue  # a copy without evaluations (queued, failed) adds nothing
            by_setting.setdefault(key, []).append(row)
    kept = [
        row
        for candidates in by_setting.values()
        if (row := _one_evaluation(candidates, metrics, settings, ambiguous)) is not None
    ]
    if not kept:  # every evaluation ambiguous: the run stays, unscored, to be named as left out
        blank = rows[0].iloc[:1].copy()
        for column in (*metrics, *settings, *RESULT_COLUMNS):
            if column in blank:
                blank[column] = None
        return blank
    out = pd.DataFrame(kept).reset_index(drop=True)
    # an evaluation adopted from another run dir: its loss by position and token losses live there,
    # not in the run dir that now names it
    own_dir = str(rows[0].iloc[0]["run_dir"])
    adopted = np.array([str(row["run_dir"]) != own_dir for row in kept])
    for column in ("eval_setting", "token_losses"):
        if column in out:
            out[column] = out[column].astype(object).where(~adopted, None)
    # run fields: the first copy's, where it has them, else the next copy's
    for column in shown_runs:
        values = [v for part in rows for v in part[column] if _canonical(v) is not None]
        if values:
            out[column] = [values[0]] * len(out)
    return out


def _one_evaluation(
    candidates: list[pd.Series], metrics: list[str], settings: list[str], ambiguous: list[str]
) -> pd.Series | None:
    """The row of one setting among a run's copies (candidates in copy order): the one with the
    most metrics; None, with a line in `ambiguous`, when two copies hold different values."""
    scored = [r for r in candidates if pd.to_numeric(r[metrics], errors="coerce").notna().any()]
    if len(scored) < 2:
        return (scored or candidates)[0]
    for metric in metrics:
        values = [(v, str(r.get("run_dir"))) for r in scored for v in [_number(r.get(metric))]]
        values = [(v, where) for v, where in values if not math.isnan(v)]
        if any(not math.isclose(v, values[0][0], rel_tol=RTOL) for v, _ in values[1:]):
            setting = ", ".join(
                f"{c}={r}"
                for c, r in zip(settings, (candidates[0].get(c) for c in settings))
                if _canonical(r) is not None
            )
            found = " vs ".join(f"{v:g} ({where})" for v, where in values)
            first = candidates[0]
            ambiguous.append(
                f"run {first.get('run_id')} (seed {label(first.get('seed'))}) at {setting}: "
                f"{metric} {found}"
            )
            return None
    return max(scored, key=lambda r: int(r[metrics].notna().sum()))


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _merged_line(groups: list[list[tuple]]) -> str:
    """One line: how many runs had several copies, and one example."""
    copies = sum(len(group) for group in groups)
    example = " = ".join(
        dict.fromkeys(
            f"{run_dir} ({source})" if source else run_dir for source, run_dir in groups[0]
        )
    )
    return (
        f"{len(groups)} runs found {copies} times (the same run id, or the same configuration and "
        f"seed; e.g. {example}): counted once each, their evaluations merged"
    )


def _ambiguous_line(ambiguous: list[str]) -> list[str]:
    if not ambiguous:
        return []
    more = f"; and {len(ambiguous) - 1} more" if len(ambiguous) > 1 else ""
    return [
        f"{len(ambiguous)} evaluations differ between copies of one run, left out "
        f"(ambiguous): {ambiguous[0]}{more}"
    ]


def spec_path(run_dir: str, raw: str, root: Path) -> Path | None:
    """The spec file a run records, or None (table_options.spec_files, the first found)."""
    return next(iter(spec_files(run_dir, raw, root)), None)


def planned_by_their_specs(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows of the runs their recorded spec still plans (by run id), and the lines to show: how
    many runs were left out, and the specs not found or not readable (their runs kept)."""
    from relpos_ablate.config import ConfigError
    from relpos_ablate.runner.grid import load_grid

    if frame.empty or not {"spec", "run_dir", "run_id"} <= set(frame.columns):
        return frame, []
    root = Path(frame.attrs.get("results_dir", "."))
    runs = frame[["run_dir", "spec", "run_id"]].drop_duplicates("run_dir")
    runs = runs[runs["spec"].map(lambda s: isinstance(s, str) and bool(s))]
    by_path: dict[Path, list] = {}
    missing: dict[str, int] = {}
    for run_dir, raw, run_id in runs.itertuples(index=False):
        path = spec_path(str(run_dir), raw, root)
        if path is None:
            missing[raw] = missing.get(raw, 0) + 1
        else:
            by_path.setdefault(path.resolve(), []).append((run_dir, run_id))
    left_out, unreadable, names = set(), [], []
    for path, members in by_path.items():
        try:
            planned = {run.run_id for run in load_grid(path).runs}
        except (OSError, ConfigError) as err:
            unreadable.append(f"{path}: {str(err).splitlines()[0]}")
            continue
        gone = [run_dir for run_dir, run_id in members if run_id not in planned]
        if gone:
            names.append(f"{_shown(path)}: {len(gone)}")
        left_out.update(gone)
    lines = []
    if left_out:
        lines.append(
            f"left out {len(left_out)} runs their spec no longer plans (an earlier version's; "
            f"{', '.join(names)}); --all-runs keeps them"
        )
    if missing:
        specs = ", ".join(f"{raw} ({n} runs)" for raw, n in missing.items())
        lines.append(f"spec not found, so its runs are all kept: {specs}")
    if unreadable:
        lines.append(f"spec not readable, so its runs are all kept: {'; '.join(unreadable)}")
    kept = frame[~frame["run_dir"].isin(left_out)]
    kept.attrs.update(frame.attrs)
    return kept, lines


def _shown(path: Path) -> str:
    """A path as short as it reads: relative to the cwd when below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
