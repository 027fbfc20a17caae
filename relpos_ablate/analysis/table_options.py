"""What a table shows and where each choice comes from: `TableOptions` (the command line's flags,
the spec's `table:` block), the spec the runs came from, and the defaults the data suggests (rows =
what varies between runs, seed excluded; columns = the evaluation settings that vary within a run;
metric = the task's main metric), resolved and checked by `resolve_options`; plus the `--where`
filter. Every table layout (tables.py's grid, best_over, a study's own layouts) and the plots read
their options here.
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from relpos_ablate import rundir
from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.render import FORMATS
from relpos_ablate.analysis.settings import MISSING_WORDS, label, normalized, short_name
from relpos_ablate.analysis.stats import CORRECTIONS
from relpos_ablate.config import ConfigError, from_dict
from relpos_ablate.config.base import check_choice
from relpos_ablate.config.evaluation import SPLITS
from relpos_ablate.config.yaml_io import load_yaml

HIGHER_IS_BETTER = ("acc", "accuracy", "exact_match")
"""Metrics where larger is better; every other metric (ppl, loss, bpc, nll) is lower-is-better."""
ALIASES = {"eval_len": "segment_len", "eval_length": "segment_len"}
"""Short names accepted for --rows/--cols (besides any unique last component of a dotted field)."""


@dataclass(frozen=True)
class TableOptions:
    """What a table shows; every field unset (None) falls back to the spec block, then to the
    data."""

    rows: tuple[str, ...] | None = None
    """Row keys: config fields (`model.attention.terms` or `terms`), variant axes, evaluation
    settings."""
    cols: tuple[str, ...] | None = None
    """Column keys, same names as rows (e.g. segment_len / eval_len, attn_len)."""
    metric: str | None = None
    """Metric in the cells (ppl, acc, loss, bpc, ...); default: the task's main metric."""
    baseline: str | None = None
    """Row label the other rows are tested against, column by column; several row keys: 'a,b'. The
    test is chosen from the data (analysis/stats.py): a paired t-test over the matched runs where a
    cell and the baseline's come from the same runs (another evaluation length, protocol, ...),
    Welch's t-test where they come from different models."""
    correction: str | None = None
    """How the table's tests against the baseline, one family, are corrected for multiple
    comparisons: holm (default), bh (Benjamini-Hochberg, false discovery rate) or none. Stars read
    the adjusted p."""
    layout: str | None = None
    """grid (rows x columns) or a study's paper layout (relpos_ablate/studies/: Transformer-XL's
    Table 6 and Table 8, the length-generalization table); checked by make_table."""
    format: str | None = None
    """markdown | latex | csv."""
    best_over: str | None = None
    """A key (e.g. train.lr) tuned per row, as papers tune each baseline: every cell reports the
    value of the key whose select_split metric is best (analysis/best_over.py); none: off (over the
    spec's block)."""
    select_split: str | None = None
    """best_over: the split the value is picked on (default valid)."""
    report_split: str | None = None
    """best_over: the split the cells report (default test)."""
    where: tuple[str, ...] | None = None
    """Keep only the collected rows whose field has (`FIELD=VALUE`) or has not (`FIELD!=VALUE`) this
    value, e.g. `protocol=sliding`; several must all hold. E.g. a stride sweep on a max_targets
    subset (ALiBi App. B) in a table of its own (`max_targets=2048`) and out of the main one
    (`max_targets!=2048`)."""

    def __post_init__(self):
        if self.format is not None:
            check_choice("format", self.format, FORMATS)
        if self.correction is not None:
            check_choice("correction", self.correction, CORRECTIONS)
        for name in ("select_split", "report_split"):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), SPLITS)

    def merged(self, fallback: TableOptions) -> TableOptions:
        """These options, with unset fields taken from `fallback`."""
        return replace(
            self,
            **{
                f.name: getattr(fallback, f.name)
                for f in fields(self)
                if getattr(self, f.name) is None
            },
        )


def metric_direction(metric: str) -> str:
    """'max' when larger is better (accuracy), else 'min' (perplexity, loss, bits per character)."""
    return "max" if metric.lower().startswith(HIGHER_IS_BETTER) else "min"


