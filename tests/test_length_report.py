"""The length-generalization report (analysis/length_report.py, `relpos-ablate report`): on hand-made run
dirs whose every number is known, each derived number (ID and OOD means per run, steps and runs that
reached the threshold, rank per task and mean reciprocal rank, the Welch test behind each ordering) is
computed here by hand; the report reads the results dir and its summary.csv alike.
Run: pytest tests/test_length_report.py -q"""

import statistics
import warnings

import pytest
from scipy import stats

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.length_report import run_scores
from relpos_ablate.analysis.reports import make_report, read_summary
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json

BINS = [(1, 4), (5, 6), (7, 8)]  # trained on n <= 4: one in-distribution bin, two beyond
VARIANTS = {("nope", "sequential"): ["model.attention.terms=a"],
            ("t5", "sequential"): ["model.attention.terms=a", "model.attention.bias=t5"],
            ("rope", "sequential"): ["model.attention.terms=a", "model.attention.absolute=rope"],
            ("rope", "randomized"): ["model.attention.terms=a", "model.attention.absolute=rope",
                                     "model.attention.positions=randomized", "model.attention.max_position=64"]}
# exact match per bin, per (task, encoding, positions) and seed 0, 1, 2; steps trained per seed (cap 900)
SCORES = {
    ("copy", "nope", "sequential"): [[1.0, 0.6, 0.4], [1.0, 0.5, 0.3], [0.99, 0.7, 0.5]],
    ("copy", "t5", "sequential"): [[1.0, 0.1, 0.0], [1.0, 0.2, 0.0], [1.0, 0.1, 0.1]],
    ("copy", "rope", "sequential"): [[1.0, 0.1, 0.0], [1.0, 0.0, 0.0], [1.0, 0.2, 0.0]],
    ("copy", "rope", "randomized"): [[0.8, 0.5, 0.4], [0.85, 0.6, 0.5], [0.75, 0.5, 0.3]],
    ("reverse", "nope", "sequential"): [[0.9, 0.1, 0.0], [0.95, 0.0, 0.0], [0.98, 0.2, 0.1]],
    ("reverse", "t5", "sequential"): [[1.0, 0.3, 0.1], [1.0, 0.2, 0.2], [1.0, 0.4, 0.0]],
    ("reverse", "rope", "sequential"): [[1.0, 0.0, 0.0], [1.0, 0.1, 0.0], [1.0, 0.0, 0.0]],
    ("reverse", "rope", "randomized"): [[1.0, 0.3, 0.2], [1.0, 0.2, 0.2], [1.0, 0.4, 0.3]],
}
STEPS = [300, 600, 900]


def build(root):
    for (task, encoding, positions), per_seed in SCORES.items():
        for seed, scores in enumerate(per_seed):
            overrides = [f"data.task={task}", "data.train_lengths=[1, 4]", "train.segment_len=9",
                         f"data.test_lengths={[list(b) for b in BINS]}", "train.max_steps=900",
                         "train.stop_at_exact_match=0.99", f"seed={seed}", *VARIANTS[(encoding, positions)]]
            run_dir = make_run(root, overrides, experiment="length_generalization",
                               variant={"data.task": task, "encoding": encoding, "model.attention.positions": positions,
                                        "seed": seed})
            reached = scores[0] >= 0.99 and STEPS[seed] < 900
            atomic_write_json(run_dir / "status.json", {"state": "done", "step": STEPS[seed], "max_steps": 900,
                                                        "stopped": "exact_match" if reached else "max_steps"})
            settings = [{"segment_len": 2 * hi + 1, "mem_len": 0, "clamp_len": None, "same_length": False,
                         "attn_len": 2 * hi + 1, "length_min": lo, "length_max": hi,
                         "metrics": {"exact_match": score}} for (lo, hi), score in zip(BINS, scores)]
            atomic_write_json(run_dir / "eval.json", {"main_metric": "exact_match", "step": STEPS[seed],
                                                      "settings": settings})
    return root / "length_generalization"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return build(tmp_path_factory.mktemp("report"))


def ood(key):
    return [statistics.mean(s[1:]) for s in SCORES[key]]


def iid(key):
    return [s[0] for s in SCORES[key]]


def fmt(values):
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (3)"


def test_per_run_id_and_ood_means(results):
    scores = run_scores(collect(results)).set_index(["task", "encoding", "positions", "seed"])
    for (task, encoding, positions), per_seed in SCORES.items():
        for seed, values in enumerate(per_seed):
            row = scores.loc[(task, encoding, positions, seed)]
            assert row["id"] == pytest.approx(values[0]) and row["ood"] == pytest.approx(statistics.mean(values[1:]))
            assert row["step"] == STEPS[seed]
    assert set(scores["variant"]) == {"NoPE", "T5", "RoPE", "RoPE (randomized)"}


def test_training_rows_quote_steps_reached_and_id_ood(results):
    report = make_report(collect(results))
    # copy, NoPE: seeds 0 and 1 reached 0.99 before the cap; seed 2 ran to the cap (900) at ID 0.99
    assert (f"| copy | NoPE | 2/3 | 600 (300-900) | {fmt(iid(('copy', 'nope', 'sequential')))} | "
            f"{fmt(ood(('copy', 'nope', 'sequential')))} |") in report
    assert f"| copy | RoPE (randomized) | 0/3 | 600 (300-900) | {fmt(iid(('copy', 'rope', 'randomized')))} |" in report
    assert "a run stopped once held-out in-distribution exact match reached 0.99" in report
    # below 0.99 ID: copy's three randomized RoPE runs, reverse's three NoPE runs
    assert "Runs below 0.99 ID exact match: 6 of 24: copy: RoPE (randomized) (3); reverse: NoPE (3)." in report


