"""Local grid runner with a fake worker (tests/fixtures/runner.py): slots and their environment,
failures isolated and recorded, idempotent reruns, locks held by others, dry run, `status`, the
live table. Executions are counted from the fake worker's own log, not from the runner.
Run: pytest tests/runner/test_runner_local.py -q   (about 20 s)
"""

import datetime
import io
import json
import os
import subprocess
import sys
import threading
import time
from itertools import combinations

import pytest
from rich.console import Console

from fixtures.runner import fake_env, read_log, write_spec
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.display import LiveDisplay, PlainDisplay, RunRow, run_table
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.runner.local import cpu_slots, gpu_slots, run_local
from relpos_ablate.runner.store import RunLock

MAX_STEPS = 6


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Route the runner to the fake worker; returns a setter for per-seed behaviours and the log
    path."""
    log = tmp_path / "worker_log.jsonl"

    def use(behaviour=None):
        for key, value in fake_env(log, behaviour).items():
            monkeypatch.setenv(key, value)
        return log

    use()
    return use


def plain_display():
    return PlainDisplay(Console(file=io.StringIO(), width=200))


def starts(log, run=None):
    return [e for e in read_log(log) if e["event"] == "start" and run in (None, e["run"])]


def intervals(log):
    """(run, start, end, cuda) of every finished execution, from the fake worker's log."""
    begun = {}
    spans = []
    for e in read_log(log):
        if e["event"] == "start":
            begun[e["pid"]] = e
        else:
            s = begun.pop(e["pid"])
            spans.append((e["run"], s["t"], e["t"], s["cuda"]))
    return spans


def max_overlap(spans):
    """Most executions alive at one instant (sweep over start/end events)."""
    events = sorted(
        [(start, 1) for _r, start, _e, _c in spans] + [(end, -1) for _r, _s, end, _c in spans]
    )
    alive = peak = 0
    for _t, delta in events:
        alive += delta
        peak = max(peak, alive)
    return peak


def test_every_run_once_on_cpu_slots_with_threads_split(tmp_path, fake):
    log = fake({0: "await_peer"})  # seed 0's runs wait for a second one: the overlap is certain
    spec = load_grid(
        write_spec(tmp_path, encodings=("xl", "alibi", "rope"), seeds=(0, 1), max_steps=MAX_STEPS)
    )
    outcome = run_local(spec, tmp_path / "results", cpu_slots(2, cores=4), plain_display())
    assert outcome.exit_code() == 0 and set(outcome.states.values()) == {"done"}
    events = starts(log)
    assert sorted(e["run"] for e in events) == sorted(r.run_id for r in spec.runs)
    assert {(e["threads"], e["omp"], e["cuda"]) for e in events} == {(2, "2", "")}
    assert max_overlap(intervals(log)) == 2
    for run in spec.runs:
        run_dir = tmp_path / "results" / spec.name / run.run_id
        info = json.loads((run_dir / "run.json").read_text())
        # when the run was first launched (its analysis plan's record: analysis/plan_history.py)
        assert datetime.datetime.fromisoformat(info.pop("launched_at")).tzinfo is not None
        assert info == {
            "run_id": run.run_id,
            "experiment": spec.name,
            "variant": run.variant,
            "spec": os.path.relpath(spec.path.resolve(), run_dir.resolve()),
        }
        assert (
            run_dir / json.loads((run_dir / "run.json").read_text())["spec"]
        ).resolve() == spec.path.resolve()


def test_gpu_slots_map_devices_and_share_each_gpu(tmp_path, fake, monkeypatch):
    log = fake()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    slots = gpu_slots([0, 1], runs_per_device=2, cores=8)
    assert [(s.device, s.gpu, s.threads) for s in slots] == [
        ("cuda:0", "4", 2),
        ("cuda:1", "6", 2),
        ("cuda:0", "4", 2),
        ("cuda:1", "6", 2),
    ]
    spec = load_grid(write_spec(tmp_path, encodings=("xl", "alibi", "rope", "nope"), seeds=(0, 1)))
    outcome = run_local(spec, tmp_path / "results", slots, plain_display())
    assert outcome.exit_code() == 0
    spans = intervals(log)
    assert {cuda for *_rest, cuda in spans} == {"4", "6"}
    for gpu in ("4", "6"):
        assert max_overlap([s for s in spans if s[3] == gpu]) <= 2


