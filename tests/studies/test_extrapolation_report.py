"""The alibi_extrapolation_cpu report (relpos_ablate/studies/extrapolation.py) on a fixture frame,
its numbers checked against values computed here by hand: each test by scipy (paired for the same
runs measured two ways, Welch's for two encodings), each section's adjusted p by statsmodels' Holm
over the raw p-values of that section computed here; `table --where` and summary.csv's restored
attrs.

Run: .venv/bin/python -m pytest tests/studies/test_extrapolation_report.py -q
"""

import math
import statistics

import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.cli import main
from relpos_ablate.studies import make_report
from relpos_ablate.studies.extrapolation import report

# (encoding, seed) -> ppl at L, 2L under non_overlapping, and at 2L under sliding (stride L)
PPL = {
    ("alibi", 0): (6.50, 6.40, 6.35),
    ("alibi", 1): (6.60, 6.52, 6.45),
    ("alibi", 2): (6.55, 6.47, 6.41),
    ("t5", 0): (6.60, 7.10, 7.60),
    ("t5", 1): (6.70, 7.30, 7.70),
    ("t5", 2): (6.65, 7.20, 7.65),
    ("rope", 0): (6.10, 6.70, 7.20),
    ("rope", 1): (6.20, 6.75, 7.10),
    ("rope", 2): (6.15, 6.60, 7.15),
}
APPB = {
    "alibi": {1: 6.20, 64: 6.40, "2L": 6.21},
    "t5": {1: 6.50, 64: 6.45, "2L": 6.60},
    "rope": {1: 6.0, 64: 6.1, "2L": 6.3},
}
APPB_SEEDS = {1: (0.0, 0.01, 0.02), 64: (0.0, 0.02, 0.01), "2L": (0.02, 0.0, 0.01)}
"""Seed s of an App. B setting is APPB's value + APPB_SEEDS[setting][s]: the same runs, their
differences between settings varying by seed (a paired test needs a spread of differences)."""


def appb(encoding, setting):
    return [APPB[encoding][setting] + d for d in APPB_SEEDS[setting]]


def record(encoding, seed, protocol, length, ppl, stride=None, max_targets=0, buckets=(32, 128)):
    return {
        "run_id": f"{encoding}{seed}",
        "experiment": "alibi_extrapolation_cpu",
        "status": "done",
        "seed": seed,
        "encoding": encoding,
        "protocol": protocol,
        "segment_len": length,
        "stride": stride,
        "rope_scaling": None,
        "max_targets": max_targets,
        "ppl": ppl,
        "run_dir": f"runs/{encoding}{seed}",
        "train.segment_len": 64,
        "model.attention.num_buckets": buckets[0],
        "model.attention.max_distance": buckets[1],
    }


def ppl_frame() -> pd.DataFrame:
    """The rows of PPL and APPB as collect() would give them."""
    rows = []
    for (encoding, seed), (at_l, plain, sliding) in PPL.items():
        buckets = (16, 16) if encoding == "t5" else (32, 128)
        rows += [
            record(encoding, seed, "non_overlapping", 64, at_l, buckets=buckets),
            record(encoding, seed, "non_overlapping", 128, plain, buckets=buckets),
            record(encoding, seed, "sliding", 64, at_l, stride=64, buckets=buckets),
            record(encoding, seed, "sliding", 128, sliding, stride=64, buckets=buckets),
        ]
        sweep = APPB[encoding]
        rows += [
            record(
                encoding,
                seed,
                "sliding",
                64,
                sweep[s] + APPB_SEEDS[s][seed],
                stride=s,
                max_targets=2048,
                buckets=buckets,
            )
            for s in (1, 64)
        ]
        rows.append(
            record(
                encoding,
                seed,
                "non_overlapping",
                128,
                sweep["2L"] + APPB_SEEDS["2L"][seed],
                max_targets=2048,
                buckets=buckets,
            )
        )
    return pd.DataFrame(rows)


@pytest.fixture
def frame():
    return ppl_frame()


@pytest.fixture(scope="module")
def text():
    """The report on ppl_frame(), written once for the tests that read it (each writing is seconds
    of tests)."""
    return report(ppl_frame())


def cell(text: str, row_start: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(row_start)]
    return [c.strip() for c in line.strip("|").split("|")]


def t_test(a, b, paired):
    """(mean difference a - b, its 95% CI, two-sided p) by scipy: paired over the seeds, or
    Welch's."""
    result = stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)
    ci = result.confidence_interval(0.95)
    return statistics.mean(a) - statistics.mean(b), (ci.low, ci.high), result.pvalue


