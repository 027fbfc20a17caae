"""One test of a against b, chosen from the data: the layer under `stats.Family`.

- A sample is a mapping unit -> value, a unit naming the runs a value comes from. Samples that share
  units (`matched`) are the same runs measured two ways: a paired t-test over the shared units
  (`scipy.stats.ttest_rel`); samples with no unit in common come from different models: Welch's
  t-test (`scipy.stats.ttest_ind(equal_var=False)`). `compare` returns the `Test` with the
  difference mean(a) - mean(b), its 95% CI and p; None below MIN_SEEDS values a side or without
  spread.
- `equivalence`: TOST of |mean(a) - mean(b)| < margin (`ttost_paired` / `ttost_ind`), with the 90%
  interval it inverts.
- `adjust`: a family's p-values corrected together (Holm, Benjamini-Hochberg or none:
  `statsmodels.stats.multitest.multipletests`).
- `Test.detectable`: the smallest |difference| the test finds at 80% power given its observed spread
  (`TTestPower` / `TTestIndPower`), effect size times spread.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestIndPower, TTestPower
from statsmodels.stats.weightstats import ttost_ind, ttost_paired

from relpos_ablate.config.base import check_choice

ALPHA = 0.05
"""Significance level of every family (after correction)."""
POWER = 0.8
"""The power at which the smallest detectable difference is stated."""
MIN_SEEDS = 3
"""A test is run only with at least this many values a side (pairs, for a paired test): two seeds
give one degree of freedom, a p-value but not one to star."""
CORRECTIONS = {"holm": "holm", "bh": "fdr_bh", "none": None}
"""`--correction` names -> statsmodels' multipletests method."""
CORRECTION_WORDS = {
    "holm": "Holm-corrected",
    "bh": "Benjamini-Hochberg (FDR) corrected",
    "none": "uncorrected",
}
PAIRED, WELCH, TOST = "paired t-test", "Welch's t-test", "TOST"

Sample = Mapping[Hashable, float]
"""unit -> value; a unit names the run(s) the value comes from."""


@dataclass
class Test:
    """One two-sided test of a - b (or a TOST against a margin); `p_adjusted` is filled by its
    family."""

    kind: str
    n_a: int
    n_b: int
    difference: float
    """mean(a) - mean(b); for a paired test the mean of the per-unit differences (the same
    number)."""
    ci: tuple[float, float]
    p: float
    spread: float
    """The standard deviation the test divides by: of the differences (paired), the pooled one
    (Welch)."""
    margin: float = math.nan
    p_adjusted: float = math.nan

    @property
    def n(self) -> int:
        """Matched pairs (paired) or the smaller side (Welch)."""
        return min(self.n_a, self.n_b)

    def detectable(self, alpha: float = ALPHA, power: float = POWER) -> float:
        """The smallest |difference| this test would find at `power` (two-sided, level alpha), given
        the observed spread; NaN where no sample size of this design reaches it or the spread is
        zero."""
        if not self.spread > 0:
            return math.nan
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self.kind == WELCH:
                    effect = TTestIndPower().solve_power(
                        nobs1=self.n_a, ratio=self.n_b / self.n_a, alpha=alpha, power=power
                    )
                else:
                    effect = TTestPower().solve_power(nobs=self.n, alpha=alpha, power=power)
        except (ValueError, RuntimeError):
            return math.nan
        effect = float(np.squeeze(effect))
        return effect * self.spread if math.isfinite(effect) and effect > 0 else math.nan


def matched(a: Sample, b: Sample) -> list[Hashable]:
    """The units both samples measured, in a's order: non-empty means the same runs (a paired
    test)."""
    return [unit for unit in a if unit in b]


def finite(sample: Sample) -> dict:
    """The sample without its missing values (None, NaN), as floats."""
    return {
        unit: float(v) for unit, v in sample.items() if v is not None and not math.isnan(float(v))
    }


