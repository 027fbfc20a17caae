"""The long-context example tasks (RULER-style niah_multikey, niah_multivalue, niah_multiquery,
variable_tracking; contextual_counting): every generated answer is what the brute-force solver
(train/data/solvers.py) reads off the prompt, over many seeds, lengths and depths; small examples
written out by hand have the answers worked out by hand; token counts, vocabulary, depths and the
config's errors; experiments/ruler_tiny.yaml trained through the CLI, its table and its depth x
length figure.
Run: pytest tests/train/test_ruler_tasks.py -q   (about half a minute)"""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fixtures.report_runs import make_run
from fixtures.sequences import unpadded
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError, DataConfig, load_run_config
from relpos_ablate.config.data import DEPTH_TASKS
from relpos_ablate.io import atomic_write_json
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.studies.length_generalization.figures import passkey_figure
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.data.examples import BOS, FILLER, KEY, SEP, generate, vocab_size
from relpos_ablate.train.data.solvers import solve
from relpos_ablate.train.run import train_run

TASKS = (
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "contextual_counting",
)
SPEC = Path(__file__).resolve().parents[2] / "experiments" / "ruler_tiny.yaml"
SHAPES = [  # needles / values / queries / hops / chains / regions, value digits, names
    {
        "niah_keys": 1,
        "niah_values": 1,
        "niah_queries": 1,
        "variable_hops": 0,
        "variable_chains": 1,
        "counting_regions": 1,
        "passkey_digits": 1,
    },
    {
        "niah_keys": 3,
        "niah_values": 10,
        "niah_queries": 2,
        "variable_hops": 3,
        "variable_chains": 3,
        "counting_regions": 3,
        "passkey_digits": 1,
        "num_keys": 12,
    },
    {},  # the defaults
]


def examples(task, seed=0, count=150, lengths=(1, 40), depth=None, **fields):
    data = DataConfig(
        task=task, train_lengths=(1, 40), test_lengths=((1, 40),), num_symbols=5, **fields
    )
    found = generate(data, seed=seed, split="eval", count=count, lengths=lengths, depth=depth)
    # (N, T + 1): the whole padded sequences
    full = torch.cat([found.inputs[:, :1], found.targets], dim=1)
    return data, found, full


# Vocabulary of the hand-written examples (examples.py): <pad> 0, <bos> 1, <sep> 2, digits 0-9 are
# 3-12, <key> is 13, then the filler symbols (num_symbols = 2: 14, 15), then the names (num_keys =
# 8: 16-23); contextual_counting: digits 3-12, bits 0 and 1 are 13 and 14, '[' 15 and ']' 16.
HAND = {"num_symbols": 2, "num_keys": 8, "passkey_digits": 2}
HAND_WRITTEN = [
    # key 17 -> 45 and key 16 -> 07 in filler; asked: 16
    ("niah_multikey", {}, [1, 14, 13, 17, 7, 8, 15, 13, 16, 3, 10, 14, 13, 16, 2], [3, 10]),
    # key 20 -> 12, 21 -> 99 (a distractor), 20 -> 30; asked: 20, its values in order of appearance
    (
        "niah_multivalue",
        {},
        [1, 13, 20, 4, 5, 14, 13, 21, 12, 12, 15, 15, 13, 20, 6, 3, 14, 13, 20, 2],
        [4, 5, 6, 3],
    ),
    # 16 -> 11, 18 -> 22, 19 -> 33; asked: 19, then 16
    (
        "niah_multiquery",
        {},
        [1, 13, 16, 4, 4, 14, 13, 18, 5, 5, 13, 19, 6, 6, 15, 13, 19, 16, 2],
        [6, 6, 4, 4],
    ),
    # chain 23 = 42, 17 = 23, 20 = 17 beside a distractor chain 18 = 77, 21 = 18; asked: 42
    (
        "variable_tracking",
        {},
        [
            1,
            13,
            23,
            7,
            5,
            14,
            13,
            18,
            10,
            10,
            13,
            17,
            23,
            15,
            13,
            21,
            18,
            13,
            20,
            17,
            14,
            13,
            7,
            5,
            2,
        ],
        [23, 17, 20],
    ),
    # asked: 77 -> 18, then 21 (the other chain's names)
    (
        "variable_tracking",
        {},
        [
            1,
            13,
            23,
            7,
            5,
            14,
            13,
            18,
            10,
            10,
            13,
            17,
            23,
            15,
            13,
            21,
            18,
            13,
            20,
            17,
            14,
            13,
            10,
            10,
            2,
        ],
        [18, 21],
    ),
    # the paper's example [ 0 ] [ 1 0 1 ] 0 [ 1 ] 1 [ ] 0 -> 0 2 1 0, two digits each
    (
        "contextual_counting",
        {"counting_regions": 4},
        [1, 15, 13, 16, 15, 14, 13, 14, 16, 13, 15, 14, 16, 14, 15, 16, 13, 2],
        [3, 3, 3, 5, 3, 4, 3, 3],
    ),
    # twelve ones in one region, ones outside it not counted: 12 -> 1 2
    (
        "contextual_counting",
        {"counting_regions": 1},
        [1, 14, 15, *[14] * 6, 13, *[14] * 6, 16, 14, 2],
        [4, 5],
    ),
]


