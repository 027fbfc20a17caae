"""SLURM through submitit, without a cluster: the sbatch script `grid --launcher slurm` generates
(checked against a mocked `sbatch` on PATH), and a grid run end to end by submitit's local executor
(real job processes) including a preempted job that submitit requeues and that resumes from its
checkpoint. Jobs run the fake worker (tests/fixtures/runner.py).
Run: pytest tests/runner/test_runner_slurm.py -q   (about 15 s)
"""

import os
import signal
import time
from pathlib import Path

from fixtures.runner import REPO, fake_env, read_log, write_spec
from relpos_ablate.cli import main
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.grid import LauncherConfig, load_grid
from relpos_ablate.runner.slurm import RunJob, submit_grid


def test_sbatch_script_carries_spec_and_cli_settings(tmp_path, fake_slurm, capsys):
    launcher = {
        "partition": "cpu",
        "qos": "high",
        "cpus": 4,
        "time": 30,
        "setup": ["module load cuda/12"],
    }
    spec_path = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1), launcher=launcher)
    results = tmp_path / "results"
    argv = [
        "grid",
        str(spec_path),
        "--results",
        str(results),
        "--launcher",
        "slurm",
        "--partition",
        "gpu",
        "--time",
        "90",
        "--gpus",
        "2",
        "--account",
        "lab",
        "--array-parallelism",
        "3",
    ]
    assert main(argv) == 0
    assert "4242" in capsys.readouterr().out
    (script_path,) = fake_slurm.glob("script_*.sh")  # one array job for the whole grid
    script = script_path.read_text()
    # one task per GPU
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --time=90",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --account=lab",
        "#SBATCH --qos=high",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --array=0-3%3",
        "#SBATCH --requeue",
        "#SBATCH --job-name=relpos-g",
        "#SBATCH --ntasks-per-node=2",
        "module load cuda/12",
    ):
        assert line in script.splitlines(), line
    assert any(line.startswith("#SBATCH --signal=USR2@") for line in script.splitlines())
    assert "-m submitit.core._submit" in script
    spec = load_grid(spec_path)
    for run in spec.runs:
        run_dir = results / "g" / run.run_id
        assert read_status(run_dir)["state"] == "queued" and (run_dir / "config.yaml").exists()


def test_slurm_flags_need_the_slurm_launcher(tmp_path, capsys):
    spec_path = write_spec(tmp_path)
    assert main(["grid", str(spec_path), "--partition", "gpu"]) == 2
    assert "--partition: only with --launcher slurm" in capsys.readouterr().err
    assert main(["grid", str(spec_path), "--launcher", "slurm", "--time", "0"]) == 2
    assert "time: 0 is out of range" in capsys.readouterr().err


def test_slurm_without_a_cluster_or_with_a_failing_sbatch_is_one_line(
    tmp_path, fake_slurm, monkeypatch, capsys
):
    spec_path = write_spec(tmp_path)
    argv = ["grid", str(spec_path), "--results", str(tmp_path / "results"), "--launcher", "slurm"]
    (tmp_path / "bin" / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n"
    )
    assert main(argv) == 2
    # submitit echoes sbatch's stderr before it
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: --launcher: submitting to SLURM failed: sbatch: error: invalid partition"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(argv) == 2
    assert "needs sbatch and srun on PATH" in capsys.readouterr().err


def test_local_executor_runs_grid_and_requeues_a_preempted_job(tmp_path, monkeypatch):
    """Seed 1 trains slowly; once it has a checkpoint its job gets the preemption signal (USR2):
    RunJob.checkpoint stops the worker, submitit requeues the job and the worker resumes."""
    log = tmp_path / "log.jsonl"
    for key, value in fake_env(log, {1: "slow_first"}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    spec = load_grid(write_spec(tmp_path, encodings=("xl",), seeds=(0, 1), max_steps=8))
    results = tmp_path / "results"
    submitted = submit_grid(spec, results, LauncherConfig(gpus=0, time=10), cluster="local")
    assert len(submitted) == 2
    slow_dir = results / "g" / spec.runs[1].run_id

    deadline = time.monotonic() + 60
    while (read_status(slow_dir) or {}).get("step", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (first_attempt,) = [
        e for e in read_log(log) if e["event"] == "start" and e["run"] == slow_dir.name
    ]
    # the job process: what SLURM signals before preempting
    os.kill(first_attempt["ppid"], signal.SIGUSR2)

    assert [job.result() for _plan, job in submitted] == ["done", "done"]
    attempts = [e for e in read_log(log) if e["event"] == "start" and e["run"] == slow_dir.name]
    assert len(attempts) == 2 and attempts[1]["start_step"] >= 2
    assert [
        e["state"] for e in read_log(log) if e["event"] == "end" and e["run"] == slow_dir.name
    ] == ["interrupted", "done"]
    steps = [int(line.split(",")[0]) for line in (slow_dir / "metrics.csv").read_text().split()]
    assert steps == list(range(1, 9))
    assert submit_grid(spec, results, LauncherConfig(gpus=0), cluster="local") == []  # all done


def test_run_job_pickles_without_its_process(tmp_path):
    import pickle

    job = RunJob(tmp_path / "run", retry_failed=True)
    job._proc = object()  # stands for the live worker process
    clone = pickle.loads(pickle.dumps(job))
    assert (
        clone._proc is None and clone.run_dir == str(Path(tmp_path / "run")) and clone.retry_failed
    )
