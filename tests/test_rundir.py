"""relpos_ablate/rundir.py owns the run-directory layout: its file names appear in no other module
of the package; "done" means the same to training, the runner and `train`; every reader finds the
same run dirs (`status` and `collect`), and damaged files read as None.
Run: pytest tests/test_rundir.py -q   (about a second)
"""

import ast
import re
from pathlib import Path

import pytest

from fixtures.report_runs import make_run
from relpos_ablate import rundir
from relpos_ablate.analysis.collect import collect
from relpos_ablate.cli import main
from relpos_ablate.config import load_run_config
from relpos_ablate.runner.store import decide

PACKAGE = Path(rundir.__file__).parent
NAMES = (
    rundir.CONFIG,
    rundir.RUN_INFO,
    rundir.STATUS,
    rundir.METRICS,
    rundir.EVAL,
    rundir.LOG,
    rundir.WORKER_LOG,
    rundir.LOCK,
    rundir.CHECKPOINTS,
    rundir.LAST_CHECKPOINT,
)


def string_literals(path: Path):
    """(line, text) of every string constant in a module that is not a docstring (prose may name
    files)."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node.lineno, node.value


def test_run_dir_file_names_are_written_in_rundir_only():
    name = re.compile("|".join(rf"(?<![\w.]){re.escape(n)}(?!\w)" for n in NAMES))
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "rundir.py"
        for line, text in string_literals(path)
        if name.search(text)
    ]
    assert found == []


def test_the_scan_sees_a_literal_name():
    """The scan above is not vacuous: it finds the names where they are written."""
    assert {text for _line, text in string_literals(PACKAGE / "rundir.py")} >= set(NAMES)


def write(run_dir: Path, name: str, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_text(text)


@pytest.mark.parametrize(
    "status, eval_text, done, action",
    [
        ('{"state": "done"}', '{"settings": []}', True, "skip"),
        ('{"state": "done"}', '{"settings": [', False, "resume"),  # eval.json truncated
        ('{"state": "done"}', None, False, "resume"),
        ('{"state": "done"}', "[1, 2]", False, "resume"),
        ('{"state": "running"}', '{"settings": []}', False, "start"),
        ('{"state": "do', '{"settings": []}', False, "start"),  # status.json truncated
    ],
)
def test_done_means_the_same_to_training_and_the_runner(tmp_path, status, eval_text, done, action):
    write(tmp_path, rundir.STATUS, status)
    if eval_text is not None:
        write(tmp_path, rundir.EVAL, eval_text)
    assert rundir.is_done(tmp_path) is done
    assert decide(tmp_path, retry_failed=False)[0] == action


def test_readers_return_none_for_damaged_or_misplaced_files(tmp_path):
    (tmp_path / "file").write_text("x")
    write(tmp_path / "run", rundir.STATUS, '{"state": "bogus"}')
    (tmp_path / "run" / rundir.EVAL).mkdir()
    for run_dir in (tmp_path / "missing", tmp_path / "file", tmp_path / "run"):
        assert rundir.read_status(run_dir) is None and rundir.read_eval(run_dir) is None
        assert rundir.read_run_info(run_dir) is None and not rundir.is_done(run_dir)


def test_same_run_ignores_only_the_vocabulary_training_fills_in():
    config = load_run_config(None, ["model.attention.terms=ac"])
    filled = load_run_config(None, ["model.attention.terms=ac", "model.vocab_size=16"])
    assert rundir.same_run(config, filled) and rundir.same_run(filled, config)
    assert not rundir.same_run(
        filled, load_run_config(None, ["model.attention.terms=ac", "model.vocab_size=17"])
    )
    assert not rundir.same_run(config, load_run_config(None, ["model.attention.terms=a"]))


def test_status_and_collect_find_the_same_runs_from_any_level(tmp_path, capsys):
    """A results root, an experiment dir, one run dir, and a run claimed by a runner (only .lock
    yet)."""
    first = make_run(
        tmp_path, ["seed=0"], experiment="first", results=[({"segment_len": 32}, {"ppl": 2.0})]
    )
    second = make_run(
        tmp_path, ["seed=1"], experiment="second", results=[({"segment_len": 32}, {"ppl": 3.0})]
    )
    claimed = tmp_path / "second" / "0123456789"
    write(claimed, rundir.LOCK, "")
    expected = {
        tmp_path: [first, *sorted([claimed, second])],
        tmp_path / "second": sorted([claimed, second]),
        first: [first],
    }
    for root, runs in expected.items():
        assert rundir.find_run_dirs(root).runs == runs
        assert sorted(collect(root)["run_dir"].unique()) == sorted(map(str, runs))
        assert main(["status", str(root)]) == 0
        out = capsys.readouterr().out
        assert all(run.name in out for run in runs), out


def test_readers_read_a_finished_run(tmp_path):
    run_dir = make_run(tmp_path, ["seed=3"], results=[({"segment_len": 32}, {"ppl": 2.0})])
    assert rundir.is_done(run_dir) and rundir.read_run_info(run_dir)["run_id"] == run_dir.name
    assert rundir.read_eval(run_dir)["settings"][0]["metrics"] == {"ppl": 2.0}
    assert rundir.stored_config(run_dir) == load_run_config(None, ["model.vocab_size=16", "seed=3"])
