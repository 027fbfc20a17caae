"""collect(): results dir -> one row per (run, evaluation setting), on fixture run dirs built here,
including broken ones (missing files, truncated JSON, foreign files). Also `relpos-ablate collect`.

Run: .venv/bin/python -m pytest tests/analysis/test_collect.py -q
"""

import json
import math
import shutil

import pandas as pd
import pytest

from fixtures.report_runs import ENCODINGS, make_grid, make_run
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main

PPL = {("xl", 0): [10.0, 12.0], ("xl", 1): [11.0, 13.0], ("alibi", 0): [12.0, 12.5]}


def test_one_row_per_run_and_setting_with_the_written_values(tmp_path):
    run_dirs = make_grid(tmp_path, PPL, lengths=(32, 64))
    df = collect(tmp_path)
    assert df.attrs["problems"] == []
    assert len(df) == 3 * 2
    for column in (
        "run_id",
        "experiment",
        "status",
        "reason",
        "seed",
        "wall_time_s",
        "encoding",
        "segment_len",
        "mem_len",
        "clamp_len",
        "same_length",
        "attn_len",
        "ppl",
        "loss",
        "main_metric",
        "model.attention.terms",
        "train.segment_len",
    ):
        assert column in df, column
    assert df.attrs["variant_axes"] == ["encoding"] and df.attrs["metrics"] == ["ppl", "loss"]
    for (enc, seed), values in PPL.items():
        rows = df[(df["encoding"] == enc) & (df["seed"] == seed)].sort_values("segment_len")
        assert rows["ppl"].tolist() == values
        assert rows["loss"].tolist() == pytest.approx([math.log(v) for v in values])
        assert rows["segment_len"].tolist() == [32, 64] and rows["attn_len"].tolist() == [32, 64]
        terms = ENCODINGS[enc][0].split("=")[1]
        assert set(rows["model.attention.terms"]) == {terms}
    assert set(df["status"]) == {"done"} and set(df["main_metric"]) == {"ppl"}
    assert sorted(df["run_dir"].unique()) == sorted(str(p) for p in run_dirs)


def _write(path, text):
    path.write_text(text)
    return path


def test_broken_runs_become_rows_and_every_problem_is_reported(tmp_path):
    good = make_grid(tmp_path, {("xl", 0): [10.0]}, lengths=(32,))[0]
    failed = make_run(tmp_path, ["seed=1"], state="failed")
    running = make_run(tmp_path, ["seed=2"], state="running")
    truncated_eval = make_run(tmp_path, ["seed=3"], results=[({"segment_len": 32}, {"ppl": 9.0})])
    _write(truncated_eval / "eval.json", (truncated_eval / "eval.json").read_text()[:40])
    no_status = make_run(tmp_path, ["seed=4"], results=[({"segment_len": 32}, {"ppl": 8.0})])
    (no_status / "status.json").unlink()
    bad_config = make_run(tmp_path, ["seed=5"], results=[({"segment_len": 32}, {"ppl": 7.0})])
    _write(bad_config / "config.yaml", "model: {d_model: 32\n  terms: [")
    done_without_eval = make_run(
        tmp_path, ["seed=6"], results=[({"segment_len": 32}, {"ppl": 6.0})]
    )
    (done_without_eval / "eval.json").unlink()
    odd_eval = make_run(tmp_path, ["seed=7"], results=[({"segment_len": 32}, {"ppl": 5.0})])
    _write(
        odd_eval / "eval.json",
        json.dumps({"main_metric": "ppl", "settings": [{"segment_len": 32}, "junk"]}),
    )
    list_eval = make_run(tmp_path, ["seed=8"], results=[({"segment_len": 32}, {"ppl": 4.0})])
    _write(list_eval / "eval.json", "[1, 2]")
    only_eval = tmp_path / "demo" / "onlyeval"
    only_eval.mkdir()
    _write(
        only_eval / "eval.json",
        json.dumps(
            {
                "main_metric": "ppl",
                "settings": [{"segment_len": 16, "mem_len": 8, "metrics": {"ppl": "nan?"}}],
            }
        ),
    )
    _write(tmp_path / "demo" / "notes.bin", "foreign")
    (tmp_path / "demo" / "junk").mkdir()
    # an interrupted atomic write: invisible, never a problem
    _write(good / ".eval.json.x1.tmp", "{half")
    # report outputs next to the runs are expected
    _write(tmp_path / "demo" / "summary.csv", "a,b\n")

    df = collect(tmp_path)
    problems = df.attrs["problems"]
    by_dir = df.groupby("run_dir")

    def rows(run_dir):
        return by_dir.get_group(str(run_dir))

    assert rows(good)["ppl"].tolist() == [10.0]
    assert rows(failed)["status"].tolist() == ["failed"] and rows(failed)["reason"].iloc[
        0
    ].startswith("loss became nan")
    assert rows(running)["status"].tolist() == ["running"] and rows(running)["ppl"].isna().all()
    assert (
        rows(truncated_eval)["ppl"].isna().all()
        and rows(truncated_eval)["status"].iloc[0] == "done"
    )
    assert rows(no_status)["status"].tolist() == ["unknown"] and rows(no_status)[
        "ppl"
    ].tolist() == [8.0]
    assert rows(bad_config)["ppl"].tolist() == [7.0] and pd.isna(rows(bad_config)["seed"].iloc[0])
    assert rows(done_without_eval)["ppl"].isna().all()
    assert len(rows(odd_eval)) == 1 and rows(odd_eval)["ppl"].isna().all()
    assert rows(list_eval)["ppl"].isna().all()
    assert rows(only_eval)["attn_len"].tolist() == [24] and rows(only_eval)["ppl"].isna().all()
    assert df["run_dir"].nunique() == 10 and len(df) == 10

    expected = {
        truncated_eval / "eval.json": "unreadable",
        no_status / "status.json": "missing",
        bad_config / "config.yaml": "unreadable",
        done_without_eval / "eval.json": "missing although the run is done",
        odd_eval / "eval.json": "settings[0] has no 'metrics'",
        list_eval / "eval.json": "unreadable",
        only_eval / "config.yaml": "missing",
        tmp_path / "demo" / "notes.bin": "foreign file",
        tmp_path / "demo" / "junk": "not a run directory",
    }
    for path, what in expected.items():
        assert any(p.startswith(f"{path}:") and what in p for p in problems), (path, problems)
    assert not any(".tmp" in p or "summary.csv" in p for p in problems)


