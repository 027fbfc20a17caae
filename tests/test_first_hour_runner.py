"""A Ctrl-C on `grid` is not left logged as a SIGTERM (issue 56): the worker sees only the SIGTERM
the runner sends it and logs "stopped by SIGTERM"; the runner adds, after it, why the run was
stopped, to each log the run has (its status.json reason was already the runner's).

Run: .venv/bin/python -m pytest tests/test_first_hour_runner.py -q
"""

import json

import pytest

from relpos_ablate import rundir
from relpos_ablate.runner.local import STOP_REASONS
from relpos_ablate.runner.worker import record_exit

WORKER_LINE = (
    "2026-12-06 17:13:57 WARNING relpos_ablate.train: stopped by SIGTERM; rerun the same command "
    "to resume (at step 34)\n"
)


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_the_log_says_why_the_runner_stopped_the_run(tmp_path, signal_name):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.STATUS).write_text(
        json.dumps({"state": "interrupted", "reason": "stopped by SIGTERM; rerun the same command"})
    )
    (run / rundir.LOG).write_text(WORKER_LINE)
    status = record_exit(run, 0, STOP_REASONS[signal_name])
    assert status["reason"] == STOP_REASONS[signal_name]
    lines = (run / rundir.LOG).read_text().splitlines()
    assert lines[0] == WORKER_LINE.rstrip("\n") and len(lines) == 2
    assert lines[1].endswith(
        "WARNING relpos_ablate.runner: why the run was stopped (its worker saw only a SIGTERM): "
        + STOP_REASONS[signal_name]
    )
    assert not (run / rundir.WORKER_LOG).exists()  # a log the run does not have is not made


def test_a_run_that_was_not_stopped_gets_no_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.STATUS).write_text(json.dumps({"state": "done"}))
    (run / rundir.LOG).write_text("done\n")
    assert record_exit(run, 0)["state"] == "done"
    assert (run / rundir.LOG).read_text() == "done\n"
