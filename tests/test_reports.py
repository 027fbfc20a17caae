"""`relpos-ablate report`: a study's report function, picked by the experiment its runs belong to, reads
the collected frame or the committed summary.csv alike; `ordering` states an ordering only when Welch's
t-test supports it.

Run: .venv/bin/python -m pytest tests/test_reports.py -q
"""

import pandas as pd
import pytest
from scipy import stats as scipy_stats

from fixtures.report_runs import make_grid
from relpos_ablate.analysis import collect, reports, stats
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError


def mean_ppl(df: pd.DataFrame) -> str:
    return "".join(f"{enc}: {ppl:.3f}\n" for enc, ppl in df.groupby("encoding")["ppl"].mean().items())


@pytest.fixture
def grid(tmp_path, monkeypatch):
    monkeypatch.setitem(reports.REPORTS, "demo", mean_ppl)
    make_grid(tmp_path, {("xl", 0): [6.0, 6.2], ("xl", 1): [6.2, 6.4], ("alibi", 0): [7.0, 7.0]})
    return tmp_path


def test_the_report_reads_the_results_dir_and_its_summary_csv_alike(grid, capsys):
    assert main(["report", str(grid / "demo")]) == 0
    from_runs = capsys.readouterr().out
    assert from_runs == "alibi: 7.000\nxl: 6.200\n"  # (6.0 + 6.2 + 6.2 + 6.4) / 4
    assert main(["collect", str(grid / "demo"), "--out", str(grid / "summary.csv")]) == 0
    assert main(["report", str(grid / "summary.csv"), "--out", str(grid / "report.md")]) == 0
    assert (grid / "report.md").read_text() == from_runs


def test_an_experiment_without_a_report_is_one_line(grid, monkeypatch, capsys):
    monkeypatch.delitem(reports.REPORTS, "demo")
    assert main(["report", str(grid / "demo")]) == 2
    assert "no report for experiment 'demo'" in capsys.readouterr().err
    assert main(["report", str(grid / "missing.csv")]) == 2
    with pytest.raises(ConfigError, match="one experiment"):
        reports.make_report(pd.concat([collect(grid), collect(grid).assign(experiment="other")]))


def test_ordering_is_stated_only_when_welch_supports_it():
    low, high = [6.0, 6.1, 5.9], [7.0, 7.2, 6.9]
    p = scipy_stats.ttest_ind(low, high, equal_var=False).pvalue
    assert p < 0.05
    assert stats.ordering("xl", low, "alibi", high) == f"xl 6.00, alibi 7.03: xl better (Welch p = {p:.2g})"
    assert stats.ordering("acc_a", low, "acc_b", high, lower_is_better=False).endswith(f"acc_b better (Welch p = {p:.2g})")
    close = [6.0, 6.3, 5.8], [6.1, 5.9, 6.2]
    p = scipy_stats.ttest_ind(*close, equal_var=False).pvalue
    assert p > 0.05
    assert stats.ordering("a", close[0], "b", close[1]).endswith(f"not significant (Welch p = {p:.2g})")
    assert stats.ordering("a", [6.0, 6.1], "b", [7.0, 7.1]).endswith("n too small to test")


def test_a_paired_ordering_tests_the_per_seed_differences():
    """Seeds far apart, each gaining about 0.1: Welch's test sees the spread between seeds, the paired one the gain."""
    short, long = [6.0, 7.0, 8.0], [5.9, 6.92, 7.88]
    assert stats.ordering("long", long, "short", short).endswith("not significant (Welch p = "
                                                                 f"{scipy_stats.ttest_ind(long, short, equal_var=False).pvalue:.2g})")
    p = scipy_stats.ttest_rel(long, short).pvalue
    assert p < 0.05 and stats.ordering("long", long, "short", short, paired=True).endswith(
        f"long better (paired t-test p = {p:.2g})")
    with pytest.raises(ValueError, match="one value per seed"):
        stats.ordering("a", [1.0, 2.0, 3.0], "b", [1.0, 2.0, 3.0, 4.0], paired=True)

