"""The alibi_extrapolation_cpu report (relpos_ablate/analysis/extrapolation_report.py) on a fixture frame, its
numbers checked against values computed here by hand; `table --where` and summary.csv's restored attrs.

Run: .venv/bin/python -m pytest tests/test_extrapolation_report.py -q
"""

import math
import statistics

import pandas as pd
import pytest
from scipy import stats

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect, reports
from relpos_ablate.analysis.extrapolation_report import report
from relpos_ablate.cli import main

PPL = {  # (encoding, seed) -> ppl at L, 2L under non_overlapping, and at 2L under sliding (stride L)
    ("alibi", 0): (6.50, 6.40, 6.35), ("alibi", 1): (6.60, 6.52, 6.45), ("alibi", 2): (6.55, 6.47, 6.41),
    ("t5", 0): (6.60, 7.10, 7.60), ("t5", 1): (6.70, 7.30, 7.70), ("t5", 2): (6.65, 7.20, 7.65),
    ("rope", 0): (6.10, 6.70, 7.20), ("rope", 1): (6.20, 6.75, 7.10), ("rope", 2): (6.15, 6.60, 7.15),
}
APPB = {"alibi": {1: 6.20, 64: 6.40, "2L": 6.21}, "t5": {1: 6.50, 64: 6.45, "2L": 6.60}, "rope": {1: 6.0, 64: 6.1, "2L": 6.3}}


def record(encoding, seed, protocol, length, ppl, stride=None, max_targets=0, buckets=(32, 128)):
    return {"run_id": f"{encoding}{seed}", "experiment": "alibi_extrapolation_cpu", "status": "done", "seed": seed,
            "encoding": encoding, "protocol": protocol, "segment_len": length, "stride": stride, "rope_scaling": None,
            "max_targets": max_targets, "ppl": ppl, "run_dir": f"runs/{encoding}{seed}", "train.segment_len": 64,
            "model.attention.num_buckets": buckets[0], "model.attention.max_distance": buckets[1]}


@pytest.fixture
def frame():
    rows = []
    for (encoding, seed), (at_l, plain, sliding) in PPL.items():
        buckets = (16, 16) if encoding == "t5" else (32, 128)
        rows += [record(encoding, seed, "non_overlapping", 64, at_l, buckets=buckets),
                 record(encoding, seed, "non_overlapping", 128, plain, buckets=buckets),
                 record(encoding, seed, "sliding", 64, at_l, stride=64, buckets=buckets),
                 record(encoding, seed, "sliding", 128, sliding, stride=64, buckets=buckets)]
        sweep = APPB[encoding]
        rows += [record(encoding, seed, "sliding", 64, sweep[s] + 0.01 * seed, stride=s, max_targets=2048,
                        buckets=buckets) for s in (1, 64)]
        rows.append(record(encoding, seed, "non_overlapping", 128, sweep["2L"] + 0.01 * seed, max_targets=2048,
                           buckets=buckets))
    return pd.DataFrame(rows)


def cell(text: str, row_start: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(row_start)]
    return [c.strip() for c in line.strip("|").split("|")]


def test_ratios_to_l_and_sliding_minus_non_overlapping_with_welch(frame):
    text = report(frame)
    alibi = [PPL[("alibi", s)] for s in range(3)]
    ratio = statistics.mean(p[1] / p[0] for p in alibi)
    assert cell(text, "| alibi | non_overlapping |")[2:] == [f"{statistics.mean(p[0] for p in alibi):.2f} (1.000)",
                                                             f"{statistics.mean(p[1] for p in alibi):.2f} ({ratio:.3f})"]
    for encoding in ("alibi", "t5"):
        values = [PPL[(encoding, s)] for s in range(3)]
        delta = statistics.mean(v[2] for v in values) - statistics.mean(v[1] for v in values)
        p = stats.ttest_ind([v[2] for v in values], [v[1] for v in values], equal_var=False).pvalue
        winner = "sliding" if delta < 0 else "non-overlapping"
        verdict = f"{winner} better (Welch p = {p:.2g})" if p < 0.05 else f"not significant (Welch p = {p:.2g})"
        assert cell(text, f"| {encoding} | {'+' if delta > 0 else '-'}")[1] == f"{delta:+.2f} ({verdict})"
        assert (p < 0.05) == (encoding == "t5")  # alibi's 0.06 lower is within its seeds' spread


