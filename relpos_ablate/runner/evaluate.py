"""`relpos-ablate evaluate` on several runs at once: one worker process per slot, a slot refilled as
soon as it frees (the slots of `grid`: a share of the CPU cores, or a GPU).

Each worker is `python -m relpos_ablate evaluate RUN_DIR ... --threads T` (on a CPU slot forked from
the fork server, runner/forkserver.py), which takes the run's lock,
evaluates and merges its eval.json on its own (train/evaluate_run.py), so a stopped worker leaves
its run's eval.json as it was. The worker's output is printed when it ends, as one block per run.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from relpos_ablate.runner.forkserver import ForkedWorker, die_with_parent, forkable, start_forked
from relpos_ablate.runner.local import Slot
from relpos_ablate.runner.worker import WORKER_PREFIX, stop, worker_env


def evaluate_command(run_dir: Path, arguments: list[str], threads: int) -> list[str]:
    """The worker's command line: `arguments` are the evaluate flags (--set ..., --replace) for one
    run."""
    return [*WORKER_PREFIX, "evaluate", str(run_dir), *arguments, "--threads", str(threads)]


def evaluate_on_slots(
    run_dirs: list[Path],
    arguments: list[str],
    slots: list[Slot],
    report: Callable[[str], None] = print,
    poll_s: float = 0.1,
    grace_s: float = 30.0,
) -> int:
    """Evaluate every run on `slots`; returns the worst worker exit status (0: every run evaluated).
    Ctrl-C or SIGTERM stops the workers (each run's eval.json stays as it was or complete) and is
    re-raised."""
    queue = deque(run_dirs)
    active: dict[int, tuple[subprocess.Popen | ForkedWorker, IO]] = {}
    worst = 0
    try:
        while queue or active:
            for index, slot in enumerate(slots):
                if index not in active and queue:
                    active[index] = _start(queue.popleft(), arguments, slot)
            for index, (proc, output) in list(active.items()):
                if proc.poll() is not None:
                    worst = max(worst, proc.returncode if proc.returncode >= 0 else 1)
                    report(_read(output).rstrip("\n"))
                    del active[index]
            time.sleep(poll_s)
    except BaseException:
        deadline = time.monotonic() + grace_s
        for proc, output in active.values():
            stop(proc, max(0.0, deadline - time.monotonic()))
            report(_read(output).rstrip("\n"))
        raise
    return worst


def _start(
    run_dir: Path, arguments: list[str], slot: Slot
) -> tuple[subprocess.Popen | ForkedWorker, IO]:
    """The worker, forked from the fork server on a CPU slot (runner/forkserver.py), else a new
    interpreter."""
    output = tempfile.TemporaryFile("w+b")
    command, env = (
        evaluate_command(run_dir, arguments, slot.threads),
        worker_env(slot.gpu, slot.threads),
    )
    if forkable(1, slot.gpu):
        return start_forked(command, env, output.fileno(), None), output
    proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),
    )
    return proc, output


def _read(output: IO) -> str:
    output.seek(0)
    text = output.read().decode(errors="replace")
    output.close()
    return text
