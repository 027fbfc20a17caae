"""Faults with real processes, real signals and the real `train` worker on CPU (issue 6).

Complements tests/runner/test_runner_faults.py (fake worker: runner killed while launching /
mid-training, SIGTERM, two runners, a failing config write, truncated status.json, missing
eval.json) and tests/runner/test_runner_e2e.py (one real worker SIGKILLed and resumed). Covered
here:
- SIGKILL in the middle of atomic writes, over and over: the target is always a complete old or new
  version, never half a file; the temp files left behind are ignored by `collect`.
- the same for checkpoints, staged on another filesystem the way Lightning's writer does with a
  node-local $TMPDIR: last.ckpt always loads whole; the next run clears the stale temp files.
- the grid runner SIGKILLed at random moments over runs that checkpoint every step, then rerun:
  every run done, its step series complete without duplicates, `collect` without duplicate rows.
- in one real grid: a NaN loss, a missing data file and a binary data file each fail their own run
  with a clear reason while the healthy run finishes.
- a full disk (ENOSPC) when writing eval.json or a checkpoint: failed with the reason, the files
  already written intact, the rerun completes without duplicated steps.
- a truncated last.ckpt (damage from outside): set aside and the run trains again from step 0.
Run: pytest tests/runner/test_faults.py -q   (about a minute; the real-grid tests are marked slow)
"""

import errno
import io
import itertools
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fixtures.report_runs import make_run
from fixtures.runner import alive, cli_body, metric_steps, tiny_base, wait_for
from fixtures.training import At, sigterm
from relpos_ablate.analysis.collect import collect
from relpos_ablate.cli import main
from relpos_ablate.config import RunConfig, apply_overrides, from_dict
from relpos_ablate.io import atomic_write_json, read_json
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.display import PlainDisplay
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.runner.local import cpu_slots, run_local
from relpos_ablate.train import records as records_module
from relpos_ablate.train import run as train_module
from relpos_ablate.train.records import AtomicCheckpointIO
from relpos_ablate.train.run import train_run, usable_checkpoint

FORK = multiprocessing.get_context("fork")


