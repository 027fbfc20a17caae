"""`table` over several sources counts each run once: the same run in two sources (the same
configuration and seed under another run id, or the same run id) is one sample per variant, its
evaluations merged over its copies whatever the order of the sources; runs an earlier version of a
spec planned are left out of `table DIR` by default (`--all-runs`, `--spec`). Every cell is checked
against the mean, count and Welch test of the values written into the fixture run dirs.

Run: .venv/bin/python -m pytest tests/analysis/test_table_sources.py -q
"""

import io
import json
import math
import shutil
import statistics

import pandas as pd
import pytest
from scipy import stats

from fixtures.report_runs import ENCODINGS, make_grid, make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.collect import pool_frames
from relpos_ablate.analysis.sources import RUN_ID_NOT_THE_MODEL, one_copy_per_run
from relpos_ablate.cli import main
from relpos_ablate.config import RunConfig

XL = {0: 10.0, 1: 10.4, 2: 10.1}
ALIBI = {0: 12.0, 1: 12.6, 2: 12.1}


def alibi_runs(root, extra=(), seeds=ALIBI, lengths=(32,)):
    """ALiBi runs of the given seeds with ppl seeds[s] + k at lengths[k]."""
    return [
        make_run(
            root,
            [*ENCODINGS["alibi"], f"seed={seed}", "train.segment_len=32", *extra],
            variant={"encoding": "alibi", "seed": seed},
            results=[({"segment_len": n}, {"ppl": ppl + k}) for k, n in enumerate(lengths)],
        )
        for seed, ppl in seeds.items()
    ]