@pytest.mark.parametrize("task, fields, prompt, answer", HAND_WRITTEN)
def test_hand_written_examples_have_the_answers_worked_out_by_hand(task, fields, prompt, answer):
    data = DataConfig(task=task, **HAND, **fields)
    assert solve(data, prompt) == answer
    assert all(0 < t < vocab_size(data) for t in prompt)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_every_generated_answer_is_the_solvers(task, shape):
    for seed in range(4):
        for depth in (None, 0.0, 0.3, 1.0) if task in DEPTH_TASKS else (None,):
            data, found, full = examples(task, seed=seed, count=60, depth=depth, **SHAPES[shape])
            for row, n in enumerate(found.lengths.tolist()):
                tokens = unpadded(full, row)
                answer = found.targets[row][found.mask[row]].tolist()
                assert answer == solve(data, tokens[: tokens.index(SEP) + 1]), (
                    f"{task} seed {seed} n {n}: {tokens}"
                )
                assert len(tokens) == data.sequence_length(n) and tokens[0] == BOS
                assert tokens[-len(answer) - 1] == SEP  # the answer is the tail after <sep>
                assert all(0 < t < vocab_size(data) for t in tokens)


@pytest.mark.parametrize("task", TASKS)
def test_the_shortest_examples_are_answerable(task):
    data, found, full = examples(task, lengths=(1, 2))
    assert set(found.lengths.tolist()) == {1, 2}
    for row in range(len(found)):
        tokens = unpadded(full, row)
        assert found.targets[row][found.mask[row]].tolist() == solve(
            data, tokens[: tokens.index(SEP) + 1]
        )


def filler_before(tokens, name, num_symbols):
    """(filler tokens before the first needle `<key> name ..`, all filler tokens) of an example's
    prompt."""
    body = tokens[1 : tokens.index(SEP)]
    at = next(i for i in range(len(body) - 1) if body[i] == KEY and body[i + 1] == name)
    filler = [i for i, t in enumerate(body) if FILLER <= t < FILLER + num_symbols]
    return sum(i < at for i in filler), len(filler)


@pytest.mark.parametrize("task", [t for t in TASKS if t in DEPTH_TASKS])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_depth_places_its_needle(task, depth):
    """round(depth·n) filler tokens come before the asked needle, the first value, the first asked
    needle, the first assignment: the first needle under the name after the question's <key>
    (variable_tracking: under the name the answer starts with)."""
    data, found, full = examples(
        task, count=80, lengths=(5, 30), depth=depth, num_keys=12, variable_chains=2
    )
    assert torch.equal(found.depths, torch.full((80,), depth, dtype=torch.float64))
    for row, n in enumerate(found.lengths.tolist()):
        tokens = unpadded(full, row)
        prompt = tokens[: tokens.index(SEP)]
        question = max(i for i, t in enumerate(prompt) if t == KEY)  # the last <key>
        name = tokens[len(prompt) + 1] if task == "variable_tracking" else prompt[question + 1]
        assert filler_before(tokens, name, data.num_symbols) == (round(depth * n), n)