def holm(p_values):
    """The family's Holm-adjusted p-values (statsmodels)."""
    return list(multipletests(p_values, alpha=0.05, method="holm")[1])


def said(name_a, name_b, difference, p, adjusted):
    """The verdict's first words for lower-is-better values."""
    if adjusted < 0.05:
        return f"{name_a if difference < 0 else name_b} better"
    return "not significant after correction" if p < 0.05 else "not significant"


def short(name_a, name_b, test, adjusted, decimals=2):
    """A table cell's verdict: `A better; 95% CI [lo, hi]; p = raw, adj. adjusted` (CI to decimals +
    1)."""
    difference, (lo, hi), p = test
    d = decimals + 1
    return (
        f"{said(name_a, name_b, difference, p, adjusted)}; 95% CI [{lo:.{d}f}, {hi:.{d}f}]; p "
        f"= {p:.2g}, adj. {adjusted:.2g}"
    )


def sentence(name_a, a, name_b, b, test, kind, adjusted, decimals=2):
    """A stated comparison: `A 6.41, B 6.52: A better (paired t-test, difference ..., 95% CI [...],
    n = 3; p = ..., Holm-adjusted p = ...)`."""
    difference, (lo, hi), p = test
    d = decimals + 1
    return (
        f"{name_a} {statistics.mean(a):.{decimals}f}, {name_b} {statistics.mean(b):.{decimals}f}: "
        f"{said(name_a, name_b, difference, p, adjusted)} ({kind}, difference {difference:.{d}f}, "
        f"95% CI [{lo:.{d}f}, {hi:.{d}f}], n = {len(a)}; p = {p:.2g}, Holm-adjusted p = "
        f"{adjusted:.2g})"
    )


def test_ratios_to_l_and_sliding_minus_non_overlapping_paired_on_the_runs(text):
    """Sliding and non-overlapping scores of one encoding are the same runs: a paired t-test over
    them, the section's three tests (one per encoding at 2L) Holm-corrected together."""
    alibi = [PPL[("alibi", s)] for s in range(3)]
    ratio = statistics.mean(p[1] / p[0] for p in alibi)
    assert cell(text, "| alibi | non_overlapping |")[2:] == [
        f"{statistics.mean(p[0] for p in alibi):.2f} (1.000)",
        f"{statistics.mean(p[1] for p in alibi):.2f} ({ratio:.3f})",
    ]
    encodings = ("alibi", "t5", "rope")
    sliding = {e: [PPL[(e, s)][2] for s in range(3)] for e in encodings}
    plain = {e: [PPL[(e, s)][1] for s in range(3)] for e in encodings}
    tests = {e: t_test(sliding[e], plain[e], paired=True) for e in encodings}
    adjusted = dict(zip(encodings, holm([tests[e][2] for e in encodings])))
    for encoding in encodings:
        delta = statistics.mean(sliding[encoding]) - statistics.mean(plain[encoding])
        verdict = short("sliding", "non-overlapping", tests[encoding], adjusted[encoding])
        assert (
            cell(text, f"| {encoding} | {'+' if delta > 0 else '-'}")[1]
            == f"{delta:+.2f} ({verdict})"
        )
    assert (
        'Family "sliding vs non-overlapping, each encoding at each length": 3 tests (paired t-test)'
        in text
    )
    # alibi's 0.06 lower is within its seeds' spread (Welch's test, for different models, would not
    # see it), but every run is 0.05 to 0.07 lower: paired on the runs it holds, after the
    # correction too
    assert stats.ttest_ind(sliding["alibi"], plain["alibi"], equal_var=False).pvalue > 0.05
    assert adjusted["alibi"] < 0.05 and "| alibi | -0.06 (sliding better; " in text


