"""RoPE context extension on a directory of RoPE and non-RoPE runs (issue 56, first-hour defects),
on a real grid of one RoPE and one ALiBi run trained here:

- `evaluate --slots N` plans the directory as `evaluate` without slots does: a setting that only
  some runs cannot take (RoPE scaling on a run without RoPE) is recorded in theirs with its reason
  and evaluated in the others (each worker used to plan its run alone and fail);
- the default `table` (the spec's `cols: [segment_len]`) and notebooks/inspect.ipynb work on a dir
  with rope_scaling records: the unscaled settings, the caption saying what was left out;
  `--cols segment_len,rope_scaling` shows them; `--where rope_scaling=none` keeps the unscaled ones.

Run: .venv/bin/python -m pytest tests/test_first_hour_rope_scaling.py -q
"""

import csv
import io
import shutil
from pathlib import Path

import pytest

from fixtures.notebook import run_notebook
from relpos_ablate import rundir
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.settings import normalized
from relpos_ablate.cli import main

SPEC = (
    "name: tiny\nbase: {model: {d_model: 16, n_layers: 1, n_heads: 2, d_head: 8, d_inner: 32, "
    "dropout: 0.0},\n       data: {num_symbols: 8, offset: 4, train_tokens: 512, eval_tokens: "
    "128},\n       train: {segment_len: 16, batch_size: 4, max_steps: 3, warmup_steps: 0, "
    "log_every: 1,\n               checkpoint_every: 3, accelerator: cpu},\n       eval: "
    "{batch_size: 2, settings: [{segment_len: 16}]}}\ngrid: {encoding: [rope, alibi]}\n"
    "table: {rows: [encoding], cols: [segment_len]}\n"
)
YARN = "eval.settings=[{segment_len: 32, rope_scaling: yarn}]"


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """root/spec.yaml and root/results/tiny: a real grid of one RoPE and one ALiBi run (ALiBi has no
    RoPE to scale)."""
    root = tmp_path_factory.mktemp("first_hour_rope_scaling")
    (root / "spec.yaml").write_text(SPEC)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)  # the real `train` worker
        command = ["grid", str(root / "spec.yaml"), "--results", str(root / "results")]
        assert main([*command, "--slots", "2"]) == 0
    return root


@pytest.fixture(scope="module")
def scaled(grid, tmp_path_factory):
    """A copy of the grid evaluated at 32 unscaled and with YaRN: the same run and length twice."""
    root = Path(shutil.copytree(grid, tmp_path_factory.mktemp("scaled") / "root"))
    both = "eval.settings=[{segment_len: 32}, {segment_len: 32, rope_scaling: yarn}]"
    assert main(["evaluate", str(root / "results" / "tiny"), "--set", both]) == 0
    return root / "results" / "tiny"


def by_encoding(directory) -> dict[str, list[dict]]:
    """Per run (by its encoding): the records of its eval.json, results left out but the error."""
    found = {}
    for run in rundir.find_run_dirs(directory).runs:
        encoding = rundir.read_run_info(run)["variant"]["encoding"]
        found[encoding] = [
            {k: v for k, v in r.items() if k not in ("metrics", "position_loss")}
            for r in rundir.read_eval(run)["settings"]
        ]
    return found


@pytest.mark.parametrize("slots", [[], ["--slots", "2"]])
def test_slots_record_what_a_run_cannot_take_as_without_slots(
    grid, tmp_path, capsys, monkeypatch, slots
):
    monkeypatch.delenv("RELPOS_ABLATE_WORKER", raising=False)
    directory = shutil.copytree(grid / "results" / "tiny", tmp_path / "tiny")
    capsys.readouterr()
    assert main(["evaluate", str(directory), *slots, "--set", YARN]) == 0
    out, err = capsys.readouterr()
    assert "cannot take it" not in out + err
    lines = (out + err).splitlines()
    recorded = [line for line in lines if "recorded with its reason" in line]
    assert len(recorded) == 1 and "eval.settings[0].rope_scaling" in recorded[0], lines
    assert sum("evaluated 1 setting(s), 0 already in eval.json" in line for line in lines) == 2
    found = by_encoding(directory)
    # the RoPE run: the scaled setting evaluated (no error); ALiBi: its reason recorded
    rope = [r for r in found["rope"] if r.get("rope_scaling") == "yarn"]
    assert len(rope) == 1 and "error" not in rope[0]
    alibi = [r for r in found["alibi"] if r.get("rope_scaling") == "yarn"]
    assert len(alibi) == 1 and "extends RoPE" in alibi[0]["error"]


