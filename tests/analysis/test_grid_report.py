"""`relpos-ablate report DIR` for a grid no study reports on (analysis/grid_report.py): the table of
the spec's `table:` block with its tests against the spec's baseline, as Markdown.

Covers: on a tiny grid laid out as the runner writes it (2 encodings x 3 seeds, evaluated at 2
lengths; the values hand-written), the report's means and standard deviations, each test's
difference, 95% CI, raw and adjusted p and the family's correction match an independent computation
(scipy's Welch test, Welch-Satterthwaite interval, Holm and Benjamini-Hochberg by hand);
`--correction` and the spec's `table: {correction: ...}` choose the correction; without a baseline
one line says so and no test is stated; a run without results is named; a study's own report still
wins.
Run: .venv/bin/python -m pytest tests/analysis/test_grid_report.py -q   (about 5 s)
"""

import math

import numpy as np
import pytest
from scipy import stats

from fixtures.runner import write_spec
from relpos_ablate import studies
from relpos_ablate.analysis.collect import collect
from relpos_ablate.analysis.grid_report import NO_BASELINE
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.runner.store import plan_grid, write_run_files

LENGTHS = (16, 32)
PPL = {
    ("xl", 0): [10.0, 14.0],
    ("xl", 1): [10.4, 14.6],
    ("xl", 2): [10.1, 13.7],
    ("alibi", 0): [12.0, 12.4],
    ("alibi", 1): [12.5, 12.1],
    ("alibi", 2): [12.2, 12.9],
}


def make_grid(tmp_path, table: dict, failed: tuple = ()):
    """The runs of a spec with this `table:` block, as the runner lays them out, each done with
    PPL's values at LENGTHS (the (encoding, seed) pairs in `failed`: failed, no results)."""
    spec_path = write_spec(tmp_path, "g", encodings=("xl", "alibi"), seeds=(0, 1, 2), table=table)
    spec = load_grid(spec_path)
    for plan in plan_grid(spec, tmp_path / "results"):
        write_run_files(plan, spec.name, spec_path)
        key = (plan.run.variant["encoding"], plan.run.variant["seed"])
        state = "failed" if key in failed else "done"
        atomic_write_json(
            plan.run_dir / "status.json",
            {"state": state, "reason": "loss is nan" if state == "failed" else None, "step": 6},
        )
        if state == "done":
            settings = [
                {
                    "segment_len": length,
                    "mem_len": 0,
                    "clamp_len": None,
                    "same_length": False,
                    "attn_len": length,
                    "metrics": {"ppl": value},
                }
                for length, value in zip(LENGTHS, PPL[key])
            ]
            atomic_write_json(
                plan.run_dir / "eval.json", {"main_metric": "ppl", "settings": settings}
            )
    return tmp_path / "results" / "g"


def values(encoding: str, column: int) -> list[float]:
    return [v[column] for (e, _), v in PPL.items() if e == encoding]


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """(mean(a) - mean(b), 95% CI low, high, p) by Welch's formulas, the p from scipy."""
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    difference = float(np.mean(a) - np.mean(b))
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    p = stats.ttest_ind(a, b, equal_var=False).pvalue
    return difference, difference - half, difference + half, float(p)


def holm(p: list[float]) -> list[float]:
    order = sorted(range(len(p)), key=lambda k: p[k])
    adjusted, running = [0.0] * len(p), 0.0
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[k]))
        adjusted[k] = running
    return adjusted


def benjamini_hochberg(p: list[float]) -> list[float]:
    order = sorted(range(len(p)), key=lambda k: p[k], reverse=True)
    adjusted, running = [0.0] * len(p), 1.0
    for rank, k in enumerate(order):
        running = min(running, p[k] * len(p) / (len(p) - rank))
        adjusted[k] = running
    return adjusted


def report(argv: list[str], capsys) -> str:
    assert main(["report", *argv]) == 0
    return capsys.readouterr().out


TABLE = {"rows": ["encoding"], "cols": ["segment_len"], "metric": "ppl", "baseline": "xl"}


