"""Training and evaluating example tasks end to end (tiny runs): eval.json has one record per test
bin with exact match and per-token accuracy on the answers, recomputed here example by example from
the trained model; the attention diagnostics come from the evaluation's own forward (one per batch),
for example tasks and for streams alike; randomized positions train and evaluate.
Run: pytest tests/train/test_train_examples.py -q"""

import pytest
import torch

from relpos_ablate import rundir
from relpos_ablate.analysis import collect
from relpos_ablate.config import load_run_config
from relpos_ablate.model import TransformerLM
from relpos_ablate.model.diagnostics import AttentionStatistics
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.evaluation import evaluate_examples
from relpos_ablate.train.run import load_run, train_run

TINY = [
    "model.d_model=16",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_head=8",
    "model.d_inner=32",
    "model.dropout=0.0",
    "train.batch_size=4",
    "train.max_steps=3",
    "train.warmup_steps=0",
    "train.log_every=1",
    "train.checkpoint_every=3",
    "train.accelerator=cpu",
    "eval.batch_size=3",
    "eval.diagnostics=true",
]
COPY = [
    *TINY,
    "data.task=copy",
    "data.train_lengths=[1, 4]",
    "data.test_lengths=[[1, 4], [6, 8]]",
    "train.segment_len=9",
    "data.train_examples=32",
    "data.eval_examples=7",
    "model.attention.terms=a",
    "model.attention.bias=alibi",
]


def trained(tmp_path, overrides):
    config = load_run_config(None, overrides)
    assert train_run(config, tmp_path / "run") == "done"
    return load_run(tmp_path / "run"), rundir.read_eval(tmp_path / "run")


def test_example_task_records_exact_match_and_accuracy_per_bin(tmp_path):
    (config, model), results = trained(tmp_path, COPY)
    assert results["main_metric"] == "exact_match"
    sets = build_datamodule(config).test_sets()
    assert [(s["length_min"], s["length_max"]) for s in results["settings"]] == [(1, 4), (6, 8)]
    for record, test_set in zip(results["settings"], sets):
        examples = test_set.examples
        exact = right = tokens = 0
        for row in range(len(examples)):  # one example at a time, unpadded
            width = int((examples.inputs[row] != 0).sum())
            with torch.no_grad():
                logits, _ = model(examples.inputs[row : row + 1, :width])
            mask = examples.mask[row, :width]
            correct = logits[0].argmax(-1)[mask] == examples.targets[row, :width][mask]
            exact, right, tokens = (
                exact + bool(correct.all()),
                right + int(correct.sum()),
                tokens + int(mask.sum()),
            )
        metrics = record["metrics"]
        assert metrics["examples"] == 7 and metrics["tokens"] == tokens == int(examples.mask.sum())
        assert metrics["exact_match"] == pytest.approx(exact / 7) and metrics[
            "acc"
        ] == pytest.approx(right / tokens)
        assert record["segment_len"] == config.data.input_length(record["length_max"])
        assert set(record["diagnostics"]) == {"entropy", "sink", "distance", "unseen"}
        assert all(len(layer) == 2 for layer in record["diagnostics"]["entropy"])
    frame = collect(tmp_path)
    assert frame["length_min"].tolist() == [1, 6] and frame["exact_match"].notna().all()


def test_diagnostics_come_from_the_one_evaluation_forward(tmp_path, monkeypatch):
    (config, model), results = trained(tmp_path, COPY)
    calls = []
    forward = TransformerLM.forward
    monkeypatch.setattr(
        TransformerLM, "forward", lambda self, *a, **k: calls.append(k) or forward(self, *a, **k)
    )
    again = evaluate_examples(model, build_datamodule(config), config)
    assert len(calls) == 3 + 3  # two bins of 7 examples in batches of 3: one forward per batch
    assert all(k["statistics"] is not None for k in calls)
    assert again["settings"] == results["settings"]


def test_stream_evaluation_records_the_diagnostics_of_its_own_batches(tmp_path):
    overrides = [
        *TINY,
        "data.task=offset_copy",
        "data.offset=2",
        "data.train_tokens=256",
        "data.eval_tokens=64",
        "train.segment_len=8",
        "eval.settings=[{segment_len: 8}, {segment_len: 16}]",
    ]
    (config, model), results = trained(tmp_path, overrides)
    module = build_datamodule(config)
    for setting, record in zip(config.eval_settings(), results["settings"]):
        sums, count = torch.zeros(4, 2, 2, dtype=torch.float64), 0.0
        # no memory: segments are independent
        for inputs, _, mask, _ in module.eval_dataloader(setting):
            with torch.no_grad():
                model(
                    inputs,
                    statistics=AttentionStatistics(
                        2, 2, mask, config.train.segment_len - 1, sums=sums
                    ),
                )
            count += float(mask.sum())
        expected = (sums / count).tolist()
        for k, name in enumerate(("entropy", "sink", "distance", "unseen")):
            torch.testing.assert_close(
                torch.tensor(record["diagnostics"][name]),
                torch.tensor(expected[k]),
                rtol=1e-5,
                atol=1e-6,
            )
    # at the training length
    assert max(max(layer) for layer in results["settings"][0]["diagnostics"]["unseen"]) == 0.0


def test_randomized_positions_train_and_evaluate_an_example_task(tmp_path):
    (config, _), results = trained(
        tmp_path, [*COPY, "model.attention.positions=randomized", "model.attention.max_position=64"]
    )
    assert config.model.attention.positions == "randomized"
    assert all(0.0 <= s["metrics"]["exact_match"] <= 1.0 for s in results["settings"])
    assert all(max(map(max, s["diagnostics"]["unseen"])) == 0.0 for s in results["settings"]), (
        "training drew distances up to max_position - 1: none is unseen"
    )


def test_a_bin_beyond_a_learned_table_is_recorded_not_evaluated(tmp_path):
    (_, _), results = trained(
        tmp_path,
        [
            *COPY,
            "model.attention.bias=none",
            "model.attention.absolute=learned",
            "model.attention.max_position=12",
        ],
    )
    first, second = results["settings"]
    assert first["metrics"]["examples"] == 7 and "error" not in first
    assert (
        second["metrics"] == {} and "learned absolute positions cover 12 tokens" in second["error"]
    )
