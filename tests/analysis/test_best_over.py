"""`table --best-over KEY`: every cell at its row's best value of KEY on the selection split,
reporting the other split; checked against picks and statistics computed here from the fixture's
numbers, in every format, from the command line and the spec's `table:` block, and the one-line
errors.

Run: .venv/bin/python -m pytest tests/analysis/test_best_over.py -q
"""

import io
import statistics

import pandas as pd
import pytest

from fixtures.report_runs import ENCODINGS, make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.render import render
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.studies import make_table

LRS = (0.0005, 0.001, 0.002)
SEEDS = (0, 1, 2)
# (encoding, lr) -> per seed: ppl at COLUMNS. xl is best on valid at 0.002 at length 64 but best on
# test at 0.001 (a pick made on test would differ); the valid picks differ by length (alibi: 0.001
# at 64, 0.0005 at 128).
PPL = {
    ("xl", 0.0005): [(9.0, 9.9, 9.5, 9.6), (9.2, 9.7, 9.4, 9.8), (9.1, 9.8, 9.6, 9.7)],
    ("xl", 0.001): [(8.0, 7.0, 8.5, 8.6), (8.1, 7.1, 8.4, 8.5), (8.2, 7.2, 8.6, 8.4)],
    ("xl", 0.002): [(7.5, 7.9, 8.8, 8.9), (7.6, 8.0, 8.9, 9.0), (7.4, 7.8, 8.7, 8.8)],
    ("alibi", 0.0005): [(8.6, 8.7, 7.0, 7.1), (8.8, 8.9, 7.2, 7.3), (8.7, 8.8, 7.1, 7.2)],
    ("alibi", 0.001): [(8.3, 8.4, 7.9, 8.0), (8.2, 8.3, 7.8, 7.9), (8.4, 8.5, 8.0, 8.1)],
    ("alibi", 0.002): [(9.5, 9.4, 9.0, 9.1), (9.6, 9.5, 9.1, 9.2), (9.4, 9.3, 8.9, 9.0)],
}
COLUMNS = (("valid", 64), ("test", 64), ("valid", 128), ("test", 128))
"""The order of each seed's tuple in PPL."""


def write_runs(root, spec=None, lengths=(64, 128)):
    for (enc, lr), seeds in PPL.items():
        for seed, values in zip(SEEDS, seeds):
            results = [
                ({"segment_len": length, "split": split}, {"ppl": ppl})
                for (split, length), ppl in zip(COLUMNS, values)
                if length in lengths
            ]
            make_run(
                root,
                [*ENCODINGS[enc], f"train.lr={lr}", f"seed={seed}", "train.segment_len=64"],
                experiment="fair",
                variant={"encoding": enc, "train.lr": lr, "seed": seed},
                spec=spec,
                results=results,
            )
    return collect(root)


def ppl(enc, lr, split, length):
    k = COLUMNS.index((split, length))
    return [seed[k] for seed in PPL[(enc, lr)]]


def valid_pick(enc, length):
    """The lr whose mean valid ppl is lowest, from the fixture's numbers."""
    return min(LRS, key=lambda lr: statistics.mean(ppl(enc, lr, "valid", length)))


@pytest.fixture
def frame(tmp_path):
    return write_runs(tmp_path)


def rows_of(table):
    return {labels[0]: (labels, values) for labels, values in table.rows}


def test_each_row_reports_test_at_the_lr_valid_picks(frame):
    table, opts = make_table(frame, TableOptions(best_over="lr", cols=("segment_len",)))
    assert (opts.best_over, opts.rows, opts.select_split, opts.report_split) == (
        "train.lr",
        ("encoding",),
        "valid",
        "test",
    )
    assert (valid_pick("xl", 64), valid_pick("alibi", 64), valid_pick("alibi", 128)) == (
        0.002,
        0.001,
        0.0005,
    )
    # not what is reported
    assert min(LRS, key=lambda lr: statistics.mean(ppl("xl", lr, "test", 64))) == 0.001
    assert table.index == ["encoding"] and table.columns == [
        "eval len 64",
        "lr (eval len 64)",
        "eval len 128",
        "lr (eval len 128)",
    ]
    rows = rows_of(table)
    for enc in ("xl", "alibi"):
        values = rows[enc][1]
        for k, length in enumerate((64, 128)):
            lr = valid_pick(enc, length)
            cell, shown = values[2 * k], values[2 * k + 1]
            assert shown == f"{lr:g}"
            assert cell.mean == pytest.approx(statistics.mean(ppl(enc, lr, "test", length)))
            assert (
                cell.std == pytest.approx(statistics.stdev(ppl(enc, lr, "test", length)))
                and cell.n == 3
            )
    for k, length in enumerate((64, 128)):  # bold: the lower test mean among the picked cells
        means = {
            enc: statistics.mean(ppl(enc, valid_pick(enc, length), "test", length))
            for enc in ("xl", "alibi")
        }
        assert {enc: rows[enc][1][2 * k].best for enc in means} == {
            enc: m == min(means.values()) for enc, m in means.items()
        }
    assert (
        "test ppl at each row's best train.lr" in table.caption
        and "mean valid ppl over seeds" in table.caption
    )


