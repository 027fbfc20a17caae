"""Tables (issue 56, first-hour defects): no pandas PerformanceWarning on a frame of many columns
added one by one (as collect's frame of a grid with many config fields can be), and a `best_over`
table names a column it cannot fill (no selection-split twin) instead of dropping it silently.

Run: .venv/bin/python -m pytest tests/test_first_hour_table.py -q
"""

import statistics
import warnings

import pandas as pd
import pytest

from fixtures.report_runs import ENCODINGS, make_grid, make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.table_options import TableOptions, default_cols, left_out_runs
from relpos_ablate.studies import make_table


def fragmented(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with 120 more columns, inserted one at a time (pandas: 'highly fragmented')."""
    frame = frame.copy()
    with warnings.catch_warnings():  # pandas warns here, as it should
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        for k in range(120):
            frame[f"model.extra_{k}"] = k
    return frame


def test_no_performance_warning_on_a_fragmented_frame(tmp_path):
    make_grid(
        tmp_path,
        {("xl", 0): [9.0, 11.0], ("xl", 1): [9.5, 11.5], ("alibi", 0): [8.0, 8.5]},
    )
    make_run(
        tmp_path,
        [*ENCODINGS["alibi"], "seed=1"],
        variant={"encoding": "alibi", "seed": 1},
        state="failed",
    )
    collected = collect(tmp_path)
    frame = fragmented(collected)
    done = fragmented(collected[collected["status"] == "done"])  # what resolve_options passes
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.PerformanceWarning)
        cols = default_cols(done, ["encoding"])
        lines = left_out_runs(frame, "ppl", ["encoding"])
    assert cols == ["segment_len"]  # the one setting that varies within a row
    failed = frame.loc[frame["status"] == "failed", "run_id"].iloc[0]
    assert lines == [f"left out run {failed} (encoding=alibi): failed: loss became nan at step 7"]


LRS = (0.001, 0.002)
# (encoding, lr) -> per seed: (valid 64, test 64, test 128); 128 has no valid twin
PPL = {
    ("xl", 0.001): [(8.0, 8.1, 9.0), (8.2, 8.3, 9.2)],
    ("xl", 0.002): [(7.0, 7.5, 9.9), (7.2, 7.7, 9.7)],
    ("alibi", 0.001): [(6.0, 6.1, 6.5), (6.2, 6.3, 6.7)],
    ("alibi", 0.002): [(6.5, 6.6, 6.0), (6.7, 6.8, 6.2)],
}


def test_best_over_names_a_column_without_a_selection_twin(tmp_path, capsys):
    for (enc, lr), seeds in PPL.items():
        for seed, (valid, test, long) in enumerate(seeds):
            make_run(
                tmp_path,
                [*ENCODINGS[enc], f"train.lr={lr}", f"seed={seed}", "train.segment_len=64"],
                experiment="fair",
                variant={"encoding": enc, "train.lr": lr, "seed": seed},
                results=[
                    ({"segment_len": 64, "split": "valid"}, {"ppl": valid}),
                    ({"segment_len": 64, "split": "test"}, {"ppl": test}),
                    ({"segment_len": 128, "split": "test"}, {"ppl": long}),
                ],
            )
    table, _ = make_table(collect(tmp_path), TableOptions(best_over="lr", cols=("segment_len",)))
    # the one column with a pick: test ppl at each row's best valid lr
    assert table.index == ["encoding", "lr"] and table.columns == ["eval len 64"]
    for labels, values in table.rows:
        enc = labels[0]
        lr = min(LRS, key=lambda lr: statistics.mean(s[0] for s in PPL[(enc, lr)]))
        assert labels[1] == f"{lr:g}"
        assert values[0].mean == pytest.approx(statistics.mean(s[1] for s in PPL[(enc, lr)]))
    assert table.caption.endswith(
        "Left out: eval len 128: no valid ppl there to pick train.lr on (evaluate those settings "
        "with split: valid too)."
    )
