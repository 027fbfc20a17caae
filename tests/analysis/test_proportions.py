"""The quasi-binomial test of proportions (relpos_ablate/analysis/proportions.py): its deviance,
dispersion and F p-value against the GLM fitted by hand, the separation case a t-test on three
proportions handles with df ~2, its level under the null with seed-to-seed variation, the paired
design, TOST, and the inputs it refuses.

Run: .venv/bin/python -m pytest tests/analysis/test_proportions.py -q
"""

import math
import warnings

import numpy as np
import pytest
from scipy import stats as sp
from scipy.special import expit, xlogy
from statsmodels.genmod.families import Binomial
from statsmodels.genmod.generalized_linear_model import GLM

from relpos_ablate.analysis import proportions as props
from relpos_ablate.analysis.ttests import ALPHA, MIN_SEEDS, TOST
from relpos_ablate.config import ConfigError


def runs(counts, prefix, examples=640):
    return {f"{prefix}{k}": (s, examples) for k, s in enumerate(counts)}


def deviance(s, n, pi):
    """The binomial deviance of counts s of n against fitted proportions pi."""
    return 2 * float(np.sum(xlogy(s, s / (n * pi)) + xlogy(n - s, (n - s) / (n * (1 - pi)))))


def pearson(s, n, pi):
    return float(np.sum((s - n * pi) ** 2 / (n * pi * (1 - pi))))


def irls(design, s, n):
    """Fitted proportions of a logistic regression on counts, by Newton's method (IRLS)."""
    beta = np.zeros(design.shape[1])
    for _ in range(100):
        eta = design @ beta
        weight = n * expit(eta) * (1 - expit(eta))
        working = eta + (s - n * expit(eta)) / weight
        step = np.linalg.solve(design.T @ (weight[:, None] * design), design.T @ (weight * working))
        if np.max(np.abs(step - beta)) < 1e-13:
            break
        beta = step
    return expit(design @ beta)


def test_unpaired_test_matches_the_model_fitted_by_hand():
    # runs of unequal size, spread wider than the binomial: φ > 1 is exercised
    a = {"a0": (560, 640), "a1": (470, 500), "a2": (690, 720)}
    b = {"b0": (540, 640), "b1": (450, 500), "b2": (640, 720)}
    s = np.array([c[0] for c in (*a.values(), *b.values())], dtype=float)
    n = np.array([c[1] for c in (*a.values(), *b.values())], dtype=float)
    # unpaired, the full model has one proportion a side: its fit is the pooled proportion
    p_a, p_b = s[:3].sum() / n[:3].sum(), s[3:].sum() / n[3:].sum()
    full = np.r_[np.full(3, p_a), np.full(3, p_b)]
    null = np.full(6, s.sum() / n.sum())
    drop = deviance(s, n, null) - deviance(s, n, full)
    phi = max(1.0, pearson(s, n, full) / (6 - 2))
    assert phi > 1
    fit = props.quasi_binomial_fit(a, b)
    assert not fit.paired and fit.df == 4
    assert fit.deviance_drop == pytest.approx(drop, rel=1e-8)
    assert fit.dispersion == pytest.approx(phi, rel=1e-8)
    p = sp.f.sf(drop / phi, 1, 4)
    test = props.compare_proportions(a, b)
    assert test.kind == props.QUASI_BINOMIAL and (test.n_a, test.n_b) == (3, 3)
    assert test.p == pytest.approx(p, rel=1e-8)
    se = math.sqrt(phi * (p_a * (1 - p_a) / n[:3].sum() + p_b * (1 - p_b) / n[3:].sum()))
    half = sp.t.ppf(0.975, 4) * se
    assert test.difference == pytest.approx(p_a - p_b)
    assert test.ci == pytest.approx((p_a - p_b - half, p_a - p_b + half), rel=1e-8)
    assert math.isnan(test.spread) and math.isnan(test.detectable())