def test_failures_are_isolated_recorded_and_rerun_is_idempotent(tmp_path, fake, capsys):
    log = fake({1: "fail", 2: "crash", 3: "sigkill"})
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0, 1, 2, 3), max_steps=MAX_STEPS)
    spec = load_grid(spec_path)
    ids = {run.config.seed: run.run_id for run in spec.runs}
    argv = ["grid", str(spec_path), "--results", str(tmp_path / "results"), "--slots", "2"]

    assert main(argv) == 1
    out = capsys.readouterr().out
    status = {seed: read_status(tmp_path / "results" / "g" / rid) for seed, rid in ids.items()}
    assert status[0]["state"] == "done"
    assert status[1]["state"] == "failed" and status[1]["reason"] == "loss is nan at step 2"
    assert status[2]["state"] == "failed" and "RuntimeError: simulated crash" in status[2]["reason"]
    assert "Traceback" in status[2]["traceback"] and status[2]["exit_code"] == 1
    assert status[3]["state"] == "interrupted" and "SIGKILL" in status[3]["reason"]
    assert status[3]["step"] == MAX_STEPS // 2
    assert all(ids[seed] in out for seed in (1, 2, 3)) and "--retry-failed" in out

    fake({})  # the faults are gone; a rerun resumes the killed run and skips the rest
    assert main(argv) == 1
    assert [len(starts(log, ids[s])) for s in range(4)] == [1, 1, 1, 2]
    assert starts(log, ids[3])[-1]["start_step"] == MAX_STEPS // 2
    assert read_status(tmp_path / "results" / "g" / ids[3])["state"] == "done"

    assert main(argv + ["--retry-failed"]) == 0
    assert [len(starts(log, ids[s])) for s in range(4)] == [1, 2, 2, 2]
    assert main(argv) == 0
    assert len(starts(log)) == 7  # a finished grid launches nothing


def test_rerunning_a_finished_grid_and_status_never_import_torch(tmp_path, fake):
    """They only read run dirs; counting GPUs for the default slots or touching the model would
    import torch (seconds at every call). Checked in a fresh process, at exit."""
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0,))
    results = tmp_path / "results"
    assert main(["grid", str(spec_path), "--results", str(results), "--slots", "1"]) == 0
    probe = (
        "import sys; from relpos_ablate.cli import main; code = main(sys.argv[1:]); "
        "print('torch imported:', 'torch' in sys.modules); sys.exit(code)"
    )
    commands = [
        (["grid", str(spec_path), "--results", str(results)], "ran 0 "),
        (["status", str(results)], "1 done"),
    ]
    for argv, says in commands:
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and says in done.stdout, done.stdout + done.stderr
        assert "torch imported: False" in done.stdout


def test_dry_run_writes_nothing_and_shows_actions(tmp_path, fake, capsys):
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0, 1))
    results = tmp_path / "results"
    assert main(["grid", str(spec_path), "--results", str(results), "--dry-run"]) == 0
    assert not results.exists() and "2 start" in capsys.readouterr().out
    spec = load_grid(spec_path)
    done_dir = results / "g" / spec.runs[0].run_id
    atomic_write_json(done_dir / "status.json", {"state": "done"})
    atomic_write_json(done_dir / "eval.json", {"settings": []})
    atomic_write_json(
        results / "g" / spec.runs[1].run_id / "checkpoints" / "last.ckpt", {"step": 3}
    )
    assert main(["grid", str(spec_path), "--results", str(results), "--dry-run"]) == 0
    assert "1 resume, 1 skip" in capsys.readouterr().out


