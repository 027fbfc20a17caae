"""Tables from collect(): mean ± std over seeds, best in bold, Welch's t-test against a baseline row
(different models) with the table's tests one Holm-corrected family, defaults (data and the spec's
`table:` block), the XL-Table-6 layout, Markdown / LaTeX / CSV output and the `table` command.
Every number is checked against statistics / the Welch formula / statsmodels' Holm correction
computed here.

Run: .venv/bin/python -m pytest tests/analysis/test_tables.py -q
"""

import io
import math
import re
import shutil
import statistics
import subprocess

import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fixtures.report_runs import ENCODINGS, make_grid, make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.render import latex_escape, render
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.studies import make_table

# xl is clearly better at length 32 (p < 0.01), alibi better at 64; 3 seeds each
PPL = {
    ("xl", 0): [10.0, 14.0],
    ("xl", 1): [10.2, 14.5],
    ("xl", 2): [10.1, 13.8],
    ("alibi", 0): [12.0, 12.4],
    ("alibi", 1): [12.3, 12.2],
    ("alibi", 2): [12.1, 12.9],
}


def welch_test(a, b):
    """Welch's test of a - b from its textbook formula (Welch–Satterthwaite degrees of freedom): the
    difference of the means, its 95% CI and the two-sided p-value."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.mean(a) - statistics.mean(b)
    t = difference / math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    return difference, (difference - half, difference + half), 2 * stats.t.sf(abs(t), dof)


def welch(a, b):
    """Welch's two-sided p-value (welch_test)."""
    return welch_test(a, b)[2]


def baseline_family():
    """The `--baseline xl` table's family on PPL: alibi against xl in each column (different runs:
    Welch's), both tests Holm-corrected together; (raw p per column, adjusted p per column)."""
    raw = [
        welch([PPL[("alibi", s)][k] for s in range(3)], [PPL[("xl", s)][k] for s in range(3)])
        for k in range(2)
    ]
    return raw, list(multipletests(raw, alpha=0.05, method="holm")[1])


def cells_by_label(table):
    return {labels[0]: values for labels, values in table.rows}


@pytest.fixture
def grid(tmp_path):
    make_grid(tmp_path, PPL, lengths=(32, 64))
    make_run(tmp_path, ["seed=9"], state="failed", variant={"encoding": "xl", "seed": 9})
    return collect(tmp_path)


def test_defaults_mean_std_count_best_and_welch(grid):
    table, opts = make_table(grid, TableOptions(baseline="xl"))
    assert (opts.rows, opts.cols, opts.metric, opts.layout) == (
        ("encoding",),
        ("segment_len",),
        "ppl",
        "grid",
    )
    assert table.columns == ["eval len 32", "eval len 64"]
    cells = cells_by_label(table)
    for enc in ("xl", "alibi"):
        for k in range(2):
            values = [PPL[(enc, s)][k] for s in range(3)]
            cell = cells[enc][k]
            assert cell.mean == pytest.approx(statistics.mean(values))
            assert cell.std == pytest.approx(statistics.stdev(values))
            assert cell.n == 3  # the failed seed 9 has no metrics and is not counted
    assert [cells["xl"][0].best, cells["alibi"][0].best] == [True, False]  # lower ppl is better
    assert [cells["xl"][1].best, cells["alibi"][1].best] == [False, True]
    raw, adjusted = baseline_family()
    for k in range(2):
        assert cells["alibi"][k].p_raw == pytest.approx(raw[k])
        # corrected over both columns' tests
        assert cells["alibi"][k].p == pytest.approx(adjusted[k])
        # the baseline is not tested
        assert math.isnan(cells["xl"][k].p) and math.isnan(cells["xl"][k].p_raw)
    for k in range(2):  # stars read the adjusted p
        p = adjusted[k]
        expected = "***" if p < 0.001 else "**" if p < 0.01 else "*" if p < 0.05 else ""
        assert cells["alibi"][k].stars == expected
    assert cells["alibi"][
        0
    ].stars  # the fixture is built so that length 32 is significant, after the correction