def test_t5_against_rope_and_the_buckets_it_was_trained_with(text):
    t5 = [PPL[("t5", s)][1] / PPL[("t5", s)][0] for s in range(3)]
    rope = [PPL[("rope", s)][1] / PPL[("rope", s)][0] for s in range(3)]
    # two encodings: Welch's; the section's only test, so Holm leaves p
    test = t_test(t5, rope, paired=False)
    verdict = short("t5", "rope", test, holm([test[2]])[0], decimals=3)
    assert cell(text, "| 2L |") == [
        "2L",
        f"{statistics.mean(t5):.3f}",
        f"{statistics.mean(rope):.3f}",
        verdict,
    ]
    assert (
        'Family "T5 vs rotary, ppl at nL over ppl at L, each length": 1 test (Welch\'s t-test)'
        in text
    )
    # 16 causal buckets (8 exact), max_distance 16: 8 + floor(log(n / 8) / log(2) * 8) reaches 15 at
    # n = 15
    far = min(n for n in range(8, 64) if 8 + int(math.log(n / 8) / math.log(2) * 8) >= 15)
    assert (
        f"num_buckets 16, max_distance 16 (0.25 L): the far bucket 15 starts at distance {far} "
        f"({far / 64:.2f} L); at L = 64, distances {far}..63 train it." in text
    )
    # 32 buckets, 128
    paper = min(n for n in range(16, 512) if 16 + int(math.log(n / 16) / math.log(8) * 16) >= 31)
    assert f"starts at distance {paper} ({paper / 512:.2f} L); max_distance = 0.25 L." in text
    # only t5's own runs
    assert "num_buckets 32" not in text.split("## T5's buckets")[1].split("##")[0]


def test_app_b_compares_strides_and_2l_on_the_same_targets(text):
    """Every App. B column scores the same runs: paired t-tests, the section's six (stride 1 vs
    stride L and vs non-overlapping 2L, each encoding) Holm-corrected together."""
    assert "ppl on the first 2,048 targets" in text
    row = cell(text, "| alibi | 6.4")  # stride 64, then 1, then non-overlapping 2L
    one, full, two = appb("alibi", 1), appb("alibi", 64), appb("alibi", "2L")
    assert row[1:4] == [
        f"{statistics.mean(full):.3f}",
        f"{statistics.mean(one):.3f}",
        f"{statistics.mean(two):.3f}",
    ]
    tests = [t_test(appb(e, 1), appb(e, other), paired=True) for e in APPB for other in (64, "2L")]
    adjusted = holm([t[2] for t in tests])
    assert row[4] == short("stride 1", "stride 64", tests[0], adjusted[0], decimals=3)
    assert row[5] == short("stride 1", "non-overlapping", tests[1], adjusted[1], decimals=3)
    assert row[4].startswith("stride 1 better; ")
    # stride 1 and non-overlapping at 2L: 6.21 vs 6.22
    assert row[5].startswith("not significant; ")
    assert (
        'Family "App. B: stride 1 vs stride L and vs the longest non-overlapping segment, '
        'each encoding": 6 tests (paired t-test), Holm-corrected at α = 0.05' in text
    )


def test_the_trends_pair_one_encoding_at_two_lengths_and_welch_two_encodings(text):
    """One family mixing both tests: alibi at 2L against the same runs at L (paired), t5's ratio
    against rope's (Welch's); alibi at 2L against itself at the longest length (also 2L here) has no
    spread: not tested."""
    text = text.split("## The papers' trends, tested")[1]
    t5 = [PPL[("t5", s)][1] / PPL[("t5", s)][0] for s in range(3)]
    rope = [PPL[("rope", s)][1] / PPL[("rope", s)][0] for s in range(3)]
    at_2l, at_l = [PPL[("alibi", s)][1] for s in range(3)], [PPL[("alibi", s)][0] for s in range(3)]
    ratio, alibi = t_test(t5, rope, paired=False), t_test(at_2l, at_l, paired=True)
    adjusted = holm([ratio[2], alibi[2]])
    welch = sentence(
        "t5 2L/L", t5, "rope 2L/L", rope, ratio, "Welch's t-test", adjusted[0], decimals=3
    )
    paired = sentence("alibi at 2L", at_2l, "at L", at_l, alibi, "paired t-test", adjusted[1])
    assert f"| T5 degrades later than rotary | {welch} |" in text
    assert f"| ALiBi improves up to ~2L | {paired} |" in text
    # the runs stop at 2L: nothing after it to compare
    assert "ALiBi degrades slowly after ~2L" not in text
    assert (
        "Family \"the papers' trends\": 2 tests (Welch's t-test, paired t-test), Holm-corrected"
        in text
    )


def test_the_report_is_registered_and_reads_summary_csv_with_its_attrs(frame, text, tmp_path):
    path = tmp_path / "summary.csv"
    frame.to_csv(path, index=False)
    assert make_report(read_summary(path)) == text
    make_run(
        tmp_path / "res",
        ["model.attention.terms=a", "model.attention.bias=alibi"],
        variant={"encoding": "alibi"},
        results=[({"segment_len": 8}, {"ppl": 3.0, "loss": 1.1})],
    )
    collected = collect(tmp_path / "res")
    collected.to_csv(tmp_path / "collected.csv", index=False)
    restored = read_summary(tmp_path / "collected.csv")
    assert restored.attrs["variant_axes"] == collected.attrs["variant_axes"] == ["encoding"]
    assert restored.attrs["metrics"] == collected.attrs["metrics"] == ["ppl", "loss"]


