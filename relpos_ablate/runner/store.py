"""Run directories on disk, as the runner sees them: what each run needs next, its status, and the
lock that runs it once (the file names: relpos_ablate/rundir.py).

The runner writes config.yaml, run.json and status.json (queued), holds `.lock`, the claim on the
run, and collects the worker's stdout/stderr in `worker.log` (the only record of a crash before
`train` could log); `train` writes the rest.

Exactly-once rule: only the holder of a run's `.lock` (an fcntl.flock) writes to its directory or
runs it, and it decides to run only after re-reading status.json under the lock. The runner hands
the locked descriptor to the worker process, so the lock lives as long as either of them; the
kernel drops it when both are gone, so a lock of a dead process never blocks anyone. Runners on
several machines can share one results dir when its filesystem supports flock across nodes (NFSv4,
Lustre or GPFS mounted with flock).
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError, RunConfig, to_plain
from relpos_ablate.io import atomic_write_json, atomic_write_yaml, now_iso
from relpos_ablate.runner.grid import GridSpec, PlannedRun

#: What the runner does with a run: start/resume/retry run it, skip leaves it, busy waits for its
#: owner.
ACTIONS = ("start", "resume", "retry", "skip", "busy")
RUNNABLE = ("start", "resume", "retry")
DONE_WITHOUT_EVAL = (
    f"marked done but {rundir.EVAL} is missing or unreadable; a rerun resumes it (evaluation only)"
)
"""Why a run marked done is not done (rundir.is_done): what `status` shows and the runner does."""
SLURM_JOB = "slurm_job"
"""status.json field: the id of the SLURM job submitted for the run (runner/slurm.py)."""


def update_status(run_dir: Path, **fields: Any) -> dict:
    """Merge `fields` into status.json (atomically) and return the new status."""
    status = {**(rundir.read_status(run_dir) or {}), **fields}
    atomic_write_json(run_dir / rundir.STATUS, status)
    return status


def mark_queued(run_dir: Path, **fields: Any) -> dict:
    """A fresh `queued` status; the previous step count is kept so progress shows through a resume,
    and the SLURM job that runs it (so a second submission skips it while that job is queued or
    running)."""
    previous = rundir.read_status(run_dir) or {}
    kept = {key: previous[key] for key in ("step", "max_steps", SLURM_JOB) if key in previous}
    status = {"state": "queued", "queued_at": now_iso(), **kept, **fields}
    atomic_write_json(run_dir / rundir.STATUS, status)
    return status


class RunLock:
    """The claim on one run: an exclusive flock on `<run_dir>/.lock`, never blocking."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / rundir.LOCK
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; note the holder in the file for `status`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run's lock ('pid N on host'), or None when it is free. Creates nothing."""
    path = Path(run_dir) / rundir.LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return path.read_text().strip() or "another process"
    finally:
        os.close(fd)
    return None


def decide(run_dir: Path, retry_failed: bool) -> tuple[str, str]:
    """(action, note) for a run from its files alone: skip done ones, resume what was cut short."""
    status = rundir.read_status(run_dir)
    state = status.get("state") if status else None
    resumable = rundir.last_checkpoint(run_dir).exists()
    if state == "done":
        if rundir.is_done(run_dir):
            return "skip", "done"
        return "resume", DONE_WITHOUT_EVAL
    if state == "failed":
        reason = status.get("reason") or "no reason recorded"
        return (
            ("retry", f"failed before: {reason}") if retry_failed else ("skip", f"failed: {reason}")
        )
    if state is None and (run_dir / rundir.STATUS).exists():
        return ("resume" if resumable else "start"), f"{rundir.STATUS} was unreadable"
    if resumable:
        step = status.get("step") if status else None
        return (
            "resume",
            f"from step {step}" if step is not None else f"from {rundir.LAST_CHECKPOINT}",
        )
    return "start", ""


def claim(run_dir: Path, retry_failed: bool) -> tuple[RunLock | None, str, str]:
    """Lock the run and re-check it under the lock: (lock, action, note); lock is None unless it
    must run."""
    lock = RunLock(run_dir)
    if not lock.try_acquire():
        return None, "busy", f"held by {lock_holder(run_dir) or 'another process'}"
    action, note = decide(run_dir, retry_failed)
    if action == "skip":
        lock.release()
        return None, action, note
    return lock, action, note


@dataclass(frozen=True)
class RunPlan:
    """A grid run, its directory, and what the runner will do with it."""

    run: PlannedRun
    run_dir: Path
    action: str
    note: str = ""


def plan_grid(spec: GridSpec, results: Path, retry_failed: bool = False) -> list[RunPlan]:
    """What each run of `spec` needs, from the files under results/<name>/ (reads only)."""
    plans = []
    for run in spec.runs:
        run_dir = Path(results) / spec.name / run.run_id
        holder = lock_holder(run_dir)
        if holder is not None:
            plans.append(RunPlan(run, run_dir, "busy", f"held by {holder}"))
            continue
        action, note = decide(run_dir, retry_failed)
        plans.append(RunPlan(run, run_dir, action, note))
    return plans


def _holds(run_dir: Path, config: RunConfig) -> bool:
    """config.yaml is there and describes `config` (train may have filled in vocab_size)."""
    try:
        stored = rundir.stored_config(run_dir)
    except (ConfigError, OSError):
        return False
    return stored is not None and rundir.same_run(stored, config)


def write_run_files(
    plan: RunPlan, experiment: str, spec_path: Path | None, analysis: dict | None = None
) -> None:
    """run.json, and config.yaml unless an equivalent one is there (call with the run's lock
    held). `analysis`: the spec's analysis plan as config/plan.py `record` gives it; run.json
    keeps the record (and the launch time) of the run's first launch, never a later one, so a
    plan changed after the run existed shows as such in `report`."""
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    before = rundir.read_run_info(run_dir) or {}
    info = {
        "run_id": plan.run.run_id,
        "experiment": experiment,
        "variant": plan.run.variant,
        # relative to the run dir, so results and experiments can move together (and be committed)
        "spec": os.path.relpath(Path(spec_path).resolve(), run_dir.resolve())
        if spec_path is not None
        else None,
    }
    # kept from the first launch, whatever a later launch's spec says: a run.json older than these
    # records has neither
    first = {"launched_at": now_iso(), "analysis": analysis}
    info.update({key: before.get(key) if before else value for key, value in first.items()})
    info = {key: value for key, value in info.items() if value is not None or key == "spec"}
    if before != info:
        atomic_write_json(run_dir / rundir.RUN_INFO, info)
    if not _holds(run_dir, plan.run.config):
        atomic_write_yaml(run_dir / rundir.CONFIG, to_plain(plan.run.config))


def prepare_run(
    plan: RunPlan,
    experiment: str,
    spec_path: Path | None,
    retry_failed: bool,
    analysis: dict | None = None,
) -> str:
    """Claim a run briefly to write its files and mark it `queued`; returns the action taken
    (start/resume/retry when it is ready to launch, busy or skip when it is not ours to run)."""
    lock, action, _note = claim(plan.run_dir, retry_failed)
    if lock is None:
        return action
    try:
        write_run_files(plan, experiment, spec_path, analysis)
        mark_queued(plan.run_dir)
    finally:
        lock.release()
    return action
