"""`relpos-ablate evaluate`: new evaluation settings on trained runs, from their checkpoints.

The records `evaluate` adds are compared with those of a run that was trained with the same settings
from the start (same seed, so the same weights): every protocol (non_overlapping with memory,
sliding, xl), RoPE context extension, the RECL ladder's per-target losses, attention diagnostics,
and the test bins of an example task. Then: settings already evaluated are skipped (or replaced with
--replace), a kill during evaluation leaves eval.json as it was and a rerun finishes the job, a grid
rerun afterwards retrains nothing and keeps the added settings, and bad input is one line before
anything is computed.

Run: .venv/bin/python -m pytest tests/train/test_evaluate.py -q
"""

import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from fixtures.runner import cli_body
from relpos_ablate import load_run, rundir
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.config import load_run_config
from relpos_ablate.train import evaluate_run
from relpos_ablate.train.evaluate_run import plan_evaluation, run_evaluation
from relpos_ablate.train.run import train_run

WORDS = (
    "the of and to in is was for on that with as by at from his her which or be are an this".split()
)
ROPE = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.dropout=0.0",
    "model.mem_len=8",
    "model.attention.terms=a",
    "model.attention.absolute=rope",
    "data.source=text",
    "data.tokenizer=char",
    "train.segment_len=16",
    "train.batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=0",
    "train.log_every=2",
    "train.checkpoint_every=6",
    "train.accelerator=cpu",
    "eval.batch_size=2",
]
FIRST = "eval.settings=[{segment_len: 16}]"
NEW_SETTINGS = (
    "[{segment_len: 32}, {segment_len: 16, protocol: sliding, stride: 4}, "
    "{segment_len: 8, protocol: xl, mem_len: 24}, {segment_len: 32, rope_scaling: yarn}, "
    "{segment_len: 64, protocol: sliding, stride: 16, rope_scaling: ntk, rope_scale: 4}]"
)
ALL_SETTINGS = "[{segment_len: 16}, " + NEW_SETTINGS[1:]
LADDER = ["eval.recl_contexts=[4, 8]", "eval.recl_targets=64"]
COPY = [
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
    "data.task=copy",
    "data.train_lengths=[1, 4]",
    "train.segment_len=9",
    "data.train_examples=32",
    "data.eval_examples=7",
    "model.attention.terms=a",
    "model.attention.positions=randomized",
    "model.attention.max_position=64",
]


