"""A tiny version of experiments/length_generalization.yaml, end to end as `make lengthgen` runs it:
every task of the spec with a sequential and a randomized encoding, one seed, a few steps, a small
model; then collect, `table` (bins + OOD mean and the rank summary, from the spec's table block),
`report` from summary.csv and `plot --kind lengthgen | diagnostics | passkey` on the results.
Run: pytest tests/studies/test_length_generalization_spec.py -q   (about half a minute)"""

from pathlib import Path

import pytest
import yaml

from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.train.run import train_run

SPEC = Path(__file__).resolve().parents[2] / "experiments" / "length_generalization.yaml"
SHRUNK = {
    "model": {"d_model": 16, "n_heads": 2, "d_head": 8, "d_inner": 32},
    "data": {"train_examples": 64, "eval_examples": 6},
    "train": {
        "batch_size": 8,
        "max_steps": 2,
        "warmup_steps": 0,
        "log_every": 1,
        "checkpoint_every": 2,
        "accelerator": "cpu",
    },
    "eval": {"batch_size": 6},
}


def tiny_spec(directory: Path) -> Path:
    """The shipped spec with a small model and budget, two encodings (one randomized), one seed
    and the analysis plan's families of those encodings."""
    raw = yaml.safe_load(SPEC.read_text())
    for section, fields in SHRUNK.items():
        raw["base"][section].update(fields)
    # the spec zips the encoding with T5's bucket fields
    raw["zip"] = {"encoding": ["nope", "alibi"]}
    raw["exclude"] = [{"encoding": "nope", "model.attention.positions": "randomized"}]
    raw["seeds"] = [0]
    # the plan's families of the two encodings kept; its aggregates need two seeds a cell
    raw["analysis"]["families"] = [f for f in raw["analysis"]["families"] if "ALiBi" in f["name"]]
    del raw["analysis"]["aggregate"]
    path = directory / "length_generalization.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lengthgen")
    spec_path = tiny_spec(root)
    spec = load_grid(spec_path)
    for run in spec.runs:  # in process, as the runner's workers would (run.json included)
        run_dir = root / "results" / spec.name / run.run_id
        atomic_write_json(
            run_dir / "run.json",
            {
                "run_id": run.run_id,
                "experiment": spec.name,
                "variant": run.variant,
                "spec": str(spec_path),
            },
        )
        assert train_run(run.config, run_dir) == "done"
    return root / "results" / spec.name


def test_every_run_of_the_tiny_spec_is_evaluated_bin_by_bin(results):
    frame = collect(results)
    tasks = yaml.safe_load(SPEC.read_text())["grid"]["data.task"]
    assert set(frame["data.task"]) == set(tasks) and frame["status"].eq("done").all()
    # nope, alibi, alibi with randomized positions
    assert frame["run_dir"].nunique() == len(tasks) * 3
    assert frame["exact_match"].between(0, 1).all()
    passkey = frame[frame["data.task"] == "passkey"]
    assert set(passkey["depth"]) == {0.0, 0.25, 0.5, 0.75, 1.0}


def test_the_report_commands_work_on_the_results(results, tmp_path, capsys):
    assert main(["table", str(results)]) == 0
    out = capsys.readouterr().out
    assert (
        "| task | encoding | positions | n=1-10 | n=11-15 | n=16-20 | n=21-25 | n=26-30 | OOD "
        "mean |" in out
    )
    assert "| encoding | positions | copy | reverse | flip_flop | passkey | mean rank |" in out
    assert main(["collect", str(results), "--out", str(tmp_path / "summary.csv")]) == 0
    assert main(["report", str(tmp_path / "summary.csv")]) == 0  # as the Makefile writes report.md
    report = capsys.readouterr().out
    assert "| copy | ALiBi (randomized) | 0/1 |" in report and "### Orderings" in report
    # the plan's families first, the study's own sections after them as exploratory
    planned, _, own = report.partition("## Exploratory: the report's own sections")
    assert "## Primary: Kazemnejad et al.: NoPE vs ALiBi" in planned and "### Orderings" in own
    assert "data.task=copy, length_min=11, depth=—: alibi vs nope:" in planned
    for kind in ("lengthgen", "diagnostics", "passkey"):
        assert main(["plot", str(results), "--kind", kind, "--formats", "png"]) == 0
    written = {Path(line).name for line in capsys.readouterr().out.split()}
    assert {
        "lengthgen.png",
        "passkey.png",
        "diagnostics_copy.png",
        "diagnostics_summary_passkey.png",
    } <= written