def test_no_welch_star_below_three_seeds(tmp_path):
    """Two seeds a side: a t-test with one degree of freedom per side is not starred (it was
    before)."""
    make_grid(
        tmp_path,
        {("xl", 0): [10.0], ("xl", 1): [10.01], ("alibi", 0): [20.0], ("alibi", 1): [20.01]},
        lengths=(32,),
    )
    table, _ = make_table(collect(tmp_path), TableOptions(baseline="xl"))
    cells = cells_by_label(table)
    assert math.isnan(cells["alibi"][0].p) and cells["alibi"][0].stars == ""
    assert (
        "Welch's t-test where they hold different models (here: none, fewer than 3 seeds)"
        in table.caption
    )
    assert 'Family "every row vs xl, column by column": 0 tests (none run)' in table.caption
    means = [f"{statistics.mean(v):.2f}" for v in ([20.0, 20.01], [10.0, 10.01])]
    assert table.tests == [f"alibi (ppl) {means[0]}, xl (ppl) {means[1]}: n too small to test"]
    assert "\\*" not in render(table, "markdown").split("\n\n")[0]


def protocol_runs(root):
    """Two seeds of one run evaluated non_overlapping at 32 and 64, sliding (stride 16) at 64, and a
    RECL ladder setting (sliding, stride 1, a subset of the targets) that grid tables leave out."""
    for seed, ppl in enumerate((10.0, 12.0)):
        make_run(
            root,
            ["model.attention.terms=abcd", f"seed={seed}", "eval.recl_contexts=[16]"],
            variant={"encoding": "xl", "seed": seed},
            results=[
                ({"segment_len": 32, "protocol": "non_overlapping"}, {"ppl": ppl, "tokens": 800}),
                (
                    {"segment_len": 64, "protocol": "non_overlapping"},
                    {"ppl": ppl + 1, "tokens": 800},
                ),
                (
                    {"segment_len": 64, "protocol": "sliding", "stride": 16, "attn_len": 64},
                    {"ppl": ppl - 1, "tokens": 800},
                ),
                (
                    {
                        "segment_len": 16,
                        "protocol": "sliding",
                        "stride": 1,
                        "max_targets": 100,
                        "token_losses": "setting_3",
                    },
                    {"ppl": 99.0, "tokens": 100},
                ),
            ],
        )


def test_tables_say_the_protocol_the_attention_length_and_the_tokens(tmp_path):
    protocol_runs(tmp_path)
    table, opts = make_table(collect(tmp_path))
    assert opts.cols == ("protocol", "segment_len", "stride")
    # the RECL setting (99.0) is left out
    assert table.columns == [
        "non_overlapping, eval len 32",
        "non_overlapping, eval len 64",
        "sliding, eval len 64, stride 16",
    ]
    assert [c.mean for c in table.rows[0][1]] == pytest.approx([11.0, 12.0, 10.0])
    assert "Attn len (keys per query): non_overlapping: segment_len + mem_len" in table.caption
    assert (
        "sliding: segment_len; a scored target sees segment_len - stride + 1 to segment_len keys"
        in table.caption
    )
    assert "Tokens scored per setting: 800." in table.caption


