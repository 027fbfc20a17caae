"""Evaluation settings that name their split: one run scored on valid and test in one eval.json
(each record checked against an evaluation written here from the files themselves), `evaluate`
adding a test setting to a trained run (and reading records written before settings named a split as
the run's eval.split), `collect`'s split column, and the one-line errors for a split a run cannot
have.

Run: .venv/bin/python -m pytest tests/train/test_eval_splits.py -q   (about 20 s)
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from relpos_ablate import load_run, rundir
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError, load_run_config
from relpos_ablate.train.run import train_run

MODEL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.dropout=0.0",
    "model.attention.terms=a",
    "model.attention.absolute=rope",
    "data.source=text",
    "data.tokenizer=char",
    "train.segment_len=16",
    "train.batch_size=4",
    "train.max_steps=4",
    "train.warmup_steps=0",
    "train.log_every=2",
    "train.checkpoint_every=4",
    "train.accelerator=cpu",
    "eval.batch_size=2",
]
BOTH = "eval.settings=[{segment_len: 16}, {segment_len: 16, split: test}]"
TEXTS = {
    "train": "the king sang to the queen of the castle at night\n" * 40,
    "valid": "a queen sang of the night\n" * 12,
    "test": "to the castle the king went singing\n" * 9,
}


def files(folder: Path) -> list[str]:
    for split, text in TEXTS.items():
        (folder / f"{split}.txt").write_text(text)
    return [f"data.{split}_file={folder / f'{split}.txt'}" for split in TEXTS] + [
        f"data.cache_dir={folder / 'cache'}"
    ]


def train(run_dir: Path, overrides: list[str]) -> Path:
    assert train_run(load_run_config(None, overrides), run_dir) == "done"
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same model (same seed: the same weights) trained twice: scored on valid only, and on
    both."""
    root = tmp_path_factory.mktemp("splits")
    data = files(root)
    valid_only = train(root / "valid_only", [*MODEL, *data, "eval.settings=[{segment_len: 16}]"])
    both = train(root / "both", [*MODEL, *data, BOTH])
    return valid_only, both


def independent_ppl(run_dir: Path, split: str) -> tuple[float, int]:
    """Perplexity and target count of the trained model on `split`, from the text itself: characters
    of the training text in code point order from id 1 (0: unknown), eval.batch_size contiguous
    streams, segments of 16 scored on their own (no memory), every next character a target."""
    config, model = load_run(run_dir)
    alphabet = sorted(set(TEXTS["train"]))
    ids = torch.tensor([alphabet.index(c) + 1 if c in alphabet else 0 for c in TEXTS[split]])
    rows = config.eval.batch_size
    streams = ids[: rows * (len(ids) // rows)].view(rows, -1)
    inputs, targets = streams[:, :-1], streams[:, 1:]
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, inputs.shape[1], 16):
            logits, _ = model(inputs[:, start : start + 16])
            losses = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2).double(), targets[:, start : start + 16], reduction="sum"
            )
            nll, count = nll + losses.item(), count + targets[:, start : start + 16].numel()
    return math.exp(nll / count), count


def test_one_run_is_scored_on_valid_and_test(runs):
    _, both = runs
    records = rundir.read_eval(both)["settings"]
    assert [r["split"] for r in records] == ["valid", "test"]
    for record in records:
        ppl, count = independent_ppl(both, record["split"])
        assert record["metrics"]["tokens"] == count
        assert record["metrics"]["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert records[0]["metrics"]["ppl"] != pytest.approx(records[1]["metrics"]["ppl"], rel=1e-3)
    frame = collect(both)
    assert frame["split"].tolist() == ["valid", "test"]


def test_evaluate_adds_a_test_setting_and_reads_old_records_as_eval_split(runs, tmp_path, capsys):
    valid_only, both = runs
    run = Path(shutil.copytree(valid_only, tmp_path / "run"))
    document = json.loads((run / rundir.EVAL).read_text())
    for record in document["settings"]:  # as written before settings named their split
        del record["split"]
    (run / rundir.EVAL).write_text(json.dumps(document))
    assert main(["evaluate", str(run), "--set", BOTH]) == 0
    # the old one is valid's
    assert "evaluated 1 setting(s), 1 already in eval.json" in capsys.readouterr().out
    added = rundir.read_eval(run)["settings"][1]
    # what training with both would have written
    assert added == rundir.read_eval(both)["settings"][1]
    # the old record reads as the run's eval.split
    assert collect(run)["split"].tolist() == ["valid", "test"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.task=offset_copy", "eval.settings=[{segment_len: 16, split: test}]"],
            "error: eval.settings[0].split: synthetic tasks have one evaluation stream",
        ),
        (
            [
                "data.source=text",
                "data.train_file=train.txt",
                "eval.settings=[{segment_len: 16}, {segment_len: 16, split: test}]",
            ],
            "error: eval.settings[1].split: 'test' with local files needs data.test_file",
        ),
        (
            ["eval.settings=[{segment_len: 16, split: dev}]"],
            "error: eval.settings[0].split: 'dev' is not allowed; choose one of valid, test",
        ),
    ],
)
def test_a_split_the_run_cannot_have_is_one_line(tmp_path, capsys, overrides, message):
    with pytest.raises(ConfigError):
        load_run_config(None, overrides)
    (tmp_path / "run.yaml").write_text("seed: 0\n")
    argv = ["train", "--config", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, *(a for o in overrides for a in ("--set", o))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_evaluate_keeps_eval_split_fixed_and_says_how_to_score_another(runs, capsys):
    assert main(["evaluate", str(runs[0]), "--set", "eval.split=test"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "eval.split: is fixed by training" in err and "split: test" in err
    )
