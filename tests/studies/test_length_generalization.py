"""The length-generalization report: `table --layout length_generalization` (bins + OOD mean per
task and encoding, the rank-per-task summary) and `plot --kind diagnostics | passkey`, on hand-made
run dirs whose every number is known; each expected value is computed here from those numbers.
Run: pytest tests/studies/test_length_generalization.py -q"""

import statistics

import numpy as np
import pytest
from matplotlib.image import AxesImage

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_json, atomic_write_yaml
from relpos_ablate.studies import make_table
from relpos_ablate.studies.length_generalization.figures import (
    collect_diagnostics,
    diagnostics_figure,
    passkey_figure,
    save_diagnostics,
    summary_figure,
    with_variants,
)
from relpos_ablate.studies.length_generalization.table import rank_table

BINS = [(1, 4), (5, 6), (7, 8)]  # trained on n <= 4: the last two bins are out of distribution
ENCODINGS = {
    "nope": ["model.attention.terms=a"],
    "alibi": ["model.attention.terms=a", "model.attention.bias=alibi"],
}
# exact match per (task, encoding, seed) and bin
SCORES = {
    ("copy", "nope", 0): [1.0, 0.5, 0.25],
    ("copy", "nope", 1): [1.0, 0.3, 0.1],
    ("copy", "nope", 2): [0.9, 0.4, 0.2],
    ("copy", "alibi", 0): [1.0, 0.1, 0.0],
    ("copy", "alibi", 1): [1.0, 0.2, 0.0],
    ("copy", "alibi", 2): [1.0, 0.1, 0.1],
    ("reverse", "nope", 0): [0.8, 0.0, 0.0],
    ("reverse", "nope", 1): [0.7, 0.1, 0.0],
    ("reverse", "nope", 2): [0.9, 0.0, 0.0],
    ("reverse", "alibi", 0): [0.9, 0.3, 0.2],
    ("reverse", "alibi", 1): [0.9, 0.2, 0.2],
    ("reverse", "alibi", 2): [1.0, 0.4, 0.1],
}
SPEC = {
    "name": "lengthgen",
    "grid": {"data.task": ["copy", "reverse"], "encoding": ["nope", "alibi"]},
    "table": {"layout": "length_generalization"},
}


def example_run(root, task, encoding, seed, scores, depths=(None,), diagnostics=None):
    """A done example-task run whose eval.json holds `scores` per bin (the same at every depth)."""
    overrides = [
        f"data.task={task}",
        "data.train_lengths=[1, 4]",
        f"data.test_lengths={[list(b) for b in BINS]}",
        "train.segment_len=16",
        "data.num_keys=8",
        f"seed={seed}",
        *ENCODINGS[encoding],
    ]
    run_dir = make_run(
        root,
        overrides,
        experiment="lengthgen",
        variant={"data.task": task, "encoding": encoding, "seed": seed},
        spec="../spec.yaml",
    )
    settings = []
    for (lo, hi), score in zip(BINS, scores):
        for depth in depths:
            record = {
                "segment_len": 2 * hi + 1,
                "mem_len": 0,
                "clamp_len": None,
                "same_length": False,
                "attn_len": 2 * hi + 1,
                "length_min": lo,
                "length_max": hi,
                "metrics": {
                    "exact_match": score + (0.0 if depth is None else depth / 10),
                    "acc": 1.0,
                },
            }
            if depth is not None:
                record["depth"] = depth
            if diagnostics is not None:
                record["diagnostics"] = diagnostics(hi)
            settings.append(record)
    atomic_write_json(run_dir / "eval.json", {"main_metric": "exact_match", "settings": settings})
    return run_dir


@pytest.fixture
def grid(tmp_path):
    atomic_write_yaml(tmp_path / "lengthgen" / "spec.yaml", SPEC)
    for (task, encoding, seed), scores in SCORES.items():
        example_run(tmp_path, task, encoding, seed, scores)
    return collect(tmp_path)


def runs(task, encoding):
    return [scores for (t, e, _), scores in SCORES.items() if (t, e) == (task, encoding)]


def test_bins_and_ood_mean_are_mean_and_std_over_seeds(grid):
    table, options = make_table(grid, TableOptions())
    # from the spec's block
    assert options.layout == "length_generalization" and options.metric == "exact_match"
    assert table.index == ["task", "encoding"]
    assert table.columns == ["n=1-4", "n=5-6", "n=7-8", "OOD mean"]
    # the spec's order
    assert [labels for labels, _ in table.rows] == [
        ["copy", "nope"],
        ["copy", "alibi"],
        ["reverse", "nope"],
        ["reverse", "alibi"],
    ]
    for labels, cells in table.rows:
        seeds = runs(*labels)
        for k in range(3):
            values = [s[k] for s in seeds]
            assert cells[k].mean == pytest.approx(statistics.mean(values))
            assert cells[k].std == pytest.approx(statistics.stdev(values))
        ood = [statistics.mean(s[1:]) for s in seeds]  # per run: the mean over its OOD bins
        assert cells[3].mean == pytest.approx(statistics.mean(ood)) and cells[
            3
        ].std == pytest.approx(statistics.stdev(ood))
    best = {tuple(labels): [c.best for c in cells] for labels, cells in table.rows}
    # best per task and column; ties both bold
    assert best[("copy", "nope")] == [False, True, True, True]
    assert best[("copy", "alibi")] == [True, False, False, False]
    assert best[("reverse", "alibi")] == [True, True, True, True]


