"""Accuracies and exact-match rates tested on their examples, with the training run as the unit.

A t-test on three per-seed proportions throws away the examples behind each, and near 0 or 1, where
one side is often constant (1.0, 1.0, 1.0), Welch's df falls to ~2. Here a side is a mapping
unit -> (successes, examples), a unit naming a run as in `ttests.Sample`, and the test is a
quasi-binomial GLM on the run-level counts (statsmodels `GLM`, `Binomial` family, endog =
[successes, failures], one row per run and side):

- **Design**, chosen from the data as in `ttests.compare`. Sides with no unit in common are
  different runs: logit p = b0 + b1·side. Sides that share units are the same runs measured two
  ways: logit p = run + b1·side (the run a categorical fixed effect) over the shared units. A shared
  run with every example right (or every one wrong) on both sides is left out of that fit: its run
  effect absorbs it exactly, so it carries nothing about b1 (the conditional-likelihood view) and
  would only add a residual df with a Pearson residual of 0.
- **Dispersion** φ = max(1, Pearson X² / residual df) of the full model: the seed-to-seed variation
  beyond the binomial, never below it.
- **p**: the likelihood-ratio F test, F = (D_null - D_full) / φ on (1, residual df). Not Wald: a
  side with every example right separates the data, and the Wald SE of b1 grows without bound
  (Hauck-Donner) while the deviance stays finite.
- **Difference and CI**, on the proportion scale (the declared scale of exact match). Unpaired: the
  pooled proportion of a minus that of b (total successes / total examples a side), variance
  φ·(p_a(1-p_a)/N_a + p_b(1-p_b)/N_b). Paired: the mean over the k shared runs of the per-run
  difference (equal to the pooled one when every run has as many examples), variance
  φ/k²·Σ_i (p_ai(1-p_ai)/n_ai + p_bi(1-p_bi)/n_bi): each run's binomial variance of its own
  difference, scaled by the φ of the run + side model, whose Pearson X² is exactly the run-by-side
  variation a per-run difference carries. The 95% CI is Wald on that scale with the t quantile on
  the residual df.
- `proportion_equivalence`: TOST of |difference| < margin with the same SE and df (two one-sided
  t tests; p is the larger), with the 90% interval it inverts.
- No test (None; `why_not` says why, in `stats.Family`'s words): fewer than MIN_SEEDS runs a side
  (shared runs, paired); no binomial variance (every example right, or wrong, on both sides); no
  residual df.
- `counts_from`: a summary row's rate and examples -> the whole count, refusing a rate that is not a
  share of those examples.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.genmod.families import Binomial
from statsmodels.genmod.generalized_linear_model import GLM

from relpos_ablate.analysis.ttests import ALPHA, MIN_SEEDS, TOST, Test, matched
from relpos_ablate.config.base import ConfigError

QUASI_BINOMIAL = "quasi-binomial LR test"
"""`Test.kind` of `compare_proportions`."""
TOO_FEW = "n too small to test"
"""The reason `stats.Family` gives for a side below MIN_SEEDS values."""
COUNT_TOLERANCE = 1e-6
"""How far rate × examples may lie from a whole number and still be read as a count."""

Counts = Mapping[Hashable, tuple[int, int] | None]
"""unit -> (successes, examples) of the run(s) the unit names; None: the run lacks the value."""


@dataclass
class QuasiBinomialFit:
    """The fitted model's numbers behind one `Test` (module docstring)."""

    paired: bool
    n_a: int
    n_b: int
    """Runs a side (shared runs, paired: n_a == n_b)."""
    deviance_drop: float
    """D_null - D_full: the likelihood-ratio statistic before the dispersion."""
    dispersion: float
    """φ = max(1, Pearson X² / df) of the full model."""
    df: int
    """Residual degrees of freedom of the full model: rows - parameters."""
    difference: float
    """Proportion of a - proportion of b (pooled; paired: the mean per-run difference)."""
    se: float
    """The difference's standard error, φ-scaled."""

    @property
    def f(self) -> float:
        return self.deviance_drop / self.dispersion

    @property
    def p(self) -> float:
        return float(stats.f.sf(self.f, 1, self.df))

    def interval(self, level: float) -> tuple[float, float]:
        """The Wald interval on the proportion scale, t quantile on the residual df."""
        half = float(stats.t.ppf(0.5 + level / 2, self.df)) * self.se
        return (self.difference - half, self.difference + half)


