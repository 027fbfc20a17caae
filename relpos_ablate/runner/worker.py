"""One run in one process: the worker command, its environment, launching, stopping, and its exit.

Local slots and SLURM jobs both go through `launch` / `stop` / `record_exit`, so a run behaves the
same wherever it executes. The worker is `python -m relpos_ablate train --run-dir DIR --threads T`
(on a CPU slot forked from the fork server instead: forkserver.py, the same process otherwise);
it writes status.json running/done/failed itself and resumes from checkpoints/last.ckpt. When it
dies without a final state (SIGKILL, OOM killer, a crash before logging), `record_exit` writes one.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.io import now_iso
from relpos_ablate.runner.forkserver import die_with_parent, start_forked
from relpos_ablate.runner.store import RunLock, mark_queued, update_status

#: Testing hook: a command line that replaces `python -m relpos_ablate train` (it gets the same
#: arguments).
WORKER_ENV = "RELPOS_ABLATE_WORKER"
LOG_TAIL_LINES = 30


def available_cores() -> int:
    """Cores this process may use (its CPU affinity, e.g. a SLURM or taskset allocation)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


WORKER_PREFIX = (sys.executable, "-m", "relpos_ablate")


def worker_arguments(run_dir: Path, threads: int, settings: tuple[str, ...] = ()) -> list[str]:
    """`relpos-ablate train`'s arguments for the run; `settings` are how-to-run overrides
    (train.devices=K, ...) that the slot or the job decides, passed as --set (they do not change
    the run's identity)."""
    return [
        "train",
        "--run-dir",
        str(run_dir),
        "--threads",
        str(threads),
        *(a for s in settings for a in ("--set", s)),
    ]


def worker_command(run_dir: Path, threads: int, settings: tuple[str, ...] = ()) -> list[str]:
    """The worker's command line: `python -m relpos_ablate train ...`, or RELPOS_ABLATE_WORKER's
    command."""
    override = os.environ.get(WORKER_ENV)
    arguments = worker_arguments(run_dir, threads, settings)
    return [*shlex.split(override), *arguments[1:]] if override else [*WORKER_PREFIX, *arguments]