def test_nested_results_root_and_single_run_dir(tmp_path):
    a = make_run(
        tmp_path,
        ["seed=0"],
        experiment="first",
        results=[({"segment_len": 32}, {"acc": 0.5})],
        main_metric="acc",
    )
    make_run(
        tmp_path,
        ["seed=1"],
        experiment="second",
        results=[({"segment_len": 32}, {"acc": 0.75})],
        main_metric="acc",
    )
    df = collect(tmp_path)
    assert sorted(df["experiment"]) == ["first", "second"] and df.attrs["problems"] == []
    assert df.attrs["metrics"] == ["acc"]
    single = collect(a)
    assert single["acc"].tolist() == [0.5] and single["experiment"].tolist() == ["first"]


def test_missing_dir_is_a_problem_not_a_crash(tmp_path):
    df = collect(tmp_path / "nope")
    assert df.empty and "not a directory" in df.attrs["problems"][0]


def test_cli_collect_writes_csv_and_parquet_and_reports_problems(tmp_path, capsys):
    make_grid(tmp_path / "res", PPL, lengths=(32, 64))
    _write(tmp_path / "res" / "demo" / "stray.bin", "x")
    out = tmp_path / "summary.csv"
    assert main(["collect", str(tmp_path / "res"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert (
        "warning:" in err and "stray.bin: foreign file" in err and "3 runs (3 done), 6 rows" in err
    )
    expected = collect(tmp_path / "res")
    written = pd.read_csv(out)
    assert written["ppl"].tolist() == expected["ppl"].tolist()
    assert written["model.attention.terms"].tolist() == expected["model.attention.terms"].tolist()
    parquet = tmp_path / "summary.parquet"
    assert main(["collect", str(tmp_path / "res"), "--out", str(parquet)]) == 0
    assert pd.read_parquet(parquet)["ppl"].tolist() == expected["ppl"].tolist()
    assert main(["collect", str(tmp_path / "res")]) == 0
    printed = capsys.readouterr().out
    assert "encoding" in printed and "13.0" in printed


def test_cli_collect_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["collect", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    make_grid(tmp_path, PPL)
    assert main(["collect", str(tmp_path), "--out", str(tmp_path / "x.xlsx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --out:") and ".csv or .parquet" in err[-1]


def test_cli_collect_merges_an_earlier_summary_and_keeps_only_planned_runs(tmp_path, capsys):
    """A committed study keeps summary.csv, not run dirs: runs added later merge with it (the run
    dirs win for a run in both), and --spec drops the runs a changed spec no longer plans."""
    runs = make_grid(tmp_path / "res", PPL, lengths=(32, 64))
    summary = tmp_path / "summary.csv"
    assert main(["collect", str(tmp_path / "res"), "--out", str(summary)]) == 0
    earlier = pd.read_csv(summary)
    stale = earlier.copy()
    kept_id = runs[0].name
    stale.loc[stale["run_id"] == kept_id, "ppl"] = 999.0  # the run dir's values must win
    stale.to_csv(summary, index=False)
    shutil.rmtree(runs[1])  # its rows now live only in the summary
    added = make_grid(tmp_path / "res", {("xl", 2): [9.0, 9.5]}, lengths=(32, 64))[0]
    assert (
        main(["collect", str(tmp_path / "res"), "--merge", str(summary), "--out", str(summary)])
        == 0
    )
    assert "4 runs (4 done), 8 rows" in capsys.readouterr().err
    merged = pd.read_csv(summary)
    assert list(merged.columns[: len(earlier.columns)]) == list(earlier.columns)
    by_run = merged.groupby("run_id")["ppl"].apply(sorted).to_dict()
    assert by_run[kept_id] == [10.0, 12.0] and by_run[runs[1].name] == [11.0, 13.0]
    assert by_run[added.name] == [9.0, 9.5] and by_run[runs[2].name] == [12.0, 12.5]
    spec = tmp_path / "xl_only.yaml"
    spec.write_text(
        "name: demo\nbase: {model: {vocab_size: 16, attention: {terms: abcd}}, train: "
        "{segment_len: 32}}\nseeds: [0, 1, 2]\n"
    )
    out = tmp_path / "xl.csv"
    assert (
        main(
            [
                "collect",
                str(tmp_path / "res"),
                "--merge",
                str(summary),
                "--spec",
                str(spec),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        f"dropped 1 runs no spec plans ({runs[2].name})" in err and "3 runs (3 done), 6 rows" in err
    )
    assert set(pd.read_csv(out)["encoding"]) == {"xl"}


def test_cli_collect_merge_and_spec_bad_inputs_are_one_line_errors(tmp_path, capsys):
    make_grid(tmp_path, PPL)
    assert main(["collect", str(tmp_path), "--merge", str(tmp_path / "none.csv")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --merge:")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nbase: {train: {segment_len: -3}}\n")
    assert main(["collect", str(tmp_path), "--spec", str(bad)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --spec:") and "segment_len" in last


def test_ladder_loss_is_the_mean_on_the_targets_every_fixed_context_scores_in_full(tmp_path):
    """ladder_loss: on each fixed-context setting with token losses, the mean over the targets at
    stream position >= longest context - 1 (the same targets for every context), computed here by
    hand."""
    import numpy as np

    from relpos_ablate import rundir

    rng = np.random.default_rng(0)
    short, long_ = rng.uniform(0, 3, (2, 12)), rng.uniform(0, 3, (2, 12))
    settings = [
        (
            {"segment_len": 4, "protocol": "sliding", "stride": 1, "token_losses": "c4"},
            {"ppl": 9.0},
        ),
        (
            {"segment_len": 8, "protocol": "sliding", "stride": 1, "token_losses": "c8"},
            {"ppl": 8.0},
        ),
        ({"segment_len": 8, "protocol": "sliding", "stride": 4}, {"ppl": 8.5}),
    ]
    run = make_run(tmp_path, ["seed=0"], results=settings)
    np.savez(run / rundir.TOKEN_LOSSES, c4=short.astype(np.float32), c8=long_.astype(np.float32))
    df = collect(tmp_path).sort_values("eval_setting")
    expected = [
        sum(float(v) for row in a for v in row[7:]) / 10
        for a in (short.astype(np.float32), long_.astype(np.float32))
    ]
    assert df["ladder_loss"].tolist()[:2] == pytest.approx(expected, rel=1e-6)
    assert df["ladder_targets"].tolist()[:2] == [10, 10] and math.isnan(
        df["ladder_loss"].tolist()[2]
    )
    (run / rundir.TOKEN_LOSSES).unlink()
    df = collect(tmp_path)
    assert "ladder_loss" not in df and any(
        "no ladder_loss" in line for line in df.attrs["problems"]
    )
