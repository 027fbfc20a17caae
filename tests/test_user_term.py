"""The worked example of docs/extending/content-term.md, run exactly as printed, from a directory
outside the package: its my_terms.py imports there and registers the gated ALiBi; `relpos-ablate
train` through the CLI entry point, with a run config that lists the module under `imports:` and
the scheme under `model.attention.term_schemes`, trains the gate; a misspelt name is one line with a
did-you-mean. (The term against a float64 formula and on every kernel: the page's own runnable
blocks, tests/test_docs.py.) Run: pytest tests/test_user_term.py -q   (about 10 s)
"""

import sys
from pathlib import Path

import pytest
import torch
import yaml

from fixtures.docs_scheme import TERM_MODULE, registered_term_example, write_term_example
from fixtures.runner import tiny_base
from relpos_ablate.cli import main
from relpos_ablate.config import registry
from relpos_ablate.rundir import last_checkpoint, read_status, stored_config
from relpos_ablate.train.module import LitLM

REPO = Path(__file__).resolve().parent.parent
GATE = "gated_alibi.gate.weight"


def test_the_pages_module_registers_from_outside_the_package(tmp_path):
    with registered_term_example(tmp_path) as module:
        assert (
            Path(module.__file__).parent == tmp_path and REPO not in Path(module.__file__).parents
        )
        assert registry.term_class("gated_alibi") is module.GatedALiBi
        assert "gated_alibi" in registry.term_schemes()
        # no form beyond the dense block (and FlexAttention's point): no low_rank, no band
        assert registry.term_forms("gated_alibi") == frozenset()
    assert "gated_alibi" not in registry.term_schemes()  # nothing leaks into other tests


def run_config(directory: Path) -> dict:
    """The page's gated_alibi.yaml on the tiny test model and task (2 steps)."""
    config = tiny_base(max_steps=2)
    page = yaml.safe_load((directory / "gated_alibi.yaml").read_text())
    config["imports"] = page["imports"]
    config["model"]["attention"] = page["model"]["attention"]
    return config


@pytest.fixture
def in_work_dir(tmp_path, monkeypatch):
    """The page's files and a run config in a fresh working directory, entered as `relpos-ablate`
    would be run from it; the registry, sys.path and sys.modules are restored afterwards."""
    work = write_term_example(tmp_path / "work")
    (work / "run.yaml").write_text(yaml.safe_dump(run_config(work)))
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(work))])
    monkeypatch.setattr(registry, "_registered_terms", dict(registry._registered_terms))
    monkeypatch.delitem(sys.modules, TERM_MODULE, raising=False)
    yield work
    sys.modules.pop(TERM_MODULE, None)


def test_train_runs_the_pages_config_and_trains_the_gate(in_work_dir):
    run_dir = in_work_dir / "runs" / "gated_alibi"
    assert main(["train", "--config", "run.yaml", "--run-dir", str(run_dir), "--threads", "1"]) == 0
    assert read_status(run_dir)["state"] == "done", read_status(run_dir)
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert stored["imports"] == [TERM_MODULE]
    assert stored["model"]["attention"]["term_schemes"] == ["gated_alibi"]
    state = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=False)
    trained = {key: value for key, value in state["state_dict"].items() if key.endswith(GATE)}
    assert len(trained) == 2, sorted(state["state_dict"])  # one gate per layer of the tiny model
    # the weights the run started from, made as the trainer makes them (its seed, then the module)
    config = stored_config(run_dir)
    torch.manual_seed(config.seed)
    initial = {key: value for key, value in LitLM(config).state_dict().items() if key in trained}
    assert initial.keys() == trained.keys()
    for key, value in trained.items():
        moved = (value - initial[key]).abs().max().item()
        # changed, by no more than two Adam steps of lr 1e-3 can move it (a wrong start: ~0.1)
        assert 0 < moved < 3e-3, f"{key} moved by {moved}"


def test_a_misspelt_term_scheme_is_one_line_with_a_did_you_mean(in_work_dir, capsys):
    config = run_config(in_work_dir)
    config["model"]["attention"]["term_schemes"] = ["gated_alib"]
    (in_work_dir / "typo.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", "typo.yaml", "--run-dir", "runs/typo"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "error: model.attention.term_schemes[0]: 'gated_alib' is not registered; "
        "did you mean 'gated_alibi'? registered: fox, cope, sink_logit, grape_a, grape_ap, "
        "gated_alibi "
    ), lines[0]
    assert not (in_work_dir / "runs").exists()
