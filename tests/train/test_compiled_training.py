"""train.compile: the training forward through torch.compile (Inductor generates C++ on CPU). A
how-to-run field: it changes no number beyond rounding, so not the run id. Run: pytest
tests/train/test_compiled_training.py -q"""

import csv

import torch

from fixtures.training import tiny
from relpos_ablate.config import HOW_TO_RUN, run_id
from relpos_ablate.rundir import same_run
from relpos_ablate.train.run import train_run


def test_compile_is_how_to_run_not_what():
    assert "compile" in HOW_TO_RUN
    base, compiled = tiny(), tiny("train.compile=true")
    assert run_id(compiled) == run_id(base) and same_run(compiled, base)


def losses(run_dir) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def test_a_compiled_run_trains_the_same_steps(tmp_path):
    """XL terms with memory (the block kernel runs eagerly between compiled graphs: dispatch.py),
    two steps: the losses equal the uncompiled run's up to rounding, the checkpoint keeps the
    model's own keys, and the final evaluation (uncompiled) runs. About 45 s the first time Inductor
    compiles in a process."""
    fields = [
        "model.n_layers=1",
        "model.mem_len=8",
        "train.max_steps=2",
        "train.log_every=1",
        "train.checkpoint_every=2",
        "eval.settings=[{segment_len: 16}]",
    ]
    for compile_ in (False, True):
        assert (
            train_run(
                tiny(*fields, f"train.compile={str(compile_).lower()}"), tmp_path / str(compile_)
            )
            == "done"
        )
    torch.testing.assert_close(
        losses(tmp_path / "True"), losses(tmp_path / "False"), rtol=1e-5, atol=1e-6
    )
    keys = set(
        torch.load(tmp_path / "True" / "checkpoints" / "last.ckpt", weights_only=False)[
            "state_dict"
        ]
    )
    assert keys == set(
        torch.load(tmp_path / "False" / "checkpoints" / "last.ckpt", weights_only=False)[
            "state_dict"
        ]
    )