def worker_env(gpu: str | None, threads: int) -> dict[str, str]:
    """The parent's environment with the slot's GPU (None: leave as is; "": hide all) and thread
    count."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def launch(
    run_dir: Path,
    lock: RunLock,
    *,
    gpu: str | None,
    threads: int,
    device: str,
    settings: tuple[str, ...] = (),
    fork: bool = False,
):
    """Mark the run queued and start its worker in its own session, holding the run's lock with it:
    a new interpreter (subprocess.Popen), or with `fork` a child of the fork server
    (forkserver.ForkedWorker: the caller checks `forkserver.forkable`; not with
    RELPOS_ABLATE_WORKER, whose command it cannot fork).

    Call from a thread that outlives the worker (PR_SET_DEATHSIG fires when the spawning thread
    exits)."""
    mark_queued(run_dir, device=device, host=socket.gethostname())
    fork = fork and not os.environ.get(WORKER_ENV)
    with open(run_dir / rundir.WORKER_LOG, "ab") as log:
        log.write(
            f"=== {now_iso()} launch on {device} "
            f"({socket.gethostname()}){' forked' if fork else ''}\n".encode()
        )
        log.flush()
        if not fork:
            return start_worker(run_dir, threads, settings, gpu=gpu, output=log, lock=lock)
        return start_forked(
            [*WORKER_PREFIX, *worker_arguments(run_dir, threads, settings)],
            worker_env(gpu, threads),
            log.fileno(),
            lock.fd,
        )


def start_worker(
    run_dir: Path,
    threads: int,
    settings: tuple[str, ...],
    *,
    gpu: str | None = None,
    output=None,
    lock: RunLock | None = None,
) -> subprocess.Popen:
    """The worker process alone, in its own session (the processes it starts for a multi-process run
    join that session, so stopping or cleaning up the session reaches them all); `output`: a file
    for its stdout/stderr (default: this process's); `lock`: the run's lock, handed to the
    worker."""
    return subprocess.Popen(
        worker_command(run_dir, threads, settings),
        env=worker_env(gpu, threads),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        pass_fds=(lock.fd,) if lock is not None else (),
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),
    )


def stop(proc, grace_s: float) -> int | None:
    """SIGTERM the worker's process group (Lightning stops after the batch), SIGKILL after
    `grace_s`; returns its exit code. Safe inside a signal handler that interrupted `proc.wait()`
    (see _reap)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.returncode is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        _reap(proc, wait_s)
    return proc.returncode


def kill_leftovers(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of an ended worker's session: the other processes of a multi-process run
    whose rank 0 died (they would wait for it in a collective, holding GPU memory)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for the worker with os.waitpid and store its exit code in `proc.returncode`.

    Not Popen.wait: its lock is not reentrant, and submitit calls RunJob.checkpoint from a signal
    handler while the same thread is inside Popen.wait, which would deadlock."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        # a ForkedWorker: the server relays its exit, poll() locks nothing
        if not isinstance(proc, subprocess.Popen):
            if proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            return
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere meanwhile
            proc.poll()
            return
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= deadline:
            return
        else:
            time.sleep(0.02)


def log_tail(run_dir: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(run_dir / rundir.WORKER_LOG, "rb") as f:
            return b"".join(deque(f, maxlen=lines)).decode(errors="replace")
    except OSError:
        return ""


SIGNAL_HINTS = {
    "SIGKILL": "out of memory (the OOM killer), or killed by hand?",
    "SIGTERM": "stopped by a scheduler or by hand before it could save; it saves when stopped "
    "after it starts",
    "SIGINT": "interrupted by hand?",
}
"""Likely causes named in an interrupted run's reason, by the signal that ended its worker."""


def exit_reason(returncode: int, stopped: str | None = None) -> tuple[str, str]:
    """(state, reason) for a worker that ended without writing a final state."""
    if stopped:
        return "interrupted", stopped
    if returncode < 0:
        name = (
            signal.Signals(-returncode).name
            if -returncode in signal.valid_signals()
            else str(-returncode)
        )
        hint = SIGNAL_HINTS.get(name, "killed by hand or by the system?")
        return "interrupted", f"worker killed by {name} ({hint}); rerun to resume"
    return "failed", f"worker exited with status {returncode} without recording a result"


def note_stop(run_dir: Path, stopped: str) -> None:
    """One line in the run's logs (those that exist) after the worker's own: the worker saw only a
    SIGTERM and logged "stopped by SIGTERM", whatever stopped it (Ctrl-C on grid, a scheduler)."""
    line = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING relpos_ablate.runner: why the run was "
        f"stopped (its worker saw only a SIGTERM): {stopped}\n"
    )
    for path in (Path(run_dir) / rundir.LOG, Path(run_dir) / rundir.WORKER_LOG):
        try:
            if path.exists():
                with open(path, "a", encoding="utf-8") as f:
                    f.write(line)
        except OSError:  # a log that cannot be written loses a line, not the run's status
            pass


def record_exit(run_dir: Path, returncode: int, stopped: str | None = None) -> dict:
    """The run's final status: the worker's own when it wrote one, else one made from its exit.

    `stopped` says why the runner stopped the worker (shutdown, preemption): the run is interrupted,
    for that reason (the worker itself only saw the SIGTERM the runner sent it)."""
    if stopped:
        note_stop(run_dir, stopped)
    status = rundir.read_status(run_dir)
    if status is not None and status["state"] in rundir.FINAL_STATES:
        return (
            update_status(run_dir, reason=stopped)
            if stopped and status["state"] == "interrupted"
            else status
        )
    state, reason = exit_reason(returncode, stopped)
    tail = log_tail(run_dir)
    last_line = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
    if state == "failed" and last_line:
        reason = f"{reason}: {last_line.strip()}"
    return update_status(
        run_dir,
        state=state,
        reason=reason,
        traceback=tail,
        exit_code=returncode,
        finished_at=now_iso(),
    )
