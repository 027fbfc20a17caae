"""Training until in-distribution success (train.stop_at_exact_match, train/stopping.py): a tiny run
that reaches the threshold stops at that check, with last.ckpt, eval.json and status.json at that
step and the check's exact match equal to one recomputed here example by example; one that cannot
reach it trains to the cap, to the very weights of a run without checks; a resumed run keeps
checking, and a run that had stopped stops again at once; two processes stop at the step one process
stops at; bad values are one line.
Run: pytest tests/train/test_stopping.py -q   (about 15 s, and 35 s more for the two-process run)"""

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
import yaml

from fixtures.runner import REPO
from relpos_ablate import rundir
from relpos_ablate.analysis import collect
from relpos_ablate.config import ConfigError, load_run_config
from relpos_ablate.train.data import examples
from relpos_ablate.train.run import load_run, train_run
from relpos_ablate.train.stopping import STOP_STREAM

TINY = [
    "model.d_model=16",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.d_head=8",
    "model.d_inner=32",
    "model.dropout=0.0",
    "model.attention.terms=a",
    "model.attention.bias=alibi",
    "data.task=copy",
    "data.num_symbols=2",
    "data.train_examples=64",
    "data.eval_examples=8",
    "data.test_lengths=[[1, 2]]",
    "train.batch_size=4",
    "train.max_steps=8",
    "train.warmup_steps=0",
    "train.log_every=1",
    "train.checkpoint_every=8",
    "train.accelerator=cpu",
    "train.stop_check_every=2",
    "train.stop_examples=40",
    "eval.batch_size=16",
]
EASY = [*TINY, "data.train_lengths=[1, 1]", "train.segment_len=3", "train.stop_at_exact_match=0.3"]
"""One symbol of two: about half the held-out examples are right from the start, so the first check
stops."""
HARD = [*TINY, "data.train_lengths=[1, 2]", "train.segment_len=5", "train.stop_at_exact_match=1.0"]
"""Two symbols, eight steps: never all 40 held-out examples right."""


def read(run_dir, name):
    return json.loads((run_dir / name).read_text())


def checkpoint(run_dir):
    return torch.load(rundir.last_checkpoint(run_dir), weights_only=False)


def exact_match_by_hand(run_dir) -> float:
    """The held-out share exactly right, one unpadded example at a time (eval mode, no randomization
    here)."""
    config, model = load_run(run_dir)
    held_out = examples.generate(
        config.data,
        config.seed,
        "eval",
        config.train.stop_examples,
        tuple(config.data.train_lengths),
        stream=STOP_STREAM,
    )
    right = 0
    for row in range(len(held_out)):
        width = int((held_out.inputs[row] != examples.PAD).sum())
        with torch.no_grad():
            logits, _ = model(held_out.inputs[row : row + 1, :width])
        mask = held_out.mask[row, :width]
        right += bool((logits[0].argmax(-1)[mask] == held_out.targets[row, :width][mask]).all())
    return right / len(held_out)


def test_a_run_that_reaches_the_threshold_stops_at_that_check(tmp_path):
    assert train_run(load_run_config(None, EASY), tmp_path) == "done"
    results, status = read(tmp_path, "eval.json"), read(tmp_path, "status.json")
    ((step, exact),) = results["stopped"]["checks"]
    assert step == 2 and results["stopped"] == {
        "reason": "exact_match",
        "step": 2,
        "threshold": 0.3,
        "checks": [[2, exact]],
    }
    # not 8, the cap
    assert results["step"] == status["step"] == checkpoint(tmp_path)["global_step"] == 2
    assert status["stopped"] == "exact_match" and status["max_steps"] == 8
    # last.ckpt is the stopped model
    assert exact >= 0.3 and exact == pytest.approx(exact_match_by_hand(tmp_path))
    frame = collect(tmp_path)
    assert frame["stopped"].tolist() == ["exact_match"] and frame["step"].tolist() == [2]