def test_dry_run_estimates_the_wall_time(tmp_path, fake, capsys):
    """From the spec's finished runs (seconds per step of the variant), else from train_step.json;
    the runs packed on the slots; without either it says what to run."""
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0, 1, 2))
    results = tmp_path / "results"
    spec = load_grid(spec_path)
    assert (
        main(["grid", str(spec_path), "--results", str(results), "--dry-run", "--slots", "1"]) == 0
    )
    assert "no wall-time estimate" in capsys.readouterr().out
    atomic_write_json(
        results / "g" / "train_step.json",
        {"rows": [{"variant": "encoding=xl", "seconds_per_step": 10.0}]},
    )
    assert (
        main(["grid", str(spec_path), "--results", str(results), "--dry-run", "--slots", "1"]) == 0
    )
    # 3 runs x 6 steps x 10 s
    assert (
        f"3 run(s) to go on 1 slot(s): 3:00 (from {results / 'g' / 'train_step.json'}"
        in capsys.readouterr().out.replace("\n", "")
    )
    done_dir = results / "g" / spec.runs[0].run_id
    atomic_write_json(
        done_dir / "status.json", {"state": "done", "wall_time_s": 12.0, "step": MAX_STEPS}
    )
    atomic_write_json(done_dir / "eval.json", {"settings": []})
    assert (
        main(["grid", str(spec_path), "--results", str(results), "--dry-run", "--slots", "2"]) == 0
    )
    out = capsys.readouterr().out.replace("\n", "")
    # 2 s/step, 6 steps
    assert "2 run(s) to go on 2 slot(s): 0:12 (from 1 finished run(s) of this spec)" in out