def test_one_column_shows_the_pick_as_a_label_and_renders_in_every_format(tmp_path):
    frame = write_runs(tmp_path, lengths=(64,))
    table, _ = make_table(frame, TableOptions(best_over="train.lr", baseline="xl"))
    # one setting: no column key
    assert table.index == ["encoding", "lr"] and table.columns == ["test ppl"]
    rows = rows_of(table)
    assert rows["xl"][0] == ["xl", "0.002"] and rows["alibi"][0] == ["alibi", "0.001"]
    markdown = render(table, "markdown")
    assert markdown.splitlines()[0] == "| encoding | lr | test ppl |"
    assert "| xl | 0.002 | **7.90 ± 0.10** |" in markdown  # 7.9, 8.0, 7.8
    csv = pd.read_csv(io.StringIO(render(table, "csv"))).set_index("encoding")
    assert csv.loc["xl", "lr"] == 0.002
    assert csv.loc["xl", "test ppl"] == pytest.approx(statistics.mean(ppl("xl", 0.002, "test", 64)))
    welch = csv.loc["alibi", "test ppl p"]  # tested against the baseline's picked cell
    from scipy import stats

    assert welch == pytest.approx(
        stats.ttest_ind(
            ppl("alibi", 0.001, "test", 64), ppl("xl", 0.002, "test", 64), equal_var=False
        ).pvalue
    )
    assert "alibi & 0.001 & " in render(table, "latex")


def test_the_splits_can_be_swapped(tmp_path):
    frame = write_runs(tmp_path, lengths=(64,))
    table, _ = make_table(
        frame,
        TableOptions(best_over="train.lr", cols=(), select_split="test", report_split="valid"),
    )
    picked = min(LRS, key=lambda lr: statistics.mean(ppl("xl", lr, "test", 64)))
    assert rows_of(table)["xl"][0][1] == f"{picked:g}" and table.columns == ["valid ppl"]


def test_ties_go_to_the_first_value_in_the_spec_order(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: fair\ngrid:\n  encoding: [xl]\n  train.lr: [0.002, 0.001]\ntable:\n  "
        "best_over: train.lr\n"
    )
    for lr in (0.001, 0.002):
        make_run(
            tmp_path / "res",
            [f"train.lr={lr}"],
            experiment="fair",
            spec=str(spec),
            variant={"encoding": "xl", "train.lr": lr},
            results=[
                ({"segment_len": 64, "split": "valid"}, {"ppl": 5.0}),
                ({"segment_len": 64, "split": "test"}, {"ppl": 6.0 if lr == 0.002 else 7.0}),
            ],
        )
    frame = collect(tmp_path / "res")
    # best_over from the spec's table: block; one row: the experiment
    table, opts = make_table(frame)
    assert (
        opts.best_over == "train.lr"
        and table.rows[0][0] == ["fair", "0.002"]
        and table.rows[0][1][0].mean == 6.0
    )
    # off: every lr (in spec order) and split
    table, opts = make_table(frame, TableOptions(best_over="none"))
    assert (opts.best_over, opts.rows, opts.cols) == (None, ("train.lr",), ("split",))
    assert [labels for labels, _ in table.rows] == [["0.002"], ["0.001"]]


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"best_over": "segment_len"},
            r"best_over: segment_len has one value in these runs \(64\): nothing to pick",
        ),
        ({"best_over": "lr", "rows": ("encoding", "lr")}, r"best_over: train.lr is picked per row"),
        (
            {"best_over": "lr", "cols": ("split",)},
            r"best_over: the split is --select-split / --report-split",
        ),
        ({"best_over": "lerning_rate"}, r"best_over: 'lerning_rate' is not a config field"),
        (
            {"best_over": "lr", "layout": "xl_table6"},
            r"best_over: picks a value per row of the grid layout",
        ),
        (
            {"best_over": "lr", "select_split": "dev"},
            r"select_split: 'dev' is not allowed; choose one of valid, test",
        ),
    ],
)
def test_bad_best_over_is_one_line(tmp_path, options, message):
    frame = write_runs(tmp_path, lengths=(64,))
    with pytest.raises(ConfigError, match=message):
        make_table(frame, TableOptions(**options))


def test_a_missing_split_is_one_line(tmp_path, capsys):
    make_run(
        tmp_path,
        ["train.lr=0.001"],
        results=[({"segment_len": 64, "split": "valid"}, {"ppl": 5.0})],
    )
    make_run(
        tmp_path,
        ["train.lr=0.002"],
        results=[({"segment_len": 64, "split": "valid"}, {"ppl": 6.0})],
    )
    assert main(["table", str(tmp_path), "--best-over", "train.lr"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "error: report_split: no ppl on the test split in these runs (they have valid)" in err


def test_cli_best_over(frame, tmp_path, capsys):
    root = frame.attrs["results_dir"]
    assert (
        main(
            [
                "table",
                root,
                "--best-over",
                "train.lr",
                "--cols",
                "segment_len",
                "--out",
                str(tmp_path / "t.csv"),
            ]
        )
        == 0
    )
    csv = pd.read_csv(tmp_path / "t.csv").set_index("encoding")
    assert csv.loc["alibi", "lr (eval len 128)"] == 0.0005
    assert (
        main(
            [
                "table",
                root,
                "--best-over",
                "train.lr",
                "--select-split",
                "test",
                "--cols",
                "segment_len",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("| encoding | eval len 64 | lr (eval len 64) |") and "| xl | " in out