@pytest.mark.parametrize(
    ("flag", "spec_correction", "word", "adjust"),
    [
        ([], None, "Holm-adjusted", holm),
        (["--correction", "bh"], None, "BH-adjusted", benjamini_hochberg),
        ([], "bh", "BH-adjusted", benjamini_hochberg),
        (["--correction", "holm"], "bh", "Holm-adjusted", holm),
    ],
)
def test_the_report_states_the_tables_tests_as_an_independent_computation_does(
    tmp_path, capsys, flag, spec_correction, word, adjust
):
    table = {**TABLE, **({"correction": spec_correction} if spec_correction else {})}
    grid = make_grid(tmp_path, table)
    text = report([str(grid), *flag], capsys)
    assert text.startswith("# g\n")
    assert "## The table: ppl by encoding × segment_len\n" in text
    heading = {"Holm-adjusted": "Holm-corrected", "BH-adjusted": "Benjamini-Hochberg (FDR)"}[word]
    assert f"Tests against xl: one family, {heading}" in text
    # the cells: mean ± std (ddof=1) over the 3 seeds
    for encoding in ("xl", "alibi"):
        cells = [
            f"{np.mean(values(encoding, k)):.2f} ± {np.std(values(encoding, k), ddof=1):.2f}"
            for k in range(len(LENGTHS))
        ]
        assert all(cell in text for cell in cells), (encoding, cells)
    # the tests: alibi against xl at each length, different models: Welch's, one family
    tests = [welch(values("alibi", k), values("xl", k)) for k in range(len(LENGTHS))]
    adjusted = adjust([t[3] for t in tests])
    for (difference, low, high, p), p_adjusted in zip(tests, adjusted):
        assert (
            f"Welch's t-test, difference {difference:.3f}, 95% CI [{low:.3f}, {high:.3f}], "
            f"n = 3; p = {p:.2g}, {word} p = {p_adjusted:.2g}"
        ) in text
    assert text.count("Welch's t-test, difference") == 2
    assert 'Family "every row vs xl, column by column": 2 tests' in text
    assert "Power: with n = 3 per side" in text


def test_without_a_baseline_one_line_says_so_and_no_test_is_stated(tmp_path, capsys):
    grid = make_grid(tmp_path, {k: v for k, v in TABLE.items() if k != "baseline"})
    text = report([str(grid)], capsys)
    assert NO_BASELINE in text
    assert "p =" not in text and "Tests:" not in text and "Power" not in text
    xl_at_32 = values("xl", 1)
    assert f"{np.mean(xl_at_32):.2f} ± {np.std(xl_at_32, ddof=1):.2f}" in text


def test_a_run_without_results_is_named_and_its_seed_left_out(tmp_path, capsys):
    grid = make_grid(tmp_path, TABLE, failed=(("alibi", 2),))
    text = report([str(grid)], capsys)
    assert "Left out of the table:" in text and "(encoding=alibi): failed: loss is nan" in text
    # alibi's cells over its 2 finished seeds: too few to test
    alibi_at_16 = values("alibi", 0)[:2]
    assert f"{np.mean(alibi_at_16):.2f} ± {np.std(alibi_at_16, ddof=1):.2f} (n=2)" in text
    assert text.count("n too small to test") == 2


def test_a_studys_own_report_wins_over_the_grids(tmp_path, monkeypatch):
    grid = make_grid(tmp_path, TABLE)
    monkeypatch.setattr(
        studies, "STUDIES", (*studies.STUDIES, studies.Study("fixtures.demo_study", ("g",)))
    )
    import fixtures.demo_study as demo

    monkeypatch.setitem(demo.REPORTS, "g", lambda df, correction: f"study {correction}\n")
    assert studies.make_report(collect(grid), None) == "study holm\n"


def test_without_a_readable_spec_the_error_says_what_the_report_needs(tmp_path, capsys):
    grid = make_grid(tmp_path, TABLE)
    (tmp_path / "g.yaml").unlink()
    assert main(["report", str(grid)]) == 2
    assert (
        "no report for experiment 'g', and no grid spec readable from its runs' records for a "
        "report of its `table:` block; reports exist for: " in capsys.readouterr().err
    )
