"""Tiny versions of the committed reproductions (README "Reproductions"): runs of each spec shrunk
to a 1-layer d_model 16 model, 2 training steps and a few hundred evaluation targets per setting,
trained in process on the shipped corpus with the spec's own encodings and evaluation settings
(protocols, RECL ladder), then the report `make repro-*` writes: collect, the tables, the figures.

Run: .venv/bin/python -m pytest tests/studies/test_reproductions.py -q   (about 30 s)
"""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest

from fixtures.training import EVAL_TARGETS, shrink
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.plots import extrapolation_figure
from relpos_ablate.analysis.positions import position_loss_figure
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.io import atomic_write_json
from relpos_ablate.runner.grid import load_grid
from relpos_ablate.studies import make_report, make_table
from relpos_ablate.train.run import train_run

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
"""Targets per ordinary setting (300 per stream: a 1024-token window is one padded window)."""
KEPT = {  # the variants each tiny version trains
    # the paper's four (its analysis plan's primary families and aggregates) and XL
    "alibi_extrapolation_cpu": lambda v: v["encoding"] in ("vaswani", "rope", "t5", "alibi", "xl"),
    "xl_table6_cpu": lambda v: (
        v["seed"] == 0
        and (v["encoding"], v["model.mem_len"], v["train.loss_on"])
        in {("xl", 48, "full"), ("shaw", 48, "full"), ("xl", 0, "full"), ("vaswani", 0, "half")}
    ),
}


@functools.cache
def trained(name: str, root: Path) -> Path:
    """results/<name>/ of the tiny version, with run.json pointing at the spec as the runner writes
    it."""
    spec = load_grid(EXPERIMENTS / f"{name}.yaml")
    results = root / name
    for run in (r for r in spec.runs if KEPT[name](r.variant)):
        run_dir = results / run.run_id
        atomic_write_json(
            run_dir / "run.json",
            {
                "run_id": run.run_id,
                "experiment": name,
                "variant": run.variant,
                "spec": str(EXPERIMENTS / f"{name}.yaml"),
            },
        )
        assert train_run(shrink(run.config, root / "cache"), run_dir) == "done"
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("repro")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_extrapolation_report(root):
    results = trained("alibi_extrapolation_cpu", root)
    df = collect(results)
    assert df.attrs["problems"] == [] and set(df["status"]) == {"done"}
    scored = df[df["eval_error"].isna()]
    # every protocol and length scores the same targets
    assert set(scored["tokens"]) == {EVAL_TARGETS}
    # RoPE context extension: only the RoPE model evaluates it
    skipped = df[df["eval_error"].notna()]
    assert (
        set(skipped["encoding"]) == {"vaswani", "t5", "alibi", "xl"}
        and skipped["rope_scaling"].notna().all()
    )
    rope = scored[scored["encoding"] == "rope"].groupby("run_id")["rope_scaling"]
    # per RoPE run: 16 settings, 6 extended
    assert set(rope.size()) == {16} and set(rope.count()) == {6}
    table, options = make_table(df)
    assert (
        options.cols == ("protocol", "segment_len", "stride", "rope_scaling")
        and options.metric == "ppl"
    )
    # the spec's order
    assert [labels[0] for labels, _ in table.rows] == ["vaswani", "rope", "t5", "alibi", "xl"]
    assert len(table.columns) == 16 and table.columns[-1] == "sliding, eval len 1024, stride 64"
    assert table.columns[3:6] == [
        f"non_overlapping, eval len 256, rope_scaling {k}" for k in ("ntk", "pi", "yarn")
    ]
    assert "Tokens scored per setting: 600." in table.caption
    figure = extrapolation_figure(df, y="ratio")  # as make repro-extrapolation draws it
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title().split(" — ")[0] for ax in panels[:2]] == [
        "non_overlapping",
        "sliding, stride 64",
    ]
    drawn = [
        {line.get_label() for line in ax.get_lines() if line.get_marker() == "o"} for ax in panels
    ]
    legends = [
        legend for legend in [*figure.legends, *(ax.get_legend() for ax in panels)] if legend
    ]
    # "a / b (overlap)"
    named = " | ".join(text.get_text() for legend in legends for text in legend.get_texts())
    # rope_scale (auto) moves with x
    extended = {f"rope, rope_scaling {kind}" for kind in ("ntk", "pi", "yarn")}
    # extensions: non-overlapping only
    assert all(name in named for name in extended) and not extended & drawn[1]
    assert all(name in named for name in ("vaswani", "rope", "t5", "alibi", "xl"))
    report = make_report(df)
    assert "alibi_extrapolation_cpu: derived numbers" in report
    # the spec's plan: Press et al.'s families on loss, paired within an encoding, Welch across
    planned = report.partition("## Exploratory: the report's own sections")[0]
    assert "## Primary: Press et al.: the paper's four encodings at nL vs at L" in planned
    assert "encoding=alibi: segment_len=1024 " in planned and "paired t-test" in planned
    assert "segment_len=1024: t5 " in planned and "Welch's t-test" in planned
    assert "- **ALiBi vs T5, 2L-16L**, on loss" in planned
    positions = position_loss_figure(df)
    panels = [ax for ax in positions.axes if ax.get_visible()]
    # the sliding panels past L keep the positions every window scores, one log bin: left out
    titles = [ax.get_title() for ax in panels]
    assert all(t.startswith("non_overlapping") for t in titles[:5]) and len(titles) <= 6
    names = {text.get_text() for text in positions.legends[0].get_texts()}
    assert {
        "rope",
        "rope, ntk",
        "rope, pi",
        "rope, yarn",
    } <= names  # an extension is a line, not averaged in


def test_xl_tables_report(root):
    results = trained("xl_table6_cpu", root)
    df = collect(results)
    table6, _ = make_table(df)  # the spec's table block: layout xl_table6
    assert table6.columns == ["PPL init", "PPL best", "Attn Len"]
    rows = [tuple(labels) for labels, _ in table6.rows]
    assert rows == [
        ("✓", "xl", "Full"),
        ("✓", "shaw", "Full"),
        ("✗", "xl", "Full"),
        ("✗", "vaswani", "Half"),
    ]
    assert all(values[0] is not None for _, values in table6.rows), (
        "PPL init at the training attention length"
    )
    assert "Protocol xl (2 rows)" in table6.caption and "sliding (2 rows)" in table6.caption
    table8, _ = make_table(df, TableOptions(layout="xl_table8"))
    assert [tuple(labels) for labels, _ in table8.rows] == rows
    ladder = load_grid(EXPERIMENTS / "xl_table6_cpu.yaml").runs[0].config.eval.recl_contexts
    assert table8.columns == ["r = 0.1", "r = 0.5", "r = 1.0", *(f"ppl c={c}" for c in ladder)]
    assert f"contexts c = {', '.join(map(str, ladder))}" in table8.caption
    # 2 streams x (260 - 256 + 1) targets
    assert "the 10 with 256 tokens of context" in table8.caption
    # one seed
    assert all(re.fullmatch(r"≥?\d+", value) for _, values in table8.rows for value in values[:3])
    report = make_report(df)
    assert (
        "| xl, memory 48, full loss |" in report and "recurrence, XL encoding (full loss)" in report
    )
    figure = extrapolation_figure(df, x="attn_len")
    entries = [
        t.get_text() for t in figure.legends[0].get_texts() if t.get_text().startswith("encoding=")
    ]
    # a line per model (coinciding ones named together): the
    assert sum(1 + e.count(" / ") for e in entries) == 4
    # evaluation memory moves with the attention length