def counts_from(rate: float, examples: int) -> int:
    """The number of examples right behind a summary row's rate (exact_match 0.996875 of 640 ->
    638); a ConfigError when rate × examples is not a whole number (within COUNT_TOLERANCE)."""
    where = f"rate {rate!r} of {examples!r} examples"
    n = _examples(examples, where)
    if not 0 <= rate <= 1:
        raise ConfigError("examples", f"{where}: a rate must lie in [0, 1]")
    count = float(rate) * n
    if abs(count - round(count)) > COUNT_TOLERANCE:
        raise ConfigError(
            "examples",
            f"{where}: {count:.9g} examples is not a whole number; the rate is not a share of "
            f"those examples",
        )
    return int(round(count))


def why_not(a: Counts, b: Counts) -> str:
    """Why `compare_proportions(a, b)` is None; empty when there is a test."""
    return _design(a, b).problem()


def quasi_binomial_fit(a: Counts, b: Counts) -> QuasiBinomialFit | None:
    """The quasi-binomial GLM of a against b (module docstring); None where `why_not` says why."""
    design = _design(a, b)
    return None if design.problem() else design.fit()


def compare_proportions(a: Counts, b: Counts) -> Test | None:
    """The quasi-binomial LR test of a against b, paired over shared units, else unpaired: the
    difference of proportions, its 95% CI and p; `spread` is NaN (no t-test power to state). None
    where `why_not` says why."""
    fit = quasi_binomial_fit(a, b)
    if fit is None:
        return None
    return Test(
        QUASI_BINOMIAL, fit.n_a, fit.n_b, fit.difference, fit.interval(1 - ALPHA), fit.p, math.nan
    )


def proportion_equivalence(a: Counts, b: Counts, margin: float) -> Test | None:
    """TOST of |proportion of a - proportion of b| < margin on the quasi-binomial model's SE and df:
    a small p says the difference lies within ±margin. The interval is the 90% one TOST inverts."""
    if not margin > 0:
        raise ValueError(f"margin: an equivalence test needs a margin > 0; got {margin}")
    fit = quasi_binomial_fit(a, b)
    if fit is None:
        return None
    above = stats.t.sf((fit.difference + margin) / fit.se, fit.df)  # H0: difference <= -margin
    below = stats.t.cdf((fit.difference - margin) / fit.se, fit.df)  # H0: difference >= margin
    return Test(
        TOST,
        fit.n_a,
        fit.n_b,
        fit.difference,
        fit.interval(1 - 2 * ALPHA),
        float(max(above, below)),
        math.nan,
        margin=margin,
    )


