"""Run a grid on SLURM through submitit: one array job per grid, one run per job.

Each job executes `RunJob`, which does exactly what a local slot does (claim the run, launch the
worker, record its exit), so a run behaves the same on a laptop and on a cluster. submitit owns
requeueing: before a time limit or on preemption it signals the job, `RunJob.checkpoint` stops the
worker (which saves checkpoints/last.ckpt) and submitit requeues the same job, which resumes from
that checkpoint. Lightning's own SLURM auto-requeue must stay off in the worker, or both would
requeue. Tested without a cluster with submitit's local executor and a mocked `sbatch`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import submitit

from relpos_ablate.config import ConfigError
from relpos_ablate.runner.grid import GridSpec, LauncherConfig
from relpos_ablate.runner.store import RUNNABLE, RunPlan, claim, plan_grid, prepare_run
from relpos_ablate.runner.worker import available_cores, launch, record_exit, stop


class RunJob(submitit.helpers.Checkpointable):
    """One run as a checkpointable submitit job (see the module docstring)."""

    def __init__(self, run_dir: str | Path, retry_failed: bool = False, grace_s: float = 60.0):
        self.run_dir = str(run_dir)
        self.retry_failed = retry_failed
        self.grace_s = grace_s
        self._proc = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for submission and on requeue: the live worker process stays behind."""
        return {**self.__dict__, "_proc": None}

    def __call__(self) -> str:
        """Run (or resume) the run; returns its final state, or why it was not this job's to run."""
        run_dir = Path(self.run_dir)
        lock, action, note = claim(run_dir, self.retry_failed)
        if lock is None:
            return f"{action}: {note}"
        try:
            env = submitit.JobEnvironment()
            threads = int(os.environ.get("SLURM_CPUS_PER_TASK", available_cores()))
            device = f"job {env.job_id} on {socket.gethostname()}"
            # gpu=None: the scheduler already set CUDA_VISIBLE_DEVICES for this job's GPUs.
            self._proc = launch(run_dir, lock, gpu=None, threads=threads, device=device)
            returncode = self._proc.wait()
            return record_exit(run_dir, returncode)["state"]
        finally:
            lock.release()

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on timeout/preemption: stop the worker so it saves, then requeue this job."""
        if self._proc is not None and self._proc.returncode is None:
            returncode = stop(self._proc, self.grace_s)
            record_exit(Path(self.run_dir), returncode, "job preempted or timed out; requeued")
        return super().checkpoint(*args, **kwargs)


def executor_parameters(launcher: LauncherConfig, name: str) -> dict[str, Any]:
    """submitit AutoExecutor parameters for the launcher settings (empty strings: cluster defaults)."""
    params: dict[str, Any] = {
        "name": f"relpos-{name}", "timeout_min": launcher.time, "gpus_per_node": launcher.gpus,
        "cpus_per_task": launcher.cpus, "nodes": 1, "tasks_per_node": 1,
        "slurm_array_parallelism": launcher.array_parallelism,
        # requeue after preemption even where the cluster's default is not to
        "slurm_additional_parameters": {"requeue": True},
    }
    optional = {
        "slurm_partition": launcher.partition, "slurm_account": launcher.account, "slurm_qos": launcher.qos,
        "mem_gb": launcher.mem_gb, "slurm_setup": list(launcher.setup),
    }
    params.update({key: value for key, value in optional.items() if value})
    return params


def submit_grid(
    spec: GridSpec, results: Path, launcher: LauncherConfig, *, retry_failed: bool = False,
    cluster: str = "slurm", folder: Path | None = None,
) -> list[tuple[RunPlan, Any]]:
    """Prepare every pending run and submit them as one job array; returns (plan, submitit job) pairs.

    `cluster="local"` uses submitit's local executor (real processes on this machine, for tests)."""
    if cluster == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError("--launcher", "slurm needs sbatch and srun on PATH; run it on a SLURM login node")
    prepared = []
    for plan in plan_grid(spec, results, retry_failed):
        if plan.action in RUNNABLE and prepare_run(plan, spec.name, spec.path, retry_failed) in RUNNABLE:
            prepared.append(plan)
    if not prepared:
        return []
    folder = folder or Path(results) / spec.name / ".submitit" / "%j"
    executor = submitit.AutoExecutor(
        folder=folder, cluster=cluster,
        slurm_max_num_timeout=launcher.max_timeouts, local_max_num_timeout=launcher.max_timeouts,
    )
    executor.update_parameters(**executor_parameters(launcher, spec.name))
    try:
        with executor.batch():
            jobs = [executor.submit(RunJob(plan.run_dir.resolve(), retry_failed)) for plan in prepared]
    except (OSError, subprocess.CalledProcessError, submitit.core.utils.FailedJobError,
            submitit.core.utils.FailedSubmissionError) as err:
        raise ConfigError("--launcher", f"submitting to SLURM failed: {' '.join(str(err).split())}") from None
    return list(zip(prepared, jobs))
