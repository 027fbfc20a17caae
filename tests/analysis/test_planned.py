"""A grid spec's `analysis:` block (config/plan.py, analysis/planned.py, analysis/plan_history.py).

Covers: the block is checked before launch (one line per error, naming the key path); each run's
run.json records the plan as it stood at the run's first launch and keeps it; `report` prints the
confirmatory families in the plan's order with each comparison's test checked against scipy and an
explicit Holm, the families' history (fixed before the first run, declared after, changed after),
the deviations (seeds outside the plan, seeds launched after results existed), the exploratory
section with every seed (no verdicts), the examples-based test on exact match, the refusal of a side
that did not learn, a cell left ambiguous, and the aggregate against an explicit IQM.
Run: .venv/bin/python -m pytest tests/analysis/test_planned.py -q   (about 4 s)
"""

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from fixtures.runner import fake_env, write_spec
from relpos_ablate.analysis.collect import collect
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.config.plan import family_hash, parse_plan
from relpos_ablate.io import atomic_write_json
from relpos_ablate.runner.grid import GridSpecError, load_grid
from relpos_ablate.runner.store import plan_grid, write_run_files

LENGTHS = (16, 32)
# (encoding, seed) -> loss at each length; exact match at 16 below
LOSS = {
    ("xl", 0): [1.00, 1.30],
    ("xl", 1): [1.04, 1.36],
    ("xl", 2): [1.01, 1.27],
    ("xl", 3): [1.02, 1.31],
    ("alibi", 0): [1.20, 1.24],
    ("alibi", 1): [1.25, 1.21],
    ("alibi", 2): [1.22, 1.29],
    ("alibi", 3): [1.21, 1.26],
}
EXACT = {"xl": (640, 640, 640, 640), "alibi": (600, 610, 605, 612)}
EXAMPLES = 640
PLAN = {
    "scale": "loss",
    "seeds": [0, 1, 2],
    "families": [
        {"name": "xl vs alibi", "each": "encoding", "vs": "alibi", "by": ["segment_len"]},
        {
            "name": "exact match",
            "role": "secondary",
            "scale": "exact_match",
            "where": ["segment_len=16"],
            "pairs": [{"a": ["encoding=xl"], "b": ["encoding=alibi"]}],
        },
    ],
    "aggregate": [
        {
            "name": "over lengths",
            "a": ["encoding=xl"],
            "b": ["encoding=alibi"],
            "over": ["segment_len"],
            "reps": 200,
        }
    ],
}


def spec_file(tmp_path, plan=PLAN, seeds=(0, 1, 2), **extra):
    return write_spec(tmp_path, "g", encodings=("xl", "alibi"), seeds=seeds, analysis=plan, **extra)


def launch(spec_path, results, finished_at="2026-01-01T00:00:00+00:00", launched_at=None):
    """Lay the spec's runs out as the runner does (write_run_files: run.json with its plan record),
    each done with LOSS and EXACT; launched_at overrides the recorded launch time."""
    spec = load_grid(spec_path)
    for plan in plan_grid(spec, results):
        if (plan.run_dir / "run.json").exists():
            continue
        write_run_files(plan, spec.name, spec_path, spec.analysis_record())
        if launched_at is not None:
            info = json.loads((plan.run_dir / "run.json").read_text())
            atomic_write_json(plan.run_dir / "run.json", {**info, "launched_at": launched_at})
        enc, seed = plan.run.variant["encoding"], plan.run.variant["seed"]
        atomic_write_json(
            plan.run_dir / "status.json", {"state": "done", "step": 6, "finished_at": finished_at}
        )
        settings = [
            {
                "segment_len": length,
                "mem_len": 0,
                "attn_len": length,
                "metrics": {
                    "loss": LOSS[enc, seed][i],
                    "ppl": math.exp(LOSS[enc, seed][i]),
                    "exact_match": EXACT[enc][seed] / EXAMPLES if length == 16 else 0.5,
                    "examples": EXAMPLES,
                },
            }
            for i, length in enumerate(LENGTHS)
        ]
        atomic_write_json(plan.run_dir / "eval.json", {"settings": settings, "main_metric": "ppl"})
    return results / spec.name