def test_ranks_and_mean_reciprocal_rank(results):
    report = make_report(collect(results))
    means = {key: statistics.mean(ood(key)) for key in SCORES}
    # copy: NoPE 0.5 > RoPE (randomized) 0.467 > T5 0.083 > RoPE 0.05; reverse: RoPE (rand.) 0.267 > T5 0.2 >
    # NoPE 0.067 > RoPE 0.017
    assert sorted((means[k], k[1:]) for k in means if k[0] == "copy")[-1][1] == ("nope", "sequential")
    assert "| NoPE | 1 | 3 | 2.00 | 0.67 |" in report  # MRR (1/1 + 1/3) / 2
    assert "| T5 | 3 | 2 | 2.50 | 0.42 |" in report  # (1/3 + 1/2) / 2
    assert "| RoPE | 4 | 4 | 4.00 | 0.25 |" in report
    assert "| RoPE (randomized) | 2 | 1 | 1.50 | 0.75 |" in report


def test_the_trend_table_puts_each_claim_beside_these_runs(results):
    report = make_report(collect(results))
    trends = report.split("## Trends: the papers' and ours")[1].split("##")[0]
    # ID: copy's randomized RoPE (0.800) and reverse's NoPE (0.943) stay below 0.99
    assert "6 of 8 (task, variant) pairs reach a mean ID exact match of 0.99; below it: RoPE (randomized) on copy " \
           "(0.800); NoPE on reverse (0.943)" in trends
    # among the sequential encodings: copy NoPE 1, T5 2, RoPE 3; reverse T5 1, NoPE 2, RoPE 3
    assert "NoPE 0.75, T5 0.75, RoPE 0.33." in trends
    over = {e: [statistics.mean([ood(("copy", e, "sequential"))[s], ood(("reverse", e, "sequential"))[s]])
                for s in range(3)] for e in ("nope", "t5", "rope")}
    # the abstract's claim: NoPE against each explicit encoding, not the explicit ones among themselves
    assert f"NoPE vs RoPE: NoPE {statistics.mean(over['nope']):.3f}, RoPE {statistics.mean(over['rope']):.3f}: " \
           f"NoPE better (Welch p = {welch(over['nope'], over['rope']):.2g})" in trends
    assert f"NoPE vs T5: NoPE {statistics.mean(over['nope']):.3f}, T5 {statistics.mean(over['t5']):.3f}" in trends
    assert "T5 vs RoPE" not in trends and "0.69" not in trends  # Fig. 1's values are not in the paper's text
    assert "by 12.0% on average over 15 tasks (abstract), and leave in-domain accuracy unaffected (Section 1); RoPE | OOD RoPE (randomized) 0.367, RoPE 0.033: " \
           "RoPE (randomized) better" in trends


def welch(a, b):
    with warnings.catch_warnings():  # T5's reverse OOD means are 0.2 three times, to rounding
        warnings.simplefilter("ignore", RuntimeWarning)
        return stats.ttest_ind(a, b, equal_var=False).pvalue


def test_orderings_state_welchs_test(results):
    report = make_report(collect(results))
    a, b = ood(("copy", "nope", "sequential")), ood(("copy", "t5", "sequential"))
    p = welch(a, b)
    assert p < 0.05  # NoPE 0.500 against T5 0.200 on copy
    assert f"- copy, OOD: NoPE 0.500, T5 0.083: NoPE better (Welch p = {p:.2g})" in report
    a, b = ood(("reverse", "nope", "sequential")), ood(("reverse", "t5", "sequential"))
    assert f"- reverse, OOD: NoPE 0.067, T5 0.200: not significant (Welch p = {welch(a, b):.2g})" in report
    over = [[statistics.mean([ood(("copy", e, "sequential"))[s], ood(("reverse", e, "sequential"))[s]]) for s in range(3)]
            for e in ("nope", "t5")]  # each seed's mean over the two tasks
    p = welch(*over)
    assert (f"- over copy, reverse (per-seed mean), OOD: NoPE {statistics.mean(over[0]):.3f}, "
            f"T5 {statistics.mean(over[1]):.3f}: ") in report and f"(Welch p = {p:.2g})" in report
    a, b = iid(("copy", "rope", "randomized")), iid(("copy", "rope", "sequential"))
    assert f"- copy, ID: RoPE (randomized) 0.800, RoPE 1.000: RoPE better (Welch p = {welch(a, b):.2g})" in report
    assert "- reverse, ID: RoPE (randomized) 1.000, RoPE 1.000: no test (no spread)" in report
    a, b = ood(("copy", "nope", "sequential")), ood(("copy", "rope", "sequential"))
    assert f"- copy, OOD: NoPE 0.500, RoPE 0.050: NoPE better (Welch p = {welch(a, b):.2g})" in report
    assert "- copy, OOD: T5" not in report  # the explicit encodings are not ordered among themselves
    assert "ALiBi" not in report.split("## Orderings")[1]  # no ALiBi runs: no ALiBi line


def test_the_report_reads_the_committed_summary_csv_as_the_results_dir(results, tmp_path, capsys):
    assert main(["collect", str(results), "--out", str(tmp_path / "summary.csv")]) == 0
    assert main(["report", str(tmp_path / "summary.csv"), "--out", str(tmp_path / "report.md")]) == 0
    assert (tmp_path / "report.md").read_text() == make_report(collect(results))
    assert make_report(read_summary(tmp_path / "summary.csv")) == make_report(collect(results))
