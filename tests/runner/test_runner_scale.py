"""The grid runner scales one run out: GPU groups per run locally, multi-GPU multi-node SLURM jobs.

Covers: --gpus-per-run K groups --devices into slots of K GPUs whose worker gets those GPUs and
train.devices=K; flag contradictions and runs whose streams cannot be split are one-line errors
before anything launches; `--launcher slurm --gpus G --nodes N` submits N nodes x G tasks (one per
GPU) whose RunJob passes train.devices=G / train.num_nodes=N to the worker; task 0 of a job decides
and the other tasks start their process only when it launched; a second submission skips runs whose
job squeue still lists (a failing squeue is an error, not a guess); --wait's follow loop runs until
every job has ended. No cluster: a mocked sbatch/squeue and submitit's local executor.
Run: pytest tests/runner/test_runner_scale.py -q   (about 10 s)
"""

import io
import types
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from fixtures.runner import REPO, fake_env, read_log, write_spec
from relpos_ablate.cli import main
from relpos_ablate.rundir import read_status
from relpos_ablate.runner import slurm
from relpos_ablate.runner.display import PlainDisplay
from relpos_ablate.runner.grid import LauncherConfig, load_grid
from relpos_ablate.runner.local import gpu_slots, run_local
from relpos_ablate.runner.slurm import LAUNCH, NO_LAUNCH, RunJob, follow, submit_grid

# a fixture: the tests that take it as an argument redefine it (noqa: F811 there)


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    for key, value in fake_env(log).items():
        monkeypatch.setenv(key, value)
    return log


def test_gpus_per_run_groups_devices_and_hands_the_group_to_one_worker(
    tmp_path, fake_worker, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    slots = gpu_slots([0, 1, 2, 3], cores=8, gpus_per_run=2)
    assert [(s.device, s.gpu, s.threads, s.settings) for s in slots] == [
        ("cuda:0,1", "4,5", 4, ("train.devices=2",)),
        ("cuda:2,3", "6,7", 4, ("train.devices=2",)),
    ]
    spec = load_grid(write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0,)))
    assert (
        run_local(
            spec, tmp_path / "results", slots, PlainDisplay(Console(file=io.StringIO()))
        ).exit_code()
        == 0
    )
    starts = [e for e in read_log(fake_worker) if e["event"] == "start"]
    assert sorted(e["cuda"] for e in starts) == ["4,5", "6,7"]
    assert all(e["settings"] == ["train.devices=2"] for e in starts)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus-per-run", "0"], "--gpus-per-run: 0 is out of range; allowed >= 1"),
        (
            ["--slots", "2", "--gpus-per-run", "2"],
            "--gpus-per-run groups GPUs; CPU slots (--slots) train one process each",
        ),
        (
            ["--devices", "0,1,2", "--gpus-per-run", "2"],
            "--gpus-per-run: 3 GPU(s) do not form groups of 2; give a multiple of 2",
        ),
        (["--wait"], "--wait: only with --launcher slurm (a local grid always waits)"),
        (
            ["--launcher", "slurm", "--gpus-per-run", "2"],
            "SLURM jobs use --gpus (per node) and --nodes",
        ),
        (["--nodes", "2"], "--nodes: only with --launcher slurm"),
        (["--launcher", "slurm", "--gpus", "3"], "--gpus/--nodes: run "),
    ],
)
def test_scale_flags_are_checked_before_anything_launches(tmp_path, capsys, argv, message):
    spec_path = write_spec(tmp_path)
    assert main(["grid", str(spec_path), "--results", str(tmp_path / "results"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_uneven_split_names_the_run_and_the_field(tmp_path, capsys):
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0,))
    assert (
        main(
            [
                "grid",
                str(spec_path),
                "--results",
                str(tmp_path / "results"),
                "--launcher",
                "slurm",
                "--gpus",
                "3",
            ]
        )
        == 2
    )
    (run,) = load_grid(spec_path).runs
    assert capsys.readouterr().err.strip() == (
        f"error: --gpus/--nodes: run {run.run_id} [encoding=xl seed=0] cannot be split over 3 "
        f"processes: train.batch_size: 4 streams do not split evenly over 3 processes; use a "
        f"multiple of 3"
    )


def test_multi_node_job_has_one_task_per_gpu_and_tells_the_worker(tmp_path, fake_slurm):
    spec = load_grid(write_spec(tmp_path, encodings=("xl",), seeds=(0,)))
    (submitted,) = submit_grid(spec, tmp_path / "results", LauncherConfig(gpus=4, nodes=2, cpus=6))
    (script_path,) = fake_slurm.glob("script_*.sh")
    lines = script_path.read_text().splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=6",
        "#SBATCH --requeue",
    ):
        assert line in lines, line
    assert any(line.startswith("srun ") for line in lines)  # every task runs the pickled RunJob
    job = submitted[1].submission().function
    assert isinstance(job, RunJob) and job.settings == ("train.devices=4", "train.num_nodes=2")
    assert read_status(submitted[0].run_dir)["slurm_job"] == str(submitted[1].job_id) == "4242"