def value(frame, encoding: str, length: int, scaling, metric: str = "loss") -> float:
    """A run's metric at one setting, from collect's frame (the independent side)."""
    rows = frame[
        (frame["encoding"] == encoding)
        & (frame["segment_len"] == length)
        & frame["rope_scaling"].map(lambda v: normalized(v) == scaling)
    ]
    assert len(rows) == 1
    return float(rows[metric].iloc[0])


def table(capsys, directory, *flags) -> str:
    capsys.readouterr()
    assert main(["table", str(directory), *flags]) == 0
    return capsys.readouterr().out


def cells(capsys, directory, *flags) -> dict[tuple[str, str], float]:
    """{(row, column): mean} of the table as CSV (full precision), loss in the cells (YaRN at twice
    the length barely moves a tiny model's loss: the digits tell the two settings apart)."""
    rows = list(
        csv.DictReader(
            io.StringIO(table(capsys, directory, *flags, "--format", "csv", "--metric", "loss"))
        )
    )
    return {
        (row["encoding"], column): float(text)
        for row in rows
        for column, text in row.items()
        if column.startswith("eval len")
        and not column.endswith((" std", " n", " best", " p", " p raw"))
        and text
    }


def test_the_default_table_shows_the_unscaled_settings_and_says_so(scaled, capsys):
    frame = collect(scaled)
    out = table(capsys, scaled)
    assert out.splitlines()[0] == "| encoding | eval len 16 | eval len 32 |"
    assert (
        "Left out: 1 evaluation(s) with RoPE context extension (rope_scaling yarn); --cols "
        "segment_len,rope_scaling shows them." in out
    )
    assert cells(capsys, scaled) == {
        (encoding, f"eval len {n}"): value(frame, encoding, n, None)
        for encoding in ("rope", "alibi")
        for n in (16, 32)
    }
    assert value(frame, "rope", 32, "yarn") != value(frame, "rope", 32, None)
    # asked for: a column of its own, the ALiBi run's (its recorded reason) empty
    out = table(capsys, scaled, "--cols", "segment_len,rope_scaling")
    assert out.splitlines()[0] == (
        "| encoding | eval len 16 | eval len 32 | eval len 32, rope_scaling yarn |"
    )
    assert "Left out" not in out
    assert cells(capsys, scaled, "--cols", "segment_len,rope_scaling") == {
        **{
            (encoding, f"eval len {n}"): value(frame, encoding, n, None)
            for encoding in ("rope", "alibi")
            for n in (16, 32)
        },
        ("rope", "eval len 32, rope_scaling yarn"): value(frame, "rope", 32, "yarn"),
    }


@pytest.mark.parametrize("word", ["none", "null", "—"])
def test_where_rope_scaling_none_keeps_the_unscaled_settings(scaled, capsys, word):
    frame = collect(scaled)
    out = table(capsys, scaled, "--where", f"rope_scaling={word}")
    assert out.splitlines()[0] == "| encoding | eval len 16 | eval len 32 |"
    assert "Left out" not in out
    assert cells(capsys, scaled, "--where", f"rope_scaling={word}") == {
        (encoding, f"eval len {n}"): value(frame, encoding, n, None)
        for encoding in ("rope", "alibi")
        for n in (16, 32)
    }
    assert cells(capsys, scaled, "--where", f"rope_scaling!={word}") == {
        ("rope", "eval len 32"): value(frame, "rope", 32, "yarn")
    }


def test_the_notebook_runs_on_a_dir_with_rope_scaling_records(scaled, monkeypatch):
    frame = collect(scaled)
    rope = frame.loc[frame["encoding"] == "rope", "run_id"].iloc[0]
    nb = run_notebook(scaled, rope, monkeypatch)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o["output_type"] == "error"]
    markdown = "".join(
        o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})
    )
    assert markdown.startswith("| encoding | eval len 16 | eval len 32 |")
    assert f"{value(frame, 'rope', 32, None, 'acc'):.3f}" in markdown
    assert "RoPE context extension (rope_scaling yarn)" in markdown
    # the run's own records say which one is scaled
    html = "".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    assert "rope_scaling" in html and "yarn" in html
