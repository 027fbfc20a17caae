"""Example tasks (train/data/examples.py): a hand-written solver per task reads each example's
prompt and gets every answer token right (100%), and lengths, masks and padding are what the config
says. Run: pytest tests/train/test_data_examples.py -q"""

import pytest
import torch

from fixtures.sequences import unpadded
from relpos_ablate.config import ConfigError, DataConfig, load_run_config
from relpos_ablate.config.data import EXAMPLE_TASKS
from relpos_ablate.train.data import build_datamodule, solvers
from relpos_ablate.train.data.examples import (
    BOS,
    FIRST,
    PAD,
    SEP,
    TrimmedSegments,
    as_streams,
    by_length,
    generate,
    vocab_size,
)

LENGTHS = (3, 9)


def sequences(task, count=200, lengths=LENGTHS, **fields):
    data = DataConfig(
        task=task, num_keys=12, train_lengths=(1, 12), test_lengths=((3, 12),), **fields
    )
    found = generate(data, seed=7, split="train", count=count, lengths=lengths)
    # (N, T + 1): the whole padded sequences
    full = torch.cat([found.inputs[:, :1], found.targets], dim=1)
    return data, found, full


def solve(task, data, tokens):
    """The answer tokens of one example, computed from its prompt alone (the task's definition)."""
    if task == "flip_flop":
        written, answers = None, []
        for op, bit in zip(tokens[1::2], tokens[2::2]):
            if op == FIRST:  # write
                written = bit
            elif op == FIRST + 1:  # read
                answers.append(written)
        return answers
    prompt = tokens[1 : tokens.index(SEP)]
    if task == "copy":
        return prompt
    if task == "reverse":
        return prompt[::-1]
    if task == "sort":
        return sorted(prompt)
    if task == "parity":
        return [FIRST + sum(t - FIRST for t in prompt) % 2]
    if task == "addition":
        plus = prompt.index(FIRST + 10)
        a, b = (
            int("".join(str(t - FIRST) for t in part))
            for part in (prompt[:plus], prompt[plus + 1 :])
        )
        digits = [FIRST + int(c) for c in str(a + b).zfill(plus + 1)]
        return digits[::-1] if data.addition_reversed else digits
    if task == "mqar":
        store = dict(zip(prompt[0::2], prompt[1::2]))
        asked = tokens[tokens.index(SEP) + 1 :][0::2]
        return [store[key] for key in asked]
    if task == "passkey":
        key = prompt.index(FIRST + 10)
        return prompt[key + 1 : key + 1 + data.passkey_digits]
    # the long-context tasks: tests/train/test_ruler_tasks.py
    return solvers.solve(data, tokens[: tokens.index(SEP) + 1])


def assert_solved(task, data, found, full):
    """Every example's marked answer tokens, non-empty, are what the solver computes from its
    prompt."""
    for row in range(len(found)):
        tokens = unpadded(full, row)
        answer = [t for t, m in zip(found.targets[row].tolist(), found.mask[row].tolist()) if m]
        assert answer and answer == solve(task, data, tokens), f"{task} example {row}: {tokens}"


@pytest.mark.parametrize(
    "task, fields", [(t, {}) for t in EXAMPLE_TASKS] + [("addition", {"addition_reversed": True})]
)
def test_a_hand_written_solver_answers_every_example(task, fields):
    assert_solved(task, *sequences(task, **fields))


@pytest.mark.parametrize("task", EXAMPLE_TASKS)
def test_the_shortest_examples_are_answerable(task):
    """n = 1 and 2 (the bottom of a train_lengths [1, max]): every answer follows from the
    prompt."""
    data, found, full = sequences(task, lengths=(1, 2))
    assert set(found.lengths.tolist()) == {1, 2}
    assert_solved(task, data, found, full)