def corpus(folder: Path) -> list[str]:
    """Local train/valid files of word-like text (the same code path as a named corpus)."""
    rng = random.Random(0)
    for name, words in (("train.txt", 3000), ("valid.txt", 400)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(words // 12)]
        (folder / name).write_text("\n".join(lines) + "\n")
    return [f"data.train_file={folder / 'train.txt'}", f"data.valid_file={folder / 'valid.txt'}"]


def train(run_dir: Path, overrides: list[str]) -> Path:
    assert train_run(load_run_config(None, overrides), run_dir) == "done"
    return run_dir


def evaluate(*argv: str) -> int:
    return main(["evaluate", *map(str, argv)])


def settings(run_dir: Path) -> list[dict]:
    return rundir.read_eval(run_dir)["settings"]


def fields(record: dict) -> str:
    """Which setting a record is (what was found left out), as a dict key."""
    found = ("metrics", "position_loss", "diagnostics", "token_losses", "error")
    return json.dumps({k: v for k, v in record.items() if k not in found}, sort_keys=True)


def without_losses_key(record: dict) -> dict:
    """A record as the two paths must agree on it: the name of its per-target array may differ."""
    return {k: v for k, v in record.items() if k != "token_losses"}


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    """The same RoPE model with memory (same seed: the same weights) trained twice: once evaluated
    at one setting, once at every setting, the RECL ladder and diagnostics included."""
    root = tmp_path_factory.mktemp("evaluate_text")
    data = corpus(root)
    few = train(root / "few", [*ROPE, *data, FIRST])
    every = train(
        root / "every",
        [*ROPE, *data, f"eval.settings={ALL_SETTINGS}", *LADDER, "eval.diagnostics=true"],
    )
    return few, every


def test_evaluate_adds_the_records_training_would_have_written(text_runs, tmp_path):
    few, every = text_runs
    run = Path(shutil.copytree(few, tmp_path / "run"))
    before = {
        name: (run / name).read_bytes() for name in (rundir.CONFIG, rundir.STATUS, rundir.METRICS)
    }
    checkpoint = rundir.last_checkpoint(run).read_bytes()
    assert (
        evaluate(
            run,
            "--set",
            f"eval.settings={ALL_SETTINGS}",
            *[a for s in LADDER for a in ("--set", s)],
            "--set",
            "eval.diagnostics=true",
        )
        == 0
    )
    got, expected = settings(run), settings(every)
    # the first setting was in eval.json already: kept as it was (evaluated again only to add
    # diagnostics)
    assert len(got) == len(expected) == 8
    by_fields = {fields(r): r for r in expected}
    for record in got:
        assert without_losses_key(record) == without_losses_key(by_fields[fields(record)])
    assert {r["protocol"] for r in got} == {"non_overlapping", "sliding", "xl"}
    assert {r["rope_scaling"] for r in got} == {None, "yarn", "ntk"}
    losses, twin_losses = rundir.read_token_losses(run), rundir.read_token_losses(every)
    ladder = [r for r in got if r["token_losses"]]
    # memory supplies the context
    assert [(r["protocol"], r["attn_len"]) for r in ladder] == [("xl", 4), ("xl", 8)]
    for record in ladder:
        twin = next(
            r for r in expected if r["token_losses"] and r["attn_len"] == record["attn_len"]
        )
        np.testing.assert_array_equal(
            losses[record["token_losses"]], twin_losses[twin["token_losses"]]
        )
    # nothing else of the run changed
    assert {name: (run / name).read_bytes() for name in before} == before
    assert rundir.last_checkpoint(run).read_bytes() == checkpoint
    frame = collect(run)
    assert len(frame) == 8 and frame["ppl"].notna().all()


def test_settings_already_evaluated_are_skipped_unless_replace(text_runs, tmp_path, capsys):
    run = Path(shutil.copytree(text_runs[0], tmp_path / "run"))
    first = settings(run)[0]
    assert evaluate(run, "--set", "eval.settings=[{segment_len: 16}, {segment_len: 32}]") == 0
    assert "evaluated 1 setting(s), 1 already in eval.json" in capsys.readouterr().out
    assert evaluate(run, "--set", "eval.settings=[{segment_len: 32}]") == 0
    assert "nothing to evaluate" in capsys.readouterr().out
    added = settings(run)
    assert added[0] == first and len(added) == 2
    assert evaluate(run, "--replace", "--set", "eval.settings=[{segment_len: 32}]") == 0
    again = settings(run)
    assert len(again) == 2 and again[0] == first and again[1]["metrics"] == added[1]["metrics"]


def test_example_task_test_bins_equal_those_trained_with_them(tmp_path):
    """New bins of an example task (randomized positions at evaluation too: each set draws from its
    own fixed random state) equal the records of a run trained with every bin."""
    few = train(tmp_path / "few", [*COPY, "data.test_lengths=[[1, 4]]"])
    every = train(tmp_path / "every", [*COPY, "data.test_lengths=[[1, 4], [6, 8], [9, 12]]"])
    assert evaluate(few, "--set", "data.test_lengths=[[6, 8], [9, 12], [1, 4]]") == 0
    got = sorted(settings(few), key=lambda r: r["length_min"])
    assert got == settings(every)
    assert main(["evaluate", str(few), "--set", "data.eval_examples=9", "--replace"]) == 0
    assert [r["metrics"]["examples"] for r in settings(few)] == [9, 9, 9]


def test_a_kill_between_the_two_writes_leaves_eval_json_as_it_was(text_runs, tmp_path, monkeypatch):
    run = Path(shutil.copytree(text_runs[0], tmp_path / "run"))
    before = (run / rundir.EVAL).read_bytes()
    overrides = [f"eval.settings={NEW_SETTINGS}", *LADDER]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill right after token_losses.npz was written

    monkeypatch.setattr(evaluate_run, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(plan_evaluation(run, overrides))
    assert (run / rundir.EVAL).read_bytes() == before
    assert rundir.read_token_losses(run)  # written first, referenced by nothing yet
    monkeypatch.undo()
    run_evaluation(plan_evaluation(run, overrides))
    records = settings(run)
    assert len(records) == 8
    arrays = rundir.read_token_losses(run)
    assert sorted(arrays) == sorted(r["token_losses"] for r in records if r["token_losses"])


def test_sigkill_during_evaluation_then_rerun_completes(text_runs, tmp_path):
    run = Path(shutil.copytree(text_runs[0], tmp_path / "run"))
    before = (run / rundir.EVAL).read_bytes()
    slow = "eval.settings=[{segment_len: 64, protocol: sliding, stride: 1}, {segment_len: 32}]"
    argv = ["evaluate", str(run), "--set", slow, "--threads", "1"]
    # forked, as a CPU worker of `evaluate` is (of the fork server): the command as the CLI runs it
    proc = multiprocessing.get_context("fork").Process(
        target=cli_body, args=(argv, tmp_path / "evaluate.out")
    )
    proc.start()
    deadline = time.monotonic() + 60
    while "evaluate:" not in (run / rundir.LOG).read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(1).uniform(0.0, 0.5))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode in (-signal.SIGKILL, 0), (
        tmp_path / "evaluate.out"
    ).read_text()  # killed, or done before
    after = (run / rundir.EVAL).read_bytes()
    assert after == before or len(json.loads(after)["settings"]) == 3  # as it was, or complete
    assert evaluate(run, "--set", slow) == 0
    assert len(settings(run)) == 3 and all(r["metrics"]["ppl"] > 0 for r in settings(run))
    assert rundir.is_done(run)


def test_load_run_is_public_and_gives_the_trained_model(text_runs):
    config, model = load_run(text_runs[0])
    assert config.model.attention.absolute == "rope" and not model.training


def test_bad_input_is_one_line_before_anything_is_computed(
    text_runs, tmp_path, capsys, monkeypatch
):
    run = Path(shutil.copytree(text_runs[0], tmp_path / "results" / "exp" / "run"))
    before = (run / rundir.EVAL).read_bytes()
    monkeypatch.setattr(
        evaluate_run, "run_evaluation", lambda plan: pytest.fail("computed despite bad input")
    )
    cases = {
        (str(tmp_path / "nothing"),): "no run directories found",
        (str(run), "--set", "model.mem_len=16"): "model.mem_len: evaluate takes only eval.* keys",
        (str(run), "--set", "encoding=alibi"): "encoding: evaluate takes only eval.* keys",
        (str(run), "--set", "eval.batch_size=4"): "eval.batch_size: is fixed by training",
        (
            str(run),
            "--set",
            "eval.settings=[{segment_len: 0}]",
        ): f"{run}: eval.settings[0].segment_len",
        (
            str(run),
            "--set",
            "eval.settings=[{segment_len: 16, protocol: sliding}]",
        ): "needs a stride",
        (str(run), "--slots", "0"): "--slots: 0 is out of range",
        (
            str(run),
            "--set",
            "eval.settings=[{segment_len: 4000}]",
        ): "eval.settings[0].segment_len: 4000 does not fit",
        (str(run), "--set", "eval.settings=[{segment_len: 32"): "is not valid YAML",
    }
    for argv, message in cases.items():
        assert evaluate(*argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (argv, err)
    status = json.loads((run / rundir.STATUS).read_text())
    (run / rundir.STATUS).write_text(json.dumps({**status, "state": "running"}))
    assert evaluate(run) == 2
    assert "not done (its state is running)" in capsys.readouterr().err
    (run / rundir.STATUS).write_text(json.dumps(status))
    assert (run / rundir.EVAL).read_bytes() == before


def test_a_setting_the_model_cannot_take_names_the_run_and_the_field(tmp_path, capsys, monkeypatch):
    """A clamp beyond a learned R table (config check) and RoPE scaling on a model without RoPE (the
    run's model), both before anything is loaded or computed; a directory where only some runs can
    take a setting records it in the others with its reason, as training does."""
    from fixtures.report_runs import make_run

    monkeypatch.setattr(
        evaluate_run, "run_evaluation", lambda plan: pytest.fail("computed despite bad input")
    )
    shaw = make_run(
        tmp_path,
        ["model.attention.terms=ab", "model.attention.rel=learned", "model.attention.clamp_len=8"],
        results=[({"segment_len": 32}, {"ppl": 9.0})],
    )
    rundir.last_checkpoint(shaw).parent.mkdir()
    rundir.last_checkpoint(shaw).write_bytes(b"weights")
    assert evaluate(shaw, "--set", "eval.settings=[{segment_len: 32, clamp_len: 9}]") == 2
    assert (
        f"{shaw}: eval.settings[0].clamp_len: 9 exceeds the learned position table"
        in capsys.readouterr().err
    )
    assert evaluate(shaw, "--set", "eval.settings=[{segment_len: 32, rope_scaling: pi}]") == 2
    err = capsys.readouterr().err
    assert (
        f"{shaw}: eval.settings[0].rope_scaling: this run cannot take it: rope_scaling 'pi' "
        f"extends RoPE" in err
    )
    rope = make_run(
        tmp_path,
        ["model.attention.terms=a", "model.attention.absolute=rope"],
        results=[({"segment_len": 32}, {"ppl": 9.0})],
    )
    rundir.last_checkpoint(rope).parent.mkdir()
    rundir.last_checkpoint(rope).write_bytes(b"weights")
    plans, errors = evaluate_run.plan_all(
        [shaw, rope], ["eval.settings=[{segment_len: 32, rope_scaling: pi}]"]
    )
    assert not errors
    assert [[key for key, _ in plan.unsupported] for plan in plans] == [
        ["eval.settings[0].rope_scaling"],
        [],
    ]
    assert all(len(plan.todo) == 1 for plan in plans)


def test_evaluate_a_grid_on_slots_then_the_grid_rerun_trains_nothing(tmp_path, capsys, monkeypatch):
    """A real grid (two runs), evaluated on 2 slots, each run by its own worker; the grid rerun
    skips both and the added settings stay; collect and table show them. `grid` and `evaluate`
    themselves run in this process (their workers are real processes, forked from one fork server):
    another interpreter would only add an import of torch, and a runner of its own a second fork
    server importing torch and Lightning (`python -m relpos_ablate grid` end to end:
    tests/runner/test_runner_e2e.py)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: tiny\nbase: {model: {d_model: 16, n_layers: 1, n_heads: 2, d_head: 8, d_inner: 32, "
        "dropout: 0.0},\n       data: {num_symbols: 8, offset: 4, train_tokens: 512, eval_tokens: "
        "128},\n       train: {segment_len: 16, batch_size: 4, max_steps: 3, warmup_steps: 0, "
        "log_every: 1,\n               checkpoint_every: 3, accelerator: cpu},\n       eval: "
        "{batch_size: 2, settings: [{segment_len: 16}]}}\ngrid: {encoding: [xl, alibi]}\n"
    )
    results = tmp_path / "results"
    monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)  # the real `train` worker, forked
    grid = ["grid", str(spec), "--results", str(results), "--slots", "2"]
    assert main(grid) == 0, "".join(capsys.readouterr())
    new = "eval.settings=[{segment_len: 32}, {segment_len: 16, protocol: sliding, stride: 2}]"
    capsys.readouterr()
    assert evaluate(results / "tiny", "--slots", "2", "--set", new) == 0
    assert capsys.readouterr().out.count("evaluated 2 setting(s), 0 already in eval.json") == 2
    assert main(grid) == 0
    rerun = capsys.readouterr().out
    assert "ran 0 in" in rerun, rerun
    frame = collect(results / "tiny")
    assert (
        len(frame) == 6
        and sorted(frame["protocol"].tolist()) == ["non_overlapping"] * 4 + ["sliding"] * 2
    )
    assert main(["table", str(results / "tiny")]) == 0


def test_the_bias_plot_reaches_the_longest_setting_evaluate_added(tmp_path):
    from fixtures.report_runs import make_run
    from relpos_ablate.analysis.plots import attention_lengths

    run = make_run(
        tmp_path,
        ["train.segment_len=32", "eval.settings=[{segment_len: 64}]"],
        results=[
            ({"segment_len": 64}, {"ppl": 9.0}),
            ({"segment_len": 512, "attn_len": 512}, {"ppl": 9.5}),
        ],
    )
    config = rundir.stored_config(run)
    assert attention_lengths(config) == (32, 64)
    assert attention_lengths(config, run) == (32, 512)
