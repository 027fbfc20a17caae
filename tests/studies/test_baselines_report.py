"""The fair-baselines report (relpos_ablate/studies/fair_baselines.py): each preset's best learning
rate picked on valid, its test perplexity there, the ratio to the best preset, the presets more than
10% above it (tuned and untuned), the picks at an edge of each preset's own sweep and each preset
against the best by Welch's t-test (different models), the four tests one Holm-corrected family, all
checked against numbers computed here from the fixture (scipy's test, statsmodels' correction); from
the runs and from summary.csv alike.

Run: .venv/bin/python -m pytest tests/studies/test_baselines_report.py -q
"""

import statistics

import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgba
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.cli import main
from relpos_ablate.config.presets import preset_fields
from relpos_ablate.studies import make_report
from relpos_ablate.studies.fair_baselines import lr_figure, preset_summary, report
from relpos_ablate.studies.fair_baselines_figure import FAR, line_styles, panels

LRS = (0.0005, 0.001, 0.002)
OFFSETS = (-0.1, 0.0, 0.1)
"""Seed s of a cell is its mean + OFFSETS[s]."""
# preset -> ([valid mean per lr], [test mean per lr])
MEANS = {
    "xl": ([6.0, 5.6, 5.5], [6.1, 5.9, 5.6]),  # best at the highest lr (an edge)
    "alibi": ([6.5, 5.9, 6.1], [6.6, 6.1, 6.3]),  # best inside the sweep
    "t5": ([7.5, 6.9, 6.0], [7.6, 7.1, 6.1]),  # within 10% only when tuned
    "vaswani": ([9.0, 8.5, 8.0], [9.1, 8.5, 7.1]),  # beyond 10% tuned or not
    "nope": ([8.0, 7.8, 7.9], [8.1, 8.0, 8.0]),  # no position: not judged
}


