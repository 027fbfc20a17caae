"""Synthetic tasks and the stream layout, checked against brute-force loops over the raw streams.

Covers: offset_copy / recall / repeat targets and masks, determinism and split independence, the
"batch t = segment t of every stream" layout, cyclic training segments and the resume sampler.
Run: pytest tests/train/test_data_synthetic.py
"""

import pytest
import torch

from relpos_ablate.config import load_run_config
from relpos_ablate.train.data import build_datamodule, sample_inputs
from relpos_ablate.train.data.streams import (
    ResumeSampler,
    SegmentStreams,
    TrainingSegments,
    batchify,
)
from relpos_ablate.train.data.synthetic import generate, vocab_size


def config(*overrides):
    return load_run_config(
        None,
        [
            "train.segment_len=16",
            "train.batch_size=3",
            "data.train_tokens=160",
            "data.eval_tokens=128",
            "eval.batch_size=2",
            *overrides,
        ],
    )


def segments(cfg, split="train", segment_len=16):
    return list(build_datamodule(cfg).streams(split, segment_len))


def test_batch_t_holds_segment_t_of_every_stream():
    cfg = config()
    task = generate(cfg.data, cfg.seed, "train", 3, 160)
    batches = segments(cfg)
    assert len(batches) == 10
    for t, (inputs, targets, mask) in enumerate(batches):
        assert inputs.shape == targets.shape == mask.shape == (3, 16)
        assert inputs.dtype == torch.long and mask.dtype == torch.bool
        assert torch.equal(inputs, task.inputs[:, 16 * t : 16 * (t + 1)])
    # Concatenating a row's segments gives back its stream: rows are contiguous streams.
    assert torch.equal(torch.cat([b[0][1] for b in batches]), task.inputs[1])


def test_offset_copy_target_is_the_input_offset_back_within_the_segment():
    cfg = config("data.offset=5", "data.num_symbols=7")
    for inputs, targets, mask in segments(cfg):
        for b in range(3):
            for t in range(16):
                assert mask[b, t] == (t >= 5)
                if t >= 5:
                    assert targets[b, t] == inputs[b, t - 5]
    assert vocab_size(cfg.data) == 7


def test_recall_counts_exactly_the_queries_answerable_from_the_segment():
    cfg = config(
        "data.task=recall", "data.num_keys=3", "data.num_symbols=4", "data.rebind_every=24"
    )
    n_pairs = 3 * 4
    counted = 0
    for inputs, targets, mask in segments(cfg, segment_len=32):
        for b in range(3):
            row = inputs[b].tolist()
            for t, token in enumerate(row):
                if token < n_pairs:
                    assert not mask[b, t]
                    continue
                key = token - n_pairs
                stored = {p for p in row[:t] if p < n_pairs and p // 4 == key}
                expected = len(stored) == 1 and stored == {targets[b, t].item()}
                assert bool(mask[b, t]) == expected, (b, t)
                counted += expected
    assert counted > 50  # the task is not vacuous
    assert vocab_size(cfg.data) == n_pairs + 3


def test_recall_target_is_the_pair_of_the_current_map():
    cfg = config(
        "data.task=recall", "data.num_keys=3", "data.num_symbols=4", "data.rebind_every=24"
    )
    task = generate(cfg.data, cfg.seed, "train", 3, 160)
    for b in range(3):
        row, tgt = task.inputs[b].tolist(), task.targets[b].tolist()
        for t, token in enumerate(row):
            episode = range(t - t % 24, t)
            same_key = [row[s] for s in episode if row[s] < 12 and row[s] // 4 == token - 12]
            if token >= 12 and same_key:
                assert tgt[t] == same_key[-1]
                assert len(set(same_key)) == 1  # one value per key within an episode


def test_repeat_targets_repeat_the_block_period_back():
    cfg = config("data.task=repeat", "data.period=24")
    task = generate(cfg.data, cfg.seed, "train", 3, 480)
    inputs, targets, mask = task.inputs, task.targets, task.mask
    assert torch.equal(targets[:, :-1], inputs[:, 1:])  # next-token targets
    for t in range(480):
        in_repeat = (t + 1) % 48 >= 24
        assert bool(mask[0, t]) == in_repeat
        if in_repeat:
            assert torch.equal(targets[:, t], inputs[:, t + 1 - 24])
    assert mask.float().mean().item() == 0.5  # 10 whole (block, repetition) pairs


@pytest.mark.parametrize("task", ["offset_copy", "recall", "repeat"])
def test_streams_are_deterministic_and_splits_independent(task):
    cfg = config(f"data.task={task}")
    a = generate(cfg.data, 0, "train", 2, 128)
    b = generate(cfg.data, 0, "train", 2, 128)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, generate(cfg.data, 0, "eval", 2, 128).inputs)
    assert not torch.equal(a.inputs, generate(cfg.data, 1, "train", 2, 128).inputs)


def test_eval_streams_follow_the_eval_setting_length_and_batch():
    cfg = config()
    dm = build_datamodule(cfg)
    long = dm.streams("eval", 64)
    assert long.rows == 2 and len(long) == 2 and long[0][0].shape == (2, 64)
    short = dm.streams("eval", 32)
    assert torch.equal(long[0][0][:, 32:], short[1][0])  # same tokens, cut differently
    assert torch.equal(sample_inputs(cfg, 32, batch_size=1), short[0][0][:1])


def test_training_loader_cycles_the_streams_and_resumes_at_the_step():
    streams = SegmentStreams(
        torch.arange(12).view(1, 12),
        torch.arange(12).view(1, 12),
        torch.ones(1, 12, dtype=torch.bool),
        segment_len=4,
    )
    cyclic = TrainingSegments(streams, steps=7, loss_on="full")
    assert [cyclic[i].inputs[0, 0].item() for i in range(7)] == [0, 4, 8, 0, 4, 8, 0]
    step = {"now": 5}
    sampler = ResumeSampler(7, start=lambda: step["now"])
    assert len(sampler) == 7 and list(sampler) == [5, 6]


def test_train_dataloader_has_max_steps_batches():
    cfg = config("train.max_steps=25")
    loader = build_datamodule(cfg).train_dataloader()
    batches = list(loader)
    assert len(loader) == len(batches) == 25
    assert torch.equal(batches[10][0], batches[0][0])  # 10 segments per stream: wraps at step 10


def test_batchify_makes_contiguous_next_token_rows():
    inputs, targets = batchify(torch.arange(23), rows=3)
    assert inputs.tolist() == [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12], [14, 15, 16, 17, 18, 19]]
    assert torch.equal(targets, inputs + 1)
