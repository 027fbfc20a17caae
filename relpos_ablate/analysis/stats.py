"""The test behind every ordering a report states: Welch's t-test over seeds at ALPHA."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
from scipy import stats

from relpos_ablate.analysis.tables import MIN_WELCH_SEEDS, welch_p

ALPHA = 0.05
"""Significance level of the orderings a report states."""


def ordering(name_a: str, a: Iterable[float], name_b: str, b: Iterable[float], lower_is_better: bool = True,
             decimals: int = 2, paired: bool = False) -> str:
    """`A 6.41, B 6.52: A better (Welch p = 0.003)` when a t-test on the seeds supports the ordering at ALPHA,
    else `...: not significant (Welch p = 0.41)`; fewer than MIN_WELCH_SEEDS values a side: `n too small to
    test`; no spread: `no test (no spread)`. Welch's test compares different models; `paired`: the same
    runs measured two ways (a[k] and b[k] from seed k), a paired t-test on the per-seed differences, which
    the seed-to-seed spread of the models does not swamp."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not paired:
        a, b = [x for x in a if not math.isnan(x)], [x for x in b if not math.isnan(x)]
    means = ", ".join(f"{name} {np.nanmean(v):.{decimals}f}" if v else f"{name} -" for name, v in ((name_a, a), (name_b, b)))
    if min(len(a), len(b)) < MIN_WELCH_SEEDS:
        return f"{means}: n too small to test"
    test, p = ("paired t-test", paired_p(a, b)) if paired else ("Welch", welch_p(a, b))
    if math.isnan(p):
        return f"{means}: no test (no spread)"
    if not p < ALPHA:
        return f"{means}: not significant ({test} p = {p:.2g})"
    winner = name_a if (np.mean(a) < np.mean(b)) == lower_is_better else name_b
    return f"{means}: {winner} better ({test} p = {p:.2g})"


def paired_p(a: list[float], b: list[float]) -> float:
    """Two-sided paired t-test p-value of a[k] - b[k]; NaN when the differences do not vary (or NaN appears)."""
    if len(a) != len(b):
        raise ValueError(f"a paired test needs one value per seed on each side; got {len(a)} and {len(b)}")
    differences = np.asarray(a) - np.asarray(b)
    if np.isnan(differences).any() or np.ptp(differences) == 0:
        return math.nan
    return float(stats.ttest_rel(a, b).pvalue)