def test_markdown_renders_bold_stars_and_seed_count(grid):
    table, _ = make_table(grid, TableOptions(baseline="xl"))
    text = render(table, "markdown")
    lines = text.splitlines()
    assert lines[0] == "| encoding | eval len 32 | eval len 64 |" and lines[1] == "|:---|---:|---:|"
    assert len({line.count("|") for line in lines[:4]}) == 1
    xl_row = next(line for line in lines if line.startswith("| xl "))
    assert "**10.10 ± 0.10**" in xl_row
    alibi_row = next(line for line in lines if line.startswith("| alibi "))
    assert re.search(r"12\.13 ± 0\.15(\\\*)+ \|", alibi_row)
    assert "n=3 seeds" in text and "Welch's t-test" in text
    assert (
        'Family "every row vs xl, column by column": 2 tests (Welch\'s t-test), '
        "Holm-corrected at α = 0.05" in text
    )
    # each test listed under the table: means, the difference with its 95% CI, raw and Holm-adjusted
    # p
    raw, adjusted = baseline_family()
    expected = []
    for k, column in enumerate(("eval len 32", "eval len 64")):
        a, b = [PPL[("alibi", s)][k] for s in range(3)], [PPL[("xl", s)][k] for s in range(3)]
        difference, (lo, hi), p = welch_test(a, b)
        assert p == pytest.approx(raw[k])
        said = (
            (f"alibi ({column}) better" if difference < 0 else f"xl ({column}) better")
            if adjusted[k] < 0.05
            else "not significant after correction"
            if p < 0.05
            else "not significant"
        )
        expected.append(
            f"- alibi ({column}) {statistics.mean(a):.2f}, xl ({column}) "
            f"{statistics.mean(b):.2f}: {said} (Welch's t-test, difference {difference:.3f}, 95% "
            f"CI [{lo:.3f}, {hi:.3f}], n = 3; p = {p:.2g}, Holm-adjusted p = {adjusted[k]:.2g})"
        )
    tests = text.split("\nTests:\n", 1)[1].strip().splitlines()
    assert tests[:2] == expected and tests[3].startswith("Power: with n = 3 per side")


def test_higher_is_better_for_accuracy_and_unequal_seed_counts(tmp_path):
    for seed, (a, b) in enumerate([(0.9, 0.5), (0.8, 0.6)]):
        make_run(
            tmp_path,
            ["model.attention.terms=ac", f"seed={seed}"],
            main_metric="acc",
            results=[({"segment_len": 32}, {"acc": a})],
        )
        make_run(
            tmp_path,
            ["model.attention.terms=a", f"seed={seed}"],
            main_metric="acc",
            results=[({"segment_len": 32}, {"acc": b})],
        )
    make_run(
        tmp_path,
        ["model.attention.terms=a", "seed=2"],
        main_metric="acc",
        results=[({"segment_len": 32}, {"acc": 0.55})],
    )
    df = collect(tmp_path)
    table, opts = make_table(df)
    assert opts.rows == ("model.attention.terms",) and opts.cols == () and opts.metric == "acc"
    cells = cells_by_label(table)
    assert cells["ac"][0].best and not cells["a"][0].best
    assert cells["a"][0].mean == pytest.approx(statistics.mean([0.5, 0.6, 0.55]))
    assert (
        table.show_n
        and "(n=3)" in render(table, "markdown")
        and "(n=2)" in render(table, "markdown")
    )
    assert table.columns == ["acc"] and table.index == ["terms"]


def test_spec_table_block_and_axis_order(tmp_path):
    spec = tmp_path / "grid.yaml"
    spec.write_text(
        "name: demo\ngrid:\n  encoding: [xl, alibi]\ntable:\n  rows: encoding\n  metric: loss\n"
        "  format: latex\n"
    )
    make_grid(
        tmp_path / "res", {("alibi", 0): [12.0], ("xl", 0): [10.0]}, lengths=(32,), spec=str(spec)
    )
    table, opts = make_table(collect(tmp_path / "res"))
    assert opts.metric == "loss" and opts.format == "latex"
    # spec order, not alphabetical
    assert [labels[0] for labels, _ in table.rows] == ["xl", "alibi"]
    assert table.rows[0][1][0].mean == pytest.approx(math.log(10.0))
    table, opts = make_table(collect(tmp_path / "res"), TableOptions(metric="ppl", format="csv"))
    assert opts.metric == "ppl" and opts.format == "csv"  # the command line wins over the spec
    spec.write_text("table:\n  rowz: [encoding]\n")
    with pytest.raises(ConfigError, match=r"table.rowz: unknown key; did you mean 'rows'"):
        make_table(collect(tmp_path / "res"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"metric": "bleu"}, r"metric: 'bleu' is not a metric of these runs; available: ppl, loss"),
        ({"rows": ("encodng",)}, r"rows: 'encodng' is not a config field.*did you mean encoding"),
        (
            {"rows": ("batch_size",)},
            r"rows: 'batch_size' is ambiguous: train.batch_size, eval.batch_size",
        ),
        ({"baseline": "nope"}, r"baseline: 'nope' is not a row label; rows are: alibi; xl"),
        ({"rows": ("encoding",), "cols": ("encoding",)}, r"cannot be both a row and a column"),
        (
            {"layout": "wide"},
            r"layout: 'wide' is not allowed; choose one of grid, xl_table6, xl_table8",
        ),
        ({"format": "html"}, r"format: 'html' is not allowed"),
    ],
)
def test_bad_options_are_one_line_errors(grid, options, message):
    with pytest.raises(ConfigError, match=message):
        make_table(grid, TableOptions(**options))