def report(directory, capsys) -> str:
    assert main(["report", str(directory)]) == 0
    return capsys.readouterr().out


def test_the_block_is_checked_before_launch_one_line_each(tmp_path):
    bad = {"scale": "ppx", "families": [{"name": "f", "each": "encoding"}]}
    with pytest.raises(GridSpecError) as err:
        load_grid(spec_file(tmp_path, bad))
    lines = str(err.value).splitlines()
    assert any("analysis.scale" in line and "loss" in line for line in lines)
    assert any("analysis.families[0]" in line and "vs" in line for line in lines)
    with pytest.raises(ConfigError, match=r"analysis\.families\[0\]\.where.*FIELD=VALUE"):
        parse_plan({"families": [{"name": "f", "each": "e", "vs": "v", "where": ["segment_len"]}]})


def test_run_json_keeps_the_plan_of_the_first_launch(tmp_path):
    spec_path = spec_file(tmp_path)
    directory = launch(spec_path, tmp_path / "results")
    run_json = next(directory.glob("*/run.json"))
    first = json.loads(run_json.read_text())
    plan = parse_plan(PLAN)
    assert first["analysis"]["families"]["xl vs alibi"] == family_hash(plan, plan.families[0])
    assert first["analysis"]["seeds"] == [0, 1, 2] and first["launched_at"]
    changed = {**PLAN, "families": [{**PLAN["families"][0], "vs": "xl"}]}
    spec = load_grid(spec_file(tmp_path, changed))
    for run in plan_grid(spec, tmp_path / "results"):
        write_run_files(run, spec.name, spec.path, spec.analysis_record())
    assert json.loads(run_json.read_text()) == first


def test_report_states_the_plans_families_with_their_tests(tmp_path, capsys):
    table = {"rows": ["encoding"], "cols": ["segment_len"], "metric": "ppl", "baseline": "alibi"}
    spec = spec_file(tmp_path, table=table)
    directory = launch(spec, tmp_path / "results", launched_at="2025-12-31T00:00:00+00:00")
    text = report(directory, capsys)
    assert "**xl vs alibi** (primary): fixed before the first run" in text
    assert "Deviations from the plan:\n\n- none found" in text
    primary = text.index("## Primary: xl vs alibi")
    assert primary < text.index("## Secondary: exact match") < text.index("## Exploratory")
    # Welch over seeds 0-2 at each length, Holm over the two by hand
    p = [
        stats.ttest_ind(
            [LOSS["xl", s][i] for s in range(3)],
            [LOSS["alibi", s][i] for s in range(3)],
            equal_var=False,
        ).pvalue
        for i in range(2)
    ]
    order = np.argsort(p)
    holm = [0.0, 0.0]
    holm[order[0]] = min(1, 2 * p[order[0]])
    holm[order[1]] = min(1, max(holm[order[0]], p[order[1]]))
    for i, length in enumerate(LENGTHS):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- segment_len={length}: xl"))
        assert f"p = {p[i]:.2g}, Holm-adjusted p = {holm[i]:.2g}" in line
    # the spec's table (every row against alibi's) is outside the plan: its tests stand, no stars
    explore = text[text.index("## Exploratory: the report's own sections") :]
    assert "\\*" not in explore
    # exact match on the examples, not a t-test on three proportions
    assert "quasi-binomial LR test" in text[text.index("## Secondary") :]
    # the aggregate: IQM of each side over the designed seeds and both lengths
    iqm_xl = stats.trim_mean([LOSS["xl", s][i] for s in range(3) for i in range(2)], 0.25)
    assert f"IQM {iqm_xl:.2f}" in text