@pytest.mark.parametrize("task", EXAMPLE_TASKS)
def test_lengths_masks_and_padding_are_what_the_config_says(task):
    data, found, full = sequences(task)
    assert set(found.lengths.tolist()) == set(range(LENGTHS[0], LENGTHS[1] + 1)), (
        "n uniform over [min, max]"
    )
    assert found.inputs.shape[1] == data.input_length(LENGTHS[1])
    read = found.inputs[:, 1:] != PAD
    # targets: the next tokens
    torch.testing.assert_close(found.inputs[:, 1:][read], found.targets[:, :-1][read])
    answer_tokens = {
        "copy": lambda n: n,
        "reverse": lambda n: n,
        "sort": lambda n: n,
        "addition": lambda n: n + 1,
        "parity": lambda n: 1,
        "mqar": lambda n: min(data.mqar_queries, n),
        "passkey": lambda n: data.passkey_digits,
        "niah_multikey": lambda n: data.passkey_digits,
        "niah_multivalue": lambda n: data.niah_values * data.passkey_digits,
        "niah_multiquery": lambda n: data.niah_queries * data.passkey_digits,
        "variable_tracking": lambda n: data.variable_hops + 1,
        "contextual_counting": lambda n: data.counting_regions * data.counting_digits,
    }
    for row, n in enumerate(found.lengths.tolist()):
        tokens = unpadded(full, row)
        assert len(tokens) == data.sequence_length(n) and tokens[0] == BOS
        assert (found.inputs[row, len(tokens) - 1 :] == PAD).all() and not found.mask[
            row, len(tokens) - 1 :
        ].any()
        assert all(FIRST <= t < vocab_size(data) for t in tokens[1:] if t != SEP)
        if task in answer_tokens:
            assert int(found.mask[row].sum()) == answer_tokens[task](n)
            if task not in ("mqar",):  # the answer is the tail, right after <sep>
                assert tokens[-answer_tokens[task](n) - 1] == SEP
        # flip_flop: one answer per read instruction; an opening write, then n instructions, the
        # last reads
        else:
            ops = tokens[1::2]
            assert len(ops) == n + 1 and ops[0] == FIRST and ops[-1] == FIRST + 1
            assert int(found.mask[row].sum()) == ops.count(FIRST + 1)


def test_mqar_keys_are_distinct_and_queries_ask_stored_keys():
    data, found, full = sequences("mqar", lengths=(12, 12))
    for row in range(len(found)):
        tokens = unpadded(full, row)
        keys = tokens[1 : tokens.index(SEP)][0::2]
        assert len(set(keys)) == len(keys) == 12
        asked = tokens[tokens.index(SEP) + 1 :][0::2]
        assert len(set(asked)) == len(asked) == data.mqar_queries and set(asked) <= set(keys)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_hides_the_key_at_its_depth(depth):
    data = DataConfig(task="passkey")
    found = generate(data, seed=0, split="eval", count=50, lengths=(10, 20), depth=depth)
    for row, n in enumerate(found.lengths.tolist()):
        sequence = found.inputs[row].tolist()
        # <bos>, then round(depth·n) filler tokens
        assert sequence.index(FIRST + 10) == 1 + round(depth * n)
    assert torch.equal(found.depths, torch.full((50,), depth, dtype=torch.float64))


def test_flip_flop_ignores_are_about_the_configured_share():
    data, found, full = sequences("flip_flop", count=400, lengths=(40, 40), flip_flop_ignore=0.8)
    ops = full[:, 1::2][:, 1:-1]  # the free instructions (not the opening write and the last read)
    assert abs(float((ops == FIRST + 2).double().mean()) - 0.8) < 0.02


def test_examples_are_generated_from_the_seed():
    data = DataConfig(task="copy")
    a = generate(data, 3, "train", 20, (2, 5))
    assert torch.equal(a.inputs, generate(data, 3, "train", 20, (2, 5)).inputs)
    assert not torch.equal(a.inputs, generate(data, 4, "train", 20, (2, 5)).inputs)
    assert not torch.equal(a.inputs, generate(data, 3, "eval", 20, (2, 5)).inputs)
    assert not torch.equal(a.inputs, generate(data, 3, "train", 20, (2, 5), stream=(1,)).inputs)


def test_as_streams_makes_each_segment_a_batch_of_whole_examples():
    data = DataConfig(task="reverse")
    found = generate(data, 1, "train", 13, (2, 4))
    inputs, targets, mask = as_streams(found, rows=4, segment_len=12)
    assert inputs.shape == (4, 3 * 12)  # 13 examples fill 3 batches of 4 rows; one left out
    example = found.padded(12)
    for r in range(4):
        for t in range(3):  # segment t is batch t: examples 4t .. 4t + 3
            torch.testing.assert_close(inputs[r, t * 12 : (t + 1) * 12], example.inputs[4 * t + r])
            torch.testing.assert_close(mask[r, t * 12 : (t + 1) * 12], example.mask[4 * t + r])
    with pytest.raises(ValueError, match="do not fit in 5 tokens"):
        found.padded(5)