def test_table_where_keeps_the_settings_asked_for(tmp_path, capsys):
    for encoding, bias in (("alibi", "alibi"), ("t5", "t5")):
        make_run(
            tmp_path,
            [
                "model.attention.terms=a",
                f"model.attention.bias={bias}",
                "train.segment_len=8",
                "data.offset=2",
            ],
            variant={"encoding": encoding},
            results=[
                ({"segment_len": 8}, {"ppl": 3.0}),
                ({"segment_len": 8, "protocol": "sliding", "stride": 8}, {"ppl": 3.0}),
                (
                    {"segment_len": 8, "protocol": "sliding", "stride": 1, "max_targets": 64},
                    {"ppl": 2.5},
                ),
                (
                    {"segment_len": 8, "protocol": "sliding", "stride": 8, "max_targets": 64},
                    {"ppl": 2.9},
                ),
            ],
        )
    assert (
        main(["table", str(tmp_path / "demo"), "--where", "max_targets=64", "--cols", "stride"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0] == "| encoding | stride 1 | stride 8 |"
        and "| alibi | **2.50** | **2.90** |" in out
    )
    assert (
        main(
            [
                "table",
                str(tmp_path / "demo"),
                "--where",
                "max_targets!=64",
                "--cols",
                "protocol",
                "stride",
            ]
        )
        == 0
    )
    assert (
        capsys.readouterr().out.splitlines()[0]
        == "| encoding | non_overlapping | sliding, stride 8 |"
    )
    assert main(["table", str(tmp_path / "demo"), "--where", "max_targets=7"]) == 2
    assert "error: where: no row has max_targets=7; values here: 0, 64" in capsys.readouterr().err


LADDER = {
    "alibi": {32: (1.80, 1.81, 1.79), 64: (1.84, 1.86, 1.83)},
    "rope": {32: (1.90, 1.92, 1.91), 64: (1.85, 1.86, 1.86)},
}
"""ladder_loss (nats) per seed at an exact context c, on the targets every window scores in full:
ALiBi's is lowest at 32 (the puzzle App. B's strides show), RoPE's at L."""


def test_exact_context_explains_a_stride_beating_stride_1(frame):
    """ppl = exp(ladder_loss) at each c, mean over seeds; the best c against c = L and App. B's best
    stride against stride 1, both paired over the runs, one Holm family; encodings without a ladder
    are left out."""
    rows = [
        {
            **record(e, seed, "sliding", c, 9.9, stride=1, max_targets=2048),
            "ladder_loss": losses[seed],
            "ladder_targets": 1544,
        }
        for e, by_c in LADDER.items()
        for c, losses in by_c.items()
        for seed in range(3)
        if c != 64
    ]
    data = frame.copy()
    data["ladder_loss"], data["ladder_targets"] = math.nan, math.nan
    for (
        e,
        by_c,
    ) in LADDER.items():  # c = L is App. B's stride-1 setting itself: its rows get the ladder loss
        for seed in range(3):
            at = (data["encoding"] == e) & (data["seed"] == seed) & (data["stride"] == 1)
            data.loc[at, ["ladder_loss", "ladder_targets"]] = [by_c[64][seed], 1544]
    text = report(pd.concat([data, pd.DataFrame(rows)], ignore_index=True))
    section = text.split("## Loss at an exact context")[1].split("\n## ")[0]
    ppl = {
        e: {c: [math.exp(v) for v in losses] for c, losses in by_c.items()}
        for e, by_c in LADDER.items()
    }
    alibi = cell(section, "| alibi")
    assert alibi[1:3] == [f"{statistics.mean(ppl['alibi'][c]):.3f}" for c in (32, 64)]
    at_c = t_test(ppl["alibi"][32], ppl["alibi"][64], paired=True)
    # App. B's sweep at L (stride 1 and 64, APPB): ALiBi and RoPE are best at stride 1, so the
    # family holds the one test of ALiBi's best c (T5, best at stride 64, has no ladder and no row
    # here)
    assert alibi[3] == short("c = 32", "c = 64", at_c, holm([at_c[2]])[0], decimals=3)
    assert alibi[4] == "best at stride 1"
    rope = cell(section, "| rope")
    assert rope[3] == "best at c = L" and rope[4] == "best at stride 1"
    assert "| t5" not in section  # no ladder: not in this section
    assert "on the 1,544 targets" in section and 'Family "exact context' in section