def test_runs_locked_by_another_process_wait_for_it(tmp_path, fake):
    """X and Y are held by 'another runner'; Z has a lock file left by a dead process. The runner
    runs the free runs and Z, never X or Y while held; once released, done X is skipped and Y
    runs."""
    log = fake()
    spec = load_grid(write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1, 2)))
    results = tmp_path / "results"
    run_dirs = [results / "g" / run.run_id for run in spec.runs]
    x, y, z = run_dirs[:3]
    held = [RunLock(x), RunLock(y)]
    assert all(lock.try_acquire() for lock in held)
    z.mkdir(parents=True)
    (z / ".lock").write_text("pid 999999 on gone\n")

    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.update(
            result=run_local(spec, results, cpu_slots(2), plain_display(), busy_retry_s=0.2)
        )
    )
    runner.start()
    others = run_dirs[2:]
    deadline = time.monotonic() + 60
    while (
        not all((read_status(d) or {}).get("state") == "done" for d in others)
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert all((read_status(d) or {}).get("state") == "done" for d in others)
    assert starts(log, x.name) == [] and starts(log, y.name) == []
    atomic_write_json(x / "status.json", {"state": "done"})  # the other runner finished X
    atomic_write_json(x / "eval.json", {"settings": []})
    for lock in held:
        lock.release()
    runner.join(60)
    assert outcome["result"].exit_code() == 0
    assert starts(log, x.name) == [] and len(starts(log, y.name)) == 1
    assert sorted(e["run"] for e in starts(log)) == sorted(d.name for d in run_dirs[1:])


def test_status_reports_broken_and_stale_runs(tmp_path, fake, capsys):
    fake({1: "fail"})
    spec_path = write_spec(tmp_path, encodings=("xl",), seeds=(0, 1, 2, 3))
    spec = load_grid(spec_path)
    results = tmp_path / "results"
    main(["grid", str(spec_path), "--results", str(results), "--slots", "2"])
    capsys.readouterr()
    d0, d1, d2, d3 = (results / "g" / run.run_id for run in spec.runs)
    (d0 / "status.json").write_text('{"state": "do')  # truncated
    # truncated: the run is marked done, but is not
    (d3 / "eval.json").write_text('{"main_metric": "ac')
    # its process is gone
    atomic_write_json(d2 / "status.json", {"state": "running", "step": 3, "max_steps": 6})
    (results / "g" / "notes.txt").write_text("foreign file")
    (results / "g" / "empty_dir").mkdir()

    assert main(["status", str(results / "g")]) == 0
    out = capsys.readouterr().out
    row = {
        d.name: next(line for line in out.splitlines() if d.name in line) for d in (d0, d1, d2, d3)
    }
    assert "unreadable" in row[d0.name]
    assert "failed" in row[d1.name] and "loss is nan" in row[d1.name]
    assert "stale" in row[d2.name] and "3/6" in row[d2.name]
    assert [cell.strip() for cell in row[d3.name].split("│")][
        3
    ] == "incomplete"  # the state column, not done
    assert "eval.json is missing or unreadable; a rerun resumes it" in out.replace("\n", " ")
    assert main(["grid", str(spec_path), "--results", str(results), "--dry-run"]) == 0
    planned = next(line for line in capsys.readouterr().out.splitlines() if d3.name in line)
    assert "resume" in planned.split()  # the runner does what status says
    assert main(["status", str(tmp_path / "nowhere")]) == 2


def test_live_table_shows_variant_state_progress_metric():
    rows = [
        RunRow("abc", "encoding=xl seed=0", "running", "cuda:0", 30, 120, "loss 2.5", 75.0),
        RunRow("def", "encoding=rope seed=0", "queued"),
    ]
    console = Console(record=True, width=200, force_terminal=True)
    console.print(run_table(rows, live=True))
    text = console.export_text()
    for piece in (
        "encoding=xl seed=0",
        "running",
        "cuda:0",
        "30/120",
        "loss 2.5",
        "1:15",
        "queued",
    ):
        assert piece in text


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_live_table_stays_readable_from_80_columns(width):
    """Run ids, states, devices and progress whole on one line, every line within the width, the
    free text (variant, metrics, a failure's note) wrapped but all there."""
    rows = [
        RunRow(
            "9e4e79a8c3",
            "encoding=rope model.attention.terms=abcd seed=0",
            "running",
            "cpu:0-1",
            120,
            300,
            "loss 2.314 acc 0.412",
            37.0,
        ),
        RunRow(
            "5ad50b00c0",
            "encoding=t5 seed=2",
            "incomplete",
            "",
            10,
            300,
            "",
            3.0,
            "RuntimeError: the worker went away",
        ),
    ]
    console = Console(record=True, width=width, force_terminal=True)
    console.print(run_table(rows, title="grid tour", live=True))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= width
    for whole in (
        "9e4e79a8c3",
        "5ad50b00c0",
        "running",
        "incomplete",
        "cpu:0-1",
        "120/300",
        "0:37",
    ):
        assert any(whole in line for line in lines), (width, whole)
    # each column's text, top to bottom, without the spaces wrapping put in
    cells = [line.split("│")[1:-1] for line in lines if line.startswith("│")]
    columns = ["".join(row[j].replace(" ", "") for row in cells) for j in range(len(cells[0]))]
    for text in (
        "encoding=ropemodel.attention.terms=abcdseed=0",
        "loss2.314acc0.412",
        "RuntimeError:theworkerwentaway",
    ):
        assert any(text in column for column in columns), (width, text)


def test_runner_draws_the_live_table_on_a_terminal(tmp_path, fake):
    spec = load_grid(write_spec(tmp_path, encodings=("xl",), seeds=(0,)))
    out = io.StringIO()
    display = LiveDisplay(Console(file=out, width=200, force_terminal=True))
    assert run_local(spec, tmp_path / "results", cpu_slots(1), display).exit_code() == 0
    assert "grid g" in out.getvalue() and f"{MAX_STEPS}/{MAX_STEPS}" in out.getvalue()


def test_overlap_helper_counts_concurrency():
    spans = [("a", 0, 2, ""), ("b", 1, 3, ""), ("c", 2.5, 4, "")]
    assert max_overlap(spans) == 2
    assert all(
        max_overlap([s, t]) == (s[1] < t[2] and t[1] < s[2]) + 1 for s, t in combinations(spans, 2)
    )


# Invalid command lines: (flags after `grid SPEC`, a phrase of the one-line error).
BAD_FLAGS = [
    (["--devices", "0", "--slots", "2"], "exclude each other"),
    (["--slots", "0"], "--slots: 0 is out of range"),
    (["--slots", "2", "--runs-per-device", "2"], "--runs-per-device applies to GPUs"),
    (["--runs-per-device", "0"], "--runs-per-device: 0 is out of range"),
    (["--devices", "a,b"], "give GPU numbers"),
    (["--account", "lab"], "--account: only with --launcher slurm"),
    (["--launcher", "slurm", "--slots", "2"], "are for --launcher local"),
]


@pytest.mark.parametrize("flags, phrase", BAD_FLAGS)
def test_bad_flags_are_one_line_errors(tmp_path, capsys, flags, phrase):
    spec_path = write_spec(tmp_path)
    assert main(["grid", str(spec_path), "--results", str(tmp_path / "results"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert phrase in err and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "results").exists()