def test_training_batches_are_of_about_one_length_and_cut_after_their_longest_example():
    data = DataConfig(task="copy", train_lengths=(1, 20))
    found = generate(data, 2, "train", 400, (1, 20))
    grouped = by_length(found, rows=8, seed=3)
    # 400 = 50 batches of 8: all kept
    assert sorted(grouped.lengths.tolist()) == sorted(found.lengths.tolist())
    batches = grouped.lengths.view(50, 8)
    assert int((batches.max(1).values - batches.min(1).values).max()) <= 1, (
        "20 lengths over 50 batches"
    )
    assert batches[:, 0].tolist() != sorted(batches[:, 0].tolist()), "the batch order is shuffled"
    assert torch.equal(grouped.inputs, by_length(found, rows=8, seed=3).inputs)
    streams = TrimmedSegments(*as_streams(grouped, rows=8, segment_len=41), 41)
    padded = sum(int((s[0] == PAD).sum()) for s in (streams[t] for t in range(len(streams))))
    assert padded < 0.1 * 400 * 41 / 2, "little padding left"
    for t in range(len(streams)):
        inputs, _, mask = streams[t]
        longest = int(batches[t].max())
        assert inputs.shape == (8, data.input_length(longest)) and mask.shape == inputs.shape


def test_the_datamodule_trains_on_padded_examples_and_evaluates_bin_by_bin():
    config = load_run_config(
        None,
        [
            "data.task=passkey",
            "train.segment_len=40",
            "train.batch_size=4",
            "data.train_lengths=[4, 20]",
            "data.test_lengths=[[4, 20], [30, 40]]",
            "data.passkey_depths=[0.0, 1.0]",
            "data.eval_examples=8",
            "data.train_examples=64",
        ],
    )
    module = build_datamodule(config)
    assert module.vocab_size == vocab_size(config.data)
    assert module.train_segments == 16  # 64 examples in 4 rows
    inputs, targets, mask = module.streams("train", 40)[0]
    assert inputs.shape[0] == 4 and inputs.shape[1] <= 40 and bool((inputs[:, 0] == BOS).all())
    sets = module.test_sets()
    assert [s.fields for s in sets] == [
        {"length_min": 4, "length_max": 20, "depth": 0.0},
        {"length_min": 4, "length_max": 20, "depth": 1.0},
        {"length_min": 30, "length_max": 40, "depth": 0.0},
        {"length_min": 30, "length_max": 40, "depth": 1.0},
    ]
    assert all(len(s.examples) == 8 for s in sets)
    assert [s.segment_len for s in config.eval_settings()] == [
        config.data.input_length(20),
        config.data.input_length(40),
    ]
    # an evaluation sample: the longest examples that fit
    inputs, _, _ = module.streams("eval", 30)[0]
    assert (
        inputs.shape[1] == 30
        and int((inputs[0] != PAD).sum()) == config.data.input_length(18) == 30
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.mem_len=8", "model.mem_len: example tasks are independent examples"),
        (
            "eval.settings=[{segment_len: 64}]",
            "eval.settings: example tasks are evaluated at data.test_lengths",
        ),
        (
            "train.segment_len=30",
            r"train.segment_len: 30 is shorter than the longest training example \(41 tokens: "
            r"copy at n = 20\); use 41",
        ),
        (
            "data.train_lengths=[5, 2]",
            r"data.train_lengths: \[5, 2\]: give \[min, max\] with 1 <= min <= max",
        ),
        ("data.test_lengths=[[3]]", r"data.test_lengths\[0\]: \[3\]: give \[lo, hi\]"),
        ("model.attention.positions=randomized", "model.attention.max_position: 2048"),
    ],
)
def test_bad_example_configs_are_one_line_errors(override, message):
    base = ["data.task=copy", "train.segment_len=41"]
    if "randomized" in override:
        base += ["data.test_lengths=[[1, 1100]]", "model.attention.max_position=2048"]
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, base + [override])


def test_mqar_needs_a_key_per_pair():
    with pytest.raises(ConfigError, match="num_keys: mqar draws n distinct keys, up to n = 40"):
        DataConfig(task="mqar", num_keys=8)


def test_a_process_share_of_trimmed_example_batches_is_still_trimmed():
    """Data parallelism gives each process some of the rows (select): the share keeps cutting each
    batch after its longest example."""
    rows = torch.full((4, 12), PAD)
    rows[:, :5] = 3
    segments = TrimmedSegments(rows, rows.clone(), rows != PAD, 12)
    share = segments.select(slice(0, 2))
    assert isinstance(share, TrimmedSegments)
    assert share[0][0].shape == (2, 5)
