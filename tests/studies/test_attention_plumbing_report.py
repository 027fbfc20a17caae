"""The attention-plumbing study's report (relpos_ablate/studies/attention_plumbing.py) on the
committed summary: its plan fixed before the first run, the order of the encodings per variant
recomputed from summary.csv with pandas, and QK-norm's entropy differences against scipy's Welch
test on the committed per-run diagnostics (diagnostics.csv).
Run: .venv/bin/python -m pytest tests/studies/test_attention_plumbing_report.py -q"""

from pathlib import Path

import pandas as pd
import pytest
from scipy import stats

from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.studies import make_report

RESULTS = Path(__file__).resolve().parents[2] / "results" / "attention_plumbing"
pytestmark = pytest.mark.skipif(
    not (RESULTS / "summary.csv").exists(), reason="the study's summary is not committed"
)


@pytest.fixture(scope="module")
def frame():
    return read_summary(RESULTS / "summary.csv")


@pytest.fixture(scope="module")
def report(frame):
    return make_report(frame)


def test_every_family_was_fixed_before_the_first_run(report):
    assert report.count("fixed before the first run") >= 10
    assert "declared after" not in report


def test_the_order_of_the_encodings_is_that_of_the_means(frame, report):
    rows = frame[frame["experiment"] == "attention_plumbing"]
    plain = rows[
        (rows["model.attention.qk_norm"] == "none")
        & (rows["model.attention.output_gate"] == "none")
        & (rows["model.attention.sink_logit"] == "none")
        & (rows["model.attention.canon_width"] == 0)
    ]
    for protocol, length in (("non_overlapping", 64), ("sliding", 512)):
        at = plain[(plain["protocol"] == protocol) & (plain["segment_len"] == length)]
        means = at.groupby("encoding")["ppl"].mean().sort_values()
        assert " < ".join(f"{e} {p:.2f}" for e, p in means.items()) in report


def test_qk_norm_entropy_differences_are_welch_tests_on_the_runs(report):
    runs = pd.read_csv(RESULTS / "diagnostics.csv")
    for encoding in ("nope", "rope", "alibi", "fox"):
        at = runs[(runs["encoding"] == encoding) & (runs["segment_len"] == 512)]
        normed = at[at["variant"] == "QK-norm"]["entropy"]
        plain = at[at["variant"] == "plain"]["entropy"]
        test = stats.ttest_ind(normed, plain, equal_var=False)
        ci = test.confidence_interval(0.95)
        line = next(ln for ln in report.splitlines() if ln.startswith(f"| {encoding} | 512 |"))
        difference = normed.mean() - plain.mean()
        assert f"{difference:+.3f} [{ci.low:+.3f}, {ci.high:+.3f}]" in line