def test_a_cell_never_averages_two_settings_of_one_run(tmp_path):
    make_run(
        tmp_path,
        ["seed=0"],
        results=[
            ({"segment_len": 32, "mem_len": 0}, {"ppl": 9.0}),
            ({"segment_len": 32, "mem_len": 32}, {"ppl": 8.0}),
        ],
    )
    df = collect(tmp_path)
    assert make_table(df)[1].cols == ("mem_len",)
    with pytest.raises(ConfigError, match=r"mem_len varies within a run"):
        make_table(df, TableOptions(cols=("segment_len",)))


def test_no_finished_runs(tmp_path):
    make_run(tmp_path, ["seed=0"], state="failed")
    make_run(tmp_path, ["seed=1"], state="running")
    with pytest.raises(ConfigError, match=r"no finished runs with metrics \(1 failed, 1 running\)"):
        make_table(collect(tmp_path))


def test_latex_is_booktabs_with_escapes(tmp_path):
    make_grid(tmp_path, {("xl", 0): [10.0], ("xl", 1): [11.0]}, lengths=(32,))
    df = collect(tmp_path)
    df["encoding"] = "al_rfou & 50%"
    text = render(make_table(df, TableOptions(rows=("encoding",)))[0], "latex")
    assert r"\toprule" in text and r"\midrule" in text and r"\bottomrule" in text
    assert r"al\_rfou \& 50\%" in text and r"\textbf{10.50 $\pm$ 0.71}" in text
    assert (
        latex_escape("p<0.05 | a>b ~x^2")
        == r"p$<$0.05 \textbar{} a$>$b \textasciitilde{}x\textasciicircum{}2"
    )
    body = text[text.index(r"\toprule") : text.index(r"\bottomrule")]
    rows = [line for line in body.splitlines() if line.endswith(r"\\")]
    assert {line.count("&") - line.count(r"\&") for line in rows} == {1}
    assert text.count("{") - text.count(r"\{") == text.count("}") - text.count(r"\}")


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex not installed")
def test_latex_compiles(tmp_path, grid):
    xl_runs(tmp_path / "xl")
    tables = [
        make_table(grid, TableOptions(baseline="xl"))[0],
        make_table(collect(tmp_path / "xl"), TableOptions(layout="xl_table6"))[0],
    ]
    body = "".join(render(table, "latex") for table in tables)
    doc = (
        f"\\documentclass{{article}}\\usepackage{{booktabs,amssymb}}\\begin{{document}}\n"
        f"{body}\\end{{document}}\n"
    )
    (tmp_path / "t.tex").write_text(doc)
    result = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert "Warning" not in result.stdout.replace("LaTeX Font Warning", "")