def seeds(mean):
    return [mean + d for d in OFFSETS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    for preset, (valid, test) in MEANS.items():
        fields = [f"model.attention.{k}={v}" for k, v in preset_fields(preset).items()]
        for k, lr in enumerate(LRS):
            for seed, d in enumerate(OFFSETS):
                # not at L: ignored
                make_run(
                    root,
                    [*fields, f"train.lr={lr}", f"seed={seed}", "train.segment_len=64"],
                    experiment="fair_baselines",
                    variant={"encoding": preset, "train.lr": lr, "seed": seed},
                    results=[
                        ({"segment_len": 64, "split": "valid"}, {"ppl": valid[k] + d}),
                        ({"segment_len": 64, "split": "test"}, {"ppl": test[k] + d}),
                        ({"segment_len": 128, "split": "test"}, {"ppl": 1.0}),
                    ],
                )
    return root / "fair_baselines"


@pytest.fixture(scope="module")
def collected(results):
    """collect(results) once for the tests that read the frame (~0.35 s each: every run's
    config.yaml parsed); each test takes a copy. The CLI tests still collect through `report`,
    `collect` and `plot` themselves."""
    return collect(results)


@pytest.fixture
def frame(collected):
    return collected.copy()


def expected():
    """Picks, test means and ratios computed from MEANS."""
    picks = {p: LRS[int(np.argmin(valid))] for p, (valid, _) in MEANS.items()}
    tuned = {p: MEANS[p][1][LRS.index(lr)] for p, lr in picks.items()}
    default = {p: test[LRS.index(0.001)] for p, (_, test) in MEANS.items()}
    return picks, tuned, default


def test_summary_picks_on_valid_and_reports_test(frame):
    picks, tuned, default = expected()
    summary = preset_summary(frame).set_index("preset")
    assert picks == {"xl": 0.002, "alibi": 0.001, "t5": 0.002, "vaswani": 0.002, "nope": 0.001}
    for preset in MEANS:
        row = summary.loc[preset]
        assert row["best_lr"] == picks[preset]
        assert row["mean"] == pytest.approx(statistics.mean(seeds(tuned[preset])))
        assert row["std"] == pytest.approx(statistics.stdev(seeds(tuned[preset]))) and row["n"] == 3
        assert row["ratio"] == pytest.approx(tuned[preset] / min(tuned.values()))
        assert row["default_ratio"] == pytest.approx(default[preset] / min(default.values()))


def test_report_counts_edges_and_orderings(frame):
    picks, tuned, default = expected()
    text = report(frame)
    judged = [p for p in MEANS if p != "nope"]
    over = [p for p in judged if tuned[p] / min(tuned.values()) > 1.10]
    untuned = sorted(
        (p for p in judged if default[p] / min(default.values()) > 1.10), key=lambda p: -default[p]
    )
    assert (over, untuned) == (["vaswani"], ["vaswani", "t5"])
    assert (
        f"- Presets that encode position more than 10% above the best at their best rate: "
        f"{len(over)} of {len(judged)} (vaswani)."
    ) in text
    assert (
        f"- At lr 0.001 for every preset (untuned): {len(untuned)} of {len(judged)} (vaswani, t5)."
        in text
    )
    assert (
        "- Best rate at the edge of its own sweep (the optimum may lie beyond it): at the lowest "
        "rate: none; at the highest: xl (0.002), t5 (0.002), vaswani (0.002)."
    ) in text
    assert "learning rates 0.0005, 0.001, 0.002; 3 seeds" in text
    assert "| nope (no position) | 0.001 | 7.80 | 8.00 ± 0.10 | 1.429 | 8.00 | 1.356 |" in text
    others = ("alibi", "t5", "vaswani", "nope")
    tests = {
        p: stats.ttest_ind(seeds(tuned["xl"]), seeds(tuned[p]), equal_var=False) for p in others
    }
    adjusted = dict(
        zip(others, multipletests([tests[p].pvalue for p in others], alpha=0.05, method="holm")[1])
    )
    for preset in others:
        p, ci = tests[preset].pvalue, tests[preset].confidence_interval(0.95)
        difference = statistics.mean(seeds(tuned["xl"])) - statistics.mean(seeds(tuned[preset]))
        said = (
            "xl better"
            if adjusted[preset] < 0.05
            else "not significant after correction"
            if p < 0.05
            else "not significant"
        )
        assert (
            f"- xl {tuned['xl']:.2f}, {preset} {tuned[preset]:.2f}: {said} (Welch's t-test, "
            f"difference {difference:.3f}, 95% CI [{ci.low:.3f}, {ci.high:.3f}], n = 3; p = "
            f"{p:.2g}, Holm-adjusted p = {adjusted[preset]:.2g})"
        ) in text
    # gaps of 0.5 or more, a spread of 0.1: all survive Holm
    assert all(a < 0.05 for a in adjusted.values())
    assert (
        'Family "every preset vs the best (xl)": 4 tests (Welch\'s t-test), Holm-corrected at '
        "α = 0.05" in text
    )


def test_a_rate_only_some_presets_ran_is_named_and_edges_are_each_presets_own(tmp_path):
    """The sweep extended below 0.001 for xl only (its pick sat there): alibi's lowest rate is
    0.001, its pick, so alibi is at its own sweep's edge; xl, best at 0.001 with 0.0005 run, is
    not."""
    for preset, valid in {
        "xl": {0.0005: 6.2, 0.001: 5.6, 0.002: 5.9},
        "alibi": {0.001: 5.9, 0.002: 6.1},
    }.items():
        fields = [f"model.attention.{k}={v}" for k, v in preset_fields(preset).items()]
        for lr, value in valid.items():
            for seed, d in enumerate(OFFSETS):
                make_run(
                    tmp_path,
                    [*fields, f"train.lr={lr}", f"seed={seed}", "train.segment_len=64"],
                    experiment="fair_baselines",
                    variant={"encoding": preset, "train.lr": lr, "seed": seed},
                    results=[
                        ({"segment_len": 64, "split": "valid"}, {"ppl": value + d}),
                        ({"segment_len": 64, "split": "test"}, {"ppl": value + d}),
                    ],
                )
    text = report(collect(tmp_path / "fair_baselines"))
    assert "learning rates 0.001, 0.002 (and 0.0005: xl); 3 seeds" in text
    assert (
        "- Best rate at the edge of its own sweep (the optimum may lie beyond it): at the lowest "
        "rate: alibi (0.001); at the highest: none."
    ) in text


def test_the_report_reads_summary_csv_as_the_runs(results, tmp_path, capsys):
    assert main(["report", str(results)]) == 0
    from_runs = capsys.readouterr().out
    assert from_runs.startswith("# Fair baselines")
    assert main(["collect", str(results), "--out", str(tmp_path / "summary.csv")]) == 0
    assert make_report(read_summary(tmp_path / "summary.csv")) == from_runs


def test_the_figure_draws_each_ratio(results, frame, tmp_path):
    picks, tuned, default = expected()
    fig = lr_figure(frame)
    *lefts, right = fig.axes
    # the presets without a bias table (split at FAR above the best: vaswani's and nope's picks are
    # 1.45x and 1.42x xl's) and the bias types: a line per preset, its pick starred, the legend in
    # the order of the stars, highest first
    named = [
        [line for line in left.lines if not line.get_label().startswith("_")] for left in lefts
    ]
    assert [[line.get_label() for line in lines] for lines in named] == [
        ["xl"],
        ["vaswani", "nope"],
        ["t5", "alibi"],
    ]
    best_valid = min(min(valid) for valid, _ in MEANS.values())  # one denominator for every line
    for line in (line for lines in named for line in lines):
        assert list(line.get_ydata()) == pytest.approx(
            [v / best_valid for v in MEANS[line.get_label()][0]]
        )
    stars = [line for left in lefts for line in left.lines if line.get_marker() == "*"]
    drawn = sorted((float(s.get_xdata()[0]), float(s.get_ydata()[0])) for s in stars)
    wanted = sorted((picks[p], min(valid) / best_valid) for p, (valid, _) in MEANS.items())
    assert [x for pair in drawn for x in pair] == pytest.approx(
        [x for pair in wanted for x in pair]
    )
    scatter = next(c for c in right.collections if isinstance(c, PathCollection))
    crosses = scatter.get_offsets()[:, 0]  # untuned test ppl over the same best as the bars
    order = [t.get_text().split()[0] for t in right.get_yticklabels()]
    assert list(crosses) == pytest.approx([default[p] / min(tuned.values()) for p in order])
    assert [left.get_title().split(" (★")[0] for left in lefts] == [
        "baselines, pick within 20% of the best",
        "baselines, pick more than 20% above the best",
        "bias types",
    ]
    widths = sorted(bar.get_width() for bar in right.patches)
    assert widths == pytest.approx(sorted(t / min(tuned.values()) - 1 for t in tuned.values()))
    for lines in named:  # no two lines of a panel alike (the legend beside it tells them apart)
        styles = {(to_rgba(ln.get_color()), ln.get_marker(), ln.get_linestyle()) for ln in lines}
        assert len(styles) == len(lines)
    # a bar's colour says its panel: baselines (xl, vaswani, nope) alike, bias types (alibi, t5)
    # alike, not both
    colour = {name: to_rgba(bar.get_facecolor()) for name, bar in zip(order, right.patches)}
    assert colour["xl"] == colour["vaswani"] == colour["nope"] != colour["alibi"] == colour["t5"]
    assert [t.get_text() for t in right.get_legend().get_texts()][-2:] == [
        "baselines (top and middle left panels)",
        "bias types (bottom left panel)",
    ]
    assert (
        main(
            ["plot", str(results), "--kind", "lr-sweep", "--out", str(tmp_path), "--formats", "png"]
        )
        == 0
    )
    assert (tmp_path / "lr_sweep.png").stat().st_size > 0


def test_near_tie_picks_are_marked(frame):
    """A pick whose second-best rate's mean valid ppl lies within 0.5% of its own is marked †: here
    alibi's 0.002 is moved to 5.91 against the pick's 5.9 (+0.17%); every other runner-up is far
    (xl: 5.6 over 5.5, +1.8%)."""
    moved = (
        (frame["encoding"] == "alibi")
        & np.isclose(frame["train.lr"], 0.002)
        & (frame["split"] == "valid")
        & (frame["segment_len"] == 64)
    )
    frame.loc[moved, "ppl"] = [5.91 + OFFSETS[int(s)] for s in frame.loc[moved, "seed"]]
    summary = preset_summary(frame).set_index("preset")
    for preset, (valid, _) in MEANS.items():
        ordered = sorted(5.91 if (preset, k) == ("alibi", 2) else v for k, v in enumerate(valid))
        assert summary.at[preset, "runner_up"] == pytest.approx(ordered[1] / ordered[0] - 1)
    text = report(frame)
    assert "| alibi | 0.001 † |" in text and "| xl | 0.002 |" in text
    assert f"(+{5.91 / 5.9 - 1:.1%})" in text and text.count(" † |") == 1
    assert (
        "so the pick is not clearly better): alibi (+0.2%)." in text
        and "† Close calls on valid" in text
    )


# preset -> (valid per lr, test per lr) of the sweep, then the test mean at the longer budget
LONGER = {
    "xl": (([6.0, 5.5], [6.1, 5.6]), 5.0),
    "vaswani": (([9.0, 8.0], [9.1, 8.1]), 5.4),
    "al_rfou": (([9.5, 9.6], [9.6, 9.7]), 6.0),
    "nope": (([9.2, 9.3], [9.3, 9.4]), 7.0),
}


@pytest.fixture(scope="module")
def budgets(tmp_path_factory):
    """A two-rate sweep at the default budget, then every preset at its pick for 2000 steps."""
    root = tmp_path_factory.mktemp("budgets")
    for preset, ((valid, test), longer) in LONGER.items():
        fields = [f"model.attention.{k}={v}" for k, v in preset_fields(preset).items()]
        for k, lr in enumerate(LRS[1:]):
            for seed, d in enumerate(OFFSETS):
                make_run(
                    root,
                    [*fields, f"train.lr={lr}", f"seed={seed}", "train.segment_len=64"],
                    experiment="fair_baselines",
                    variant={"encoding": preset, "train.lr": lr, "seed": seed},
                    results=[
                        ({"segment_len": 64, "split": "valid"}, {"ppl": valid[k] + d}),
                        ({"segment_len": 64, "split": "test"}, {"ppl": test[k] + d}),
                    ],
                )
        pick = LRS[1:][int(np.argmin(valid))]
        for seed, d in enumerate(OFFSETS):
            make_run(
                root,
                [
                    *fields,
                    f"train.lr={pick}",
                    f"seed={seed}",
                    "train.segment_len=64",
                    "train.max_steps=2000",
                ],
                experiment="fair_baselines",
                variant={"encoding": preset, "train.lr": pick, "seed": seed},
                results=[
                    ({"segment_len": 64, "split": "valid"}, {"ppl": longer + d}),
                    ({"segment_len": 64, "split": "test"}, {"ppl": longer + 2 * d}),
                ],
            )
    return collect(root / "fair_baselines")


def test_a_longer_budget_is_its_own_section_and_leaves_the_sweep_alone(budgets):
    text = report(budgets)
    sweep, longer = text.split("## A longer budget: 2000 steps")
    sweep_only = budgets[budgets["train.max_steps"] != 2000]
    # the sweep's report does not see the 2000-step runs
    assert sweep == report(sweep_only).rstrip("\n") + "\n\n"
    test_at = {p: [m + 2 * d for d in OFFSETS] for p, (_, m) in LONGER.items()}
    best = min(test_at, key=lambda p: np.mean(test_at[p]))
    assert best == "xl" and f"(at 2000 steps: xl, {np.mean(test_at['xl']):.2f}," in longer
    # each row: the sweep's test ppl at the pick and its ratio, then the longer budget's and its
    # ratio
    sweep_means = {p: min(zip(v, t))[1] for p, ((v, t), _) in LONGER.items()}
    for preset in ("vaswani", "al_rfou"):
        ratio_short = sweep_means[preset] / min(sweep_means.values())
        ratio_long = np.mean(test_at[preset]) / np.mean(test_at["xl"])
        assert (
            f"| {preset} | {0.002 if preset == 'vaswani' else 0.001:g} | "
            f"{sweep_means[preset]:.2f} ± 0.10 | {ratio_short:.3f} | "
            f"{np.mean(test_at[preset]):.2f} ± 0.20 | {ratio_long:.3f} |"
        ) in longer
    # judged: xl, vaswani, al_rfou (nope encodes no position); vaswani 1.08, al_rfou 1.20 over the
    # best
    assert "more than 10% above the best at 2000 steps: 1 of 3 (al_rfou)." in longer
    p_values = [
        stats.ttest_ind(test_at["xl"], test_at[p], equal_var=False).pvalue
        for p in ("vaswani", "al_rfou", "nope")
    ]
    adjusted = multipletests(p_values, method="holm")[1]
    assert f"Holm-adjusted p = {adjusted[0]:.2g})" in longer.split("- xl ")[1].split("\n")[0]
    # al_rfou against nope at both budgets: one family of two Welch tests
    short_p = stats.ttest_ind(
        [9.6 + d for d in OFFSETS], [9.3 + d for d in OFFSETS], equal_var=False
    ).pvalue
    long_p = stats.ttest_ind(test_at["al_rfou"], test_at["nope"], equal_var=False).pvalue
    pair = longer.split("Al-Rfou's per-layer")[1]
    assert (
        f"p = {short_p:.2g}, Holm-adjusted p = "
        f"{multipletests([short_p, long_p], method='holm')[1][0]:.2g}" in pair
    )
    assert "al_rfou, 2000 steps 6.00, nope, 2000 steps 7.00: al_rfou, 2000 steps better" in pair
    # the lr figure draws the sweep alone
    assert len(lr_figure(budgets).axes) == len(lr_figure(sweep_only).axes)


def test_fourteen_lines_of_a_panel_are_told_apart():
    """Issue 58: 14 lines in tab20's paired hues could not be read. Each line of a panel has its own
    (colour, marker, line style): nine colours, none grey (the baselines' bars), then the colours
    again dashed with another marker. A kind whose picks lie far apart is split in two panels."""
    styles = line_styles(14)
    assert len(set(styles)) == 14 and len({to_rgba(c) for c, _, _ in styles[:9]}) == 9
    assert to_rgba("C7") not in {to_rgba(color) for color, _, _ in styles}
    for (color, marker, style), first in zip(styles[9:], styles):
        assert (color, style) == (first[0], "--") and marker != first[1]
    groups = [("baselines", ["xl", "rope", "nope"]), ("bias types", ["alibi", "t5"])]
    ratios = {"xl": 1.0, "rope": 1.0 + FAR, "nope": 1.0 + FAR + 0.01, "alibi": 1.1, "t5": 1.2}
    assert panels(groups, ratios) == [
        (0, "baselines, pick within 20% of the best", ["xl", "rope"]),
        (0, "baselines, pick more than 20% above the best", ["nope"]),
        (1, "bias types", ["alibi", "t5"]),
    ]
    assert panels([("", ["xl"])], {"xl": 1.0}) == [(0, "", ["xl"])]


def test_the_best_rows_zero_width_bar_is_marked(frame):
    """The best preset's bar is 1 - 1 = 0 wide (issue 56): a mark at 1 on its row, in its colour."""
    _, tuned, _ = expected()
    right = lr_figure(frame).axes[-1]
    order = [t.get_text().split()[0] for t in right.get_yticklabels()]
    best = min(tuned, key=tuned.get)
    marks = [c for c in right.collections if isinstance(c, PathCollection)][1]
    assert marks.get_offsets().tolist() == [[1.0, float(order.index(best))]]
    bar = right.patches[order.index(best)]
    assert bar.get_width() == pytest.approx(0.0)
    # the same colour (the bar drawn at alpha 0.85)
    assert to_rgba(marks.get_facecolors()[0])[:3] == pytest.approx(to_rgba(bar.get_facecolor())[:3])