def test_a_plan_changed_after_the_runs_and_seeds_added_after_a_look(tmp_path, capsys):
    results = tmp_path / "results"
    launch(
        spec_file(tmp_path),
        results,
        finished_at="2026-01-01T01:00:00+00:00",
        launched_at="2026-01-01T00:00:00+00:00",
    )
    changed = {**PLAN, "families": [{**PLAN["families"][0], "values": ["xl"]}, PLAN["families"][1]]}
    directory = launch(
        spec_file(tmp_path, changed, seeds=(0, 1, 2, 3)),
        results,
        launched_at="2026-01-02T00:00:00+00:00",
    )
    text = report(directory, capsys)
    assert (
        "**xl vs alibi** (primary): changed after runs existed: 6 of the 8 runs record another "
        "version; as it stands first recorded by a run launched 2026-01-02T00:00:00+00:00" in text
    )
    assert "**exact match** (secondary): declared after runs existed" not in text
    assert "**exact match** (secondary): fixed before the first run" in text
    assert "runs of seeds 3 are not among the plan's designed seeds 0, 1, 2" in text
    assert "seed 3 was first launched 2026-01-02T00:00:00+00:00, after 6 runs" in text
    explore = text[text.index("## Exploratory: the families with seeds 3 too") :]
    assert "raw p =" in explore and "better" not in explore.split("## Exploratory: the report")[0]


def test_no_run_recorded_a_plan_written_after_the_runs(tmp_path, capsys):
    spec_path = spec_file(tmp_path)
    directory = launch(spec_path, tmp_path / "results")
    for run_json in directory.glob("*/run.json"):
        info = json.loads(run_json.read_text())
        info.pop("analysis")
        atomic_write_json(run_json, info)
    assert "declared after the runs: none of the 6 runs records a plan" in report(directory, capsys)


def test_a_side_that_did_not_learn_is_not_compared(tmp_path, capsys):
    plan = {**PLAN, "learned": {"metric": "exact_match", "min": 0.99, "where": ["segment_len=16"]}}
    text = report(launch(spec_file(tmp_path, plan), tmp_path / "results"), capsys)
    assert "xl vs alibi: not compared: alibi did not learn the task in distribution" in text
    assert "not computed: in every cell a side did not learn the task in distribution" in text


def test_an_ambiguous_cell_says_which_fields_differ(tmp_path, capsys):
    plan = {"families": [{"name": "f", "pairs": [{"a": ["encoding=xl"], "b": ["encoding=alibi"]}]}]}
    directory = launch(spec_file(tmp_path, plan), tmp_path / "results")
    assert main(["report", str(directory)]) != 0
    err = capsys.readouterr().err
    assert "segment_len" in err and len(err.strip().splitlines()) == 1


def test_collect_reads_the_records(tmp_path):
    frame = collect(launch(spec_file(tmp_path), tmp_path / "results"))
    assert frame["launched_at"].notna().all() and frame["finished_at"].notna().all()
    assert all(json.loads(a)["seeds"] == [0, 1, 2] for a in frame["analysis"])


def test_the_yaml_example_in_the_docstring_parses():
    from relpos_ablate.config import plan as module

    example = module.__doc__.split("\n\n")[1]
    parse_plan(yaml.safe_load(example)["analysis"])


def test_the_runner_records_the_plan_at_launch_and_keeps_it(tmp_path, monkeypatch):
    """The real `grid` command (the fake worker trains): every run.json holds the plan of its first
    launch; a rerun under a changed plan launches nothing and rewrites none."""
    for key, value in fake_env(tmp_path / "log.jsonl").items():
        monkeypatch.setenv(key, value)
    spec_path, results = spec_file(tmp_path), tmp_path / "results"
    assert main(["grid", str(spec_path), "--results", str(results), "--slots", "2"]) == 0
    infos = {p: json.loads(p.read_text()) for p in (results / "g").glob("*/run.json")}
    plan = parse_plan(PLAN)
    assert len(infos) == 6 and all(
        i["analysis"]["families"]
        == {f.name: family_hash(plan, f) for f in (*plan.families, *plan.aggregate)}
        and i["launched_at"]
        for i in infos.values()
    )
    changed = {**PLAN, "families": [{**PLAN["families"][0], "vs": "xl"}]}
    assert main(["grid", str(spec_file(tmp_path, changed)), "--results", str(results)]) == 0
    assert {p: json.loads(p.read_text()) for p in infos} == infos