def test_csv_has_numbers(grid):
    table, _ = make_table(grid, TableOptions(baseline="xl"))
    frame = pd.read_csv(io.StringIO(render(table, "csv"))).set_index("encoding")
    assert frame.loc["xl", "eval len 32"] == pytest.approx(statistics.mean([10.0, 10.2, 10.1]))
    assert frame.loc["alibi", "eval len 64 std"] == pytest.approx(
        statistics.stdev([12.4, 12.2, 12.9])
    )
    assert frame.loc["alibi", "eval len 32 n"] == 3 and bool(frame.loc["xl", "eval len 32 best"])
    assert pd.isna(frame.loc["xl", "eval len 32 p"]) and frame.loc["alibi", "eval len 32 p"] < 0.01
    raw, adjusted = baseline_family()
    for k, column in enumerate(("eval len 32", "eval len 64")):
        # the family-adjusted p
        assert frame.loc["alibi", f"{column} p"] == pytest.approx(adjusted[k])
        assert frame.loc["alibi", f"{column} p raw"] == pytest.approx(raw[k])
        assert pd.isna(frame.loc["xl", f"{column} p raw"])


def xl_runs(root):
    """XL-Table-6 style runs: recurrence x encoding x loss, attention lengths via evaluation
    mem_len."""
    spec = {  # (mem_len, encoding, loss_on): [ppl per evaluation mem_len 0, 16, 32] per seed
        (16, "ours", "full"): [[30.0, 27.0, 26.5], [30.4, 27.2, 26.7]],
        # tie at 32/48: shortest wins
        (16, "shaw", "full"): [[31.0, 28.0, 28.0], [31.2, 28.2, 28.2]],
        (0, "ours", "half"): [[29.0, 29.5, 30.0], [29.2, 29.9, 30.4]],
    }
    encodings = {
        "ours": ["model.attention.terms=abcd"],
        "shaw": [
            "model.attention.terms=ab",
            "model.attention.rel=learned",
            "model.attention.clamp_len=20",
        ],
    }
    for (mem, enc, loss), seeds in spec.items():
        for seed, values in enumerate(seeds):
            make_run(
                root,
                [
                    *encodings[enc],
                    f"model.mem_len={mem}",
                    f"train.loss_on={loss}",
                    "train.segment_len=16",
                    f"seed={seed}",
                ],
                variant={"encoding": enc, "recurrence": mem > 0, "loss": loss, "seed": seed},
                results=[
                    ({"segment_len": 16, "mem_len": m}, {"ppl": v})
                    for m, v in zip((0, 16, 32), values)
                ],
            )
    return spec


def test_xl_table6_layout(tmp_path):
    spec = xl_runs(tmp_path)
    table, _ = make_table(collect(tmp_path), TableOptions(layout="xl_table6"))
    assert table.index == ["Recurrence", "Encoding", "Loss"]
    assert table.columns == ["PPL init", "PPL best", "Attn Len"]
    rows = {tuple(labels): values for labels, values in table.rows}
    assert list(rows)[-1] == ("✗", "ours", "Half")  # recurrence rows first
    for (mem, enc, loss), seeds in spec.items():
        init, best, attn = rows[("✓" if mem else "✗", enc, loss.capitalize())]
        train_attn = 16 + mem  # evaluation mem_len equal to the training one
        k_init = (0, 16, 32).index(mem)
        assert init.mean == pytest.approx(statistics.mean(s[k_init] for s in seeds))
        means = [statistics.mean(s[k] for s in seeds) for k in range(3)]
        k_best = min(range(3), key=lambda k: (means[k], k))
        assert best.mean == pytest.approx(means[k_best]) and best.std == pytest.approx(
            statistics.stdev(s[k_best] for s in seeds)
        )
        assert attn == str(16 + (0, 16, 32)[k_best])
        assert train_attn in (16, 32)
    assert rows[("✓", "shaw", "Full")][2] == "32"
    assert rows[("✓", "ours", "Full")][1].best and rows[("✓", "ours", "Full")][
        1
    ].mean == pytest.approx(26.6)
    # 27.1 < 28.1 < 29.1
    assert rows[("✓", "ours", "Full")][0].best and not rows[("✗", "ours", "Half")][0].best
    latex = render(table, "latex")
    assert r"\checkmark" in latex and r"$\times$" in latex