def kill_at_random_moments(
    target, args, times: int, ready, rng: random.Random, longest_s: float, poll_s: float = 0.05
) -> None:
    """Start `target(*args)` in a forked process `times` times; SIGKILL each one a random moment (up
    to `longest_s`) after `ready()` holds, checked every `poll_s`."""
    for _ in range(times):
        child = FORK.Process(target=target, args=args)
        child.start()
        deadline = time.monotonic() + 30
        while not ready():
            assert time.monotonic() < deadline and child.is_alive(), "never ready"
            time.sleep(poll_s)
        time.sleep(rng.uniform(0.0, longest_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL


def writing(final: Path, *staging: Path):
    """A `ready` for kill_at_random_moments: `final` exists and a new version of it is being written
    (a temp file of it exists next to it or in a staging dir)."""

    def ready() -> bool:
        return final.exists() and (
            any(final.parent.glob(f".{final.name}.*.tmp")) or any(any(d.iterdir()) for d in staging)
        )

    return ready


def tiny_config(max_steps: int, *overrides: str) -> RunConfig:
    """A real run that logs and checkpoints every step (most of its time is spent writing files)."""
    base = tiny_base(max_steps)
    base["train"].update(log_every=1, checkpoint_every=1)
    return from_dict(RunConfig, apply_overrides(base, list(overrides)))


# --- atomic writes under SIGKILL
# ---------------------------------------------------------------------

PAYLOAD = 200_000  # list items: about 1.5 MB of indented JSON, so kills land mid-write


def _rewrite_eval_forever(path: Path) -> None:
    for version in itertools.count(1):
        atomic_write_json(
            path,
            {
                "main_metric": "ppl",
                "version": version,
                "payload": [version] * PAYLOAD,
                "settings": [
                    {
                        "segment_len": 32,
                        "mem_len": 0,
                        "clamp_len": None,
                        "same_length": False,
                        "attn_len": 32,
                        "metrics": {"ppl": float(version)},
                    }
                ],
            },
        )


def test_sigkill_mid_write_leaves_the_old_or_the_new_file_never_half(tmp_path):
    run_dir = make_run(tmp_path, ["seed=0"], results=[({"segment_len": 32}, {"ppl": 1.0})])
    target = run_dir / "eval.json"
    target.unlink()
    seen = set()
    rng = random.Random(6)
    for _ in range(10):
        kill_at_random_moments(
            _rewrite_eval_forever, (target,), 1, writing(target), rng, 0.002, poll_s=0.0005
        )
        content = read_json(target)
        assert isinstance(content, dict), "a killed write left a file that is not valid JSON"
        version = content["version"]
        assert content["payload"] == [version] * PAYLOAD  # whole, not a valid-looking prefix
        assert content["settings"][0]["metrics"]["ppl"] == float(version)
        seen.add(version)
    assert list(run_dir.glob(".eval.json.*.tmp"))  # kills landed mid-write
    frame = collect(tmp_path)
    assert len(frame) == 1 and frame["ppl"].iloc[0] == float(read_json(target)["version"])
    assert frame.attrs["problems"] == []  # the temp files are neither rows nor problems


CKPT_FLOATS = 5_000_000  # 20 MB: the copy out of the staging dir takes long enough to be cut short


def _checkpoint_forever(path: Path, staging: Path) -> None:
    import tempfile

    tempfile.tempdir = str(staging)  # where Lightning's own writer would stage the file
    io_plugin = AtomicCheckpointIO()
    for version in itertools.count(1):
        io_plugin.save_checkpoint(
            {"version": version, "weights": torch.full((CKPT_FLOATS,), float(version))}, path
        )


def test_sigkill_mid_checkpoint_leaves_a_whole_checkpoint_and_no_stray_staging_files(tmp_path):
    """Staging on /dev/shm (another filesystem than tmp_path on most machines) is the cluster case
    of node-local $TMPDIR and shared results, where a move is a copy that a kill cuts short."""
    shm = Path("/dev/shm")
    staging = (
        Path(__import__("tempfile").mkdtemp(dir=shm)) if shm.is_dir() else tmp_path / "staging"
    )
    staging.mkdir(exist_ok=True)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    rng = random.Random(7)
    try:
        for _ in range(8):
            kill_at_random_moments(
                _checkpoint_forever,
                (last, staging),
                1,
                writing(last, staging),
                rng,
                0.01,
                poll_s=0.0005,
            )
            checkpoint = torch.load(last, weights_only=True)
            assert torch.equal(
                checkpoint["weights"], torch.full((CKPT_FLOATS,), float(checkpoint["version"]))
            )
        assert list(staging.iterdir()) == []  # nothing written outside the run dir
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    assert usable_checkpoint(last.parent.parent)
    # temp files of killed writes cleared
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]


# --- full disk and damaged checkpoints (in-process runs)
# ----------------------------------------------


def fail_writes_of(monkeypatch, name: str, module, function: str) -> None:
    """Make `module`'s `function` raise ENOSPC for files called `name` or staged for it (a full
    results disk)."""
    real = getattr(module, function)

    def write(path, data):
        if Path(path).name in (name, f".{name}.staged.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(module, function, write)


@pytest.mark.parametrize(
    "name, module, function",
    [
        ("eval.json", train_module, "atomic_write_json"),
        ("last.ckpt", records_module, "atomic_write_bytes"),
    ],
)
def test_full_disk_fails_the_run_keeps_its_files_and_the_rerun_completes(
    tmp_path, monkeypatch, name, module, function
):
    config = tiny_config(12)
    with monkeypatch.context() as patch:
        fail_writes_of(patch, name, module, function)
        assert train_run(config, tmp_path) == "failed"
    status = read_json(tmp_path / "status.json")
    assert status["state"] == "failed" and "No space left on device" in status["reason"]
    assert not list(tmp_path.rglob("*.tmp"))
    if name == "eval.json":  # training itself finished and was checkpointed
        assert (
            torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
            == 12
        )
    else:
        assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert train_run(config, tmp_path) == "done"
    assert metric_steps(tmp_path) == list(range(12))
    assert read_json(tmp_path / "eval.json")["step"] == 12


def test_truncated_checkpoint_is_set_aside_and_the_run_starts_over(tmp_path):
    config = tiny_config(10)
    assert train_run(config, tmp_path, callbacks=(At(6, sigterm),)) == "interrupted"
    last = tmp_path / "checkpoints" / "last.ckpt"
    whole = last.read_bytes()
    last.write_bytes(whole[: len(whole) // 2])  # e.g. a disk that filled up under another program
    assert train_run(config, tmp_path) == "done"
    assert (tmp_path / "checkpoints" / "last.ckpt.corrupt").read_bytes() == whole[: len(whole) // 2]
    assert "not a complete checkpoint" in (tmp_path / "log.txt").read_text()
    assert torch.load(last, weights_only=False)["global_step"] == 10
    assert metric_steps(tmp_path) == list(range(10))


# --- real grids: the runner killed at random moments; failures of several kinds in one grid
# ------------

# runner processes launch the real `train`, not the fake worker
REAL_WORKER = {"RELPOS_ABLATE_WORKER": None}


def write_grid(tmp_path: Path, name: str, base: dict, **axes) -> Path:
    import yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump({"name": name, "base": base, "seeds": [0], **axes}, sort_keys=False)
    )
    return path


@pytest.mark.slow
def test_runner_sigkilled_at_random_moments_then_rerun_finishes_every_run_once(
    tmp_path, monkeypatch
):
    # random.Random(66) kills 0.1 s past step 2 (mid-run), then 1.7 s into the relaunch (its fork
    # server still imports)
    max_steps = 40
    base = tiny_base(max_steps)
    base["train"].update(log_every=1, checkpoint_every=1)
    spec_path = write_grid(tmp_path, "kill", base, grid={"encoding": ["xl", "alibi"]})
    spec, results = load_grid(spec_path), tmp_path / "results"
    run_dirs = [results / "kill" / run.run_id for run in spec.runs]
    argv = ["grid", str(spec_path), "--results", str(results), "--slots", "2"]

    # metrics.csv, not status.json: that is written at most once a second, and a
    def training() -> bool:
        # run of 40 steps takes about one on a fast core (it was done before the kill, and the test
        # tested nothing)
        return any((d / "metrics.csv").exists() and len(metric_steps(d)) >= 2 for d in run_dirs)

    rng = random.Random(66)
    kill_at_random_moments(
        cli_body, (argv, tmp_path / "first.out", REAL_WORKER), 1, training, rng, longest_s=1.5
    )
    worker_pids = [(read_status(d) or {}).get("pid") for d in run_dirs]
    # died with the runner
    wait_for(lambda: not any(pid and alive(pid) for pid in worker_pids), timeout=15)
    assert any((read_status(d) or {}).get("state") != "done" for d in run_dirs), (
        "the kill came after the runs ended"
    )
    started = lambda: any((d / "status.json").exists() for d in run_dirs)  # noqa: E731
    kill_at_random_moments(
        cli_body, (argv, tmp_path / "second.out", REAL_WORKER), 1, started, rng, longest_s=4.0
    )
    worker_pids = [(read_status(d) or {}).get("pid") for d in run_dirs]
    wait_for(lambda: not any(pid and alive(pid) for pid in worker_pids), timeout=15)

    monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)
    assert main(argv) == 0
    for run_dir in run_dirs:
        assert read_status(run_dir)["state"] == "done"
        assert metric_steps(run_dir) == list(range(max_steps))  # complete, none repeated
        assert read_json(run_dir / "eval.json")["step"] == max_steps
        assert (
            torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
            == max_steps
        )
    frame = collect(results / "kill")
    assert len(frame) == len(run_dirs) * len(base["eval"]["settings"])
    assert not frame.duplicated(["run_id", "segment_len"]).any() and frame.attrs["problems"] == []


@pytest.mark.slow
def test_nan_loss_and_unreadable_data_fail_their_own_runs_and_the_grid_goes_on(
    tmp_path, monkeypatch
):
    text = "".join(random.Random(0).choice("abcdefgh \n") for _ in range(20_000))
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 20)
    base = tiny_base(8)
    base["data"] = {"source": "text", "tokenizer": "char", "cache_dir": str(tmp_path / "cache")}
    spec_path = write_grid(
        tmp_path,
        "mixed",
        base,
        zip={  # zip axes need distinct values
            "data.train_file": [
                str(tmp_path / name) for name in ("a.txt", "b.txt", "missing.txt", "binary.txt")
            ],
            "train.lr": [1e-3, 1e30, 2e-3, 3e-3],
        },
    )
    spec = load_grid(spec_path)
    monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)
    outcome = run_local(
        spec, tmp_path / "results", cpu_slots(2), PlainDisplay(Console(file=io.StringIO()))
    )
    ok, nan, missing, binary = (run.run_id for run in spec.runs)
    assert outcome.states == {ok: "done", nan: "failed", missing: "failed", binary: "failed"}
    assert outcome.reasons[nan].startswith("non-finite loss at step")
    assert (
        outcome.reasons[missing] == f"data.train_file: file not found: {tmp_path / 'missing.txt'}"
    )
    assert outcome.reasons[binary].startswith(
        f"data.train_file: {tmp_path / 'binary.txt'} is not UTF-8 text"
    )
    assert outcome.exit_code() == 1
    frame = collect(tmp_path / "results" / "mixed")
    assert set(frame.loc[frame["status"] == "done", "run_id"]) == {ok}
    assert all(
        read_status(tmp_path / "results" / "mixed" / rid)["state"] == "failed"
        for rid in (nan, missing, binary)
    )
