"""The worked example of docs/extending/new-bias.md, run exactly as printed, from a directory
outside the package: its own formula test passes; `grid`, run as the `relpos-ablate` console script
from that directory, validates it and its worker process (`relpos-ablate train`) trains it by name,
both importing `my_schemes` because the run config lists it under `imports:`; `train` through the
CLI entry point does too; without the module, each says so in one line. (Causality, memory and
kernel agreement on it: test_bias_registry.py.) Run: pytest tests/test_user_scheme.py -q   (about 20
s)
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fixtures.docs_scheme import page_block, registered_example, write_example
from fixtures.runner import tiny_base
from relpos_ablate.cli import main
from relpos_ablate.config import registry
from relpos_ablate.rundir import last_checkpoint, read_eval, read_status

REPO = Path(__file__).resolve().parent.parent
# What the `relpos-ablate` console script runs: unlike `python -m`, it does not put the working
# directory on sys.path, so finding my_schemes.py there is the registry's doing.
CONSOLE_SCRIPT = "import sys\nfrom relpos_ablate.cli import main\nsys.exit(main())\n"


def test_the_readme_shows_the_pages_scheme():
    """The README's own-scheme example is the page's my_schemes.py, not a copy that may drift."""
    assert page_block("my_schemes.py", REPO / "README.md") == page_block("my_schemes.py")


def test_the_pages_formula_test_passes(tmp_path):
    with registered_example(tmp_path):
        # the page's own test file, as pytest would import it from the reader's folder
        page_test = importlib.import_module("test_my_schemes")
        page_test.test_gaussian_is_minus_a_times_squared_distance()


def run_config(directory: Path) -> dict:
    """The worked example's gaussian.yaml on the tiny test model and task (2 steps)."""
    config = tiny_base(max_steps=2)
    readme = yaml.safe_load((directory / "gaussian.yaml").read_text())
    config["imports"] = readme["imports"]
    config["model"]["attention"] = readme["model"]["attention"]
    return config


def console_script(directory: Path, *argv: str) -> subprocess.CompletedProcess:
    """`relpos-ablate ARGV` run from `directory` as the console script runs, with only the package
    on PYTHONPATH."""
    script = directory.parent / "bin" / "relpos-ablate"
    script.parent.mkdir(exist_ok=True)
    script.write_text(CONSOLE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_trained_the_gaussian(run_dir: Path) -> None:
    """Done, config.yaml names the import, and the scheme's own parameter was trained."""
    assert read_status(run_dir)["state"] == "done", read_status(run_dir)
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (
        stored["imports"] == ["my_schemes"] and stored["model"]["attention"]["bias"] == "gaussian"
    )
    assert read_eval(run_dir)["settings"]
    state = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=False)[
        "state_dict"
    ]
    log_a = [value for key, value in state.items() if key.endswith("bias_scheme.log_a")]
    assert log_a and not torch.equal(log_a[0], torch.full_like(log_a[0], -4.0)), (
        "log_a was not trained"
    )


@pytest.fixture
def in_work_dir(tmp_path, monkeypatch):
    """The worked example's files in a fresh working directory, entered as `relpos-ablate` would be
    run from it; the registry, sys.path and sys.modules are restored afterwards."""
    work = write_example(tmp_path / "work")
    (work / "run.yaml").write_text(yaml.safe_dump(run_config(work)))
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(work))])
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    monkeypatch.delitem(sys.modules, "my_schemes", raising=False)
    yield work
    sys.modules.pop("my_schemes", None)


def test_a_grid_runs_the_docs_scheme_by_name_in_its_workers(in_work_dir, capsys):
    """The grid as the console script, then its dry-run rerun in this process from the same
    directory (the import of my_schemes through `imports:` again, without another interpreter
    importing torch for it)."""
    work = in_work_dir
    base = run_config(work)
    spec = {"name": "mine", "base": base, "grid": {"encoding": ["gaussian"]}}
    (work / "grid.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = console_script(work, "grid", "grid.yaml", "--results", "results", "--slots", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    (run_dir,) = [
        path for path in (work / "results" / "mine").iterdir() if not path.name.startswith(".")
    ]
    assert_trained_the_gaussian(run_dir)
    assert "my_schemes" not in sys.modules  # the rerun below imports it itself
    rerun = main(["grid", "grid.yaml", "--results", "results", "--slots", "1", "--dry-run"])
    out, err = capsys.readouterr()
    assert rerun == 0 and "1 skip" in out, out + err
    assert "my_schemes" in sys.modules


def test_train_runs_the_readme_config(in_work_dir):
    assert (
        main(["train", "--config", "run.yaml", "--run-dir", "runs/gaussian", "--threads", "1"]) == 0
    )
    assert_trained_the_gaussian(in_work_dir / "runs" / "gaussian")


def test_without_the_module_on_the_path_the_error_names_it_once(in_work_dir, capsys):
    (in_work_dir / "my_schemes.py").rename(in_work_dir / "elsewhere.py")
    assert main(["train", "--config", "run.yaml", "--run-dir", "runs/gaussian"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: imports[0]: cannot import 'my_schemes' (ModuleNotFoundError: No module named "
        "'my_schemes'); the module must be on PYTHONPATH or in the working directory"
    ]
    assert not (in_work_dir / "runs").exists()
    spec = {
        "base": yaml.safe_load((in_work_dir / "run.yaml").read_text()),
        "grid": {"encoding": ["alibi", "gaussian"]},
    }
    (in_work_dir / "grid.yaml").write_text(yaml.safe_dump(spec))
    assert main(["grid", "grid.yaml", "--dry-run"]) == 2
    # after the headline: the import, then what it left unknown
    problems = capsys.readouterr().err.splitlines()[1:]
    assert problems[0].startswith(
        "error: base.imports[0]: cannot import 'my_schemes' (ModuleNotFoundError"
    )
    assert sum("cannot import" in line for line in problems) == 1
    assert all(
        "'gaussian' is not registered" in line or "unknown encoding 'gaussian'" in line
        for line in problems[1:]
    )
