"""The fork server (relpos_ablate/runner/forkserver.py): a forked CPU worker is the process a new
interpreter would be (session, output, stdin, lock, environment, argv, working directory,
PYTHONPATH), trains the run bit for bit as in-process training does, stops on SIGTERM as a worker
does, and dies with the server. Which runs are forked, and the grid without forking: here; a runner
SIGKILLed with forked workers: tests/runner/test_faults.py; a forked worker SIGKILLed and resumed:
tests/runner/test_runner_e2e.py; a grid driven by a script without a __main__ guard:
tests/test_user_scheme.py.
Run: pytest tests/runner/test_forkserver.py -q   (about half a minute: the server imports torch and
Lightning once)
"""

import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from fixtures.runner import fake_env, tiny_base, write_spec
from relpos_ablate.config import RunConfig, from_dict
from relpos_ablate.rundir import read_status
from relpos_ablate.runner import forkserver, local
from relpos_ablate.runner.display import PlainDisplay
from relpos_ablate.runner.forkserver import ForkedWorker, forkable
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.runner.local import cpu_slots, run_local
from relpos_ablate.runner.store import RunLock
from relpos_ablate.runner.worker import launch, record_exit, stop
from relpos_ablate.train.run import train_run

PROBE = """
import fcntl, json, os, sys
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1]) if "--run-dir" in sys.argv else None
if run_dir is not None and os.environ.get("PROBE_OUT"):
    lock = run_dir / ".lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked_elsewhere = False
    except BlockingIOError:
        locked_elsewhere = True
    os.close(fd)
    links = {n: os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{n}")}
    facts = {"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
             "stdin": links.get("0"), "stdout": links.get("1"), "stderr": links.get("2"),
             "holds_lock": str(lock.resolve()) in links.values(),
             "locked_elsewhere": locked_elsewhere,
             "omp": os.environ.get("OMP_NUM_THREADS"),
             "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
             "marker": os.environ.get("PROBE_MARKER"),
             "main": sys.modules["__main__"].__spec__.name}
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps(facts) + "\\n")
"""