def test_t5_against_rope_and_the_buckets_it_was_trained_with(frame):
    text = report(frame)
    t5 = [PPL[("t5", s)][1] / PPL[("t5", s)][0] for s in range(3)]
    rope = [PPL[("rope", s)][1] / PPL[("rope", s)][0] for s in range(3)]
    p = stats.ttest_ind(t5, rope, equal_var=False).pvalue
    verdict = f"t5 better (Welch p = {p:.2g})" if p < 0.05 else f"not significant (Welch p = {p:.2g})"
    assert cell(text, "| 2L |") == ["2L", f"{statistics.mean(t5):.3f}", f"{statistics.mean(rope):.3f}", verdict]
    # 16 causal buckets (8 exact), max_distance 16: 8 + floor(log(n / 8) / log(2) * 8) reaches 15 at n = 15
    far = min(n for n in range(8, 64) if 8 + int(math.log(n / 8) / math.log(2) * 8) >= 15)
    assert f"num_buckets 16, max_distance 16 (0.25 L): the far bucket 15 starts at distance {far} " \
           f"({far / 64:.2f} L); at L = 64, distances {far}..63 train it." in text
    paper = min(n for n in range(16, 512) if 16 + int(math.log(n / 16) / math.log(8) * 16) >= 31)  # 32 buckets, 128
    assert f"starts at distance {paper} ({paper / 512:.2f} L); max_distance = 0.25 L." in text
    assert "num_buckets 32" not in text.split("## T5's buckets")[1].split("##")[0]  # only t5's own runs


def test_app_b_compares_strides_and_2l_on_the_same_targets(frame):
    text = report(frame)
    assert "ppl on the first 2,048 targets" in text
    row = cell(text, "| alibi | 6.4")  # stride 64, then 1, then non-overlapping 2L
    one = [APPB["alibi"][1] + 0.01 * s for s in range(3)]
    full = [APPB["alibi"][64] + 0.01 * s for s in range(3)]
    assert row[1:4] == [f"{statistics.mean(full):.3f}", f"{statistics.mean(one):.3f}",
                        f"{APPB['alibi']['2L'] + 0.01:.3f}"]
    p = stats.ttest_ind(one, full, equal_var=False).pvalue
    assert row[4] == f"stride 1 better (Welch p = {p:.2g})"
    assert row[5].startswith("not significant")  # stride 1 and non-overlapping at 2L: 6.21 vs 6.22, same spread


def test_the_report_is_registered_and_reads_summary_csv_with_its_attrs(frame, tmp_path):
    path = tmp_path / "summary.csv"
    frame.to_csv(path, index=False)
    assert reports.make_report(reports.read_summary(path)) == report(frame)
    make_run(tmp_path / "res", ["model.attention.terms=a", "model.attention.bias=alibi"], variant={"encoding": "alibi"},
             results=[({"segment_len": 8}, {"ppl": 3.0, "loss": 1.1})])
    collected = collect(tmp_path / "res")
    collected.to_csv(tmp_path / "collected.csv", index=False)
    restored = reports.read_summary(tmp_path / "collected.csv")
    assert restored.attrs["variant_axes"] == collected.attrs["variant_axes"] == ["encoding"]
    assert restored.attrs["metrics"] == collected.attrs["metrics"] == ["ppl", "loss"]


def test_table_where_keeps_the_settings_asked_for(tmp_path, capsys):
    for encoding, bias in (("alibi", "alibi"), ("t5", "t5")):
        make_run(tmp_path, ["model.attention.terms=a", f"model.attention.bias={bias}", "train.segment_len=8",
                                  "data.offset=2"],
                 variant={"encoding": encoding},
                 results=[({"segment_len": 8}, {"ppl": 3.0}),
                          ({"segment_len": 8, "protocol": "sliding", "stride": 8}, {"ppl": 3.0}),
                          ({"segment_len": 8, "protocol": "sliding", "stride": 1, "max_targets": 64}, {"ppl": 2.5}),
                          ({"segment_len": 8, "protocol": "sliding", "stride": 8, "max_targets": 64}, {"ppl": 2.9})])
    assert main(["table", str(tmp_path / "demo"), "--where", "max_targets=64", "--cols", "stride"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "| encoding | stride 1 | stride 8 |" and "| alibi | **2.50** | **2.90** |" in out
    assert main(["table", str(tmp_path / "demo"), "--where", "max_targets!=64", "--cols", "protocol", "stride"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "| encoding | non_overlapping | sliding, stride 8 |"
    assert main(["table", str(tmp_path / "demo"), "--where", "max_targets=7"]) == 2
    assert "error: where: no row has max_targets=7; values here: 0, 64" in capsys.readouterr().err
