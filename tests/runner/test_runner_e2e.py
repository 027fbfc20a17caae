"""The runner with the real `relpos-ablate train` worker: experiments/smoke.yaml end to end on 2 CPU
slots (its 4 runs at SMOKE_STEPS steps instead of 300: the checks are about the runner and the run
dirs, not what 300 steps learn) and a rerun that launches nothing, and a worker SIGKILLed
mid-training that the runner records as interrupted and the rerun resumes from last.ckpt with a
complete, duplicate-free step series. Run: pytest tests/runner/test_runner_e2e.py -q   (under a
minute; the smoke grid is marked slow)
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from fixtures.runner import REPO, checkpoint_step, metric_steps, tiny_base
from relpos_ablate.cli import main
from relpos_ablate.config import RunConfig, from_dict, run_id
from relpos_ablate.io import read_json
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.grid import load_grid

# past the spec's 20 warmup steps and 2 log rows; the final checkpoint is written at any step
SMOKE_STEPS = 40


def check_finished_run(run_dir, config):
    """A done run dir as docs/architecture.md describes it, for `config`."""
    assert read_status(run_dir)["state"] == "done"
    plain = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert plain["model"]["vocab_size"] > 0  # train filled it in
    plain["model"]["vocab_size"] = 0
    assert from_dict(RunConfig, plain) == config and run_dir.name == run_id(config)
    settings = read_json(run_dir / "eval.json")["settings"]
    assert [s["segment_len"] for s in settings] == [s.segment_len for s in config.eval_settings()]
    steps = metric_steps(run_dir)
    assert steps and steps == sorted(set(steps))  # one row per logged step, none repeated
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_smoke_grid_on_two_cpu_slots_then_rerun_launches_nothing(tmp_path):
    raw = yaml.safe_load((REPO / "experiments" / "smoke.yaml").read_text())
    raw["base"]["train"]["max_steps"] = SMOKE_STEPS
    spec_path = tmp_path / "smoke.yaml"
    spec_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    results = tmp_path / "results"
    argv = [
        sys.executable,
        "-m",
        "relpos_ablate",
        "grid",
        str(spec_path),
        "--results",
        str(results),
        "--slots",
        "2",
    ]
    started = time.monotonic()
    first = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    spec = load_grid(spec_path)
    assert len(spec.runs) == len(load_grid(REPO / "experiments" / "smoke.yaml").runs)
    for run in spec.runs:
        check_finished_run(results / "smoke" / run.run_id, run.config)
    statuses = {
        run.run_id: (results / "smoke" / run.run_id / "status.json").read_bytes()
        for run in spec.runs
    }

    started = time.monotonic()
    rerun = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    rerun_wall = time.monotonic() - started
    assert rerun.returncode == 0 and "ran 0 " in rerun.stdout
    assert statuses == {
        rid: (results / "smoke" / rid / "status.json").read_bytes() for rid in statuses
    }
    print(f"\nsmoke grid: {wall:.1f}s on 2 slots; rerun of the finished grid: {rerun_wall:.1f}s")


def killer(run_dir, step, errors: list, timeout_s: float = 120) -> threading.Thread:
    """A thread that SIGKILLs the run's worker (e.g. the OOM killer) once its last.ckpt is of `step`
    or later; what went wrong goes to `errors`. The checkpoint is loaded only when a new one was
    renamed into place: loading it at every poll took a share of the cores the worker trains on."""

    def kill() -> None:
        deadline, seen = time.monotonic() + timeout_s, None
        last = run_dir / "checkpoints" / "last.ckpt"
        while True:
            try:
                stat = last.stat()
                current = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            except FileNotFoundError:
                current = None
            if current is not None and current != seen:
                seen = current
                if (checkpoint_step(run_dir) or 0) >= step:
                    break
            if time.monotonic() > deadline:
                errors.append(f"no checkpoint of step {step} within {timeout_s} s")
                return
            time.sleep(0.02)
        os.kill(read_status(run_dir)["pid"], signal.SIGKILL)

    return threading.Thread(target=kill, daemon=True)


def test_killed_worker_is_recorded_and_resumed_from_its_checkpoint(tmp_path, capsys, monkeypatch):
    """The runner runs in this process and its worker is killed from a thread: the fork server the
    first grid starts forks the rerun's worker too (a runner process of its own would import torch
    and Lightning in a second fork server; a runner killed with its workers:
    tests/runner/test_faults.py)."""
    # killed once its checkpoint of step 40 is on disk: 60 steps of margin
    base = tiny_base(max_steps=100)
    base["train"].update(log_every=5, checkpoint_every=20)
    spec_path = tmp_path / "kill.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "kill", "base": base, "seeds": [0]}))
    (run,) = load_grid(spec_path).runs
    run_dir = tmp_path / "results" / "kill" / run.run_id
    argv = ["grid", str(spec_path), "--results", str(tmp_path / "results"), "--slots", "1"]
    monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)  # the real `train` worker, forked

    # the checkpoint, not status.json's step: that is written at most once a second, about when a
    # fast core ends this run (test_faults' kill once came after its runs had ended)
    errors = []
    thread = killer(run_dir, 40, errors)
    thread.start()
    first = main(argv)
    thread.join(60)
    assert not errors and first == 1, (errors, capsys.readouterr().out)
    status = read_status(run_dir)
    assert status["state"] == "interrupted" and "SIGKILL" in status["reason"]
    kept = metric_steps(run_dir)  # rows flushed with the checkpoints before the kill

    capsys.readouterr()
    assert main(argv) == 0
    assert "resume" in capsys.readouterr().out
    check_finished_run(run_dir, run.config)
    assert "Restored all states from the checkpoint" in (run_dir / "log.txt").read_text()
    assert metric_steps(run_dir)[: len(kept)] == kept