def fake_squeue(bin_dir: Path, listed: str, status: int = 0) -> None:
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{listed}'\nexit {status}\n")
    (bin_dir / "squeue").chmod(0o755)


def test_resubmitting_skips_runs_whose_job_is_still_queued_or_running(tmp_path, fake_slurm, capsys):
    spec_path = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0,))
    argv = ["grid", str(spec_path), "--results", str(tmp_path / "results"), "--launcher", "slurm"]
    assert main(argv) == 0
    fake_squeue(tmp_path / "bin", "4242_0\n4242_1\n999")
    assert main(argv) == 1  # nothing to submit: both runs queued elsewhere
    assert "nothing to submit" in capsys.readouterr().out
    assert len(list(fake_slurm.glob("script_*.sh"))) == 1
    fake_squeue(tmp_path / "bin", "4242_1")  # the job of run 0 ended without a result (node lost)
    assert main(argv) == 0
    assert "submitted 1 run(s)" in capsys.readouterr().out
    xl, alibi = (tmp_path / "results" / "g" / run.run_id for run in load_grid(spec_path).runs)
    assert read_status(xl)["slurm_job"] == "4242" and read_status(alibi)["slurm_job"] == "4242_1"
    fake_squeue(tmp_path / "bin", "", status=1)
    assert main(argv) == 2
    assert "cannot ask squeue which runs are still queued or running" in capsys.readouterr().err


class _Env(types.SimpleNamespace):
    """What RunJob reads from submitit.JobEnvironment."""


def test_tasks_other_than_0_start_their_process_only_when_task_0_launched(
    tmp_path, fake_worker, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    run_dir = tmp_path / "results" / "g" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "train": {"max_steps": 2}}))
    env = _Env(global_rank=1, job_id="7_0", paths=_Env(folder=str(tmp_path)))
    monkeypatch.setattr(slurm.submitit, "JobEnvironment", lambda: env)
    job = RunJob(run_dir, settings=("train.devices=2",), wait_for_task0_s=0.5)
    assert job() == "task 1: task 0 did not decide within 0 s"
    decision = tmp_path / "7_0_attempt0_decision"
    decision.write_text(NO_LAUNCH)
    assert job() == "task 1: not run (task 0 did not launch it)"
    assert read_log(fake_worker) == []
    decision.write_text(LAUNCH)
    assert job() == "task 1: exit status 0"
    (start,) = [e for e in read_log(fake_worker) if e["event"] == "start"]
    assert start["settings"] == ["train.devices=2"]
    # a requeued job waits for the new attempt's decision
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert job() == "task 1: task 0 did not decide within 0 s"

    env.global_rank = 0
    (run_dir / "status.json").write_text('{"state": "failed", "reason": "x"}')
    assert (
        job() == "skip: failed: x" and (tmp_path / "7_0_attempt1_decision").read_text() == NO_LAUNCH
    )


def test_follow_refreshes_until_every_job_has_ended(tmp_path, fake_worker, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    spec = load_grid(write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0,), max_steps=4))
    submitted = submit_grid(spec, tmp_path / "results", LauncherConfig(gpus=0), cluster="local")
    refreshes = []
    follow(
        submitted,
        lambda: refreshes.append([read_status(plan.run_dir)["state"] for plan, _ in submitted]),
        poll_s=0.1,
    )
    assert refreshes[-1] == ["done", "done"] and len(refreshes) > 1
    assert all(job.done() for _plan, job in submitted)
