"""The statistics behind stars and orderings (relpos_ablate/analysis/stats.py): the test chosen from
the data (paired for the same runs, Welch's for different models), the family's correction against
statsmodels and scipy, confidence intervals and power against their textbook formulas, TOST, and the
table's use of all of it on a grid where paired and Welch's tests disagree.

Run: .venv/bin/python -m pytest tests/analysis/test_stats.py -q
"""

import math
import statistics

import numpy as np
import pytest
from scipy import stats as sp
from statsmodels.stats.multitest import multipletests

from fixtures.report_runs import make_grid
from relpos_ablate.analysis import collect, stats
from relpos_ablate.analysis.render import render
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.studies import make_table

# Three seeds far apart, each improving by about 0.1 from length 32 to 64: the same runs measured
# twice. Paired on the runs the gain is clear; Welch's test (which would treat the lengths as
# different models) sees only the spread between seeds.
SHORT, LONG = [6.0, 7.0, 8.0], [5.9, 6.92, 7.88]


def runs(values, prefix="run"):
    return {f"{prefix}{k}": v for k, v in enumerate(values)}


def test_same_runs_get_a_paired_test_and_different_runs_welch():
    paired = stats.compare(runs(LONG), runs(SHORT))
    welch = stats.compare(runs(LONG, "a"), runs(SHORT, "b"))
    assert paired.kind == stats.PAIRED and welch.kind == stats.WELCH
    assert paired.p == pytest.approx(sp.ttest_rel(LONG, SHORT).pvalue)
    assert welch.p == pytest.approx(sp.ttest_ind(LONG, SHORT, equal_var=False).pvalue)
    assert paired.p < 0.05 < welch.p  # the two choices give opposite verdicts on these numbers


def test_the_paired_test_matches_on_units_not_on_order():
    a = {"r0": 6.0, "r1": 7.0, "r2": 8.0}
    b = {"r2": 7.88, "r0": 5.9, "r1": 6.92}  # another order: the pairs are the runs
    assert stats.compare(b, a).p == pytest.approx(sp.ttest_rel(LONG, SHORT).pvalue)
    # 2 pairs: too few
    assert stats.compare({"r0": 1.0, "r1": 2.0}, {"r0": 1.5, "r1": 2.5, "r2": 3.0}) is None


def test_confidence_intervals_follow_the_t_formulas():
    paired = stats.compare(runs(LONG), runs(SHORT))
    d = np.subtract(LONG, SHORT)
    half = sp.t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    assert paired.difference == pytest.approx(d.mean())
    assert paired.ci == pytest.approx((d.mean() - half, d.mean() + half))
    welch = stats.compare(runs(LONG, "a"), runs(SHORT, "b"))
    va, vb = statistics.variance(LONG) / 3, statistics.variance(SHORT) / 3
    dof = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    half = sp.t.ppf(0.975, dof) * math.sqrt(va + vb)
    diff = statistics.mean(LONG) - statistics.mean(SHORT)
    assert welch.ci == pytest.approx((diff - half, diff + half))


def noncentral_power(effect: float, n: int, alpha: float) -> float:
    """Power of a two-sided one-sample (paired) t-test at standardized effect `effect`, from the
    noncentral t."""
    crit = sp.t.ppf(1 - alpha / 2, n - 1)
    nc = effect * math.sqrt(n)
    return sp.nct.sf(crit, n - 1, nc) + sp.nct.cdf(-crit, n - 1, nc)


def test_the_smallest_detectable_difference_has_80_percent_power():
    test = stats.compare(runs([1.0, 1.3, 0.8, 1.1, 1.2]), runs([0.0, 0.1, -0.1, 0.3, 0.2]))
    assert test.kind == stats.PAIRED
    spread = statistics.stdev(np.subtract([1.0, 1.3, 0.8, 1.1, 1.2], [0.0, 0.1, -0.1, 0.3, 0.2]))
    assert test.spread == pytest.approx(spread)
    smallest = test.detectable(0.05)
    assert noncentral_power(smallest / spread, 5, 0.05) == pytest.approx(0.8, abs=1e-4)
    assert test.detectable(0.01) > smallest  # a stricter level needs a larger difference