def test_xl_table6_compares_the_xl_protocol_settings(tmp_path):
    """With xl and non_overlapping settings, Table 6 reads the xl ones (Attn Len = mem_len) only."""
    for mem, ppls in ((16, (9.0, 8.0, 30.0)), (0, (10.0, 9.5, 1.0))):
        make_run(
            tmp_path,
            ["model.attention.terms=abcd", f"model.mem_len={mem}", "train.segment_len=16"],
            variant={"encoding": "xl", "model.mem_len": mem},
            results=[
                (
                    {"segment_len": 16, "protocol": "xl", "mem_len": 16, "attn_len": 16},
                    {"ppl": ppls[0]},
                ),
                (
                    {"segment_len": 16, "protocol": "xl", "mem_len": 32, "attn_len": 32},
                    {"ppl": ppls[1]},
                ),
                (
                    {"segment_len": 16, "protocol": "non_overlapping", "mem_len": 0},
                    {"ppl": ppls[2]},
                ),
            ],
        )
    table, _ = make_table(collect(tmp_path), TableOptions(layout="xl_table6"))
    rows = {labels[0]: values for labels, values in table.rows}
    # init at attn 16 + 16
    assert rows["✓"][0].mean == 8.0 and rows["✓"][1].mean == 8.0 and rows["✓"][2] == "32"
    assert rows["✗"][0].mean == 10.0  # init: its training attention length, 16
    assert rows["✗"][1].mean == 9.5 and rows["✗"][2] == "32"  # never the non_overlapping 1.0
    assert (
        "Protocol xl (2 rows)" in table.caption
        and "mem_len, the keys every query sees" in table.caption
    )


def test_xl_table6_measures_each_row_the_way_it_was_trained(tmp_path):
    """With memory: the xl settings (init at attention length 16 + 16 = 32); without: the sliding
    windows of stride 1 (init at the training window, 16), never the xl settings that feed it memory
    it never had, nor a sliding window of another stride."""
    for mem, xl, sliding in ((16, (9.0, 8.0), (7.0, 6.0)), (0, (1.0, 1.0), (10.0, 9.5))):
        make_run(
            tmp_path,
            ["model.attention.terms=abcd", f"model.mem_len={mem}", "train.segment_len=16"],
            variant={"encoding": "xl", "model.mem_len": mem},
            results=[
                *(
                    ({"segment_len": 16, "protocol": "xl", "mem_len": m, "attn_len": m}, {"ppl": v})
                    for m, v in zip((16, 32), xl)
                ),
                *(
                    (
                        {
                            "segment_len": w,
                            "protocol": "sliding",
                            "stride": 1,
                            "mem_len": 0,
                            "attn_len": w,
                        },
                        {"ppl": v},
                    )
                    for w, v in zip((16, 32), sliding)
                ),
                (
                    {
                        "segment_len": 32,
                        "protocol": "sliding",
                        "stride": 8,
                        "mem_len": 0,
                        "attn_len": 32,
                    },
                    {"ppl": 0.5},
                ),
            ],
        )
    table, _ = make_table(collect(tmp_path), TableOptions(layout="xl_table6"))
    rows = {labels[0]: values for labels, values in table.rows}
    assert (rows["✓"][0].mean, rows["✓"][1].mean, rows["✓"][2]) == (8.0, 8.0, "32")
    assert (rows["✗"][0].mean, rows["✗"][1].mean, rows["✗"][2]) == (10.0, 9.5, "32")
    assert "Protocol xl (1 row)" in table.caption and "sliding (1 row)" in table.caption