def spec_files(run_dir: str, raw: str, root: Path) -> Iterable[Path]:
    """The files a run's recorded spec may be, most likely first: run.json stores it relative to
    the run dir (older runs: absolute or relative to the cwd); for a committed summary.csv the run
    dir is gone, so its '..' are resolved by name and the results dir `root` is searched too."""
    for path in (
        Path(run_dir) / raw,
        Path(os.path.normpath(Path(run_dir) / raw)),
        Path(raw),
        root / raw,
        root / Path(raw).name,
    ):
        if path.is_file():
            yield path


def read_spec(df: pd.DataFrame) -> dict:
    """The grid spec the runs came from (run.json `spec`), or {} when none is recorded or
    readable."""
    root = Path(df.attrs.get("results_dir", "."))
    pairs = (
        df[["run_dir", "spec"]].dropna().drop_duplicates().itertuples(index=False)
        if "spec" in df
        else ()
    )
    for run_dir, raw in pairs:
        for path in spec_files(run_dir, raw, root):
            try:
                spec = load_yaml(path.read_text())
            except yaml.YAMLError:
                continue
            if isinstance(spec, dict):
                return spec
    return {}


def spec_options(spec: dict) -> TableOptions:
    """The spec's `table:` block as options (unknown keys and wrong types are one-line errors)."""
    block = spec.get("table") or {}
    if isinstance(block, dict):
        block = {
            k: [v] if k in ("rows", "cols", "where") and isinstance(v, str) else v
            for k, v in block.items()
        }
    return from_dict(TableOptions, block, "table")


def axis_orders(spec: dict) -> dict[str, list]:
    """Value order of every grid and zip axis as written in the spec (a zip column's repeated values
    count once, at their first place): rows follow it instead of sorting."""
    zipped = spec.get("zip") or []
    groups = [spec.get("grid") or {}] + ([zipped] if isinstance(zipped, dict) else list(zipped))
    orders: dict[str, list] = {}
    for group in groups:
        for axis, values in group.items() if isinstance(group, dict) else ():
            if isinstance(values, list):
                orders[axis] = list(
                    dict.fromkeys(v for v in values if isinstance(v, (str, int, float, bool)))
                )
    return orders


def metric_columns(df: pd.DataFrame) -> list[str]:
    """Metrics with at least one value (from collect's attrs, else the known names present)."""
    names = df.attrs.get("metrics") or [c for c in ("ppl", "acc", "loss", "bpc") if c in df]
    return [m for m in names if m in df and df[m].notna().any()]


def default_metric(df: pd.DataFrame) -> str:
    """The metric a table or plot shows unless asked: the one the runs declare as their main metric
    (eval.json `main_metric`), else the first available one."""
    declared = df["main_metric"].dropna() if "main_metric" in df else pd.Series(dtype=object)
    available = metric_columns(df)
    if not declared.empty and declared.mode().iloc[0] in available:
        return str(declared.mode().iloc[0])
    if not available:
        raise no_finished_runs(df)
    return available[0]


def no_finished_runs(df: pd.DataFrame) -> ConfigError:
    states = Counter(df["status"]) if "status" in df else Counter()
    seen = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no runs at all"
    return ConfigError(
        df.attrs.get("results_dir", "results"), f"no finished runs with metrics ({seen})"
    )


def check_metric(df: pd.DataFrame, metric: str) -> str:
    available = metric_columns(df)
    if not available:
        raise no_finished_runs(df)
    if metric not in available:
        raise ConfigError(
            "metric", f"{metric!r} is not a metric of these runs; available: {', '.join(available)}"
        )
    return metric


def resolve_column(df: pd.DataFrame, name: str, what: str) -> str:
    """A column by full name, alias or unique last dotted component (`terms` ->
    `model.attention.terms`)."""
    name = ALIASES.get(name, name) if name not in df else name
    if name in df:
        return name
    matches = [c for c in df.columns if isinstance(c, str) and c.rsplit(".", 1)[-1] == name]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ConfigError(what, f"{name!r} is ambiguous: {', '.join(matches)}")
    close = difflib.get_close_matches(name, [str(c) for c in df.columns], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        what, f"{name!r} is not a config field, variant axis or evaluation setting{hint}"
    )


