"""Runner faults with real processes and signals (fake worker, tests/fixtures/runner.py):
SIGKILL of the runner while launching and mid-training (its workers die with it; the rerun resumes
every run, each ends done exactly once), SIGTERM or Ctrl-C (workers stopped, recorded interrupted
with the runner's reason, exit 130),
two runners on one results dir (no run executed twice), a results dir that cannot be written.
Run: pytest tests/runner/test_runner_faults.py -q   (about 30 s)
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from fixtures import runner as fake_worker
from fixtures.runner import alive, cli_body, fake_env, read_log, tiny_base, wait_for, write_spec
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.runner.worker import record_exit

MAX_STEPS = 8
FORK = multiprocessing.get_context("fork")


def runner(spec_path, results, log, *, step_s=0.05, slots=2):
    """`relpos-ablate grid` in its own process. Forked from this one (which has imported everything
    already) rather than started afresh, which would spend seconds importing torch for each."""
    argv = ["grid", str(spec_path), "--results", str(results), "--slots", str(slots)]
    out_path = log.parent / f"runner_{time.monotonic_ns()}.out"
    proc = FORK.Process(target=cli_body, args=(argv, out_path, fake_env(log, step_s=step_s)))
    proc.start()
    proc.output = out_path
    return proc


def finish(proc, timeout=60.0) -> int:
    proc.join(timeout)
    assert proc.exitcode is not None, "runner did not finish"
    if proc.exitcode not in (0, 130):
        print(proc.output.read_text())
    return proc.exitcode


def ends(log, state="done"):
    return [e["run"] for e in read_log(log) if e["event"] == "end" and e["state"] == state]


def metric_steps(run_dir):
    return [int(line.split(",")[0]) for line in (run_dir / "metrics.csv").read_text().split()]


def assert_each_run_done_once(spec, results, log):
    run_ids = sorted(run.run_id for run in spec.runs)
    assert sorted(ends(log)) == run_ids  # every run completed exactly once
    for rid in run_ids:
        assert read_status(results / spec.name / rid)["state"] == "done"
        # no step lost or repeated
        assert metric_steps(results / spec.name / rid) == list(range(1, MAX_STEPS + 1))


@pytest.mark.parametrize("moment", ["before", "after"])
def test_fake_worker_stopped_as_it_checkpoints_resumes_with_every_step_once(
    tmp_path, monkeypatch, moment
):
    """The tests above count the fake worker's metrics.csv rows; a runner's death reaches its
    workers as SIGTERM, which can land just before or after a checkpoint is written: no row may be
    lost (it was, once in a while, when the fake wrote the checkpoint before the row) or
    repeated."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed": 0, **tiny_base(MAX_STEPS)}))
    for key, value in fake_env(tmp_path / "log.jsonl", step_s=0.0).items():
        monkeypatch.setenv(key, value)
    write_json = fake_worker._write_json

    def write_and_stop_at_step_3(path, obj):
        stop = path.name == "last.ckpt" and obj["step"] == 3
        if stop and moment == "before":
            os.kill(os.getpid(), signal.SIGTERM)
        write_json(path, obj)
        if stop and moment == "after":
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    try:
        monkeypatch.setattr(fake_worker, "_write_json", write_and_stop_at_step_3)
        with pytest.raises(SystemExit):
            fake_worker.fake_train(run_dir, threads=1)
        monkeypatch.setattr(fake_worker, "_write_json", write_json)
        assert fake_worker.fake_train(run_dir, threads=1) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    checkpointed = 2 if moment == "before" else 3
    assert [e["start_step"] for e in read_log(tmp_path / "log.jsonl") if e["event"] == "start"] == [
        0,
        checkpointed,
    ]
    assert metric_steps(run_dir) == list(range(1, MAX_STEPS + 1))


@pytest.mark.parametrize("moment", ["launching", "mid_training"])
def test_sigkill_runner_then_rerun_finishes_every_run_once(tmp_path, moment):
    spec_path = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1), max_steps=MAX_STEPS)
    spec, results, log = load_grid(spec_path), tmp_path / "results", tmp_path / "log.jsonl"
    proc = runner(spec_path, results, log, step_s=0.25)
    if moment == "launching":  # the first run is marked queued; its worker may not exist yet
        wait_for(
            lambda: any((results / "g" / r.run_id / "status.json").exists() for r in spec.runs)
        )
    else:
        wait_for(
            lambda: any(
                (read_status(results / "g" / r.run_id) or {}).get("step", 0) >= 3 for r in spec.runs
            )
        )
    proc.kill()
    proc.join()
    workers = [e["pid"] for e in read_log(log) if e["event"] == "start"]
    # they died with the runner
    wait_for(lambda: not any(alive(pid) for pid in workers), timeout=10)

    assert finish(runner(spec_path, results, log)) == 0
    assert_each_run_done_once(spec, results, log)
    resumed = [e for e in read_log(log) if e["event"] == "start" and e["start_step"] > 0]
    assert moment == "launching" or resumed


