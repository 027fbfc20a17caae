"""Faults of a 2-process run (Lightning DDP, gloo on CPU), started as the grid runner starts a
worker.

One rank SIGKILLed mid-run (the OOM killer's way): the whole run stops, is recorded interrupted and
leaves no process behind; SIGTERM (the runner stopping, preemption): every rank stops at one step,
last.ckpt holds that step; each rerun resumes from the checkpoint and the run finishes with every
step in metrics.csv exactly once; the run so stopped and resumed ends with the weights of one never
stopped. The runs are of term d alone, so the one never stopped is also the check that such a run
trains on 2 processes.
Run: pytest tests/train/test_ddp_faults.py -q   (about a minute: four 2-process attempts, rank 0
forked as the runner does)
"""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from fixtures.runner import REPO, checkpoint_step, metric_steps
from fixtures.training import RECALL
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.store import RunLock
from relpos_ablate.runner.worker import launch, record_exit, stop

pytestmark = pytest.mark.process_group  # make test runs these alone (tests/conftest.py)

# the SIGTERM lands near step 10: room to stop mid-run on a quiet machine too (40 was not: the run
# ended first)
MAX_STEPS = 100


def start(run_dir: Path):
    lock = RunLock(run_dir)
    assert lock.try_acquire()
    # rank 0 forked, as the runner does
    proc = launch(run_dir, lock, gpu="", threads=2, device="cpu:0", fork=True)
    lock.release()  # the worker holds it now
    return proc


def wait_for_checkpoint(run_dir: Path, step: int, proc, timeout_s: float = 90) -> int:
    """Wait until last.ckpt holds `step` or later (checkpoint_every 2: within two steps of it), not
    for status.json, which is written at most once a second: on a fast core this 100-step run could
    end before status.json showed the step to stop at (the SIGTERM once landed after the run was
    done)."""
    deadline = time.monotonic() + timeout_s
    while (reached := checkpoint_step(run_dir) or 0) < step:
        assert proc.poll() is None, (run_dir / "worker.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)
    return reached


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def write_config(run_dir: Path, config: dict) -> Path:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def fault_config() -> dict:
    """RECALL on 2 processes with dropout (each rank's random state must survive a stop) and term d
    alone, which reads neither q nor k (Lightning's DDP, find_unused_parameters off, stopped at step
    1 while the model still built their projections); one evaluation setting."""
    config = yaml.safe_load(yaml.safe_dump(RECALL))
    config["model"].update(dropout=0.2)
    config["model"]["attention"] = {"terms": "d"}
    config["train"].update(devices=2, max_steps=MAX_STEPS, checkpoint_every=2)
    config["eval"]["settings"] = [{"segment_len": 16}]
    return config


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory) -> Path:
    """fault_config() trained start to end by 2 processes, launched as the runner launches a worker:
    the run the interrupted one must end at, and the run of term d alone that must train. One launch
    for both checks: each 2-process attempt costs two interpreters' imports of torch and
    Lightning."""
    run_dir = write_config(tmp_path_factory.mktemp("ddp_faults") / "whole", fault_config())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(REPO))
        proc = start(run_dir)
        proc.wait(timeout=120)
    assert proc.returncode == 0, (run_dir / "worker.log").read_text()[-3000:]
    assert record_exit(run_dir, proc.returncode)["state"] == "done"
    return run_dir


def test_a_run_whose_terms_read_no_query_trains_on_two_processes(never_stopped):
    """Terms d alone read neither q nor k: Lightning's DDP (find_unused_parameters off) stopped at
    step 1 while the model still built their projections. Every configuration under DDP:
    tests/train/test_ddp_parameters.py."""
    assert (
        yaml.safe_load((never_stopped / "config.yaml").read_text())["model"]["attention"]["terms"]
        == "d"
    )
    assert read_status(never_stopped)["state"] == "done"
    assert metric_steps(never_stopped) == list(range(MAX_STEPS))


# a long name, kept: benchmarks/results/records/suite_durations_xeon_20261206.md records it
def test_a_killed_rank_or_sigterm_interrupts_the_run_and_reruns_end_bit_for_bit_where_the_uninterrupted_one_does(  # noqa: E501
    never_stopped, tmp_path, monkeypatch
):
    """One run SIGKILLed in a rank, rerun and SIGTERMed, rerun to the end, against the same run
    never stopped: each rank's dropout continues from the random state the checkpoint keeps, and its
    memory from the checkpointed memory (RECALL trains with mem_len 16), across both kinds of stop.
    (One test, not two: each 2-process attempt costs two interpreters' imports, and the interrupted
    run is the one to compare.)"""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    run_dir = write_config(tmp_path / "cut", fault_config())
    proc = start(run_dir)
    wait_for_checkpoint(run_dir, 4, proc)
    (rank1,) = children(proc.pid)
    os.kill(rank1, signal.SIGKILL)
    proc.wait(timeout=60)  # Lightning's launcher notices within 5 s and takes the run down
    status = record_exit(run_dir, proc.returncode)
    assert status["state"] == "interrupted", status
    deadline = time.monotonic() + 10
    while group_alive(proc.pid):  # nothing left holding memory or a port
        assert time.monotonic() < deadline, "processes of the killed run are still alive"
        time.sleep(0.1)
    killed_at = checkpoint_step(run_dir)
    assert killed_at >= 4
    # the rerun resumes with every row
    assert metric_steps(run_dir)[:killed_at] == list(range(killed_at))

    proc = start(run_dir)
    stopped_at = wait_for_checkpoint(run_dir, killed_at + 2, proc)  # a checkpoint the rerun wrote
    assert stop(proc, grace_s=60) is not None
    status = record_exit(run_dir, proc.returncode)
    assert status["state"] == "interrupted" and status["reason"].startswith(
        "stopped by SIGTERM;"
    ), status
    # saved at the step every rank stopped at
    assert checkpoint_step(run_dir) == status["step"] >= stopped_at
    assert 0 < status["step"] < MAX_STEPS
    assert metric_steps(run_dir)[: status["step"]] == list(range(status["step"]))

    proc = start(run_dir)
    proc.wait(timeout=120)
    assert record_exit(run_dir, proc.returncode)["state"] == "done"
    assert metric_steps(run_dir) == list(range(MAX_STEPS))
    log = (run_dir / "log.txt").read_text()
    assert log.count("Restored all states from the checkpoint") == 2
    whole, cut = (
        torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for d in (never_stopped, run_dir)
    )
    for name, value in whole.items():
        assert torch.equal(value, cut[name]), name