def test_paired_test_matches_the_model_fitted_by_hand():
    # the same four runs at two lengths, match by unit (b listed in another order)
    a = {"r0": (402, 640), "r1": (515, 640), "r2": (590, 640), "r3": (470, 640)}
    b = {"r2": (575, 640), "r0": (371, 640), "r3": (468, 640), "r1": (480, 640)}
    units = list(a)
    s = np.array([a[u][0] for u in units] + [b[u][0] for u in units], dtype=float)
    n = np.full(8, 640.0)
    run = np.vstack([np.eye(4)] * 2)
    side = np.r_[np.ones(4), np.zeros(4)]
    full = irls(np.column_stack([run, side]), s, n)
    null = np.tile((s[:4] + s[4:]) / (n[:4] + n[4:]), 2)  # run effects only: each run's pooled rate
    drop = deviance(s, n, null) - deviance(s, n, full)
    phi = max(1.0, pearson(s, n, full) / (8 - 5))
    fit = props.quasi_binomial_fit(a, b)
    assert fit.paired and fit.df == 3
    assert fit.deviance_drop == pytest.approx(drop, rel=1e-8)
    assert fit.dispersion == pytest.approx(phi, rel=1e-8)
    assert fit.p == pytest.approx(sp.f.sf(drop / phi, 1, 3), rel=1e-8)
    rate_a, rate_b = s[:4] / 640, s[4:] / 640
    d = rate_a - rate_b
    se = math.sqrt(phi * np.sum(rate_a * (1 - rate_a) / 640 + rate_b * (1 - rate_b) / 640)) / 4
    test = props.compare_proportions(a, b)
    assert test.difference == pytest.approx(d.mean())
    half = sp.t.ppf(0.975, 3) * se
    assert test.ci == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-8)


def test_a_run_right_on_both_sides_adds_no_residual_df():
    a = {"r0": (402, 640), "r1": (515, 640), "r2": (590, 640)}
    b = {"r0": (371, 640), "r1": (480, 640), "r2": (575, 640)}
    without = props.quasi_binomial_fit(a, b)
    with_run = props.quasi_binomial_fit({**a, "r3": (640, 640)}, {**b, "r3": (640, 640)})
    assert (with_run.df, with_run.n_a) == (without.df, 4)
    assert with_run.deviance_drop == pytest.approx(without.deviance_drop, rel=1e-8)
    assert with_run.dispersion == pytest.approx(without.dispersion, rel=1e-8)
    # the difference is the mean over every shared run: the fourth adds a 0
    assert with_run.difference == pytest.approx(without.difference * 3 / 4)


