"""The test behind every ordering a report states: Welch's t-test over seeds at ALPHA."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from relpos_ablate.analysis.tables import MIN_WELCH_SEEDS, welch_p

ALPHA = 0.05
"""Significance level of the orderings a report states."""


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
