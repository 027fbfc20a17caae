"""The per-layer schedule study's report (relpos_ablate/studies/hybrid_schedules.py) under its plans
(experiments/hybrid_schedules*.yaml `analysis:`), on the committed summaries, with every number
checked here computed independently: the primary 8L family by scipy's Welch test on the runs' loss
and statsmodels' Holm; the threats' distances and Llama 4's temperature factor from the runs'
config; the long-context note's means from the summary. The task that was not learnt is neither
ranked nor tested, and its plan refuses every comparison.

Run: .venv/bin/python -m pytest tests/studies/test_hybrid_schedules_report.py -q
"""

import math
import re
from pathlib import Path

import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from relpos_ablate.analysis.collect import merge_frames, read_summary
from relpos_ablate.studies import make_report

RESULTS = Path(__file__).resolve().parents[2] / "results"
HYBRIDS = ("rnope", "llama4_like", "gemma3_like")


@pytest.fixture(scope="module")
def text():
    return read_summary(RESULTS / "hybrid_schedules" / "summary.csv")


@pytest.fixture(scope="module")
def task():
    return read_summary(RESULTS / "hybrid_schedules_retrieval" / "summary.csv")


@pytest.fixture(scope="module")
def both(text, task):
    return make_report(merge_frames(task, text))


def section(report: str, heading: str) -> str:
    return report.split(heading, 1)[1].split("\n#", 1)[0]


def test_the_primary_8l_family_is_welch_on_loss_holm_corrected_over_its_6_tests(text, both):
    def losses(encoding, protocol):
        rows = text[
            (text["encoding"] == encoding)
            & (text["protocol"] == protocol)
            & (text["segment_len"] == 512)
        ]
        return rows["loss"].astype(float).to_numpy()

    raw = [
        stats.ttest_ind(losses(h, protocol), losses("rope", protocol), equal_var=False).pvalue
        for protocol in ("non_overlapping", "sliding")
        for h in HYBRIDS
    ]
    adjusted = multipletests(raw, method="holm")[1]
    family = section(both, "## Primary of hybrid_schedules: long context")
    found = [float(p) for p in re.findall(r"Holm-adjusted p = ([\d.e-]+)\)", family)]
    assert found == pytest.approx(list(adjusted), rel=0.05)
    assert max(adjusted) < 0.05 and family.count(" better (") == 6
    assert "declared after the runs" in both.split("## Primary", 1)[0]


def test_the_threats_read_the_local_distances_and_the_temperature_from_the_runs(text, both):
    threats = section(both, "## Threats to validity")
    window = int(text["model.layer_kinds.local.window"].max())
    assert window == 16 and f"distances 0 to {window - 1}" in threats
    peak = 1 + 0.1 * math.log(512 // 16 + 1)
    assert f"scaled by up to {peak:.2f}" in threats and f"{32 * 8192:,} tokens" in threats
    assert "`rnope` 5, `llama4_like` 5, `gemma3_like` 5 are local" in threats


def test_the_task_not_learnt_is_neither_ranked_nor_tested(task, both):
    note = section(both, "### Long-context task: not learnt, not compared")
    inside = task[task["length_max"] == 16].groupby("encoding")["exact_match"].mean()
    for encoding, mean in inside.items():
        assert f"`{encoding}` {mean:.3f}" in note
    assert "|" not in note and "**" not in note and " better" not in note and "p =" not in note
    assert "12 of 12 (seed, bin) cells" in note


def test_the_task_plan_refuses_every_comparison(task):
    report = make_report(task)
    planned = report.split("## Exploratory", 1)[0]
    items = [line for line in planned.splitlines() if line.startswith("- data.task=")]
    assert len(items) == 12 and all("not compared: " in line for line in items)
    assert "0 tests (none run)" in planned and " better (" not in planned