@pytest.mark.parametrize(
    "sig, reason",
    [
        (signal.SIGTERM, "grid stopped by SIGTERM; rerun the same command"),
        (signal.SIGINT, "interrupted by the user (Ctrl-C on grid); rerun the same"),
    ],
)
def test_sigterm_or_ctrl_c_stops_workers_and_marks_them_interrupted_saying_why(
    tmp_path, sig, reason
):
    """The workers only see the runner's SIGTERM; each run's reason says why the runner stopped."""
    spec_path = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0,), max_steps=MAX_STEPS)
    spec, results, log = load_grid(spec_path), tmp_path / "results", tmp_path / "log.jsonl"
    proc = runner(spec_path, results, log, step_s=0.25)
    wait_for(
        lambda: all(
            (read_status(results / "g" / r.run_id) or {}).get("step", 0) >= 1 for r in spec.runs
        )
    )
    os.kill(proc.pid, sig)
    assert finish(proc) == 130
    assert sorted(ends(log, "interrupted")) == sorted(r.run_id for r in spec.runs)
    for run in spec.runs:
        status = read_status(results / "g" / run.run_id)
        assert status["state"] == "interrupted" and status["reason"].startswith(reason), status
    assert finish(runner(spec_path, results, log)) == 0
    assert_each_run_done_once(spec, results, log)


def test_two_runners_on_one_results_dir_share_the_work(tmp_path):
    spec_path = write_spec(
        tmp_path, encodings=("xl", "alibi", "rope"), seeds=(0, 1), max_steps=MAX_STEPS
    )
    spec, results, log = load_grid(spec_path), tmp_path / "results", tmp_path / "log.jsonl"
    first, second = [runner(spec_path, results, log, step_s=0.1) for _ in range(2)]
    assert finish(first) == 0 and finish(second) == 0
    starts = [e["run"] for e in read_log(log) if e["event"] == "start"]
    assert sorted(starts) == sorted(r.run_id for r in spec.runs)  # none started twice
    assert_each_run_done_once(spec, results, log)


def test_a_failing_write_is_recorded_for_that_run_only(tmp_path, monkeypatch):
    """A full disk for one run's directory (simulated: its config.yaml write raises ENOSPC)."""
    import errno
    import io

    from rich.console import Console

    from relpos_ablate.runner import store
    from relpos_ablate.runner.display import PlainDisplay
    from relpos_ablate.runner.local import cpu_slots, run_local

    for key, value in fake_env(tmp_path / "log.jsonl").items():
        monkeypatch.setenv(key, value)
    spec = load_grid(write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0,)))
    full = spec.runs[0].run_id
    real_write = store.atomic_write_yaml

    def write(path, obj):
        if full in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, obj)

    monkeypatch.setattr(store, "atomic_write_yaml", write)
    outcome = run_local(
        spec, tmp_path / "results", cpu_slots(2), PlainDisplay(Console(file=io.StringIO()))
    )
    assert outcome.states == {full: "failed", spec.runs[1].run_id: "done"}
    assert "No space left on device" in outcome.reasons[full] and outcome.exit_code() == 1


def test_a_worker_that_cannot_start_fails_its_run_only(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from relpos_ablate.runner.display import PlainDisplay
    from relpos_ablate.runner.local import cpu_slots, run_local

    for key, value in fake_env(tmp_path / "log.jsonl").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RELPOS_ABLATE_WORKER", str(tmp_path / "no_such_program"))
    spec = load_grid(write_spec(tmp_path, encodings=("xl",), seeds=(0,)))
    outcome = run_local(
        spec, tmp_path / "results", cpu_slots(1), PlainDisplay(Console(file=io.StringIO()))
    )
    (rid,) = outcome.states
    assert outcome.states[rid] == "failed" and "no_such_program" in outcome.reasons[rid]


def test_rerun_redoes_exactly_the_runs_with_broken_files(tmp_path):
    """After a finished grid: one truncated status.json, one missing eval.json, foreign files. The
    rerun launches exactly the two broken runs (which resume and end done) and ignores the rest."""
    spec_path = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1), max_steps=MAX_STEPS)
    spec, results, log = load_grid(spec_path), tmp_path / "results", tmp_path / "log.jsonl"
    assert finish(runner(spec_path, results, log)) == 0
    truncated, no_eval = (results / "g" / run.run_id for run in spec.runs[:2])
    (truncated / "status.json").write_text('{"state": "done", "st')
    (no_eval / "eval.json").unlink()
    (results / "g" / "notes.md").write_text("not a run")
    (results / "g" / "scratch").mkdir()
    (results / "g" / spec.runs[2].run_id / "stray.tmp").write_text("x")

    assert finish(runner(spec_path, results, log)) == 0
    second = [e for e in read_log(log) if e["event"] == "start"][len(spec.runs) :]
    assert sorted(e["run"] for e in second) == sorted([truncated.name, no_eval.name])
    assert all(e["start_step"] == MAX_STEPS for e in second)  # resumed from their checkpoints
    assert all(read_status(results / "g" / run.run_id)["state"] == "done" for run in spec.runs)


@pytest.mark.parametrize(
    "sig, hint",
    [
        (signal.SIGKILL, "out of memory"),
        (signal.SIGTERM, "before it could save"),
        (signal.SIGSEGV, "by hand or by the system"),
    ],
)
def test_a_worker_killed_by_a_signal_is_interrupted_with_that_signals_likely_cause(
    tmp_path, sig, hint
):
    """A real process ended by the signal, recorded as the runner records a worker that wrote no
    final state."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, signal, time; os.kill(os.getpid(), {int(sig)}); time.sleep(5)",
        ]
    )
    assert proc.wait(timeout=30) == -int(sig)
    status = record_exit(tmp_path, proc.returncode)
    assert status["state"] == "interrupted" and status["exit_code"] == -int(sig)
    assert (
        status["reason"].startswith(f"worker killed by {sig.name} (") and hint in status["reason"]
    )
    # SIGTERM is not the OOM killer's
    assert "out of memory" not in status["reason"] or sig == signal.SIGKILL