def compare(a: Sample, b: Sample) -> Test | None:
    """The t-test of a against b the data calls for (module docstring); None when a side has fewer
    than MIN_SEEDS values (pairs) or the values do not vary (no spread: no t statistic). Samples
    that share only some units (a run missing one of the two measurements) are paired over the units
    they share; NaN values count as missing."""
    # near-identical seeds: scipy warns of precision loss, the test stands
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return _compare(finite(a), finite(b))


def _compare(a: dict, b: dict) -> Test | None:
    units = matched(a, b)
    if units:
        x, y = np.array([a[u] for u in units]), np.array([b[u] for u in units])
        if len(units) < MIN_SEEDS or _constant(x - y):
            return None
        result = stats.ttest_rel(x, y)
        ci = result.confidence_interval(1 - ALPHA)
        return Test(
            PAIRED,
            len(units),
            len(units),
            float(np.mean(x - y)),
            (float(ci.low), float(ci.high)),
            float(result.pvalue),
            float(np.std(x - y, ddof=1)),
        )
    x, y = np.array(list(a.values())), np.array(list(b.values()))
    if min(len(x), len(y)) < MIN_SEEDS or (_constant(x) and _constant(y)):
        return None
    result = stats.ttest_ind(x, y, equal_var=False)
    ci = result.confidence_interval(1 - ALPHA)
    return Test(
        WELCH,
        len(x),
        len(y),
        float(x.mean() - y.mean()),
        (float(ci.low), float(ci.high)),
        float(result.pvalue),
        float(math.sqrt((x.var(ddof=1) + y.var(ddof=1)) / 2)),
    )


def _constant(values: np.ndarray) -> bool:
    """No spread up to rounding (a t statistic would divide by a rounding error)."""
    return bool(np.ptp(values) <= 1e-12 * max(1.0, float(np.max(np.abs(values)))))


def equivalence(a: Sample, b: Sample, margin: float) -> Test | None:
    """TOST of |mean(a) - mean(b)| < margin (paired over matched units, else Welch's form): a small
    p says the difference lies within ±margin. The interval is the difference's 90% CI, the one TOST
    inverts."""
    if not margin > 0:
        raise ValueError(f"margin: an equivalence test needs a margin > 0; got {margin}")
    base = compare(a, b)
    if base is None:
        return None
    a, b = finite(a), finite(b)
    units = matched(a, b)
    if base.kind == PAIRED:
        x, y = np.array([a[u] for u in units]), np.array([b[u] for u in units])
        p = ttost_paired(x, y, -margin, margin)[0]
        ci = stats.ttest_rel(x, y).confidence_interval(1 - 2 * ALPHA)
    else:
        x, y = np.array(list(a.values())), np.array(list(b.values()))
        p = ttost_ind(x, y, -margin, margin, usevar="unequal")[0]
        ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(1 - 2 * ALPHA)
    return Test(
        TOST,
        base.n_a,
        base.n_b,
        base.difference,
        (float(ci.low), float(ci.high)),
        float(p),
        base.spread,
        margin=margin,
    )


def adjust(p_values: Iterable[float], correction: str = "holm") -> list[float]:
    """The family's adjusted p-values (NaN stays NaN and does not count as a test)."""
    check_choice("correction", correction, CORRECTIONS)
    p = np.asarray(list(p_values), dtype=float)
    out = np.full(p.shape, math.nan)
    tested = ~np.isnan(p)
    if tested.any():
        method = CORRECTIONS[correction]
        if method is not None:
            # statsmodels' Holm ends with gc.collect(), a quarter of a second per family when a
            # report holds its frames: the same numbers without it
            with _without_collect():
                out[tested] = multipletests(p[tested], alpha=ALPHA, method=method)[1]
        else:
            out[tested] = p[tested]
    return [float(x) for x in out]


@contextlib.contextmanager
def _without_collect():
    """gc.collect a no-op for the call (statsmodels imports gc inside multipletests)."""
    saved = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = saved
