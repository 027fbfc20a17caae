"""`relpos-ablate report DIR`: a study's derived numbers as Markdown (its trends next to the paper's,
and the test behind every ordering it states), computed by code from the study's collected frame.

The frame is the one `collect` gives and summary.csv holds, so a committed report.md is regenerated from
the committed summary.csv alone (tests/test_results_numbers.py), and a results README quotes only numbers
that a committed table, report or summary.csv holds: none is typed by hand, none can drift.

A study's report function is one function of the frame, returning Markdown, listed in REPORTS under its
experiment name (the grid spec's `name:`). Orderings go through stats.ordering, which states one only when
a t-test over seeds supports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from relpos_ablate.analysis.baselines_report import report as fair_baselines_report
from relpos_ablate.analysis.collect import RUN_COLUMNS, SETTING_FIELDS
from relpos_ablate.analysis.extrapolation_report import report as extrapolation_report
from relpos_ablate.analysis.length_report import length_generalization_report
from relpos_ablate.analysis.xl_report import context_report, table6_report
from relpos_ablate.config import ConfigError

REPORTS: dict[str, Callable[[pd.DataFrame], str]] = {
    "xl_table6_cpu": table6_report,
    "xl_context_cpu": context_report,
    "fair_baselines": fair_baselines_report,
    "alibi_extrapolation_cpu": extrapolation_report,
    "length_generalization": length_generalization_report,
}
"""Experiment name -> its report function (the frame of its runs -> Markdown)."""


def make_report(df: pd.DataFrame) -> str:
    """The report of the one experiment the frame holds (one line naming what is wrong otherwise)."""
    names = sorted(str(name) for name in df["experiment"].dropna().unique()) if "experiment" in df else []
    if len(names) != 1:
        raise ConfigError("report", f"needs the runs of one experiment; found {names or 'none'}")
    if names[0] not in REPORTS:
        raise ConfigError("report", f"no report for experiment {names[0]!r}; reports exist for: "
                          f"{', '.join(sorted(REPORTS)) or 'none'}")
    return REPORTS[names[0]](df)


def read_summary(path) -> pd.DataFrame:
    """A committed summary.csv as the frame `collect` gave (what the report functions and the extrapolation
    figure read), its attrs restored from collect's column order: run columns, variant axes, setting fields,
    metrics, then main_metric (analysis/collect.py, _column_order)."""
    frame = pd.read_csv(path)
    columns = list(frame.columns)
    first_setting = min((columns.index(f) for f in SETTING_FIELDS if f in columns), default=len(columns))
    last_setting = max((columns.index(f) for f in SETTING_FIELDS if f in columns), default=-1)
    end = columns.index("main_metric") if "main_metric" in columns else last_setting + 1
    frame.attrs.update(problems=[], results_dir=str(Path(path).parent) if isinstance(path, (str, Path)) else "",
                       variant_axes=[c for c in columns[:first_setting] if c not in RUN_COLUMNS],
                       metrics=columns[last_setting + 1:end])
    return frame