def test_a_run_that_cannot_reach_it_trains_to_the_cap_with_the_weights_of_a_run_without_checks(
    tmp_path,
):
    assert train_run(load_run_config(None, HARD), tmp_path / "checked") == "done"
    stopped = read(tmp_path / "checked", "eval.json")["stopped"]
    assert stopped["reason"] == "max_steps" and stopped["step"] == 8
    # none at the cap: training ends there anyway
    assert [step for step, _ in stopped["checks"]] == [2, 4, 6]
    assert all(exact < 1.0 for _, exact in stopped["checks"])
    unchecked = [o for o in HARD if not o.startswith("train.stop_at")]
    assert train_run(load_run_config(None, unchecked), tmp_path / "plain") == "done"
    assert "stopped" not in read(tmp_path / "plain", "eval.json")
    a, b = (checkpoint(tmp_path / d)["state_dict"] for d in ("checked", "plain"))
    # the checks draw nothing from training's generator
    assert all(torch.equal(a[k], b[k]) for k in a)


class CrashAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise RuntimeError("boom")


def test_a_resumed_run_keeps_checking_and_ends_as_the_uninterrupted_one(tmp_path):
    config = load_run_config(None, [*HARD, "train.checkpoint_every=4"])
    assert train_run(config, tmp_path / "whole") == "done"
    assert train_run(config, tmp_path / "cut", callbacks=(CrashAt(5),)) == "failed"
    # with the checks at 2 and 4 in its state
    assert checkpoint(tmp_path / "cut")["global_step"] == 4
    assert train_run(config, tmp_path / "cut") == "done"
    assert (
        read(tmp_path / "cut", "eval.json")["stopped"]
        == read(tmp_path / "whole", "eval.json")["stopped"]
    )


# last.ckpt of the stopping step written here / by ModelCheckpoint
@pytest.mark.parametrize("every", [8, 2])
def test_a_run_that_had_stopped_stops_again_at_once(tmp_path, every):
    config = load_run_config(None, [*EASY, f"train.checkpoint_every={every}"])
    assert train_run(config, tmp_path) == "done"
    first = read(tmp_path, "eval.json")
    (tmp_path / rundir.EVAL).unlink()  # killed between training and writing eval.json
    status = read(tmp_path, "status.json")
    (tmp_path / rundir.STATUS).write_text(json.dumps({**status, "state": "interrupted"}))
    assert train_run(config, tmp_path) == "done"
    again = read(tmp_path, "eval.json")
    assert (
        again["step"] == 2
        and again["stopped"] == first["stopped"]
        and again["settings"] == first["settings"]
    )


@pytest.mark.process_group
def test_two_processes_stop_at_the_step_one_process_stops_at(tmp_path):
    config_path = tmp_path / "easy.yaml"
    config_path.write_text(yaml.safe_dump({}))
    overrides = [*EASY, "train.devices=2", "train.batch_size=4", "eval.batch_size=16"]
    argv = [
        sys.executable,
        "-m",
        "relpos_ablate",
        "train",
        "--config",
        str(config_path),
        "--run-dir",
        str(tmp_path / "two"),
        "--threads",
        "2",
        *[a for o in overrides for a in ("--set", o)],
    ]
    done = subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert train_run(load_run_config(None, EASY), tmp_path / "one") == "done"
    one, two = (read(tmp_path / d, "eval.json")["stopped"] for d in ("one", "two"))
    assert two["reason"] == one["reason"] == "exact_match" and two["step"] == one["step"] == 2
    # 20 + 20 examples, counts summed
    assert two["checks"][0][1] == pytest.approx(one["checks"][0][1], abs=1e-12)


def test_bad_stopping_settings_are_one_line():
    with pytest.raises(
        ConfigError, match=r"train.stop_at_exact_match: needs an example task .*'offset_copy'"
    ):
        load_run_config(None, ["train.stop_at_exact_match=0.99"])
    with pytest.raises(
        ConfigError,
        match=r"train.stop_at_exact_match: 1.5 is out of range; give a share in \(0, 1\]",
    ):
        load_run_config(None, [*EASY, "train.stop_at_exact_match=1.5"])
    with pytest.raises(ConfigError, match="train.stop_check_every"):
        load_run_config(None, [*EASY, "train.stop_check_every=0"])