def test_under_a_plan_the_studys_sections_are_exploratory_and_its_threats_come_last(tmp_path):
    from relpos_ablate.analysis.planned import with_plan

    frame = collect(launch(spec_file(tmp_path), tmp_path / "results"))
    body = "# study\n\nopening\n\n## Threats to validity\n\nsmall\n\n## A test\n\nx better\n"
    spec = {"analysis": PLAN, "seeds": [0, 1, 2]}
    text = with_plan([("g", frame, spec), ("h", frame, spec)], body)
    order = [
        "# study",
        "## The declared analysis of g",
        "## Primary of g: xl vs alibi",
        "## The declared analysis of h",
        "## Exploratory: the report's own sections",
        "opening",
        "### A test",
        "## Threats to validity",
    ]
    assert [text.index(part) for part in order] == sorted(text.index(part) for part in order)
    assert "### Threats" not in text


def test_report_aggregate_on_the_command_line(tmp_path, capsys):
    """`report DIR --aggregate A B --over FIELD`: the IQM of each side over every seed and both
    lengths (an explicit trimmed mean here), P(A lower) from the pairs; exploratory unless the
    plan declares the same aggregate."""
    directory = launch(spec_file(tmp_path), tmp_path / "results")
    argv = ["report", str(directory), "--over", "segment_len", "--scale", "loss", "--aggregate"]
    assert main([*argv, "encoding=alibi", "encoding=xl"]) == 0
    out = capsys.readouterr().out
    alibi = sorted(LOSS["alibi", s][i] for s in range(3) for i in range(2))
    assert f"IQM {np.mean(alibi[1:5]):.2f}" in out  # 6 values: the middle 4 (rliable's cut)
    # P(alibi < xl) per length over all seed pairs, averaged over the two lengths
    pairs = [
        [LOSS["alibi", s][i] < LOSS["xl", t][i] for s in range(3) for t in range(3)] for i in (0, 1)
    ]
    assert f"P(alibi < xl) = {np.mean([np.mean(p) for p in pairs]):.2f}" in out
    assert "exploratory: not in the spec's analysis plan" in out
    assert main([*argv, "encoding=xl", "encoding=alibi"]) == 0
    assert "exploratory" not in capsys.readouterr().out  # the plan's own aggregate
    assert main(["report", str(directory), "--aggregate", "encoding=xl", "encoding=alibi"]) != 0
    assert "--over" in capsys.readouterr().err


def test_a_cell_that_pools_two_values_of_a_variant_is_refused(tmp_path, capsys):
    plan = {
        "families": [
            {
                "name": "f",
                "where": ["segment_len=16"],
                "pairs": [{"a": [], "b": ["encoding=alibi"]}],
            }
        ]
    }
    directory = launch(spec_file(tmp_path, plan), tmp_path / "results")
    assert main(["report", str(directory)]) != 0
    err = capsys.readouterr().err.strip()
    assert "runs differ in encoding (encoding: alibi, xl)" in err and len(err.splitlines()) == 1


def test_a_rerun_without_the_block_keeps_the_first_launchs_record(tmp_path):
    directory = launch(spec_file(tmp_path), tmp_path / "results")
    before = {p: p.read_text() for p in directory.glob("*/run.json")}
    spec = load_grid(write_spec(tmp_path, "g", encodings=("xl", "alibi"), seeds=(0, 1, 2)))
    assert spec.analysis is None
    for run in plan_grid(spec, tmp_path / "results"):
        write_run_files(run, spec.name, spec.path, spec.analysis_record())
    assert {p: p.read_text() for p in before} == before