def test_power_line_on_fixed_inputs():
    family = stats.Family("fixed")
    family.compare("a", runs([1.0, 1.3, 0.8, 1.1, 1.2]), "b", runs([0.0, 0.1, -0.1, 0.3, 0.2]))
    smallest = family.tests[0].detectable(0.05)
    line = family.power_line()
    assert line.startswith("Power: with n = 5 per side") and f"{smallest:.3g} at α = 0.05" in line
    tiny = stats.Family("tiny")
    tiny.compare("a", runs([1.0, 1.1, 1.3]), "b", runs([0.0, 0.2, 0.1]))
    tiny.compare("a", runs([1.0, 1.1, 1.3], "x"), "b", runs([0.0, 0.2, 0.1], "y"))
    assert "at α/2" in tiny.power_line()


P_VALUES = [0.001, 0.008, 0.039, 0.041, 0.042, 0.06, 0.074, 0.205, 0.212, 0.216]


def test_holm_and_bh_equal_statsmodels_and_scipy():
    holm = stats.adjust(P_VALUES, "holm")
    assert holm == pytest.approx(list(multipletests(P_VALUES, method="holm")[1]))
    # Holm by hand: step k multiplies the k-th smallest by (m - k), kept monotone, capped at 1
    order = np.argsort(P_VALUES)
    running, by_hand = 0.0, np.empty(len(P_VALUES))
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(P_VALUES) - k) * P_VALUES[i]))
        by_hand[i] = running
    assert holm == pytest.approx(list(by_hand))
    assert stats.adjust(P_VALUES, "bh") == pytest.approx(
        list(sp.false_discovery_control(P_VALUES, method="bh"))
    )
    assert stats.adjust(P_VALUES, "none") == P_VALUES
    # an untested cell is not part of the family
    with_nan = stats.adjust([0.01, math.nan, 0.02], "holm")
    assert math.isnan(with_nan[1]) and with_nan[0] == pytest.approx(0.02)
    with pytest.raises(
        ValueError, match="correction: 'bonferroni' is not allowed; choose one of holm, bh, none"
    ):
        stats.adjust(P_VALUES, "bonferroni")


def test_a_family_states_orderings_on_the_adjusted_p():
    family = stats.Family("three tests")
    clear = family.compare("long", runs(LONG), "short", runs(SHORT), decimals=2)
    weak = family.compare("x", runs([1.0, 1.1, 1.2], "x"), "y", runs([1.25, 1.35, 1.45], "y"))
    family.compare("u", runs([1.0, 1.1, 1.2], "u"), "v", runs([1.0, 1.2, 1.1], "v"))  # p = 1
    p = sp.ttest_rel(LONG, SHORT).pvalue
    adjusted = multipletests([p, weak.test.p, 1.0], method="holm")[1]
    text = str(clear)
    assert text.startswith(
        "long 6.90, short 7.00: long better (paired t-test, difference -0.100, 95% CI ["
    )
    assert text.endswith(f"p = {p:.2g}, Holm-adjusted p = {adjusted[0]:.2g})")
    assert weak.test.p < 0.05 < weak.test.p_adjusted
    assert (
        str(weak)
        .split(": ", 1)[1]
        .startswith("not significant after correction (Welch's t-test, difference")
    )
    assert (
        family.heading().startswith('Family "three tests": 3 tests')
        and "Holm-corrected" in family.heading()
    )
    with pytest.raises(RuntimeError, match="already corrected"):
        family.compare("a", runs(LONG), "b", runs(SHORT))


def test_no_test_below_three_seeds_or_without_spread():
    family = stats.Family("small")
    assert str(family.compare("a", runs([6.0, 6.1]), "b", runs([7.0, 7.1], "b"))).endswith(
        "n too small to test"
    )
    assert str(
        family.compare("a", runs([6.0, 6.0, 6.0]), "b", runs([6.0, 6.0, 6.0], "b"))
    ).endswith("no test (no spread)")


def test_equivalence_is_a_tost_against_a_stated_margin():
    a, b = runs([6.30, 6.41, 6.52]), runs([6.35, 6.47, 6.56])
    family = stats.Family("tost")
    inside = family.equivalent("a", a, "b", b, margin=0.1)
    outside = family.equivalent("a", a, "b", b, margin=0.03)
    family.close()
    d = np.subtract([6.30, 6.41, 6.52], [6.35, 6.47, 6.56])
    se = statistics.stdev(d) / math.sqrt(3)
    # the larger one-sided p
    by_hand = max(sp.t.sf((d.mean() + 0.1) / se, 2), sp.t.cdf((d.mean() - 0.1) / se, 2))
    assert inside.test.p == pytest.approx(by_hand)
    assert str(inside).split(": ", 1)[1].startswith("equivalent within ±0.100 (TOST")
    assert str(outside).split(": ", 1)[1].startswith("equivalence not shown (TOST")
    with pytest.raises(ValueError, match="margin"):
        stats.equivalence(a, b, 0)