def test_rank_per_task_and_mean_rank(grid):
    table = rank_table(
        grid,
        "exact_match",
        ["encoding"],
        {"encoding": ["nope", "alibi"], "data.task": ["copy", "reverse"]},
    )
    assert table.columns == ["copy", "reverse", "mean rank"]
    rows = {labels[0]: values for labels, values in table.rows}
    # copy: nope's OOD mean (0.292) beats alibi's (0.083); reverse: alibi (0.233) beats nope
    # (0.017); in brackets the mean over seeds of the in-distribution bin n=1-4
    iid = {
        (t, e): statistics.mean(s[0] for s in runs(t, e))
        for t in ("copy", "reverse")
        for e in ("nope", "alibi")
    }
    assert rows["nope"][:2] == [
        f"1 (ID {iid['copy', 'nope']:.2f})",
        f"2 (ID {iid['reverse', 'nope']:.2f})",
    ]
    assert rows["alibi"][:2] == [
        f"2 (ID {iid['copy', 'alibi']:.2f})",
        f"1 (ID {iid['reverse', 'alibi']:.2f})",
    ]
    assert rows["nope"][:2] == ["1 (ID 0.97)", "2 (ID 0.80)"]
    assert (
        rows["nope"][2].mean == rows["alibi"][2].mean == 1.5
        and rows["nope"][2].best
        and rows["alibi"][2].best
    )


def test_ties_share_their_mean_rank(tmp_path):
    for encoding in ("nope", "alibi"):
        example_run(tmp_path, "copy", encoding, 0, [1.0, 0.5, 0.5])
    table = rank_table(collect(tmp_path), "exact_match", ["encoding"])
    assert [values[0] for _, values in table.rows] == ["1.5 (ID 1.00)", "1.5 (ID 1.00)"]


def test_passkey_depths_are_averaged_per_bin_and_drawn_as_a_depth_by_length_map(tmp_path):
    for encoding in ("nope", "alibi"):
        for seed in (0, 1):
            example_run(
                tmp_path, "passkey", encoding, seed, [0.5, 0.2 * seed, 0.1], depths=(0.0, 0.5, 1.0)
            )
    frame = collect(tmp_path)
    table, _ = make_table(frame, TableOptions(layout="length_generalization"))
    cells = table.rows[0][1]
    # depth adds depth/10 here
    assert cells[0].mean == pytest.approx(0.5 + statistics.mean([0.0, 0.05, 0.1]))
    assert cells[1].mean == pytest.approx(statistics.mean([0.0, 0.2]) + 0.05)
    fig = passkey_figure(frame)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["ALiBi", "NoPE"]  # no spec: sorted; named in words
    image = panels[0].get_images()[0].get_array()
    # seeds 0, 1 averaged
    expected = np.array([[0.5 + d / 10, 0.1 + d / 10, 0.1 + d / 10] for d in (0.0, 0.5, 1.0)])
    np.testing.assert_allclose(np.asarray(image), expected)


def test_a_frame_without_example_tasks_is_a_one_line_error(tmp_path):
    make_run(tmp_path, ["seed=0"], results=[({"segment_len": 32}, {"ppl": 3.0})])
    with pytest.raises(ConfigError, match="layout: length_generalization needs example-task runs"):
        make_table(collect(tmp_path), TableOptions(layout="length_generalization"))
    with pytest.raises(ConfigError, match="kind: no passkey runs"):
        passkey_figure(collect(tmp_path))


