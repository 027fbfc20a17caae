"""Run a grid on this machine: one worker process per device slot, a slot refilled as soon as it
frees.

Each slot is a GPU, or a group of GPUs that one run trains on data-parallel (--gpus-per-run; the
worker gets CUDA_VISIBLE_DEVICES and train.devices for them; K slots per GPU group with
--runs-per-device), or a share of the CPU (torch threads split evenly between slots). A run is
claimed (store.claim) right before it is launched, so several runners on one results directory share
the work and never run a run twice; a run another runner holds is retried until that runner lets go
of it, then skipped when it is done or resumed when its runner died. A failed or killed run is
recorded and the others go on. SIGINT/SIGTERM stop the workers (they checkpoint), mark them
interrupted, and leave everything resumable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.runner.display import PlainDisplay, RunRow, row_for, run_table
from relpos_ablate.runner.forkserver import ForkedWorker, forkable
from relpos_ablate.runner.grid import GridSpec
from relpos_ablate.runner.store import (
    RUNNABLE,
    RunLock,
    RunPlan,
    claim,
    plan_grid,
    prepare_run,
    write_run_files,
)
from relpos_ablate.runner.worker import available_cores, kill_leftovers, launch, record_exit, stop


@dataclass(frozen=True)
class Slot:
    """Where one worker runs: a label for the table, the GPUs it sees ("0,1"; "" none), its torch
    threads."""

    device: str
    gpu: str
    threads: int

    @property
    def settings(self) -> tuple[str, ...]:
        """How the worker runs on this slot: as many processes as the slot has GPUs (none for CPU
        slots, where the run config decides)."""
        return (f"train.devices={len(self.gpu.split(','))}",) if self.gpu else ()


def cpu_slots(n: int, cores: int | None = None) -> list[Slot]:
    """N CPU slots sharing the cores evenly (at least one thread each); workers see no GPU."""
    threads = max(1, (cores or available_cores()) // n)
    return [Slot(device=f"cpu:{i}", gpu="", threads=threads) for i in range(n)]


def gpu_slots(
    devices: list[int], runs_per_device: int = 1, cores: int | None = None, gpus_per_run: int = 1
) -> list[Slot]:
    """Groups of `gpus_per_run` consecutive GPUs, K slots per group, spread across groups first.
    Device numbers index the GPUs this process sees, so they are mapped through an inherited
    CUDA_VISIBLE_DEVICES (--devices 0 under "4,5" is GPU 4)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else None
    groups = [devices[i : i + gpus_per_run] for i in range(0, len(devices), gpus_per_run)]
    n = len(groups) * runs_per_device
    threads = max(1, (cores or available_cores()) // n)
    return [
        Slot(
            device="cuda:" + ",".join(map(str, group)),
            threads=threads,
            gpu=",".join(physical[d] if physical else str(d) for d in group),
        )
        for _ in range(runs_per_device)
        for group in groups
    ]


@dataclass
class _Active:
    plan: RunPlan
    proc: subprocess.Popen | ForkedWorker
    lock: RunLock
    started: float


@dataclass
class GridOutcome:
    """How a grid ended: each run's state and reason, and how busy the slots were."""

    states: dict[str, str]
    reasons: dict[str, str]
    launched: int
    busy_s: float
    wall_s: float
    n_slots: int
    stopped: str = ""
    run_times: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        return [rid for rid, state in self.states.items() if state == "failed"]

    @property
    def incomplete(self) -> list[str]:
        return [rid for rid, state in self.states.items() if state not in ("done", "failed")]

    @property
    def utilisation(self) -> float:
        """Σ worker time / (wall × slots): 1.0 means no slot ever idled while the grid ran."""
        return (
            self.busy_s / (self.wall_s * self.n_slots) if self.wall_s > 0 and self.n_slots else 0.0
        )

    def exit_code(self) -> int:
        if self.stopped:
            return 130
        return 0 if not self.failed and not self.incomplete else 1


STOP_REASONS = {
    "SIGINT": "interrupted by the user (Ctrl-C on grid); rerun the same command to resume",
    "SIGTERM": "grid stopped by SIGTERM; rerun the same command to resume",
}
"""The reason recorded for each run the runner stops, by the signal that stopped the runner."""


class _Stop(Exception):
    """Raised in the loop by SIGTERM, so the runner shuts down like on Ctrl-C."""


class LocalRunner:
    """Runs the pending runs of a grid on `slots` (see the module docstring)."""

    def __init__(
        self,
        spec: GridSpec,
        results: Path,
        slots: list[Slot],
        display: PlainDisplay,
        *,
        retry_failed: bool = False,
        poll_s: float = 0.1,
        busy_retry_s: float = 1.0,
        grace_s: float = 30.0,
        fork: bool = True,
    ):
        self.spec, self.results, self.slots, self.display = spec, Path(results), slots, display
        self.retry_failed, self.poll_s, self.busy_retry_s, self.grace_s = (
            retry_failed,
            poll_s,
            busy_retry_s,
            grace_s,
        )
        self.fork = fork  # fork the workers of CPU slots from the fork server (forkserver.py)
        self.plans = plan_grid(spec, self.results, retry_failed)
        self.queue: deque[RunPlan] = deque()
        self.waiting: list[RunPlan] = []
        self.active: dict[int, _Active] = {}
        self.errors: dict[str, str] = {}
        self.run_times: dict[str, float] = {}
        self.devices: dict[str, str] = {}
        self._last_busy_retry = 0.0
        self._last_refresh = 0.0

    # --- preparation -------------------------------------------------------------------------
    def prepare(self) -> None:
        """Write run.json/config.yaml and mark `queued` every run this runner will try to run."""
        for plan in self.plans:
            if plan.action == "busy":
                self.waiting.append(plan)
            elif plan.action in RUNNABLE:
                self._prepare_one(plan)

    def _prepare_one(self, plan: RunPlan) -> None:
        try:
            action = prepare_run(
                plan, self.spec.name, self.spec.path, self.retry_failed, self.spec.analysis_record()
            )
        except OSError as err:
            self.errors[plan.run.run_id] = f"could not write the run directory: {err}"
            return
        if action == "busy":
            self.waiting.append(plan)
        elif action in RUNNABLE:
            self.queue.append(plan)

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> GridOutcome:
        started = time.monotonic()
        stopped = ""
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main_thread else None
        try:
            with self.display:
                try:
                    self.prepare()
                    self._loop()
                except (KeyboardInterrupt, _Stop) as exc:
                    stopped = "SIGTERM" if isinstance(exc, _Stop) else "SIGINT"
                    if main_thread:  # a second SIGTERM must not cut the shutdown short
                        signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    self._stop_all(STOP_REASONS[stopped])
                self._refresh(force=True)
        finally:
            for active in self.active.values():
                active.lock.release()
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        return self._outcome(time.monotonic() - started, stopped)

    def _on_sigterm(self, signum, frame) -> None:
        raise _Stop()

    def _loop(self) -> None:
        while self.queue or self.active or self.waiting:
            self._reap()
            self._fill_slots()
            self._retry_busy()
            self._refresh()
            time.sleep(self.poll_s)

    def _fill_slots(self) -> None:
        for index, slot in enumerate(self.slots):
            while index not in self.active and self.queue:
                self._start(index, slot, self.queue.popleft())

    def _start(self, index: int, slot: Slot, plan: RunPlan) -> None:
        lock, action, note = claim(plan.run_dir, self.retry_failed)
        if lock is None:
            if action == "busy":
                self.waiting.append(plan)
            else:
                self._event(plan, f"skipped: {note} (by another runner)")
            return
        train = plan.run.config.train
        fork = self.fork and forkable(train.num_nodes, slot.gpu)
        try:
            write_run_files(plan, self.spec.name, self.spec.path, self.spec.analysis_record())
            proc = launch(
                plan.run_dir,
                lock,
                gpu=slot.gpu,
                threads=slot.threads,
                device=slot.device,
                settings=slot.settings,
                fork=fork,
            )
        except OSError as err:
            lock.release()
            self.errors[plan.run.run_id] = f"could not launch: {err}"
            self._event(plan, f"failed to launch: {err}")
            if fork:  # the next runs start as new interpreters (a rerun launches this one again)
                self.fork = False
                self._event(
                    plan, "the fork server failed: every later worker starts as a new interpreter"
                )
            return
        self.active[index] = _Active(plan, proc, lock, time.monotonic())
        self.devices[plan.run.run_id] = slot.device
        self._event(
            plan, f"started on {slot.device}" + (f" ({action} {note})" if action != "start" else "")
        )

    def _reap(self) -> None:
        for index, active in list(self.active.items()):
            returncode = active.proc.poll()
            if returncode is not None:
                self._finish(index, returncode)

    def _finish(self, index: int, returncode: int, stopped: str | None = None) -> None:
        active = self.active.pop(index)
        rid = active.plan.run.run_id
        self.run_times[rid] = time.monotonic() - active.started
        kill_leftovers(active.proc)
        try:
            status = record_exit(active.plan.run_dir, returncode, stopped)
        except OSError as err:
            status = {"state": "failed", "reason": f"could not record the exit: {err}"}
            self.errors[rid] = status["reason"]
        finally:
            active.lock.release()
        detail = f": {status['reason']}" if status.get("reason") else ""
        self._event(active.plan, f"{status['state']} after {self.run_times[rid]:.1f}s{detail}")

    def _retry_busy(self) -> None:
        """Runs held by another runner go back to the queue every `busy_retry_s` seconds."""
        now = time.monotonic()
        if self.waiting and now - self._last_busy_retry >= self.busy_retry_s:
            self._last_busy_retry = now
            self.queue.extend(self.waiting)
            self.waiting.clear()

    def _stop_all(self, reason: str) -> None:
        """SIGTERM every worker at once, then give them `grace_s` in total before SIGKILL."""
        deadline = time.monotonic() + self.grace_s
        for active in self.active.values():
            try:
                os.killpg(active.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for index, active in list(self.active.items()):
            stop(active.proc, max(0.0, deadline - time.monotonic()))
            self._finish(index, active.proc.returncode, reason)

    # --- display and outcome -----------------------------------------------------------------
    def rows(self) -> list[RunRow]:
        started = {a.plan.run_dir: a.started for a in self.active.values()}
        rows = []
        for plan in self.plans:
            row = row_for(plan.run_dir, plan.run.variant)
            row.device = self.devices.get(plan.run.run_id, row.device)
            if plan.run_dir in started:
                row.elapsed_s = time.monotonic() - started[plan.run_dir]
            if plan.run.run_id in self.errors:
                row.state, row.note = "failed", self.errors[plan.run.run_id]
            rows.append(row)
        return rows

    def _refresh(self, force: bool = False) -> None:
        if self.display.live and (force or time.monotonic() - self._last_refresh >= 0.5):
            self._last_refresh = time.monotonic()
            self.display.refresh(run_table(self.rows(), title=f"grid {self.spec.name}", live=True))

    def _event(self, plan: RunPlan, text: str) -> None:
        self.display.event(row_for(plan.run_dir, plan.run.variant), text)

    def _outcome(self, wall_s: float, stopped: str) -> GridOutcome:
        states, reasons = {}, {}
        for plan in self.plans:
            rid = plan.run.run_id
            status = rundir.read_status(plan.run_dir) or {}
            states[rid] = "failed" if rid in self.errors else status.get("state", "new")
            reasons[rid] = self.errors.get(rid) or str(status.get("reason") or "")
        return GridOutcome(
            states=states,
            reasons=reasons,
            launched=len(self.run_times),
            busy_s=sum(self.run_times.values()),
            wall_s=wall_s,
            n_slots=len(self.slots),
            stopped=stopped,
            run_times=dict(self.run_times),
        )


def run_local(
    spec: GridSpec, results: Path, slots: list[Slot], display: PlainDisplay, **options
) -> GridOutcome:
    """Run every pending run of `spec` on `slots` and return how it went (see LocalRunner)."""
    return LocalRunner(spec, results, slots, display, **options).run()
