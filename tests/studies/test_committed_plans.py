"""The analysis plans of the committed studies (issue 58): each spec's `analysis:` block run by
`report` on the committed summaries states what the plan declares, each number checked here
against scipy or statsmodels: Table 6's memory test on the designed seeds 0-2 only, with every seed
beside it as exploratory; the fair baselines' 10% line as a TOST on loss.

Run: .venv/bin/python -m pytest tests/studies/test_committed_plans.py -q   (about 10 s)
"""

import math
from pathlib import Path

import pytest
from scipy import stats
from statsmodels.stats.weightstats import ttost_ind

from relpos_ablate.analysis.collect import merge_frames, read_summary
from relpos_ablate.studies import make_report

RESULTS = Path(__file__).resolve().parents[2] / "results"


def section(text: str, role: str, experiment: str, name: str) -> str:
    """The report's section `## ROLE of EXPERIMENT: NAME...` (a report of two studies' summaries
    states each plan under its experiment's name; of one, `## ROLE: NAME...`), up to the next
    heading."""
    heads = (f"## {role} of {experiment}: {name}", f"## {role}: {name}")
    head = next(ln for ln in text.splitlines() if ln.startswith(heads))
    return text.split(head)[1].split("\n## ")[0]


def test_the_committed_plan_tests_memory_on_the_designed_seeds_only():
    """Issue 58: experiments/xl_table6_cpu.yaml declares seeds 0-2; seeds 3-5 were added after a
    look. Its report states memory against no memory (XL, full loss, each at its training attention
    length) on loss over seeds 0-2 as confirmatory, and over every seed beside it as exploratory:
    both Welch tests computed here from the committed summaries."""
    frame = merge_frames(
        read_summary(RESULTS / "xl_context_cpu" / "summary.csv"),
        read_summary(RESULTS / "xl_table6_cpu" / "summary.csv"),
    )
    text = make_report(frame)
    xl = frame[(frame["encoding"] == "xl") & (frame["train.loss_on"] == "full")]
    memory = xl[(xl["protocol"] == "xl") & (xl["attn_len"] == 64)]
    none = xl[(xl["protocol"] == "sliding") & (xl["attn_len"] == 16)]

    def welch(seeds):
        a, b = (s[s["seed"].isin(seeds)]["loss"] for s in (memory, none))
        return stats.ttest_ind(a, b, equal_var=False).pvalue, a.mean() - b.mean()

    designed, everyone = welch([0, 1, 2]), welch(range(6))
    primary = section(text, "Primary", "xl_table6_cpu", "memory beats no memory")
    line = next(ln for ln in primary.splitlines() if ln.startswith("- train.loss_on=full"))
    assert f"difference {designed[1]:.4f}" in line and f"p = {designed[0]:.2g}," in line
    assert "n = 3;" in line and "not significant" in line
    assert "runs of seeds 3, 4, 5 are not among the plan's designed seeds 0, 1, 2" in text
    beside = section(text, "Exploratory", "xl_table6_cpu", "the families with seeds")
    assert f"difference {everyone[1]:.4f}" in beside and f"raw p = {everyone[0]:.2g}" in beside


def test_the_committed_plan_tests_the_ten_percent_line_by_tost():
    """Issue 58: experiments/fair_baselines.yaml declares the study's question, each preset within
    10% of the best at its own best rate, as a TOST on loss at ±0.0953 nats (ln 1.1): xl at its pick
    against stick_breaking at its pick, on test, checked here with statsmodels' ttost_ind."""
    frame = merge_frames(
        read_summary(RESULTS / "fair_baselines_2000" / "summary.csv"),
        read_summary(RESULTS / "fair_baselines" / "summary.csv"),
    )
    assert 0.0953 == pytest.approx(math.log(1.1), abs=5e-5)
    text = make_report(frame)
    test = frame[(frame["experiment"] == "fair_baselines") & (frame["split"] == "test")]
    xl, best = (
        test[(test["encoding"] == name) & (test["train.lr"] == 0.002)]["loss"]
        for name in ("xl", "stick_breaking")
    )
    p = ttost_ind(xl.to_numpy(), best.to_numpy(), -0.0953, 0.0953, usevar="unequal")[0]
    primary = section(text, "Primary", "fair_baselines", "each preset that encodes position")
    line = next(ln for ln in primary.splitlines() if ln.startswith("- train.lr=0.002: xl "))
    assert f"difference {xl.mean() - best.mean():.4f}" in line and f"p = {p:.2g}," in line
    assert "equivalent within ±0.0953" in line