def run_level(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run (the first evaluation setting's row)."""
    return df.drop_duplicates("run_dir") if "run_dir" in df else df


def varies(frame: pd.DataFrame, column: str) -> bool:
    return frame[column].map(normalized).nunique(dropna=False) > 1


def default_rows(df: pd.DataFrame, exclude: Iterable[str] = ()) -> list[str]:
    """What varies between runs, seed excluded: the variant axes, else the flattened config fields
    (of the runs whose config.yaml could be read); the experiment first when there are several. When
    nothing varies: the experiment, or the run (its dir name) for a run trained by `train` alone (no
    experiment). Pass every run, not only the finished ones: a run without results must not take a
    label away. `exclude`: fields that are no row key (best_over's tuned key)."""
    runs = run_level(df)
    axes = [a for a in df.attrs.get("variant_axes", []) if a in df and a != "seed"]
    config = [
        c for c in df.columns if isinstance(c, str) and "." in c and not c.startswith("eval.")
    ]
    configured = runs[runs[config].notna().any(axis=1)] if config else runs
    keys = [c for c in axes if c not in exclude and varies(runs, c)] or [
        c for c in config if c not in exclude and varies(configured, c)
    ]
    named = runs.dropna(subset=["experiment"]) if "experiment" in runs else runs
    if "experiment" in named and varies(named, "experiment"):
        keys.insert(0, "experiment")
    return keys or (["experiment"] if len(named) == len(runs) else ["run_id"])


def left_out_runs(df: pd.DataFrame, metric: str, rows: Iterable[str]) -> list[str]:
    """One line per run without a value of `metric` (so left out of a table): its id, its row label
    and why."""
    # a Series grouped, not a column added: assign would copy a frame of many columns (pandas warns
    # when collect's frame is fragmented)
    scored = pd.Series(np.isfinite(pd.to_numeric(df[metric], errors="coerce")), index=df.index)
    scored = scored.groupby(df["run_dir"]).any()
    lines = []
    for _, run in run_level(df[~df["run_dir"].map(scored)]).iterrows():
        status, reason = run.get("status"), normalized(run.get("reason"))
        if status == "done" or status == "unknown":
            why = (f"{rundir.STATUS} missing or unreadable; " if status == "unknown" else "") + (
                f"{rundir.EVAL} missing or unreadable"
                if rundir.read_eval(run["run_dir"]) is None
                else f"no {metric} in its {rundir.EVAL}"
            )
        else:
            why = f"{status}" + (f": {reason}" if reason else "")
        variant = ", ".join(f"{short_name(k)}={label(run.get(k))}" for k in rows if k != "run_id")
        lines.append(
            f"left out run {run['run_id']}" + (f" ({variant})" if variant else "") + f": {why}"
        )
    return lines


def default_cols(df: pd.DataFrame, rows: list[str]) -> list[str]:
    """Evaluation-setting fields that vary within some row: the natural columns of the table."""
    candidates = [f for f in SETTING_FIELDS if f != "attn_len" and f not in rows and f in df]
    # the row key as a Series to group by, not a column added (as in left_out_runs)
    row = pd.Series(
        [tuple(normalized(v) for v in t) for t in df[rows].itertuples(index=False)], index=df.index
    )
    chosen = [
        f
        for f in candidates
        if df[f].groupby(row).agg(lambda s: s.map(normalized).nunique(dropna=False)).max() > 1
    ]
    if "protocol" in chosen:  # same_length is the xl protocol's, not a setting of its own
        chosen = [f for f in chosen if f != "same_length"]
    return chosen


def resolve_options(df: pd.DataFrame, options: TableOptions, spec: dict) -> TableOptions:
    """Command line > the spec's `table:` block > what the finished runs suggest; names checked."""
    opts = options.merged(spec_options(spec))
    metric = check_metric(df, opts.metric or default_metric(df))
    data = finished(df, metric)
    # best_over: the tuned key and the split are chosen per cell, so neither is a default row or
    # column
    tuned = (
        resolve_column(df, opts.best_over, "best_over")
        if opts.best_over not in (None, "none")
        else None
    )
    rows = (
        [resolve_column(df, r, "rows") for r in opts.rows]
        if opts.rows
        else default_rows(df, exclude=(tuned,))
    )
    cols = (
        [resolve_column(df, c, "cols") for c in opts.cols]
        if opts.cols is not None
        else [c for c in default_cols(data, rows) if not (tuned and c in (tuned, "split"))]
    )
    overlap = set(rows) & set(cols)
    if overlap:
        raise ConfigError(
            "cols", f"{', '.join(sorted(overlap))} cannot be both a row and a column key"
        )
    splits = (opts.select_split or "valid", opts.report_split or "test") if tuned else (None, None)
    return TableOptions(
        tuple(rows),
        tuple(cols),
        metric,
        opts.baseline,
        opts.correction or "holm",
        opts.layout or "grid",
        opts.format or "markdown",
        tuned,
        *splits,
        opts.where,
    )


def apply_where(df: pd.DataFrame, where: Iterable[str] | None) -> pd.DataFrame:
    """The rows whose fields have (`FIELD=VALUE`) or do not have (`FIELD!=VALUE`) the values `where`
    asks for, values compared as a table labels them (`max_targets!=2048`, `protocol=sliding`); a
    field that is no column, a malformed condition or a condition no row meets is a one-line
    error."""
    kept = df
    for condition in where or ():
        field, sep, value = str(condition).partition("=")
        negate = field.endswith("!")
        field, value = field.removesuffix("!").strip(), value.strip()
        if not sep or not field:
            raise ConfigError(
                "where", f"{condition!r}: write FIELD=VALUE or FIELD!=VALUE, e.g. max_targets=0"
            )
        column = resolve_column(df, field, "where")
        match = (kept[column].map(label) == value) != negate
        if value in MISSING_WORDS:  # rope_scaling=none: the unscaled settings
            unset = kept[column].map(normalized).isna()
            match = (unset | (kept[column].map(label) == value)) != negate
        if not match.any():
            seen = ", ".join(sorted({label(v) for v in kept[column]})) or "none"
            raise ConfigError(
                "where", f"no row has {column}{'!=' if negate else '='}{value}; values here: {seen}"
            )
        kept = kept[match]
    return kept


SCALING_FIELDS = ("rope_scaling", "rope_scale")
"""A setting's RoPE context extension (eval.settings[].rope_scaling)."""


def unscaled_unless_asked(data: pd.DataFrame, options: TableOptions) -> tuple[pd.DataFrame, str]:
    """The records without RoPE context extension when the resolved rows and columns and --where do
    not name rope_scaling (e.g. a spec's `cols: [segment_len]`), and a caption sentence saying what
    was left out ('' when nothing was). A scaled record is another evaluation of a run at a length
    it also has unscaled (`evaluate --set` adds them): such a cell would average the two, or show a
    scaled value as the plain one."""
    if "rope_scaling" not in data:
        return data, ""
    named = [str(c).partition("=")[0].removesuffix("!").strip() for c in options.where or ()]
    if {short_name(k) for k in (*options.rows, *options.cols, *named)} & set(SCALING_FIELDS):
        return data, ""
    scaled = data["rope_scaling"].map(normalized).notna()
    if scaled.all():  # nothing unscaled to show instead
        return data, ""
    shown = scaled & np.isfinite(pd.to_numeric(data[options.metric], errors="coerce"))
    if not shown.any():  # only records of runs that cannot take it (no metric): nothing lost
        return data[~scaled], ""
    kinds = ", ".join(sorted(set(data.loc[shown, "rope_scaling"])))
    cols = ",".join(short_name(c) for c in options.cols)
    return data[~scaled], (
        f"Left out: {int(shown.sum())} evaluation(s) with RoPE context extension (rope_scaling "
        f"{kinds}); --cols {cols + ',' if cols else ''}rope_scaling shows them."
    )


def finished(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    data = df[np.isfinite(pd.to_numeric(df[metric], errors="coerce"))]
    if data.empty:
        raise no_finished_runs(df)
    return data