@pytest.fixture
def probe(tmp_path, monkeypatch) -> Path:
    """A module of the run's `imports:` that records, in the worker, what kind of process it runs
    in; found only through PYTHONPATH, which the test sets after the server started (the child must
    read it)."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "forkprobe.py").write_text(PROBE)
    out = tmp_path / "probe.jsonl"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("PROBE_OUT", str(out))
    monkeypatch.setenv("PROBE_MARKER", "set by the test")
    monkeypatch.chdir(tmp_path)
    return out


def run_dir_with(tmp_path: Path, name: str, config: dict) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def fork_launch(run_dir: Path) -> ForkedWorker:
    lock = RunLock(run_dir)
    assert lock.try_acquire()
    proc = launch(run_dir, lock, gpu="", threads=1, device="cpu:0", fork=True)
    lock.release()  # the worker holds it now
    assert isinstance(proc, ForkedWorker)
    return proc


def steps_logged(run_dir: Path) -> int:
    """Rows of metrics.csv (a run with log_every 1: one a trained step, flushed at the start of the
    next)."""
    metrics = run_dir / "metrics.csv"
    return max(0, len(metrics.read_text().splitlines()) - 1) if metrics.exists() else 0


def wait_for_step(run_dir: Path, step: int, proc: ForkedWorker, timeout_s: float = 120) -> None:
    """Until the run has trained `step` steps, seen in metrics.csv: status.json's step is written at
    most once a second (after step 1, then a second later), which kept each test waiting that
    second."""
    deadline = time.monotonic() + timeout_s
    while steps_logged(run_dir) < step:
        assert proc.poll() is None, (run_dir / "worker.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)


def test_a_forked_worker_is_the_process_a_new_interpreter_is_and_trains_the_same_steps(
    tmp_path, probe
):
    config = {**tiny_base(max_steps=6), "imports": ["forkprobe"]}
    run_dir = run_dir_with(tmp_path, "forked", config)
    proc = fork_launch(run_dir)
    assert proc.wait(timeout=300) == 0, (run_dir / "worker.log").read_text()[-3000:]
    assert record_exit(run_dir, proc.returncode)["state"] == "done"

    (facts,) = [json.loads(line) for line in probe.read_text().splitlines()]
    assert facts["pid"] == proc.pid == read_status(run_dir)["pid"]
    assert facts["sid"] == proc.pid  # its own session: stopping the run signals its group
    assert facts["stdin"] == os.devnull
    assert facts["stdout"] == facts["stderr"] == str((run_dir / "worker.log").resolve())
    assert facts["holds_lock"] and facts["locked_elsewhere"]
    assert (facts["omp"], facts["cuda"], facts["marker"]) == ("1", "", "set by the test")
    assert facts["argv"][1:] == ["train", "--run-dir", str(run_dir), "--threads", "1"]
    assert facts["argv"][0].endswith(os.path.join("relpos_ablate", "__main__.py"))
    # as `python -m relpos_ablate`: Lightning starts ranks from it
    assert facts["main"] == "relpos_ablate.__main__"
    assert facts["cwd"] == str(tmp_path)
    log = (run_dir / "worker.log").read_text()
    # the command's own table
    assert " forked\n" in log.splitlines(keepends=True)[0] and "eval len 32" in log

    # the same run trained in this process, one thread as the worker: the same losses and evaluation
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sys.path.insert(0, str(tmp_path / "modules"))
        here = tmp_path / "here"
        assert train_run(from_dict(RunConfig, config), here) == "done"
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(tmp_path / "modules"))
    assert (run_dir / "metrics.csv").read_text() == (here / "metrics.csv").read_text()
    forked, local = (json.loads((d / "eval.json").read_text())["settings"] for d in (run_dir, here))
    assert [s["metrics"] for s in forked] == [s["metrics"] for s in local]


def test_sigterm_stops_a_forked_worker_at_a_checkpoint_and_its_status_comes_back(tmp_path):
    base = tiny_base(max_steps=2000)
    base["train"].update(log_every=1, checkpoint_every=1000)
    run_dir = run_dir_with(tmp_path, "stopped", base)
    proc = fork_launch(run_dir)
    wait_for_step(run_dir, 3, proc)
    assert stop(proc, grace_s=60) == 1  # the command's status for an interrupted run
    status = record_exit(run_dir, proc.returncode, "stopped by the test")
    assert status["state"] == "interrupted" and status["reason"] == "stopped by the test"
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert 3 <= step < 2000


def test_a_worker_dies_with_its_server_and_the_next_launch_starts_a_new_server(tmp_path):
    base = tiny_base(max_steps=2000)
    base["train"].update(log_every=1, checkpoint_every=1000)
    run_dir = run_dir_with(tmp_path, "orphan", base)
    proc = fork_launch(run_dir)
    server = forkserver._server
    wait_for_step(run_dir, 3, proc)
    # what the runner's death does to it (PR_SET_DEATHSIG)
    os.kill(server.process.pid, signal.SIGKILL)
    # what the server gave it; the worker saved and stopped
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert read_status(run_dir)["state"] == "interrupted"
    assert not server.alive

    again = run_dir_with(tmp_path, "again", tiny_base(max_steps=2))
    proc = fork_launch(again)
    assert forkserver._server is not server and proc.wait(timeout=300) == 0
    assert record_exit(again, 0)["state"] == "done"


def test_after_fork_a_child_process_starts_its_own_server(monkeypatch):
    server = object.__new__(forkserver.ForkServer)
    # stands for the socket to the parent's server: closed in the child
    server.socket = open(os.devnull)
    monkeypatch.setattr(forkserver, "_server", server)
    with server.socket:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if forkserver._server is None and server.socket.closed else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert forkserver._server is server and not server.socket.closed  # the parent keeps its own


@pytest.mark.parametrize(
    "nodes, gpu, forked",
    [
        (1, "", True),  # of a run of several processes, rank 0 (tests/train/test_ddp_faults.py)
        (2, "", False),
        (1, "0", False),
        (1, None, False),  # a GPU slot sets CUDA_VISIBLE_DEVICES before CUDA starts
    ],
)
def test_only_runs_on_cpu_slots_of_this_machine_are_forked(nodes, gpu, forked):
    assert forkable(nodes, gpu) is forked


def test_when_the_server_fails_the_runner_goes_on_with_new_interpreters(tmp_path, monkeypatch):
    """A fork that fails (the server cannot start, or dies) fails that run's launch; every later run
    of the grid starts as a new interpreter, and a rerun launches the failed one again."""
    for key, value in fake_env(tmp_path / "worker_log.jsonl").items():
        monkeypatch.setenv(key, value)
    calls = []

    def launch_or_fail(*args, fork, **kwargs):
        calls.append(fork)
        if fork:
            raise OSError("the fork server ended before it forked the worker")
        return launch(*args, fork=fork, **kwargs)

    monkeypatch.setattr(local, "launch", launch_or_fail)
    spec = load_grid(write_spec(tmp_path, encodings=("xl",), seeds=(0, 1, 2)))
    console = Console(file=io.StringIO(), width=200)
    outcome = run_local(spec, tmp_path / "results", cpu_slots(1), PlainDisplay(console))
    assert calls == [True, False, False]
    assert sorted(outcome.states.values()) == ["done", "done", "failed"]
    (failed,) = outcome.failed
    assert (
        outcome.reasons[failed]
        == "could not launch: the fork server ended before it forked the worker"
    )
    assert "every later worker starts as a new interpreter" in console.file.getvalue()
    rerun = run_local(spec, tmp_path / "results", cpu_slots(1), PlainDisplay(console))
    # tried again, by fork
    assert calls == [True, False, False, True] and rerun.states[failed] == "failed"