def test_cli_table(tmp_path, capsys):
    make_grid(tmp_path, PPL, lengths=(32, 64))
    assert (
        main(
            ["table", str(tmp_path), "--rows", "encoding", "--cols", "eval_len", "--baseline", "xl"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("| encoding | eval len 32 | eval len 64 |") and "**10.10 ± 0.10**" in out
    tex = tmp_path / "table.tex"
    assert main(["table", str(tmp_path), "--out", str(tex)]) == 0
    assert tex.read_text().startswith("% requires \\usepackage{booktabs}")
    assert main(["table", str(tmp_path), "--metric", "bleu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: metric: 'bleu' is not a metric of these runs; available: ppl, loss"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["table", str(empty)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_an_unreadable_eval_json_leaves_its_run_out_by_name_and_keeps_the_labels(tmp_path, capsys):
    xl, alibi = make_grid(tmp_path, {("xl", 0): [3.0, 4.0], ("alibi", 0): [2.0, 3.0]})
    (alibi / "eval.json").write_text('{"main_metric": "pp')  # truncated
    assert main(["table", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert (
        captured.out.startswith("| encoding | eval len 32 | eval len 64 |\n")
        and "| xl |" in captured.out
    )
    assert (
        f"warning: left out run {alibi.name} (encoding=alibi): eval.json missing or unreadable"
        in captured.err
    )


def train_alone(root, name, encoding):
    """A run trained by `train` alone in root/runs/<name>: no run.json, no experiment."""
    run = make_run(root, ENCODINGS[encoding], results=[({"segment_len": 32}, {"ppl": 3.0})])
    (run / "run.json").unlink()
    (root / "runs").mkdir(exist_ok=True)
    return run.rename(root / "runs" / name)


def test_runs_trained_by_train_alone_are_labelled_by_their_dir_or_by_what_differs(tmp_path):
    """The folder holding such runs ('runs') is no experiment: never a label."""
    mine = train_alone(tmp_path, "mine", "xl")
    table, opts = make_table(collect(mine))
    assert opts.rows == ("run_id",) and [labels for labels, _ in table.rows] == [["mine"]]
    train_alone(tmp_path, "other", "alibi")
    table, opts = make_table(collect(tmp_path / "runs"))
    assert "experiment" not in opts.rows and "runs" not in str(table.rows)
    assert sorted(labels[0] for labels, _ in table.rows) == ["a", "abcd"]  # model.attention.terms


def test_axis_orders_follow_grid_and_zip_columns():
    from relpos_ablate.analysis.table_options import axis_orders

    spec = {
        "grid": {"model.mem_len": [64, 0]},
        "zip": {
            "encoding": ["xl", "xl", "t5", "alibi"],
            "model.attention.terms": ["abcd", "ab", "a", "a"],
        },
    }
    assert axis_orders(spec) == {
        "model.mem_len": [64, 0],
        "encoding": ["xl", "t5", "alibi"],
        "model.attention.terms": ["abcd", "ab", "a"],
    }


def test_latex_output_is_plain_ascii(grid):
    """pdflatex without extra packages rejects characters like α (the family's level in a baseline
    caption): checked here even where pdflatex is not installed."""
    text = render(make_table(grid, TableOptions(baseline="xl"))[0], "latex")
    assert "$\\alpha$" in text and text.isascii(), [c for c in text if not c.isascii()]


def test_table_settings_leaves_out_recl_ladders_only():
    """Settings saving token losses at a fixed context that is one of the run's eval.recl_contexts
    are RECL's ladder (a subset of targets), left out of plain tables; any other (a run without
    recl_contexts, or a setting of the user's at another context or protocol, in the same run)
    stays."""
    import pandas as pd

    from relpos_ablate.analysis.settings import table_settings

    frame = pd.DataFrame(
        {
            "token_losses": [
                None,
                "setting_1",
                "setting_2",
                None,
                "setting_4",
                "setting_5",
                "setting_6",
            ],
            "eval.recl_contexts": [
                "[16,32]",
                "[16,32]",
                "[]",
                "[]",
                "[16,32]",
                "[16,32]",
                "[16, 32]",
            ],
            "protocol": [
                "non_overlapping",
                "sliding",
                "sliding",
                "sliding",
                "sliding",
                "xl",
                "sliding",
            ],
            "stride": [None, 1, 1, 1, 1, None, 8],
            "attn_len": [64, 16, 16, 16, 40, 32, 32],
        }
    )
    assert table_settings(frame).index.tolist() == [0, 2, 3, 4, 6]
    assert table_settings(
        frame.drop(columns=["protocol", "stride", "attn_len"])
    ).index.tolist() == [0, 2, 3]