def table_csv(capsys, *args):
    """`table ... --format csv` as a frame by row label, and its stderr."""
    assert main(["table", *map(str, args), "--cols", "eval_len", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    return pd.read_csv(io.StringIO(captured.out)).set_index("encoding"), captured.err


def welch_p(a, b):
    return stats.ttest_ind(a, b, equal_var=False).pvalue


def test_the_same_runs_in_two_specs_are_one_sample_per_seed(tmp_path, capsys):
    """The issue's case: spec B holds A's ALiBi runs with an `imports:` entry for an unrelated
    scheme (another run id, the same trained models): n = 3, and Welch's test on 3 and 3."""
    a, b = tmp_path / "a", tmp_path / "b"
    make_grid(a, {("xl", s): [p] for s, p in XL.items()}, lengths=(32,))
    in_a = alibi_runs(a)
    in_b = alibi_runs(b, ["imports=[colorsys]"])
    assert {p.name for p in in_a}.isdisjoint(p.name for p in in_b)  # not found by run id
    frame, err = table_csv(capsys, a, b, "--rows", "encoding", "--baseline", "xl")
    assert frame.loc["alibi", "eval len 32 n"] == 3
    assert frame.loc["alibi", "eval len 32"] == pytest.approx(statistics.mean(ALIBI.values()))
    assert frame.loc["alibi", "eval len 32 std"] == pytest.approx(statistics.stdev(ALIBI.values()))
    assert frame.loc["alibi", "eval len 32 p raw"] == pytest.approx(
        welch_p(list(ALIBI.values()), list(XL.values()))
    )
    assert err.count("\n") == 1 and "3 runs found 6 times" in err and "counted once" in err
    again, _ = table_csv(capsys, b, a, "--rows", "encoding", "--baseline", "xl")
    pd.testing.assert_frame_equal(again, frame)


def test_copies_are_one_run_only_when_they_train_the_same_model(tmp_path):
    """Within one source too (results/ holding two experiments); what changes the model keeps two
    runs apart, and what only evaluates (eval.*, imports) or says how to run it does not."""
    alibi_runs(tmp_path / "a", seeds={0: 12.0})
    alibi_runs(tmp_path / "b", ["imports=[colorsys]", "eval.batch_size=4"], seeds={0: 12.0})
    alibi_runs(tmp_path / "c", ["train.accumulate=2"], seeds={0: 12.0})
    alibi_runs(tmp_path / "d", ["train.lr=0.01"], seeds={0: 12.0})
    alibi_runs(tmp_path / "e", seeds={1: 12.0})
    frame = collect(tmp_path)
    assert frame["run_dir"].nunique() == 5
    once, lines = one_copy_per_run(frame)
    lr = RunConfig().train.lr
    assert once.groupby(["train.lr", "seed"])["run_dir"].nunique().to_dict() == {
        (lr, 0): 1,
        (lr, 1): 1,
        (0.01, 0): 1,
    }
    assert lines == [lines[0]] and lines[0].startswith("1 runs found 3 times")


def test_the_identity_leaves_out_what_evaluate_may_change_and_how_to_run():
    from relpos_ablate.config.run import HOW_TO_RUN
    from relpos_ablate.train.evaluate_run import EVALUATION_KEYS, EXAMPLE_KEYS

    assert set(EVALUATION_KEYS) | set(EXAMPLE_KEYS) | {"imports"} <= set(RUN_ID_NOT_THE_MODEL)
    assert {f"train.{name}" for name in HOW_TO_RUN} <= set(RUN_ID_NOT_THE_MODEL)


def _rewrite_eval(run_dir, ppl_by_length):
    path = run_dir / "eval.json"
    data = json.loads(path.read_text())
    template = data["settings"][0]
    data["settings"] = [
        {**template, "segment_len": n, "attn_len": n, "metrics": {"ppl": p}}
        for n, p in ppl_by_length.items()
    ]
    path.write_text(json.dumps(data))


def test_a_runs_evaluations_are_merged_over_its_copies_whatever_the_order(tmp_path, capsys):
    """The same run ids in two sources, each copy with evaluations the other lacks: the union,
    n = 3 in every column, in both orders (today's code kept the later source's copy only)."""
    a, b = tmp_path / "a", tmp_path / "b"
    runs = alibi_runs(a, lengths=(32, 64))
    make_grid(a, {("xl", s): [p, p + 1] for s, p in XL.items()}, lengths=(32, 64))
    shutil.copytree(a, b)
    for seed, run in enumerate(runs):
        _rewrite_eval(b / run.relative_to(a), {64: ALIBI[seed] + 1, 128: ALIBI[seed] + 5})
    first, err = table_csv(capsys, a, b, "--rows", "encoding")
    second, _ = table_csv(capsys, b, a, "--rows", "encoding")
    pd.testing.assert_frame_equal(first, second)
    for k, n in ((0, 32), (1, 64), (5, 128)):
        assert first.loc["alibi", f"eval len {n} n"] == 3
        assert first.loc["alibi", f"eval len {n}"] == pytest.approx(
            statistics.mean(p + k for p in ALIBI.values())
        )
    assert first.loc["xl", "eval len 32 n"] == 3 and first.loc["xl", "eval len 64 n"] == 3
    assert "6 runs found 12 times" in err and "evaluations differ" not in err


def test_one_setting_scored_differently_by_two_copies_is_left_out_and_said(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    runs = alibi_runs(a, lengths=(32, 64))
    shutil.copytree(a, b)
    _rewrite_eval(b / runs[1].relative_to(a), {32: ALIBI[1], 64: 99.0})
    frame, err = table_csv(capsys, b, a, "--rows", "encoding")
    assert frame.loc["alibi", "eval len 64 n"] == 2
    assert frame.loc["alibi", "eval len 64"] == pytest.approx(
        statistics.mean([ALIBI[0] + 1, ALIBI[2] + 1])
    )
    assert frame.loc["alibi", "eval len 32 n"] == 3
    line = next(x for x in err.splitlines() if "evaluations differ" in x)
    assert line.startswith("warning: 1 evaluations differ between copies of one run")
    assert f"run {runs[1].name} (seed 1)" in line and "segment_len=64" in line
    assert f"ppl {ALIBI[1] + 1:g}" in line and "99" in line


def test_a_summary_csv_and_its_run_dirs_are_the_runs_once(tmp_path, capsys):
    """The committed-study case: `table DIR DIR/summary.csv` after `evaluate` added a length to the
    run dirs is `table DIR`, the summary.csv round trip giving the same numbers (no ambiguity)."""
    runs = alibi_runs(tmp_path / "res", lengths=(32,))
    make_grid(tmp_path / "res", {("xl", s): [p] for s, p in XL.items()}, lengths=(32,))
    summary = tmp_path / "summary.csv"
    assert main(["collect", str(tmp_path / "res"), "--out", str(summary)]) == 0
    for seed, run in enumerate(runs):
        _rewrite_eval(run, {32: ALIBI[seed], 64: ALIBI[seed] / 3})
    alone, _ = table_csv(capsys, tmp_path / "res")
    for sources in ((tmp_path / "res", summary), (summary, tmp_path / "res")):
        both, err = table_csv(capsys, *sources)
        pd.testing.assert_frame_equal(both, alone)
        assert both.loc["alibi", "eval len 64 n"] == 3 and "evaluations differ" not in err
        assert "6 runs found 12 times" in err


SPEC = (
    "name: demo\nbase: {{model: {{vocab_size: 16, attention: {{terms: abcd}}}}, "
    "train: {{segment_len: 32, max_steps: {steps}}}}}\nseeds: {seeds}\n"
)


def versioned_runs(root):
    """results/demo with seed 0 at max_steps 200 (the spec's first version) and seeds 0-2 at 250
    (the spec as it is now), all recording the spec demo.yaml."""
    spec = root / "demo.yaml"
    spec.write_text(SPEC.format(steps=250, seeds="[0, 1, 2]"))
    old = root / "old.yaml"
    old.write_text(SPEC.format(steps=200, seeds="[0]"))
    made = {}
    for steps, seeds in ((200, {0: 11.0}), (250, XL)):
        for seed, ppl in seeds.items():
            made[(steps, seed)] = make_run(
                root / "results",
                [
                    *ENCODINGS["xl"],
                    "train.segment_len=32",
                    f"train.max_steps={steps}",
                    f"seed={seed}",
                ],
                variant={"seed": seed},
                spec="../../../demo.yaml",
                results=[({"segment_len": 32}, {"ppl": ppl})],
            )
    return spec, old, made


def by_terms(capsys, *args):
    args = [*map(str, args), "--rows", "model.attention.terms", "--cols", "eval_len"]
    assert main(["table", *args, "--format", "csv"]) == 0
    captured = capsys.readouterr()
    return pd.read_csv(io.StringIO(captured.out)).set_index("terms").loc["abcd"], captured.err


def test_runs_an_earlier_version_of_the_spec_planned_are_left_out_by_default(tmp_path, capsys):
    """max_steps changed 200 -> 250 and rerun under the same spec name: the table holds the 3 seeds
    the spec plans now, not "n = 4" with seed 0 twice; --all-runs and --spec bring the others."""
    spec, old, made = versioned_runs(tmp_path)
    results = tmp_path / "results" / "demo"
    row, err = by_terms(capsys, results)
    assert row["eval len 32 n"] == 3
    assert row["eval len 32"] == pytest.approx(statistics.mean(XL.values()))
    assert (
        f"warning: left out 1 runs their spec no longer plans (an earlier version's; {spec}: 1); "
        "--all-runs keeps them" in err
    )
    row, err = by_terms(capsys, results, "--all-runs")
    assert row["eval len 32 n"] == 4 and "left out" not in err
    assert row["eval len 32"] == pytest.approx(statistics.mean([11.0, *XL.values()]))
    row, err = by_terms(capsys, results, "--spec", old)
    assert row["eval len 32 n"] == 1 and row["eval len 32"] == 11.0
    assert "--spec: dropped 3 runs no spec plans" in err
    row, _ = by_terms(capsys, results, "--spec", old, spec)
    assert row["eval len 32 n"] == 4


def test_a_spec_that_cannot_be_found_keeps_every_run_with_one_line(tmp_path, capsys):
    spec, _, _ = versioned_runs(tmp_path)
    spec.unlink()
    row, err = by_terms(capsys, tmp_path / "results" / "demo")
    assert row["eval len 32 n"] == 4
    assert err.splitlines() == [
        "warning: spec not found, so its runs are all kept: ../../../demo.yaml (4 runs)"
    ]


def test_table_spec_and_all_runs_are_one_line_errors(tmp_path, capsys):
    versioned_runs(tmp_path)
    results = tmp_path / "results" / "demo"
    assert main(["table", str(results), "--spec", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --spec:")
    with pytest.raises(SystemExit):
        main(["table", str(results), "--spec", str(tmp_path / "old.yaml"), "--all-runs"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_lines_are_about_runs_not_rows(tmp_path):
    """A run with two settings found twice is one merged run (the count is of runs)."""
    alibi_runs(tmp_path / "a", seeds={0: 12.0}, lengths=(32, 64))
    alibi_runs(tmp_path / "b", ["imports=[colorsys]"], seeds={0: 12.0}, lengths=(32, 64))
    once, lines = one_copy_per_run(collect(tmp_path))
    assert len(once) == 2 and once["run_dir"].nunique() == 1
    assert sorted(once["ppl"]) == [12.0, 13.0] and not any(math.isnan(v) for v in once["ppl"])
    assert lines[0].startswith("1 runs found 2 times")


def test_runs_trained_alone_are_told_apart_by_their_config_not_their_folder_name(tmp_path):
    """`train` alone names a run by its folder: two folders of one name hold different runs."""
    for root, encoding in ((tmp_path / "one", "xl"), (tmp_path / "two", "alibi")):
        run = make_run(root, ENCODINGS[encoding], results=[({"segment_len": 32}, {"ppl": 3.0})])
        (run / "run.json").unlink()
        run.rename(root / "mine")
    frames = [collect(tmp_path / "one" / "mine"), collect(tmp_path / "two" / "mine")]
    assert {frame["run_id"].iloc[0] for frame in frames} == {"mine"}
    pooled = pool_frames(frames, ["one", "two"])
    once, lines = one_copy_per_run(pooled)
    assert len(once) == 2 and lines == []


def test_a_run_whose_every_evaluation_is_ambiguous_is_named_as_left_out(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    runs = alibi_runs(a)
    shutil.copytree(a, b)
    _rewrite_eval(b / runs[2].relative_to(a), {32: 50.0})
    frame, err = table_csv(capsys, a, b, "--rows", "encoding")
    assert frame.loc["alibi", "eval len 32 n"] == 2
    assert frame.loc["alibi", "eval len 32"] == pytest.approx(statistics.mean([ALIBI[0], ALIBI[1]]))
    assert (
        f"ppl {ALIBI[2]:g} ({a / 'demo' / runs[2].name}) vs 50 ({b / 'demo' / runs[2].name})" in err
    )
    assert f"warning: left out run {runs[2].name} (encoding=alibi)" in err