@dataclass
class _Design:
    """The two sides as the model sees them: paired -> only the shared units, in a's order."""

    paired: bool
    a: dict
    b: dict

    def _rates(self, side: dict) -> np.ndarray:
        return np.array([s / n for s, n in side.values()])

    def _informative(self) -> list:
        """The shared runs the paired fit keeps (not every example right, or wrong, on both
        sides)."""
        return [u for u in self.a if not _same_constant(self.a[u], self.b[u])]

    def df(self) -> int:
        if self.paired:
            return len(self._informative()) - 1  # 2k rows, k run effects + the side
        return len(self.a) + len(self.b) - 2

    def difference(self) -> float:
        if self.paired:
            return float(np.mean(self._rates(self.a) - self._rates(self.b)))
        return _pooled(self.a) - _pooled(self.b)

    def binomial_variance(self) -> float:
        """The difference's variance under a binomial (φ = 1)."""
        if self.paired:
            n_a, n_b = (np.array([n for _, n in side.values()]) for side in (self.a, self.b))
            p_a, p_b = self._rates(self.a), self._rates(self.b)
            terms = p_a * (1 - p_a) / n_a + p_b * (1 - p_b) / n_b
            return float(terms.sum()) / len(self.a) ** 2
        return sum(
            _pooled(side) * (1 - _pooled(side)) / sum(n for _, n in side.values())
            for side in (self.a, self.b)
        )

    def problem(self) -> str:
        if min(len(self.a), len(self.b)) < MIN_SEEDS:
            return TOO_FEW
        if self.binomial_variance() == 0:
            return self._no_spread()
        if self.df() < 1:
            return (
                "no residual degrees of freedom: one shared run varies, the others get every "
                "example right (or every one wrong) on both sides"
            )
        return ""

    def _no_spread(self) -> str:
        rates_a, rates_b = set(self._rates(self.a)), set(self._rates(self.b))
        word = {1.0: "right", 0.0: "wrong"}
        if len(rates_a) == len(rates_b) == 1:
            (p_a,), (p_b,) = rates_a, rates_b
            where = "on both sides" if p_a == p_b else f"in a and {word[p_b]} in b"
            return f"no spread: every example {word[p_a]} {where}"
        return "no spread: every run gets every example right or every one wrong, on each side"

    def _model(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """endog [successes, failures] (rows, 2), the null model's columns, the side column."""
        if self.paired:
            units = self._informative()
            rows = [self.a[u] for u in units] + [self.b[u] for u in units]
            base = np.vstack([np.eye(len(units))] * 2)  # (2k, k): one indicator per run
            in_a = len(units)
        else:
            rows = [*self.a.values(), *self.b.values()]
            base = np.ones((len(rows), 1))  # (rows, 1): the intercept
            in_a = len(self.a)
        successes, examples = np.array(rows, dtype=float).T
        side = (np.arange(len(rows)) < in_a).astype(float)
        return np.column_stack([successes, examples - successes]), base, side

    def fit(self) -> QuasiBinomialFit:
        endog, base, side = self._model()
        # a side with every example right separates the data: statsmodels warns and the fitted
        # proportion goes to 1, which is the deviance's finite limit
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = GLM(endog, np.column_stack([base, side]), family=Binomial()).fit(tol=1e-12)
            null = GLM(endog, base, family=Binomial()).fit(tol=1e-12)
        df = int(round(full.df_resid))
        dispersion = max(1.0, float(full.pearson_chi2) / df)
        return QuasiBinomialFit(
            self.paired,
            len(self.a),
            len(self.b),
            max(0.0, float(null.deviance - full.deviance)),
            dispersion,
            df,
            self.difference(),
            math.sqrt(dispersion * self.binomial_variance()),
        )


def _design(a: Counts, b: Counts) -> _Design:
    a, b = _counts(a, "a"), _counts(b, "b")
    units = matched(a, b)
    if units:
        return _Design(True, {u: a[u] for u in units}, {u: b[u] for u in units})
    return _Design(False, a, b)


def _counts(sample: Counts, side: str) -> dict:
    """The side's runs as unit -> (successes, examples) of ints, checked; None values dropped."""
    out = {}
    for unit, value in sample.items():
        if value is None:
            continue
        where = f"side {side}, unit {unit!r}"
        try:
            successes, examples = value
        except (TypeError, ValueError):
            raise ConfigError(
                "examples", f"{where}: expected (successes, examples); got {value!r}"
            ) from None
        n = _examples(examples, where)
        s = _whole(successes, "successes", where)
        if not 0 <= s <= n:
            raise ConfigError(
                "examples", f"{where}: successes must lie in [0, examples]; got {s} of {n}"
            )
        out[unit] = (s, n)
    return out


def _examples(value, where: str) -> int:
    n = _whole(value, "examples", where)
    if n <= 0:
        raise ConfigError("examples", f"{where}: examples must be > 0; got {n}")
    return n


def _whole(value, what: str, where: str) -> int:
    """A count as an int; never rounded: a non-integral one is an error."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not float(value).is_integer()
    ):
        raise ConfigError(
            "examples",
            f"{where}: {what} {value!r} is not a whole number; give counts of examples "
            f"(counts_from turns a rate into one)",
        )
    return int(value)


def _constant(count: tuple[int, int]) -> bool:
    """Every example right, or every one wrong."""
    return count[0] in (0, count[1])


def _same_constant(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Every example right on both sides, or every one wrong on both."""
    return _constant(a) and _constant(b) and a[0] / a[1] == b[0] / b[1]


def _pooled(side: dict) -> float:
    """Total successes / total examples."""
    return sum(s for s, _ in side.values()) / sum(n for _, n in side.values())
