"""The length-generalization report (relpos_ablate/studies/length_generalization/report.py,
`relpos-ablate report`): on hand-made run dirs whose every number is known, each derived number (ID
and OOD means per run, steps and runs that reached the threshold, rank per task and mean reciprocal
rank, the Welch test behind each ordering and its Holm-adjusted p over the report's one family of
orderings, per task and over tasks) is computed here by hand (scipy's Welch test, statsmodels'
multipletests); the report reads the results dir and its summary.csv alike. Run: pytest
tests/studies/test_length_report.py -q"""

import functools
import statistics
import warnings

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fixtures.length_study import BINS, SCORES, STEPS, VARIANTS, build
from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json
from relpos_ablate.studies import make_report
from relpos_ablate.studies.length_generalization.report import run_scores


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return build(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def report(results):
    """The report on `results`, written once for the tests that read it (each writing is seconds of
    YAML and tests)."""
    return make_report(collect(results))


def ood(key):
    return [statistics.mean(s[1:]) for s in SCORES[key]]


def iid(key):
    return [s[0] for s in SCORES[key]]


def fmt(values):
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (3)"


def test_per_run_id_and_ood_means(results):
    scores = run_scores(collect(results))
    # one row per run, named by its run dir (what a test's sample is keyed by)
    assert sorted(scores["run_dir"]) == sorted(
        str(run) for run in results.iterdir() if run.is_dir()
    )
    scores = scores.set_index(["task", "encoding", "positions", "seed"])
    for (task, encoding, positions), per_seed in SCORES.items():
        for seed, values in enumerate(per_seed):
            row = scores.loc[(task, encoding, positions, seed)]
            assert row["id"] == pytest.approx(values[0]) and row["ood"] == pytest.approx(
                statistics.mean(values[1:])
            )
            assert row["step"] == STEPS[seed]
    assert set(scores["variant"]) == {"NoPE", "T5", "RoPE", "RoPE (randomized)"}


def test_training_rows_quote_steps_reached_and_id_ood(report):
    # copy, NoPE: seeds 0 and 1 reached 0.99 before the cap; seed 2 ran to the cap (900) at ID 0.99
    assert (
        f"| copy | NoPE | 2/3 | 600 (300-900) | {fmt(iid(('copy', 'nope', 'sequential')))} | "
        f"{fmt(ood(('copy', 'nope', 'sequential')))} |"
    ) in report
    assert (
        f"| copy | RoPE (randomized) | 0/3 | 600 (300-900) | "
        f"{fmt(iid(('copy', 'rope', 'randomized')))} |" in report
    )
    assert "a run stopped once held-out in-distribution exact match reached 0.99" in report
    # below 0.99 ID: copy's three randomized RoPE runs, reverse's three NoPE runs
    assert (
        "Runs below 0.99 ID exact match: 6 of 24: copy: RoPE (randomized) (3); reverse: NoPE (3)."
        in report
    )


def test_ranks_and_mean_reciprocal_rank(report):
    means = {key: statistics.mean(ood(key)) for key in SCORES}
    # copy: NoPE 0.5 > RoPE (randomized) 0.467 > T5 0.083 > RoPE 0.05; reverse: RoPE (rand.) 0.267 >
    # T5 0.2 > NoPE 0.067 > RoPE 0.017
    assert sorted((means[k], k[1:]) for k in means if k[0] == "copy")[-1][1] == (
        "nope",
        "sequential",
    )
    assert "| NoPE | 1 | 3 | 2.00 | 0.67 |" in report  # MRR (1/1 + 1/3) / 2
    assert "| T5 | 3 | 2 | 2.50 | 0.42 |" in report  # (1/3 + 1/2) / 2
    assert "| RoPE | 4 | 4 | 4.00 | 0.25 |" in report
    assert "| RoPE (randomized) | 2 | 1 | 1.50 | 0.75 |" in report


TASKS = ("copy", "reverse")
NAMES = {
    ("nope", "sequential"): "NoPE",
    ("t5", "sequential"): "T5",
    ("rope", "sequential"): "RoPE",
    ("rope", "randomized"): "RoPE (randomized)",
}
NOPE, T5, ROPE = ("nope", "sequential"), ("t5", "sequential"), ("rope", "sequential")
RANDOMIZED = ("rope", "randomized")
# the report's orderings: NoPE against each explicit encoding run here (OOD), randomized against
# sequential RoPE (ID and OOD); never the explicit encodings among themselves
ORDERINGS = [
    (NOPE, T5, "ood"),
    (NOPE, ROPE, "ood"),
    (RANDOMIZED, ROPE, "id"),
    (RANDOMIZED, ROPE, "ood"),
]


def over(variant, column):
    """Each seed's mean over the tasks of its runs' ID or OOD exact match."""
    pick = ood if column == "ood" else iid
    return [statistics.mean(pick((task, *variant))[s] for task in TASKS) for s in range(3)]


@functools.cache
def samples():
    """(variant a, variant b, task or "over", column) -> (a's values, b's values), seeds in order:
    every comparison of the report's orderings, per task and over the tasks."""
    found = {}
    for a, b, column in ORDERINGS:
        pick = ood if column == "ood" else iid
        for task in TASKS:
            found[(a, b, task, column)] = (pick((task, *a)), pick((task, *b)))
        found[(a, b, "over", column)] = (over(a, column), over(b, column))
    return found


@functools.cache  # line() asks for it once per ordering
def family():
    """The family the report corrects together: every ordering that has a test (two sides that do
    not vary at all have no t statistic), each key -> (raw Welch p, Holm-adjusted p over the
    family)."""
    tested = {
        key: pair
        for key, pair in samples().items()
        if not (np.ptp(pair[0]) == 0 and np.ptp(pair[1]) == 0)
    }
    raw = [welch(*pair) for pair in tested.values()]
    return dict(zip(tested, zip(raw, multipletests(raw, alpha=0.05, method="holm")[1])))


def line(key, corrected=True):
    """The ordering as the report states it (higher is better; 3 decimals for the means, 4 for the
    difference), every number computed here: means, the verdict the (adjusted) p supports,
    difference and 95% CI, n, p."""
    a_variant, b_variant, _, _ = key
    a, b = samples()[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(a, b, equal_var=False)
    p, p_adjusted = family()[key]
    (low, high), difference = (
        result.confidence_interval(0.95),
        statistics.mean(a) - statistics.mean(b),
    )
    name_a, name_b = NAMES[a_variant], NAMES[b_variant]
    if (p_adjusted if corrected else p) < 0.05:
        said = f"{name_a if difference > 0 else name_b} better"
    else:
        said = "not significant after correction" if p < 0.05 else "not significant"
    adjusted = f", Holm-adjusted p = {p_adjusted:.2g}" if corrected else ""
    return (
        f"{name_a} {statistics.mean(a):.3f}, {name_b} {statistics.mean(b):.3f}: {said} (Welch's "
        f"t-test, difference {difference:.4f}, 95% CI [{low:.4f}, {high:.4f}], n = 3; p = "
        f"{p:.2g}{adjusted})"
    )


def test_the_trend_table_puts_each_claim_beside_these_runs(report):
    trends = report.split("## Trends: the papers' and ours")[1].split("##")[0]
    # ID: copy's randomized RoPE (0.800) and reverse's NoPE (0.943) stay below 0.99
    assert (
        "6 of 8 (task, variant) pairs reach a mean ID exact match of 0.99; below it: RoPE "
        "(randomized) on copy (0.800); NoPE on reverse (0.943)" in trends
    )
    # the rank table's ranks, among every variant (randomized RoPE too): one definition of MRR in
    # the report
    assert (
        "(ranks among all 4 variants run here, as in the rank table): NoPE 0.67, T5 0.42, "
        "RoPE 0.25." in trends
    )
    # the abstract's claim: NoPE against each explicit encoding, not the explicit ones among
    # themselves; the tests are the orderings' over-tasks ones, with their p adjusted over the whole
    # family of orderings
    assert f"NoPE vs RoPE: {line((NOPE, ROPE, 'over', 'ood'))}" in trends
    assert f"NoPE vs T5: {line((NOPE, T5, 'over', 'ood'))}" in trends
    p, p_adjusted = family()[(NOPE, ROPE, "over", "ood")]
    # NoPE 0.283 against RoPE 0.033 over the tasks: not once corrected
    assert p < 0.05 <= p_adjusted
    assert "NoPE vs RoPE: NoPE 0.283, RoPE 0.033: not significant after correction" in trends
    # Fig. 1's values are not in the paper's text
    assert "T5 vs RoPE" not in trends and "0.69" not in trends
    assert (
        f"by 12.0% on average over 15 tasks (abstract), and leave in-domain accuracy unaffected "
        f"(Section 1); RoPE | OOD {line((RANDOMIZED, ROPE, 'over', 'ood'))}; ID "
        f"{line((RANDOMIZED, ROPE, 'over', 'id'))} |"
    ) in trends
    # p ~ 1e-5 survives
    assert "OOD RoPE (randomized) 0.367, RoPE 0.033: RoPE (randomized) better" in trends


def welch(a, b):
    with warnings.catch_warnings():  # T5's reverse OOD means are 0.2 three times, to rounding
        warnings.simplefilter("ignore", RuntimeWarning)
        return stats.ttest_ind(a, b, equal_var=False).pvalue


def test_orderings_state_welchs_test_corrected_over_the_family(report):
    """Every ordering, per task and over the tasks, is Welch's t-test (two variants are different
    models) and the whole list is one family: each line's adjusted p is Holm's over all of its
    tests, and an ordering is stated only where that adjusted p is below 0.05."""
    orderings = report.split("## Orderings")[1]
    tests = family()
    # reverse's RoPE ID: 1.0 on every run of both sides, no test
    assert len(tests) == len(samples()) - 1
    for key in tests:
        _, _, task, column = key
        where = "over copy, reverse (per-seed mean)" if task == "over" else task
        assert f"- {where}, {column.upper()}: {line(key)}" in orderings
    assert (
        f'Family "the orderings (per task and over tasks)": {len(tests)} tests '
        "(Welch's t-test), Holm-corrected at α = 0.05; an ordering is stated only where the "
        "adjusted p < 0.05."
    ) in orderings
    p, p_adjusted = tests[(NOPE, T5, "copy", "ood")]
    # NoPE 0.500 against T5 0.083 on copy: p ~ 0.013 alone, not over the family
    assert p < 0.05 <= p_adjusted
    assert (
        "- copy, OOD: NoPE 0.500, T5 0.083: not significant after correction (Welch's t-test"
        in orderings
    )
    assert tests[(NOPE, T5, "reverse", "ood")][0] >= 0.05
    assert "- reverse, OOD: NoPE 0.067, T5 0.200: not significant (Welch's t-test" in orderings
    assert (
        "- copy, ID: RoPE (randomized) 0.800, RoPE 1.000: not significant after correction"
        in orderings
    )
    assert "- reverse, ID: RoPE (randomized) 1.000, RoPE 1.000: no test (no spread)" in orderings
    assert tests[(RANDOMIZED, ROPE, "copy", "ood")][1] < 0.05
    assert (
        "- copy, OOD: RoPE (randomized) 0.467, RoPE 0.050: RoPE (randomized) better (Welch's t-test"
        in orderings
    )
    # the explicit encodings are not ordered among themselves
    assert "- copy, OOD: T5" not in report
    assert "ALiBi" not in orderings  # no ALiBi runs: no ALiBi line


def test_uncorrected_orderings_read_the_raw_p(results):
    """--correction none: the same tests, each ordering stated where its own Welch p is below
    0.05."""
    report = make_report(collect(results), correction="none")
    orderings = report.split("## Orderings")[1]
    for key in family():
        _, _, task, column = key
        where = "over copy, reverse (per-seed mean)" if task == "over" else task
        assert f"- {where}, {column.upper()}: {line(key, corrected=False)}" in orderings
    assert "- copy, OOD: NoPE 0.500, T5 0.083: NoPE better (Welch's t-test" in orderings
    assert (
        "- copy, ID: RoPE (randomized) 0.800, RoPE 1.000: RoPE better (Welch's t-test" in orderings
    )
    assert "- copy, OOD: NoPE 0.500, RoPE 0.050: NoPE better (Welch's t-test" in orderings
    assert (
        "adjusted p =" not in orderings
        and "tests (Welch's t-test), uncorrected at α = 0.05" in orderings
    )


def test_the_report_reads_the_committed_summary_csv_as_the_results_dir(
    results, report, tmp_path, capsys
):
    assert main(["collect", str(results), "--out", str(tmp_path / "summary.csv")]) == 0
    assert (
        main(["report", str(tmp_path / "summary.csv"), "--out", str(tmp_path / "report.md")]) == 0
    )
    assert (tmp_path / "report.md").read_text() == report
    assert make_report(read_summary(tmp_path / "summary.csv")) == report


def test_t5_buckets_line_names_the_untrained_test_distances(report):
    """T5 with the default 32 buckets / max_distance 128, trained on inputs of 9 tokens (distances
    <= 8), tested to 17 (distances <= 16): bucket(d) = d below 16 exact buckets, and bucket 16 =
    16 + floor(log(16/16) / log(128/16) * 16) at d = 16, worked out here; distances 9..16 read
    buckets no training distance reached."""
    assert (
        "- num_buckets 32, max_distance 128 (causal): the far bucket 31 starts at distance 113; "
        "training distances reach 8 (buckets up to 8): test distances 9..16 read buckets 9..16, "
        "never trained."
    ) in report


CAPPED = [[1.0, 0.5, 0.4], [1.0, 0.6, 0.3], [1.0, 0.4, 0.4]]
"""reverse, randomized RoPE, trained again with the cap at 1800: exact match per bin and seed."""


def test_the_step_cap_section_compares_the_higher_cap_with_the_study(tmp_path):
    build(tmp_path)
    for seed, scores in enumerate(CAPPED):
        overrides = [
            "data.task=reverse",
            "data.train_lengths=[1, 4]",
            "train.segment_len=9",
            f"data.test_lengths={[list(b) for b in BINS]}",
            "train.max_steps=1800",
            "train.stop_at_exact_match=0.99",
            f"seed={seed}",
            *VARIANTS[("rope", "randomized")],
        ]
        run_dir = make_run(
            tmp_path,
            overrides,
            experiment="length_generalization_cap",
            variant={"encoding": "rope", "model.attention.positions": "randomized", "seed": seed},
        )
        atomic_write_json(
            run_dir / "status.json",
            {
                "state": "done",
                "step": 1000 + 100 * seed,
                "max_steps": 1800,
                "stopped": "exact_match",
            },
        )
        settings = [
            {
                "segment_len": 2 * hi + 1,
                "mem_len": 0,
                "clamp_len": None,
                "same_length": False,
                "attn_len": 2 * hi + 1,
                "length_min": lo,
                "length_max": hi,
                "metrics": {"exact_match": score},
            }
            for (lo, hi), score in zip(BINS, scores)
        ]
        atomic_write_json(
            run_dir / "eval.json",
            {"main_metric": "exact_match", "step": 1000, "settings": settings},
        )
    frame = collect(tmp_path)
    text = make_report(frame)
    main_only = make_report(frame[frame["experiment"] == "length_generalization"])
    assert text.startswith(main_only)  # the study's report unchanged, the cap section after it
    section = text.split("## The step cap")[1]
    capped_ood = [statistics.mean(s[1:]) for s in CAPPED]
    assert (
        f"| reverse | RoPE (randomized) | 1800 | 3/3 | 1100 (1000-1200) | 1.000 ± 0.000 (3) | "
        f"{fmt(capped_ood)} |" in section
    )
    key = ("reverse", "rope", "randomized")
    assert "| reverse | RoPE (randomized) | 900 | " in section and fmt(ood(key)) in section
    # three Welch tests, one family: ID at the higher cap vs the study's runs; randomized vs
    # sequential, ID and OOD (ID: both sides 1.0 at every seed there is no spread to test)
    sequential = ("reverse", "rope", "sequential")
    p_ood = stats.ttest_ind(capped_ood, ood(sequential), equal_var=False).pvalue
    assert "reverse, RoPE (randomized) at cap 1800 vs RoPE, OOD: " in section
    assert f"p = {p_ood:.2g}" in section.split("vs RoPE, OOD: ")[1].split("\n")[0]
