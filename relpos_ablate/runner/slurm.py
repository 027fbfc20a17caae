"""Run a grid on SLURM through submitit: one array job per grid, one run per job.

Each job executes `RunJob`, which does exactly what a local slot does (claim the run, launch the
worker, record its exit), so a run behaves the same on a laptop and on a cluster. A job has one
SLURM task per GPU on each of its nodes, and every task starts one process of the run (Lightning's
SLURMEnvironment finds the others from SLURM's variables); task 0 owns the run (claim, status, lock)
and tells the others, through a file in the job's submitit folder, whether to start theirs.

submitit owns requeueing: before a time limit or on preemption it signals the job,
`RunJob.checkpoint` (task 0) stops its worker, whose rank 0 stops every rank at one step and saves
checkpoints/last.ckpt, and submitit requeues the same job, which resumes from that checkpoint.
Lightning's own SLURM auto-requeue stays off in the worker, or both would requeue. Tested without a
cluster with submitit's local executor and a mocked `sbatch` / `squeue`.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import submitit

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_text
from relpos_ablate.runner.grid import GridSpec, LauncherConfig
from relpos_ablate.runner.store import (
    RUNNABLE,
    SLURM_JOB,
    RunPlan,
    claim,
    plan_grid,
    prepare_run,
    update_status,
)
from relpos_ablate.runner.worker import (
    available_cores,
    kill_leftovers,
    launch,
    record_exit,
    start_worker,
    stop,
)

LAUNCH, NO_LAUNCH = "launch", "no launch"
"""What task 0 of a job tells the other tasks (see RunJob)."""


class RunJob(submitit.helpers.Checkpointable):
    """One run as a checkpointable submitit job; every task of the job executes it (module
    docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        retry_failed: bool = False,
        grace_s: float = 60.0,
        settings: tuple[str, ...] = (),
        wait_for_task0_s: float = 600.0,
    ):
        self.run_dir = str(run_dir)
        self.retry_failed = retry_failed
        self.grace_s = grace_s
        self.settings = settings
        self.wait_for_task0_s = wait_for_task0_s
        self._proc = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for submission and on requeue: the live worker process stays behind."""
        return {**self.__dict__, "_proc": None}

    def __call__(self) -> str:
        """Run (or resume) the run; returns its final state, or why it was not this job's to run."""
        env = submitit.JobEnvironment()
        threads = int(os.environ.get("SLURM_CPUS_PER_TASK", available_cores()))
        if env.global_rank != 0:
            return self._follow(env, threads)
        run_dir = Path(self.run_dir)
        lock, action, note = claim(run_dir, self.retry_failed)
        decision = self._decision_file(env)
        if lock is None:
            atomic_write_text(decision, NO_LAUNCH)
            return f"{action}: {note}"
        try:
            device = f"job {env.job_id} on {socket.gethostname()}"
            # gpu=None: the scheduler already set CUDA_VISIBLE_DEVICES for this task's GPU.
            self._proc = launch(
                run_dir, lock, gpu=None, threads=threads, device=device, settings=self.settings
            )
            atomic_write_text(decision, LAUNCH)
            returncode = self._proc.wait()
            kill_leftovers(self._proc)
            return record_exit(run_dir, returncode)["state"]
        finally:
            lock.release()

    def _follow(self, env: submitit.JobEnvironment, threads: int) -> str:
        """Tasks > 0: start this task's process of the run once task 0 has launched its own."""
        decision = self._decision_file(env)
        deadline = time.monotonic() + self.wait_for_task0_s
        while not decision.exists():
            if time.monotonic() > deadline:
                return (
                    f"task {env.global_rank}: task 0 did not decide within "
                    f"{self.wait_for_task0_s:.0f} s"
                )
            time.sleep(0.5)
        if decision.read_text() != LAUNCH:
            return f"task {env.global_rank}: not run (task 0 did not launch it)"
        self._proc = start_worker(Path(self.run_dir), threads, self.settings)
        returncode = self._proc.wait()
        kill_leftovers(self._proc)
        return f"task {env.global_rank}: exit status {returncode}"

    @staticmethod
    def _decision_file(env: submitit.JobEnvironment) -> Path:
        """Task 0's decision for this attempt of the job (a requeued job keeps its id: SLURM counts
        restarts)."""
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        return Path(env.paths.folder) / f"{env.job_id}_attempt{attempt}_decision"

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit (task 0 only) on timeout/preemption: stop the worker so it saves, then
        requeue."""
        if self._proc is not None and self._proc.returncode is None:
            returncode = stop(self._proc, self.grace_s)
            record_exit(Path(self.run_dir), returncode, "job preempted or timed out; requeued")
        return super().checkpoint(*args, **kwargs)


def worker_settings(launcher: LauncherConfig) -> tuple[str, ...]:
    """How a job's tasks run the run: one process per GPU on every node (one process on a CPU
    job)."""
    return (f"train.devices={max(1, launcher.gpus)}", f"train.num_nodes={launcher.nodes}")


def executor_parameters(launcher: LauncherConfig, name: str) -> dict[str, Any]:
    """submitit AutoExecutor parameters for the launcher settings (empty strings: cluster
    defaults)."""
    params: dict[str, Any] = {
        "name": f"relpos-{name}",
        "timeout_min": launcher.time,
        "gpus_per_node": launcher.gpus,
        "cpus_per_task": launcher.cpus,
        "nodes": launcher.nodes,
        "tasks_per_node": max(1, launcher.gpus),
        "slurm_array_parallelism": launcher.array_parallelism,
        # requeue after preemption even where the cluster's default is not to
        "slurm_additional_parameters": {"requeue": True},
    }
    optional = {
        "slurm_partition": launcher.partition,
        "slurm_account": launcher.account,
        "slurm_qos": launcher.qos,
        "mem_gb": launcher.mem_gb,
        "slurm_setup": list(launcher.setup),
    }
    params.update({key: value for key, value in optional.items() if value})
    return params


def submit_grid(
    spec: GridSpec,
    results: Path,
    launcher: LauncherConfig,
    *,
    retry_failed: bool = False,
    cluster: str = "slurm",
    folder: Path | None = None,
) -> list[tuple[RunPlan, Any]]:
    """Prepare every pending run and submit them as one job array; returns (plan, submitit job)
    pairs.

    A run whose SLURM job (status.json `slurm_job`) is still queued or running is not submitted
    again. `cluster="local"` uses submitit's local executor (real processes on this machine, for
    tests)."""
    if cluster == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError(
            "--launcher", "slurm needs sbatch and srun on PATH; run it on a SLURM login node"
        )
    plans = [plan for plan in plan_grid(spec, results, retry_failed) if plan.action in RUNNABLE]
    alive = live_jobs(_recorded_jobs(plans)) if cluster == "slurm" else set()
    prepared = [
        plan
        for plan in plans
        if _recorded_job(plan) not in alive
        and prepare_run(plan, spec.name, spec.path, retry_failed, spec.analysis_record())
        in RUNNABLE
    ]
    if not prepared:
        return []
    folder = folder or Path(results) / spec.name / ".submitit" / "%j"
    executor = submitit.AutoExecutor(
        folder=folder,
        cluster=cluster,
        slurm_max_num_timeout=launcher.max_timeouts,
        local_max_num_timeout=launcher.max_timeouts,
    )
    executor.update_parameters(**executor_parameters(launcher, spec.name))
    settings = worker_settings(launcher)
    try:
        with executor.batch():
            jobs = [
                executor.submit(RunJob(plan.run_dir.resolve(), retry_failed, settings=settings))
                for plan in prepared
            ]
    except (
        OSError,
        subprocess.CalledProcessError,
        submitit.core.utils.FailedJobError,
        submitit.core.utils.FailedSubmissionError,
    ) as err:
        raise ConfigError(
            "--launcher", f"submitting to SLURM failed: {' '.join(str(err).split())}"
        ) from None
    for plan, job in zip(prepared, jobs):
        update_status(plan.run_dir, **{SLURM_JOB: str(job.job_id)})
    return list(zip(prepared, jobs))


def _recorded_job(plan: RunPlan) -> str | None:
    """The SLURM job last submitted for a run that is still marked queued or running."""
    status = rundir.read_status(plan.run_dir) or {}
    return status.get(SLURM_JOB) if status.get("state") in ("queued", "running") else None


def _recorded_jobs(plans: list[RunPlan]) -> list[str]:
    return [job for job in map(_recorded_job, plans) if job]


def live_jobs(job_ids: list[str]) -> set[str]:
    """The ids among `job_ids` that SLURM still has pending or running: your jobs as squeue lists
    them, one line per array task. A failing squeue is an error (guessing 'ended' would submit
    duplicates)."""
    if not job_ids:
        return set()
    command = ["squeue", "--noheader", "--array", "--format=%i", f"--user={getpass.getuser()}"]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        listed = subprocess.CompletedProcess(command, 1, "", str(err))
    if listed.returncode != 0:
        raise ConfigError(
            "--launcher",
            "cannot ask squeue which runs are still queued or running: "
            f"{' '.join(listed.stderr.split()) or f'exit status {listed.returncode}'}",
        )
    return set(listed.stdout.split()) & set(job_ids)


def follow(submitted: list[tuple[RunPlan, Any]], refresh, poll_s: float = 10.0) -> None:
    """Until every job has ended: call `refresh()` (the live table) every `poll_s` seconds."""
    while not all(job.done() for _plan, job in submitted):
        refresh()
        time.sleep(poll_s)
    refresh()
