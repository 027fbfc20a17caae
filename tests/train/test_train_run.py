"""One run in a run directory: the files it writes, resuming, failure records and the `train`
command.

Covers: the run-dir contract (config.yaml with vocab filled in, status.json, metrics.csv, eval.json,
checkpoints/last.ckpt, log.txt); resume after a crash and after SIGTERM (step count continues, every
step trains the segment it should, earlier metrics kept, no duplicated steps, status.json at the
checkpoint's step from the start; with dropout, randomized positions or memory the weights of the
uninterrupted run bit for bit); a rerun with the same thread count evaluates bit for bit the same; a
done run is not retrained; a non-finite loss fails the run; learned absolute positions beyond their
table; the CLI (config from the run dir, mismatch error, exit codes, --help listing every field).
Run: pytest tests/train/test_train_run.py
"""

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
import yaml

from fixtures.runner import REPO
from fixtures.training import At, crash, short, sigterm
from relpos_ablate.cli import main
from relpos_ablate.config import EvalSetting, RunConfig, describe, from_dict, to_plain
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.run import train_run


def read_metrics(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def read(run_dir, name):
    return json.loads((run_dir / name).read_text())


def checkpoint_step(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]


class SeenBatches(L.Callback):
    """Records the first input row of the batch trained at each global step."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen[trainer.global_step] = batch[0][0].clone()


def test_run_directory_contract(tmp_path):
    cfg = short("train.log_every=10")
    assert train_run(cfg, tmp_path) == "done"
    stored = from_dict(RunConfig, yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert stored.model.vocab_size == 8 and to_plain(stored)["train"] == to_plain(cfg)["train"]
    status = read(tmp_path, "status.json")
    assert status["state"] == "done" and status["step"] == status["max_steps"] == 30
    assert status["pid"] == os.getpid() and status["device"] == "cpu" and status["wall_time_s"] > 0
    assert {"started_at", "finished_at", "host"} <= set(status) and set(status["last_metric"]) == {
        "loss",
        "acc",
    }
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [9, 19, 29]
    results = read(tmp_path, "eval.json")
    assert results["main_metric"] == "acc" and results["step"] == 30
    assert checkpoint_step(tmp_path) == 30
    assert "trained to step 30" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize("stop, state", [(crash, "failed"), (sigterm, "interrupted")])
def test_resume_continues_the_steps_and_keeps_earlier_metrics(tmp_path, stop, state):
    cfg = short()
    seen = SeenBatches()
    assert train_run(cfg, tmp_path, callbacks=(At(17, stop), seen)) == state
    status = read(tmp_path, "status.json")
    assert status["state"] == state and status["step"] == 17
    resume_step = checkpoint_step(tmp_path)
    assert resume_step == (10 if stop is crash else 17)  # SIGTERM saves the batch it finished
    before = {int(r["step"]): r for r in read_metrics(tmp_path)}

    class StatusAtStart(L.Callback):  # before Lightning restores the checkpoint and starts training
        def setup(self, trainer, pl_module, stage):
            if stage == "fit":
                self.status = read(tmp_path, "status.json")

    at_start = StatusAtStart()
    assert train_run(cfg, tmp_path, callbacks=(seen, at_start)) == "done"
    # not 17
    assert at_start.status["state"] == "running" and at_start.status["step"] == resume_step
    rows = read_metrics(tmp_path)
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(30))  # nothing lost, nothing twice
    for row in rows[:resume_step]:
        assert row == before[int(row["step"])]
    assert checkpoint_step(tmp_path) == 30 and read(tmp_path, "eval.json")["step"] == 30
    streams = build_datamodule(cfg).streams("train", 16)
    assert sorted(seen.seen) == list(range(30))
    for step, first_row in seen.seen.items():  # resumed steps train the segment they would have
        assert torch.equal(first_row, streams[step % 12][0][0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """uninterrupted(cfg): the run dir of `cfg` trained without a stop, trained once per config in
    this process (a crash and a SIGTERM with randomized positions resume to the same one), not once
    a test."""
    runs = {}

    def run(cfg):
        key = yaml.safe_dump(to_plain(cfg))
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("whole")
            assert train_run(cfg, run_dir) == "done"
            runs[key] = run_dir
        return runs[key]

    return run


@pytest.mark.parametrize(
    "stop, overrides",
    [
        (crash, ("model.attention.positions=randomized", "model.attention.max_position=64")),
        (sigterm, ("model.attention.positions=randomized", "model.attention.max_position=64")),
        # resumed at step 10, between the stream restarts at 0 and 12
        (crash, ("model.mem_len=8",)),
    ],
)
def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(
    tmp_path, uninterrupted, stop, overrides
):
    """Dropout and randomized positions draw from the random state the checkpoint keeps; memory
    continues."""
    cfg = short("model.dropout=0.2", *overrides)
    whole = uninterrupted(cfg)
    assert train_run(cfg, tmp_path / "cut", callbacks=(At(17, stop),)) in ("failed", "interrupted")
    assert train_run(cfg, tmp_path / "cut") == "done"
    weights = [
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        for run in (whole, tmp_path / "cut")
    ]
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
    assert read(whole, "eval.json")["settings"] == read(tmp_path / "cut", "eval.json")["settings"]


def test_a_done_run_is_not_retrained_and_a_lost_eval_is_redone(tmp_path):
    cfg = short()
    assert train_run(cfg, tmp_path) == "done"
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    stamp, status = ckpt.stat().st_mtime_ns, (tmp_path / "status.json").read_text()
    assert train_run(cfg, tmp_path) == "done"
    assert ckpt.stat().st_mtime_ns == stamp and (tmp_path / "status.json").read_text() == status
    first = read(tmp_path, "eval.json")
    (tmp_path / "eval.json").unlink()
    assert train_run(cfg, tmp_path) == "done"
    assert read(tmp_path, "eval.json") == first and checkpoint_step(tmp_path) == 30


def test_non_finite_loss_fails_the_run_naming_the_step(tmp_path):
    def poison(trainer, module):
        with torch.no_grad():
            next(module.model.parameters()).fill_(float("nan"))

    assert train_run(short(), tmp_path, callbacks=(At(3, poison),)) == "failed"
    status = read(tmp_path, "status.json")
    # the first step that ran on the NaN weights
    assert status["reason"] == "non-finite loss at step 3"
    assert "NonFiniteLoss" in status["traceback"]


def test_learned_positions_beyond_their_table_are_recorded_not_fatal(tmp_path):
    cfg = short(
        "model.attention.terms=a",
        "model.attention.absolute=learned",
        "model.attention.max_position=16",
        "eval.settings=[{segment_len: 16}, {segment_len: 64}]",
    )
    assert train_run(cfg, tmp_path) == "done"
    fits, too_long = read(tmp_path, "eval.json")["settings"]
    assert "acc" in fits["metrics"] and "error" not in fits
    assert too_long["metrics"] == {} and "max_position" in too_long["error"]


def test_a_rerun_with_the_same_thread_count_evaluates_bit_for_bit_the_same(tmp_path):
    """The README's promise for the same machine, torch and thread count: one training in this
    process and one through `train` in a fresh process, 1 thread each, write identical eval.json
    files (with dropout)."""
    cfg = short("model.dropout=0.1", "train.max_steps=10")
    assert train_run(cfg, tmp_path / "here") == "done"
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(to_plain(cfg)))
    argv = [
        sys.executable,
        "-m",
        "relpos_ablate",
        "train",
        "--config",
        str(tmp_path / "again.yaml"),
        "--run-dir",
        str(tmp_path / "again"),
        "--threads",
        "1",
    ]
    done = subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert read(tmp_path / "again", "eval.json") == read(tmp_path / "here", "eval.json")


def test_validation_during_training_is_logged(tmp_path):
    assert train_run(short("train.val_every=10", "train.log_every=10"), tmp_path) == "done"
    rows = {int(r["step"]): r for r in read_metrics(tmp_path)}
    assert [s for s, r in rows.items() if r.get("val_acc")] == [9, 19, 29]


def test_cli_runs_from_the_run_dir_config_and_exits_by_state(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # as the grid runner writes it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_plain(short())))
    assert main(["train", "--run-dir", str(run_dir), "--threads", "1"]) == 0
    assert "acc" in capsys.readouterr().out and read(run_dir, "status.json")["state"] == "done"
    assert main(["train", "--run-dir", str(run_dir)]) == 0
    assert "already done" in capsys.readouterr().out

    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(to_plain(short("seed=5"))))
    assert main(["train", "--config", str(other), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "seed: 0 there, 5 here" in err and "\n" not in err


def text_run(tmp_path, *overrides):
    """`train` argv of a char-level run on local files: a train split of 2,000 characters, a valid
    split of 600."""
    (tmp_path / "train.txt").write_text("to be or not to be\n" * 105)
    (tmp_path / "valid.txt").write_text("abcdefghi\n" * 60)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            to_plain(
                short(
                    "data.source=text",
                    f"data.train_file={tmp_path / 'train.txt'}",
                    f"data.valid_file={tmp_path / 'valid.txt'}",
                    f"data.cache_dir={tmp_path / 'cache'}",
                    *overrides,
                )
            )
        )
    )
    return ["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]


def test_cli_failed_run_exits_1_with_the_reason(tmp_path, capsys, monkeypatch):
    import relpos_ablate.train.run

    monkeypatch.setattr(
        relpos_ablate.train.run,
        "train_run",
        lambda config, run_dir, **kw: train_run(config, run_dir, callbacks=(At(2, crash),), **kw),
    )
    assert main(text_run(tmp_path)) == 1
    assert "failed: RuntimeError: boom" in capsys.readouterr().out
    assert read(tmp_path / "run", "status.json")["state"] == "failed"


def test_cli_ctrl_c_says_the_run_is_interrupted_and_how_to_resume(tmp_path, capsys, monkeypatch):
    def ctrl_c(trainer, module):
        raise KeyboardInterrupt

    import relpos_ablate.train.run

    monkeypatch.setattr(
        relpos_ablate.train.run,
        "train_run",
        lambda config, run_dir, **kw: train_run(config, run_dir, callbacks=(At(2, ctrl_c),), **kw),
    )
    # Lightning ignores further Ctrl-C while it shuts down
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert main(text_run(tmp_path)) == 1
    finally:
        signal.signal(signal.SIGINT, handler)
    assert (
        "interrupted: interrupted by the user; rerun the same command to resume"
        in capsys.readouterr().out
    )
    monkeypatch.undo()
    assert (
        main(text_run(tmp_path)) == 0 and read(tmp_path / "run", "status.json")["state"] == "done"
    )


def test_an_evaluation_the_text_split_cannot_feed_is_bad_input_before_any_training_step(
    tmp_path, capsys
):
    """600 valid tokens in 8 streams leave 74 targets per stream: segment_len 128 is named before
    training."""
    argv = text_run(
        tmp_path, "eval.settings=[{segment_len: 16}, {segment_len: 128}]", "eval.batch_size=8"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err  # besides the progress of datasets reading the files
    assert "Traceback" not in err and [
        line for line in err.splitlines() if line.startswith("error")
    ] == [
        "error: eval.settings[1].segment_len: 128 does not fit the valid split: its 600 tokens "
        "cut into eval.batch_size=8 streams leave 74 targets per stream; use segment_len <= 74 "
        "(or fewer streams)"
    ]
    assert (
        not (tmp_path / "run" / "metrics.csv").exists()
        and not (tmp_path / "run" / "checkpoints").exists()
    )
    assert read(tmp_path / "run", "status.json")["state"] == "failed"
    assert (
        main(
            text_run(
                tmp_path,
                "eval.settings=[{segment_len: 16}, {segment_len: 74}]",
                "eval.batch_size=8",
            )
        )
        == 0
    )


def test_a_training_split_too_short_is_bad_input_too_and_the_wall_time_counts_the_start_up(
    tmp_path, capsys, monkeypatch
):
    """status.json's wall time (status's elapsed) runs from the command's start, its start-up
    included (here a slow config read stands for importing torch and reading the data)."""
    import relpos_ablate.cli.train as cli_train

    def slow(*args):
        time.sleep(0.5)
        return resolve(*args)

    resolve = cli_train.resolve_config
    monkeypatch.setattr(cli_train, "resolve_config", slow)
    (tmp_path / "short.txt").write_text("tiny\n")
    argv = text_run(tmp_path, f"data.train_file={tmp_path / 'short.txt'}")
    began = time.monotonic()
    assert main(argv) == 2
    took = time.monotonic() - began
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("error: train.batch_size: the train split has")
    )
    assert took - 0.25 < read(tmp_path / "run", "status.json")["wall_time_s"] <= took


def test_cli_summary_labels_settings_as_tables_do(tmp_path, capsys):
    """A sliding and an xl setting of the same length are told apart, by the labels `table` uses."""
    from fixtures.report_runs import make_run
    from relpos_ablate.cli.train import print_outcome

    run_dir = make_run(
        tmp_path,
        ["model.mem_len=64"],
        results=[
            ({"segment_len": 64, "protocol": "sliding", "stride": 32, "mem_len": 0}, {"ppl": 3.0}),
            ({"segment_len": 64, "protocol": "xl"}, {"ppl": 4.0}),
        ],
    )
    (run_dir / "eval.json").write_text(json.dumps({**read(run_dir, "eval.json"), "step": 300}))
    print_outcome(run_dir, "done")
    lines = capsys.readouterr().out.splitlines()
    assert any(
        "sliding, eval len 64, stride 32, mem 0" in line and "3" in line for line in lines
    ), lines
    assert any("xl, eval len 64, mem 64" in line and "4" in line for line in lines), lines


def test_cli_without_any_config_is_a_usage_error(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path)]) == 2
    assert "--config: not given" in capsys.readouterr().err


def test_help_lists_every_config_field_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for path, default, _doc in describe(RunConfig):
        assert f"{path} = {default}" in text
    # every field of an evaluation setting, none left out
    for field in dataclasses.fields(EvalSetting):
        assert f"eval.settings[i].{field.name} = " in text, field.name
