"""The LightningModule and what training achieves, on tiny models (d_model 32, 2 layers) on CPU.

Covers: half loss counts exactly the last half; memory carried between training segments and reset
when the streams restart; the lr schedule and weight-decay groups; evaluation metrics recomputed
independently (with memory, at 4x the training length); learning margins a broken model cannot
reach: offset-copy with terms abcd vs NoPE at 1x/4x, memory beating no memory on the repeat task,
and a char-level text run (ppl, bpc).
Run: pytest tests/train/test_train_module.py
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fixtures.training import tiny
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.module import LitLM, build_optimizer, loss_mask, lr_factor
from relpos_ablate.train.run import load_run, resolve_vocab, train_run


def module_for(config):
    config = resolve_vocab(config, build_datamodule(config).vocab_size)
    torch.manual_seed(0)
    return LitLM(config)


def test_half_loss_counts_exactly_the_last_half():
    cfg = tiny("train.loss_on=half", "train.segment_len=15")
    module = module_for(cfg)
    inputs, targets, mask = build_datamodule(cfg).streams("train", 15)[0]
    loss, _acc = module.segment_loss(inputs, targets, mask, restart=True)
    logits, _ = module.model(inputs)
    keep = mask.clone()
    keep[:, :7] = False  # L = 15: the last half is positions 7..14
    expected = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)
    assert loss_mask(torch.ones(1, 4, dtype=torch.bool), "half").tolist() == [
        [False, False, True, True]
    ]


def test_training_memory_is_carried_and_reset_when_the_streams_restart():
    """segment_loss glue; that training restarts every train_segments steps is in test_train_run."""
    cfg = tiny("model.mem_len=16")
    module = module_for(cfg)
    streams = build_datamodule(cfg).streams("train", 16)
    first, second = streams[0], streams[1]
    module.segment_loss(*first, restart=True)
    loss_with_memory, _ = module.segment_loss(*second, restart=False)
    _, mems = module.model(first[0])
    logits, _ = module.model(second[0], mems)
    torch.testing.assert_close(
        loss_with_memory, F.cross_entropy(logits[second[2]], second[1][second[2]])
    )
    loss_fresh, _ = module.segment_loss(*second, restart=True)
    logits, _ = module.model(second[0])
    torch.testing.assert_close(loss_fresh, F.cross_entropy(logits[second[2]], second[1][second[2]]))


def test_lr_warms_up_linearly_then_follows_a_cosine_to_zero():
    train = tiny("train.warmup_steps=10", "train.max_steps=110").train
    assert lr_factor(0, train) == pytest.approx(0.1)
    assert lr_factor(9, train) == pytest.approx(1.0)
    assert lr_factor(60, train) == pytest.approx(0.5)  # halfway through the 100 cosine steps
    assert lr_factor(110, train) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(60, tiny("train.schedule=constant").train) == 1.0


def test_weight_decay_applies_to_linear_weights_only():
    module = module_for(tiny())
    optimizer, _ = build_optimizer(module.model, module.config.train, torch.device("cpu"))
    decayed, plain = optimizer.param_groups
    linear = {id(m.weight) for m in module.model.modules() if isinstance(m, torch.nn.Linear)}
    assert {id(p) for p in decayed["params"]} == linear and decayed["weight_decay"] == 0.01
    assert plain["weight_decay"] == 0.0
    everything = [id(p) for p in module.model.parameters()]
    assert sorted(everything) == sorted(id(p) for g in optimizer.param_groups for p in g["params"])


def independent_eval(run_dir, segment_len, mem_len, same_length):
    """Loss and accuracy over the eval streams, memory carried by hand."""
    config, model = load_run(run_dir)
    total = correct = count = 0.0
    mems = None
    with torch.no_grad():
        for inputs, targets, mask in build_datamodule(config).streams("eval", segment_len):
            logits, mems = model(inputs, mems, mem_len=mem_len, same_length=same_length)
            total += F.cross_entropy(logits[mask], targets[mask], reduction="sum").item()
            correct += (logits.argmax(-1) == targets)[mask].sum().item()
            count += mask.sum().item()
    return total / count, correct / count, int(count)


def test_eval_json_matches_an_independent_evaluation(tmp_path):
    cfg = tiny(
        "model.mem_len=8",
        "train.max_steps=20",
        "eval.settings=[{segment_len: 16}, {segment_len: 64, mem_len: 32}, "
        "{segment_len: 32, mem_len: 32, protocol: xl}]",
    )
    assert train_run(cfg, tmp_path) == "done"
    records = json.loads((tmp_path / "eval.json").read_text())["settings"]
    assert len(records) == 3
    for record, (segment_len, mem_len, same_length) in zip(
        records, [(16, 8, False), (64, 32, False), (32, 32, True)]
    ):
        loss, acc, count = independent_eval(tmp_path, segment_len, mem_len, same_length)
        assert record["metrics"]["loss"] == pytest.approx(loss, rel=1e-5)
        assert record["metrics"]["acc"] == pytest.approx(acc)
        assert record["metrics"]["tokens"] == count
        # xl: every query sees mem_len keys
        attn_len = mem_len if same_length else segment_len + mem_len
        assert (record["mem_len"], record["attn_len"]) == (mem_len, attn_len)


def offset_copy_accuracy(tmp_path, name, *overrides):
    cfg = tiny("eval.settings=[{segment_len: 16}, {segment_len: 64}]", *overrides)
    assert train_run(cfg, tmp_path / name) == "done"
    return [
        s["metrics"]["acc"]
        for s in json.loads((tmp_path / name / "eval.json").read_text())["settings"]
    ]


def test_offset_copy_needs_relative_positions_and_they_extrapolate(tmp_path):
    chance = 1 / 8
    relative = offset_copy_accuracy(tmp_path, "abcd")
    nope = offset_copy_accuracy(tmp_path, "nope", "model.attention.terms=a")
    assert min(relative) > 0.9  # at the training length and at 4x
    assert nope[1] < 0.5 and nope[1] < relative[1] - 0.4
    assert nope[0] >= chance - 0.05  # NoPE is not broken, it just cannot locate the source


def test_memory_solves_the_repeat_task_that_a_memoryless_model_cannot(tmp_path):
    accuracy = {}
    for mem_len in (0, 32):
        cfg = tiny(
            "data.task=repeat",
            "data.period=24",
            f"model.mem_len={mem_len}",
            "train.max_steps=200",
            "eval.settings=[{segment_len: 16}]",
        )
        assert train_run(cfg, tmp_path / str(mem_len)) == "done"
        accuracy[mem_len] = json.loads((tmp_path / str(mem_len) / "eval.json").read_text())[
            "settings"
        ][0]["metrics"]["acc"]
    assert accuracy[0] < 0.25  # period 24 > segment 16: the source is out of reach (chance 1/8)
    assert accuracy[32] > 0.7


def test_char_text_run_learns_and_reports_ppl_and_bpc(tmp_path):
    words = ["alpha", "beta", "gamma", "delta"]
    lines = [" ".join(words[(i * 7 + j) % 4] for j in range(6)) for i in range(400)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    cfg = tiny(
        "data.source=text",
        f"data.train_file={tmp_path / 'train.txt'}",
        f"data.cache_dir={tmp_path / 'c'}",
        "train.max_steps=60",
        "eval.batch_size=4",
        "eval.settings=[{segment_len: 16}]",
    )
    assert train_run(cfg, tmp_path / "run") == "done"
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    metrics = result["settings"][0]["metrics"]
    vocab = load_run(tmp_path / "run")[0].model.vocab_size
    assert result["main_metric"] == "ppl"
    assert metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))
    assert metrics["bpc"] == pytest.approx(metrics["loss"] / math.log(2))
    assert metrics["ppl"] < vocab / 3  # far below a uniform guess over the characters