def test_a_misspelt_value_is_named_and_spellings_of_one_value_match(tmp_path, capsys):
    typo = {"families": [{"name": "f", "each": "encoding", "vs": "alibj", "by": ["segment_len"]}]}
    text = report(launch(spec_file(tmp_path, typo), tmp_path / "results"), capsys)
    assert "- the plan names encoding=alibj: no run has it (encoding has: alibi, xl)" in text
    assert "segment_len=16: xl vs alibj: not compared: no run in the cell encoding=alibj" in text
    spelt = {
        "families": [
            {"name": "f", "where": ["segment_len=16.0"], "each": "encoding", "vs": "alibi"},
            {
                "name": "g",
                "where": ["segment_len=32"],
                "each": "encoding",
                "vs": "alibi",
                "margin": 0.3,
            },
        ]
    }
    (tmp_path / "b").mkdir()
    text = report(launch(spec_file(tmp_path / "b", spelt), tmp_path / "b" / "results"), capsys)
    assert "- xl 1.017, alibi 1.223: xl better (Welch's t-test" in text
    # a margin makes the family a TOST
    assert "- xl 1.310, alibi 1.247: equivalent within ±0.3000 (TOST" in text


def test_accuracy_a_share_of_tokens_is_tested_over_runs(tmp_path, capsys):
    plan = {
        "scale": "acc",
        "families": [{"name": "f", "where": ["segment_len=16"], "each": "encoding", "vs": "alibi"}],
    }
    directory = launch(spec_file(tmp_path, plan), tmp_path / "results")
    for eval_json in directory.glob("*/eval.json"):
        info = json.loads(eval_json.read_text())
        for i, setting in enumerate(info["settings"]):
            setting["metrics"]["acc"] = (
                0.5 + 0.01 * i + 0.001 * (int(eval_json.parent.name, 16) % 7)
            )
        atomic_write_json(eval_json, info)
    text = report(directory, capsys)
    assert "Welch's t-test" in text[text.index("## Primary") :] and "quasi-binomial" not in text


def test_the_history_is_the_plans_own_experiments_and_a_dropped_family_is_named(tmp_path):
    from relpos_ablate.analysis.planned import planned_report

    own = collect(
        launch(spec_file(tmp_path), tmp_path / "results", launched_at="2026-01-02T00:00:00+00:00")
    )
    control_spec = write_spec(tmp_path, "h", encodings=("xl", "alibi"), seeds=(0, 1, 2, 3))
    control = collect(
        launch(control_spec, tmp_path / "results", launched_at="2026-01-01T00:00:00+00:00")
    )
    frame = pd.concat([own, control], ignore_index=True)
    frame.attrs = own.attrs
    # the family's cells are g's runs (`experiment=g`), not the control's too
    family = {**PLAN["families"][0], "where": ["experiment=g"]}
    aggregate = {**PLAN["aggregate"][0], "where": ["experiment=g"]}
    plan = parse_plan({**PLAN, "families": [family], "aggregate": [aggregate]})
    text = "\n".join(planned_report(frame, plan, (0, 1, 2), "g"))
    # its hash changed with the where: "changed after runs existed", over g's 6 runs only
    assert "**xl vs alibi** (primary): changed after runs existed: 6 of the 6 runs" in text
    assert "**over lengths** (aggregate): changed after runs existed: 6 of the 6 runs" in text
    assert "seeds 3" not in text  # the control's seed 3 is the control's, not a deviation here
    assert "dropped or renamed): exact match" in text


def test_a_family_and_an_aggregate_may_not_share_a_name():
    block = {**PLAN, "aggregate": [{**PLAN["aggregate"][0], "name": "xl vs alibi"}]}
    with pytest.raises(ConfigError, match="'xl vs alibi' names two families or aggregates"):
        parse_plan(block)


def test_a_run_without_results_is_named_as_a_deviation(tmp_path, capsys):
    directory = launch(spec_file(tmp_path), tmp_path / "results")
    failed = next(directory.glob("*/status.json"))
    atomic_write_json(failed, {"state": "failed", "reason": "loss is nan", "step": 3})
    (failed.parent / "eval.json").unlink()
    text = report(directory, capsys)
    run_id = failed.parent.name
    assert f"1 runs have no results, so their families test fewer seeds: {run_id} (seed" in text
    assert "failed)" in text