def test_the_table_command_prints_both_tables(grid, capsys):
    # --all-runs: the fixture writes its runs by hand, under ids its spec does not plan
    argv = ["table", grid.attrs["results_dir"], "--layout", "length_generalization", "--all-runs"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| task | encoding | n=1-4 | n=5-6 | n=7-8 | OOD mean |" in out
    assert "| encoding | copy | reverse | mean rank |" in out
    assert main(["table", grid.attrs["results_dir"], "--format", "csv", "--all-runs"]) == 0
    assert "task,encoding,n=1-4,n=1-4 std" in capsys.readouterr().out


def statistics_of(hi):
    """Diagnostics of a bin (up to n = hi), [layers=2][heads=3], with values that encode where they
    are."""
    return {
        name: [[k + hi / 10 + layer + head / 100 for head in range(3)] for layer in range(2)]
        for k, name in enumerate(("entropy", "sink", "distance", "unseen"))
    }


def test_diagnostics_are_collected_per_layer_and_head_and_drawn_per_statistic(tmp_path):
    atomic_write_yaml(tmp_path / "lengthgen" / "spec.yaml", SPEC)
    for encoding in ("nope", "alibi"):
        for seed in (0, 1):
            example_run(
                tmp_path, "copy", encoding, seed, [1.0, 0.5, 0.2], diagnostics=statistics_of
            )
    frame = collect(tmp_path)
    long = collect_diagnostics(frame)
    assert len(long) == 4 * len(BINS) * 2 * 3  # runs x bins x layers x heads
    row = long[(long["layer"] == 1) & (long["head"] == 2) & (long["length"] == "n=7-8")].iloc[0]
    assert row["sink"] == pytest.approx(1 + 0.8 + 1 + 0.02) and row["encoding"] in ("nope", "alibi")
    long, keys, variants = with_variants(long, frame)
    assert keys == ["encoding"] and variants == [("nope",), ("alibi",)]
    fig = diagnostics_figure(long, keys, variants, "t")
    panels = [ax for ax in fig.axes if ax.get_images()]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    # a panel per statistic, each with its own colour bar
    assert len(panels) == 4 and len(bars) == 4
    entropy = np.asarray(panels[0].get_images()[0].get_array())  # rows: nope's layers, then alibi's
    # a row per layer: the mean over its 3 heads (head / 100: 0, 0.01, 0.02) and the 2 seeds (equal
    # here)
    one_variant = [[hi / 10 + layer + 0.01 for _, hi in BINS] for layer in range(2)]
    np.testing.assert_allclose(entropy, one_variant + one_variant)
    # the variants in words
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["NoPE", "ALiBi"]
    right = panels[-1].child_axes[0]  # the layer names at the right of the last panel
    assert [t.get_text() for t in right.get_yticklabels()] == ["L0", "L1", "L0", "L1"]
    # a single run keeps its heads: a row per (layer, head)
    one = long[long["run_dir"] == long["run_dir"].iloc[0]]
    by_head = diagnostics_figure(
        one.assign(variant=[variants[0]] * len(one)), keys, variants[:1], "t", by_head=True
    )
    assert np.asarray(
        [ax for ax in by_head.axes if ax.get_images()][0].get_images()[0].get_array()
    ).shape == (6, 3)
    written = save_diagnostics(frame, tmp_path / "figures", formats=("png",))
    assert sorted(p.name for p in written) == [
        "diagnostics_copy.png",
        "diagnostics_summary_copy.png",
    ]


def test_the_summary_draws_each_variant_in_its_own_colour_with_its_head_mean():
    """Eleven variants (the reproduction's count): matplotlib's 10-colour cycle would repeat one."""
    import pandas as pd
    from matplotlib.colors import to_rgba

    variants = [(f"e{k}",) for k in range(11)]
    frame = pd.DataFrame(
        [
            {
                "variant": v,
                "length": length,
                "order": order,
                "layer": 0,
                "head": head,
                "entropy": k + order + head / 2,
            }
            for k, v in enumerate(variants)
            for order, length in enumerate(("n=1-4", "n=5-6"))
            for head in range(2)
        ]
    )
    fig = summary_figure(frame, ["encoding"], variants, "t")
    lines = fig.axes[0].get_lines()
    assert len({to_rgba(line.get_color()) for line in lines}) == 11
    # mean over the two heads
    np.testing.assert_allclose(lines[3].get_ydata(), [3 + 0.25, 3 + 1 + 0.25])


def test_the_summary_styles_variants_as_the_main_figure_does():
    """(encoding, positions) variants: randomized RoPE takes RoPE's colour, dashed (a colour each
    would pair unrelated encodings in tab20's light and dark shades)."""
    import pandas as pd
    from matplotlib.colors import to_rgba

    keys = ["encoding", "model.attention.positions"]
    variants = [("nope", "sequential"), ("rope", "sequential"), ("rope", "randomized")]
    frame = pd.DataFrame(
        [
            {"variant": v, "length": "n=1-4", "order": 0, "layer": 0, "head": 0, "entropy": 1.0}
            for v in variants
        ]
    )
    nope, rope, randomized = summary_figure(frame, keys, variants, "t").axes[0].get_lines()
    assert to_rgba(rope.get_color()) == to_rgba(randomized.get_color()) != to_rgba(nope.get_color())
    assert (nope.get_linestyle(), rope.get_linestyle(), randomized.get_linestyle()) == (
        "-",
        "-",
        "--",
    )


def test_plot_command_draws_diagnostics_and_passkey(tmp_path, capsys):
    example_run(
        tmp_path,
        "passkey",
        "nope",
        0,
        [1.0, 0.5, 0.2],
        depths=(0.0, 1.0),
        diagnostics=statistics_of,
    )
    run_dir = next((tmp_path / "lengthgen").iterdir())
    assert main(["plot", str(run_dir), "--kind", "diagnostics", "--formats", "png"]) == 0
    assert (
        main(
            [
                "plot",
                str(tmp_path),
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
    out = capsys.readouterr().out.split()
    assert out == [
        str(run_dir / "figures" / "diagnostics.png"),
        str(tmp_path / "f" / "passkey.png"),
    ]
    assert isinstance(passkey_figure(collect(tmp_path)).axes[0].get_images()[0], AxesImage)