def test_separation_gets_a_finite_likelihood_ratio_test():
    a, b = runs([640, 640, 640], "a"), runs([600, 610, 605], "b")
    # the motivation: on the three proportions, one side is constant and Welch's df falls to 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy: a constant side, precision loss
        welch = sp.ttest_ind([1.0] * 3, [600 / 640, 610 / 640, 605 / 640], equal_var=False)
    assert welch.df == pytest.approx(2.0)
    # and a Wald test of the same GLM is lost to separation (Hauck-Donner): its SE runs away
    endog = np.array([[c, 640 - c] for c in (640, 640, 640, 600, 610, 605)], dtype=float)
    design = np.column_stack([np.ones(6), np.r_[np.ones(3), np.zeros(3)]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wald = GLM(endog, design, family=Binomial()).fit()
    assert wald.bse[1] > 100 and wald.pvalues[1] > 0.5
    test = props.compare_proportions(a, b)
    assert math.isfinite(test.p) and test.p < 0.05
    assert test.ci[0] > 0 and test.difference == pytest.approx(1 - 1815 / 1920)


def test_equal_rates_are_not_found_different():
    rng = np.random.default_rng(0)
    draw = rng.binomial(640, 0.95, size=6)
    test = props.compare_proportions(runs(draw[:3], "a"), runs(draw[3:], "b"))
    assert test.p > 0.05 and test.ci[0] < 0 < test.ci[1]


def test_level_under_the_null_with_seed_to_seed_variation():
    # each run's own rate drawn from a beta around 0.9 (seed sd ~0.015, φ ~2.6 at 640 examples),
    # its examples binomial on that rate: both sides the same distribution
    rng = np.random.default_rng(1)
    mean, concentration = 0.9, 399

    def side(prefix):
        rates = rng.beta(mean * concentration, (1 - mean) * concentration, size=3)
        return runs(rng.binomial(640, rates), prefix)

    p = np.array([props.compare_proportions(side("a"), side("b")).p for _ in range(300)])
    assert np.mean(p < 0.05) <= 0.08
    assert np.median(p) > 0.25


def test_paired_design_removes_the_run_effect():
    # three seeds far apart (logits -0.5, 1, 2.5); side a adds 0.3 to the logit in every run
    rng = np.random.default_rng(3)
    run_logit = np.array([-0.5, 1.0, 2.5])
    draw_a = rng.binomial(2000, expit(run_logit + 0.3))
    draw_b = rng.binomial(2000, expit(run_logit))
    paired = props.compare_proportions(runs(draw_a, "r", 2000), runs(draw_b, "r", 2000))
    unpaired = props.compare_proportions(runs(draw_a, "a", 2000), runs(draw_b, "b", 2000))
    assert paired.p < 0.05 < unpaired.p
    assert paired.ci[0] > 0 and unpaired.ci[0] < 0 < unpaired.ci[1]
    reordered = dict(reversed(list(runs(draw_b, "r", 2000).items())))
    assert props.compare_proportions(runs(draw_a, "r", 2000), reordered).p == pytest.approx(
        paired.p
    )


def test_tost_on_the_models_standard_error():
    rng = np.random.default_rng(4)
    a = runs(rng.binomial(20000, 0.9, size=3), "a", 20000)
    close = runs(rng.binomial(20000, 0.9, size=3), "b", 20000)
    far = runs(rng.binomial(20000, 0.95, size=3), "b", 20000)
    margin = 0.01
    same = props.proportion_equivalence(a, close, margin)
    assert same.kind == TOST and same.margin == margin and same.p < 0.05
    assert props.proportion_equivalence(a, far, margin).p > 0.05
    fit = props.quasi_binomial_fit(a, close)
    lower = sp.t.sf((fit.difference + margin) / fit.se, fit.df)
    upper = sp.t.cdf((fit.difference - margin) / fit.se, fit.df)
    assert same.p == pytest.approx(max(lower, upper), rel=1e-8)
    half = sp.t.ppf(1 - ALPHA, fit.df) * fit.se
    assert same.ci == pytest.approx((fit.difference - half, fit.difference + half), rel=1e-8)
    with pytest.raises(ValueError, match="margin > 0"):
        props.proportion_equivalence(a, close, 0.0)


def test_no_test_and_its_reason():
    right = runs([640] * 3, "a")
    assert props.compare_proportions(right, runs([640] * 3, "b")) is None
    assert props.why_not(right, runs([640] * 3, "b")) == (
        "no spread: every example right on both sides"
    )
    few = runs([600] * (MIN_SEEDS - 1), "b")
    assert props.compare_proportions(right, few) is None
    assert props.why_not(right, few) == "n too small to test"
    # shared runs: two pairs are too few even when a side has more runs
    assert props.why_not(runs([600, 610, 620], "r"), runs([590, 600], "r")) == (
        "n too small to test"
    )
    # one shared run varies, two are right on both sides: nothing left to estimate φ on
    a, b = runs([640, 640, 600], "r"), runs([640, 640, 620], "r")
    assert props.compare_proportions(a, b) is None
    assert props.why_not(a, b).startswith("no residual degrees of freedom")
    # a run without the value is missing, as NaN is for a t-test
    assert (
        props.why_not({**runs([600, 610, 620], "a"), "a9": None}, runs([600, 610, 620], "b")) == ""
    )


@pytest.mark.parametrize(
    "value, words",
    [((600.5, 640), "successes 600.5 is not a whole number"), ((641, 640), "got 641 of 640")],
)
def test_bad_counts_are_one_line_errors(value, words):
    with pytest.raises(ConfigError, match=words) as err:
        props.compare_proportions({**runs([600, 610], "a"), "a2": value}, runs([600] * 3, "b"))
    assert err.value.field == "examples" and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="examples must be > 0"):
        props.why_not(runs([0, 0, 0], "a", examples=0), runs([600] * 3, "b"))
    # a whole float is a count (a CSV's 600.0)
    assert props.why_not(runs([600.0, 610.0, 620.0], "a"), runs([600] * 3, "b")) == ""


def test_counts_from_a_summary_rate():
    assert props.counts_from(638 / 640, 640) == 638
    assert props.counts_from(0.0, 640) == 0
    for rate in (0.9971, 1.2):
        with pytest.raises(ConfigError) as err:
            props.counts_from(rate, 640)
        assert err.value.field == "examples" and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not a whole number"):
        props.counts_from(0.5, 640.5)