def test_other_tasks_have_no_depth_and_every_depth_task_is_evaluated_depth_by_depth():
    found = generate(DataConfig(task="contextual_counting"), 0, "eval", 5, (3, 5))
    assert found.depths.isnan().all()
    config = load_run_config(
        None,
        [
            "data.task=niah_multiquery",
            "train.segment_len=74",
            "data.eval_examples=4",
            "data.test_lengths=[[1, 10], [20, 30]]",
            "data.passkey_depths=[0.0, 1.0]",
        ],
    )
    sets = build_datamodule(config).test_sets()
    assert [s.fields for s in sets] == [
        {"length_min": lo, "length_max": hi, "depth": d}
        for lo, hi in ((1, 10), (20, 30))
        for d in (0.0, 1.0)
    ]
    assert all(bool((s.examples.depths == s.fields["depth"]).all()) for s in sets)


def test_token_counts_and_vocabulary_as_laid_out():
    """Counted here from the layout: <bos>, n filler (or bits), the needles, the question, <sep>,
    the answer."""
    w, n = 3, 7
    fields = {
        "passkey_digits": w,
        "niah_keys": 3,
        "niah_values": 2,
        "niah_queries": 2,
        "variable_hops": 4,
        "variable_chains": 2,
        "counting_regions": 3,
        "counting_digits": 2,
        "num_symbols": 6,
        "num_keys": 10,
    }
    expected = {
        "niah_multikey": 1 + n + 3 * (2 + w) + 2 + 1 + w,
        "niah_multivalue": 1 + n + (2 + 2) * (2 + w) + 2 + 1 + 2 * w,
        "niah_multiquery": 1 + n + 3 * (2 + w) + 3 + 1 + 2 * w,
        "variable_tracking": 1 + n + 2 * ((2 + w) + 4 * 3) + 1 + w + 1 + 5,
        "contextual_counting": 1 + n + 2 * 3 + 1 + 3 * 2,
    }
    for task, length in expected.items():
        data = DataConfig(task=task, **fields)
        assert data.sequence_length(n) == length and data.input_length(n) == length - 1
        assert vocab_size(data) == (
            3 + 10 + 4 if task == "contextual_counting" else 3 + 10 + 1 + 6 + 10
        )


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"task": "niah_multikey", "niah_keys": 9},
            "num_keys: niah_multikey hides 9 distinct names",
        ),
        (
            {"task": "variable_tracking", "variable_chains": 2, "variable_hops": 4},
            r"num_keys: variable_tracking hides 10 distinct names .* use num_keys >= 10",
        ),
        (
            {"task": "niah_multiquery", "niah_queries": 5},
            r"niah_queries: 5 is out of range; allowed \[1, 4\]",
        ),
        (
            {"task": "niah_multivalue", "niah_values": 11, "passkey_digits": 1},
            "niah_values: 11 distinct values of passkey_digits = 1 digits do not exist; use "
            "at most 10",
        ),
        (
            {
                "task": "variable_tracking",
                "variable_chains": 2,
                "variable_hops": 1,
                "passkey_digits": 0,
            },
            r"passkey_digits: 0 is out of range; allowed \[1, 18\]",
        ),
        (
            {"task": "contextual_counting", "counting_digits": 1},
            "counting_digits: 1 digits cannot write a count of n = 40"
            r".* use counting_digits >= 2",
        ),
        (
            {"task": "contextual_counting", "counting_regions": 0},
            r"counting_regions: 0 is out of range; allowed \[1, inf\]",
        ),
        (
            {"task": "variable_tracking", "variable_hops": -1},
            r"variable_hops: -1 is out of range; allowed \[0, inf\]",
        ),
        (
            {"task": "niah_multivalue", "passkey_depths": ()},
            "passkey_depths: give at least one depth",
        ),
    ],
)
def test_bad_needle_fields_are_one_line_errors_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        DataConfig(**fields)
    assert "\n" not in str(err.value)


def depth_run(root, task, encoding, scores):
    """A done run of `task` (encoding nope or rope) whose eval.json holds scores[depth][bin]."""
    bins = [(1, 4), (5, 8)]
    absolute = {"nope": "none", "rope": "rope"}[encoding]
    overrides = [
        f"data.task={task}",
        "data.train_lengths=[1, 4]",
        "data.test_lengths=[[1, 4], [5, 8]]",
        "train.segment_len=40",
        "model.attention.terms=a",
        f"model.attention.absolute={absolute}",
    ]
    run_dir = make_run(
        root, overrides, experiment="ruler", variant={"data.task": task, "encoding": encoding}
    )
    settings = [
        {
            "segment_len": 40,
            "mem_len": 0,
            "clamp_len": None,
            "same_length": False,
            "attn_len": 40,
            "length_min": lo,
            "length_max": hi,
            "depth": depth,
            "metrics": {"exact_match": row[k], "acc": 1.0},
        }
        for depth, row in scores.items()
        for k, (lo, hi) in enumerate(bins)
    ]
    atomic_write_json(run_dir / "eval.json", {"main_metric": "exact_match", "settings": settings})