# ---------------------------------------------------------------- the table


@pytest.fixture
def lengths(tmp_path):
    """alibi, rope, t5 x 3 seeds at 32 and 64: every column's two cells come from the same three
    runs."""
    rng = np.random.default_rng(0)
    ppl = {}
    for k, enc in enumerate(("xl", "alibi")):
        for seed, base in enumerate(SHORT):
            ppl[(enc, seed)] = [base + k, LONG[seed] + k + 0.001 * rng.standard_normal()]
    make_grid(tmp_path, ppl, lengths=(32, 64))
    return collect(tmp_path)


def test_table_pairs_same_run_cells_and_corrects_the_family(lengths):
    table, options = make_table(
        lengths, TableOptions(rows=("segment_len",), cols=("encoding",), baseline="32")
    )
    assert options.correction == "holm"
    frame = lengths[lengths["segment_len"] == 64].sort_values("seed")
    tests = {}
    for enc in ("xl", "alibi"):
        long = frame[frame["encoding"] == enc]["ppl"].tolist()
        short = (
            lengths[(lengths["segment_len"] == 32) & (lengths["encoding"] == enc)]
            .sort_values("seed")["ppl"]
            .tolist()
        )
        tests[enc] = sp.ttest_rel(long, short).pvalue
        assert sp.ttest_ind(long, short, equal_var=False).pvalue > 0.5  # Welch would see nothing
    adjusted = multipletests([tests["xl"], tests["alibi"]], method="holm")[1]
    row = {column.split()[-1]: cell for column, cell in zip(table.columns, table.rows[1][1])}
    assert row["xl"].p_raw == pytest.approx(tests["xl"]) and row["xl"].p == pytest.approx(
        adjusted[0]
    )
    assert row["xl"].stars  # significant after Holm, paired
    text = render(table, "markdown")
    assert "paired t-test" in text and "Welch" not in text.split("Tests:")[1].split("Power")[0]
    assert (
        'Family "every row vs 32, column by column": 2 tests (paired t-test), Holm-corrected'
        in text
    )
    none = make_table(
        lengths,
        TableOptions(rows=("segment_len",), cols=("encoding",), baseline="32", correction="none"),
    )[0]
    assert none.rows[1][1][none.columns.index("encoding xl")].p == pytest.approx(tests["xl"])
    csv = render(table, "csv").splitlines()[0].split(",")
    assert "encoding xl p raw" in csv and "encoding xl p" in csv


def test_table_uses_welch_between_models(lengths):
    table, _ = make_table(
        lengths, TableOptions(rows=("encoding",), cols=("segment_len",), baseline="xl")
    )
    text = render(table, "markdown")
    assert "(here: Welch's t-test)" in text and "paired t-test," not in text


def test_correction_is_checked_and_taken_from_the_spec(lengths, tmp_path, capsys):
    with pytest.raises(ConfigError, match="correction"):
        TableOptions(correction="bonferroni")
    assert (
        main(
            [
                "table",
                str(tmp_path),
                "--rows",
                "segment_len",
                "--cols",
                "encoding",
                "--baseline",
                "32",
                "--correction",
                "bh",
            ]
        )
        == 0
    )
    assert "Benjamini-Hochberg (FDR) corrected" in capsys.readouterr().out


def test_a_single_ordering_chooses_its_test_from_the_data_too():
    p = sp.ttest_rel(LONG, SHORT).pvalue
    assert stats.ordering("long", runs(LONG), "short", runs(SHORT)).startswith(
        "long 6.90, short 7.00: long better (paired t-test, difference -0.100"
    )
    assert stats.ordering("long", runs(LONG), "short", runs(SHORT)).endswith(f"p = {p:.2g})")
    welch = sp.ttest_ind(LONG, SHORT, equal_var=False).pvalue
    assert stats.ordering("long", runs(LONG, "a"), "short", runs(SHORT, "b")).endswith(
        f"p = {welch:.2g})"
    )
    assert "not significant (Welch's t-test" in stats.ordering(
        "long", runs(LONG, "a"), "short", runs(SHORT, "b")
    )
