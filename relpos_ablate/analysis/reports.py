"""`relpos-ablate report DIR`: a study's derived numbers as Markdown (its trends next to the paper's,
and the test behind every ordering it states), computed by code from the study's collected frame.

The frame is the one `collect` gives and summary.csv holds, so a committed report.md is regenerated from
the committed summary.csv alone (tests/test_results_numbers.py), and a results README quotes only numbers
that a committed table, report or summary.csv holds: none is typed by hand, none can drift.

A study registers its report function under its experiment name (the grid spec's `name:`) in REPORTS:
one function of the frame, returning Markdown, given as "module:function" (imported when its report is
made: the study's module imports `ordering` from here, so this module cannot import it) or as the function.
Orderings go through `ordering`, which states one only when Welch's t-test supports it.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from relpos_ablate.analysis.tables import MIN_WELCH_SEEDS, welch_p
from relpos_ablate.config import ConfigError

ALPHA = 0.05
"""Significance level of the orderings a report states."""

REPORTS: dict[str, str | Callable[[pd.DataFrame], str]] = {
    "length_generalization": "relpos_ablate.analysis.length_report:length_generalization_report",
}
"""Experiment name -> its report function (the frame of its runs -> Markdown), or where it lives."""


def make_report(df: pd.DataFrame) -> str:
    """The report of the one experiment the frame holds (one line naming what is wrong otherwise)."""
    names = sorted(str(name) for name in df["experiment"].dropna().unique()) if "experiment" in df else []
    if len(names) != 1:
        raise ConfigError("report", f"needs the runs of one experiment; found {names or 'none'}")
    if names[0] not in REPORTS:
        raise ConfigError("report", f"no report for experiment {names[0]!r}; reports exist for: "
                          f"{', '.join(sorted(REPORTS)) or 'none'}")
    report = REPORTS[names[0]]
    if isinstance(report, str):
        module, _, function = report.partition(":")
        report = getattr(importlib.import_module(module), function)
    return report(df)


def read_summary(path) -> pd.DataFrame:
    """A committed summary.csv as the frame `collect` gave (what the report functions read)."""
    return pd.read_csv(path)


def ordering(name_a: str, a: Iterable[float], name_b: str, b: Iterable[float], lower_is_better: bool = True,
             decimals: int = 2) -> str:
    """`A 6.41, B 6.52: A better (Welch p = 0.003)` when Welch's t-test on the seeds supports the ordering at
    ALPHA, else `...: not significant (Welch p = 0.41)`; fewer than MIN_WELCH_SEEDS values a side: `n too
    small to test`; no spread on either side: `no test (no spread)`."""
    a, b = [float(x) for x in a if not math.isnan(x)], [float(x) for x in b if not math.isnan(x)]
    means = ", ".join(f"{name} {np.mean(v):.{decimals}f}" if v else f"{name} -" for name, v in ((name_a, a), (name_b, b)))
    if min(len(a), len(b)) < MIN_WELCH_SEEDS:
        return f"{means}: n too small to test"
    p = welch_p(a, b)
    if math.isnan(p):
        return f"{means}: no test (no spread)"
    if not p < ALPHA:
        return f"{means}: not significant (Welch p = {p:.2g})"
    winner = name_a if (np.mean(a) < np.mean(b)) == lower_is_better else name_b
    return f"{means}: {winner} better (Welch p = {p:.2g})"