def test_the_depth_by_length_figure_draws_a_row_of_panels_per_depth_task(tmp_path):
    multikey = {0.0: [0.9, 0.5], 1.0: [0.7, 0.1]}
    depth_run(tmp_path, "niah_multikey", "nope", multikey)
    depth_run(tmp_path, "niah_multikey", "rope", {0.0: [1.0, 0.8], 1.0: [1.0, 0.6]})
    depth_run(tmp_path, "variable_tracking", "rope", {0.0: [0.2, 0.0], 1.0: [0.4, 0.1]})
    fig = passkey_figure(collect(tmp_path))
    panels = [ax for ax in fig.axes if ax.get_images()]
    # no panel for a run that is not there
    assert [ax.get_title() for ax in panels] == [
        "niah_multikey: NoPE",
        "niah_multikey: RoPE",
        "variable_tracking: RoPE",
    ]
    assert panels[0].get_ylabel() == "depth of the asked needle"
    np.testing.assert_allclose(
        np.asarray(panels[0].get_images()[0].get_array()), [multikey[0.0], multikey[1.0]]
    )
    np.testing.assert_allclose(
        np.asarray(panels[2].get_images()[0].get_array()), [[0.2, 0.0], [0.4, 0.1]]
    )


def tiny_copy_of_the_spec(directory):
    """experiments/ruler_tiny.yaml with a few steps on few examples (every task and encoding
    kept)."""
    raw = yaml.safe_load(SPEC.read_text())
    raw["base"]["data"].update({"train_examples": 32, "eval_examples": 4})
    raw["base"]["train"].update(
        {
            "max_steps": 2,
            "warmup_steps": 0,
            "log_every": 1,
            "checkpoint_every": 2,
            "accelerator": "cpu",
        }
    )
    path = directory / SPEC.name
    path.write_text(yaml.safe_dump(raw))
    return path, raw


def test_the_tiny_spec_trains_and_reports_through_the_cli_with_every_depth_task_in_the_figure(
    tmp_path, capsys
):
    """Each run trained in process as the runner's workers would (a worker process per run would
    cost ~5 s of imports each); then `grid` finds them all done, and `table` and `plot --kind
    passkey` read them."""
    spec_path, raw = tiny_copy_of_the_spec(tmp_path)
    assert raw["grid"]["data.task"] == list(TASKS)
    spec = load_grid(spec_path)
    results = tmp_path / "results" / spec.name
    for run in spec.runs:
        atomic_write_json(
            results / run.run_id / "run.json",
            {
                "run_id": run.run_id,
                "experiment": spec.name,
                "variant": run.variant,
                "spec": str(spec_path),
            },
        )
        assert train_run(run.config, results / run.run_id) == "done"
    assert (
        main(["grid", str(spec_path), "--results", str(tmp_path / "results"), "--slots", "1"]) == 0
    )
    assert "ran 0" in capsys.readouterr().out
    frame = collect(results)
    assert set(frame["data.task"]) == set(TASKS) and frame["run_dir"].nunique() == 2 * len(TASKS)
    assert frame["status"].eq("done").all() and frame["exact_match"].between(0, 1).all()
    depths = frame.groupby("data.task")["depth"].apply(lambda d: sorted(d.dropna().unique()))
    assert all(depths[t] == [0.0, 0.5, 1.0] for t in TASKS if t in DEPTH_TASKS)
    assert depths["contextual_counting"] == []
    assert main(["table", str(results)]) == 0
    assert "| task | encoding | n=1-16 | n=17-32 | OOD mean |" in capsys.readouterr().out
    assert (
        main(
            [
                "plot",
                str(results),
                "--kind",
                "passkey",
                "--formats",
                "png",
                "--out",
                str(tmp_path / "f"),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split() == [str(tmp_path / "f" / "passkey.png")]
    titles = [ax.get_title() for ax in passkey_figure(frame).axes if ax.get_images()]
    assert titles == [
        f"{task}: {name}" for task in TASKS if task in DEPTH_TASKS for name in ("NoPE", "RoPE")
    ]
