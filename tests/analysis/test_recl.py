"""RECL (docs/guide/evaluation.md#recl) on frames whose answer is worked out by hand below, and the
xl_table8 layout on fixture run dirs (eval.json + token_losses.npz as training writes them).

Run: .venv/bin/python -m pytest tests/analysis/test_recl.py -q
"""

import io
import math

import numpy as np
import pandas as pd
import pytest

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect
from relpos_ablate.analysis.recl import (
    own_gain,
    recl,
    relative_gain,
    token_loss_frame,
    top_fraction,
)
from relpos_ablate.analysis.table_options import TableOptions
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_bytes
from relpos_ablate.studies import make_table

# l_i(c, t) for two models at contexts 10, 20, 30 on four targets.
LOSSES = {
    "A": {10: [2.0, 1.0, 3.0, 0.5], 20: [1.5, 1.0, 2.0, 0.5], 30: [1.5, 1.0, 1.9, 0.5]},
    "B": {10: [2.5, 0.8, 3.2, 0.6], 20: [2.4, 0.8, 3.1, 0.6], 30: [1.0, 0.8, 2.0, 0.6]},
}


def tidy(losses=LOSSES) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"model": m, "context": c, "target": t, "loss": v}
            for m, by_c in losses.items()
            for c, values in by_c.items()
            for t, v in enumerate(values)
        ]
    )


def gain(f_short, f_long):
    return (math.exp(f_short) - math.exp(f_long)) / math.exp(f_short)


def test_recl_half_of_the_hardest_targets_by_hand():
    """r = 0.5: two targets. c = 10: b = [2.0, 0.8, 3.0, 0.5], T = {2, 0}, f(10, 10) = 2.5.
    A: min(b, l_A(20)) on T = (2.0 + 1.5) / 2 = 1.75, g = 1 - e^-0.75 = 0.53 > 1%: go on.
    B: min(b, l_B(20)) on T = (3.0 + 2.0) / 2 = 2.5, g = 0 < 1%: RECL_B = 10 (it would gain from 20
    to 30, but the search has stopped). c = 20 for A: b = [1.5, 0.8, 2.0, 0.5], T = {2, 0}, f =
    1.75;
    min(b, l_A(30)) = (1.9 + 1.5) / 2 = 1.7, g = 1 - e^-0.05 = 4.9% > 1%: still gaining at the last
    step."""
    frame = tidy()
    # (models, contexts, targets)
    values = np.array([[LOSSES[m][c] for c in (10, 20, 30)] for m in "AB"])
    assert relative_gain(values, 0, 0, 1, 0.5) == pytest.approx(gain(2.5, 1.75))
    assert relative_gain(values, 1, 0, 1, 0.5) == pytest.approx(0.0)
    assert relative_gain(values, 0, 1, 2, 0.5) == pytest.approx(gain(1.75, 1.7))
    result = recl(frame, r=0.5)
    assert result.to_dict("records") == [
        {"model": "A", "recl": 30, "censored": True},
        {"model": "B", "recl": 10, "censored": False},
    ]
    # a 5% threshold stops A at 20 (its gain from 20 to 30 is 4.9%)
    assert recl(frame, r=0.5, threshold=0.05)["recl"].tolist() == [20, 10]


def test_recl_all_targets_by_hand():
    """r = 1: T is every target. c = 10: f = 6.3 / 4; A: (1.5 + 0.8 + 2.0 + 0.5) / 4 = 1.2.
    c = 20: f = 4.8 / 4 = 1.2; A at 30: (1.5 + 0.8 + 1.9 + 0.5) / 4 = 1.175, g = 1 - e^-0.025 =
    2.5%."""
    values = np.array([[LOSSES[m][c] for c in (10, 20, 30)] for m in "AB"])
    assert relative_gain(values, 0, 0, 1, 1.0) == pytest.approx(gain(6.3 / 4, 1.2))
    assert relative_gain(values, 0, 1, 2, 1.0) == pytest.approx(gain(1.2, 1.175))
    assert recl(tidy(), r=1.0)[["recl", "censored"]].values.tolist() == [[30, True], [10, False]]
    assert recl(tidy(), r=1.0, threshold=0.03)["recl"].tolist() == [20, 10]


def test_the_token_set_is_chosen_again_for_every_context():
    """b(10) puts target 3 first, b(20) target 0: A gains on target 3 at 10 -> 20 (from 4.0 to 1.0)
    and nothing on target 0; from 20 to 30 A gains on target 0 only. With r = 0.25 (one target) a
    token set fixed at c = 10 would see no gain from 20 to 30; re-chosen, it sees 3.0 -> 1.0."""
    losses = {
        "A": {10: [3.0, 0.1, 0.1, 4.0], 20: [3.0, 0.1, 0.1, 1.0], 30: [1.0, 0.1, 0.1, 1.0]},
        "B": {10: [3.5, 0.1, 0.1, 4.5], 20: [3.5, 0.1, 0.1, 4.5], 30: [3.5, 0.1, 0.1, 4.5]},
    }
    values = np.array([[losses[m][c] for c in (10, 20, 30)] for m in "AB"])
    assert relative_gain(values, 0, 1, 2, 0.25) == pytest.approx(gain(3.0, 1.0))
    assert recl(tidy(losses), r=0.25).to_dict("records")[0] == {
        "model": "A",
        "recl": 30,
        "censored": True,
    }


def test_a_model_whose_own_loss_rises_earns_no_recl_from_a_lucky_target():
    """V is far above the group's best A; from 10 to 20 it beats b on target 0 (1.0 < 2.0) but its
    own mean loss rises (3.0 -> 3.5). The paper's gain alone: f_V(10, 20) = (1.0 + 2.0) / 2 = 1.5
    against f(10, 10) = 2.0, g = 1 - e^-0.5 = 39% (RECL >= 20); the guard stops V at 10."""
    losses = {"A": {10: [2.0, 2.0], 20: [2.0, 2.0]}, "V": {10: [3.0, 3.0], 20: [1.0, 6.0]}}
    values = np.array([[losses[m][c] for c in (10, 20)] for m in "AV"])
    assert relative_gain(values, 1, 0, 1, 1.0) == pytest.approx(gain(2.0, 1.5))
    assert own_gain(values, 1, 0, 1, 1.0) == pytest.approx(3.0 - 3.5)
    assert recl(tidy(losses), r=1.0).to_dict("records") == [
        {"model": "A", "recl": 10, "censored": False},
        {"model": "V", "recl": 10, "censored": False},
    ]


def test_top_fraction_rounds_keeps_one_and_breaks_ties_by_order():
    # 0.1 · 30 is 3.0000000000000004 in floating point
    assert len(top_fraction(np.arange(30.0), 0.1)) == 3
    # round(0.4) = 0 -> at least one
    assert top_fraction(np.array([1.0, 5.0, 2.0, 9.0]), 0.1).tolist() == [3]
    assert top_fraction(np.array([2.0, 1.0, 2.0, 2.0]), 0.5).tolist() == [0, 2]


def test_targets_some_model_did_not_score_are_left_out():
    frame = tidy()
    frame.loc[
        (frame["model"] == "B") & (frame["context"] == 20) & (frame["target"] == 2), "loss"
    ] = np.nan
    # without target 2: c = 10, b = [2.0, 0.8, ·, 0.5], r = 0.5 of 3 targets -> 2: T = {0, 1}: A
    # gains 0.5 on target 0
    values = np.array(
        [[[v for t, v in enumerate(LOSSES[m][c]) if t != 2] for c in (10, 20, 30)] for m in "AB"]
    )
    assert relative_gain(values, 0, 0, 1, 0.5) == pytest.approx(gain(1.4, 1.15))
    assert (
        recl(frame, r=0.5)["recl"].tolist()
        == recl(
            tidy(
                {
                    m: {c: [v for t, v in enumerate(vals) if t != 2] for c, vals in by_c.items()}
                    for m, by_c in LOSSES.items()
                }
            ),
            r=0.5,
        )["recl"].tolist()
    )


# ---------------------------------------------------------------- xl_table8 on run dirs

MODELS = {  # (encoding, memory) -> overrides
    ("ours", 16): ["model.attention.terms=abcd", "model.mem_len=16"],
    ("ours", 0): ["model.attention.terms=abcd"],
    ("shaw", 16): [
        "model.attention.terms=ab",
        "model.attention.rel=learned",
        "model.attention.clamp_len=20",
        "model.mem_len=16",
    ],
}
JUNK = 50.0
"""Losses of targets without the ladder's longest context in their stream: never used by RECL."""


def ladder_setting(c: int, mem: int, k: int) -> dict:
    """Context c as the run's kind gets it: memory of c keys (xl) with memory, else a sliding window
    of c."""
    own = (
        {"segment_len": 16, "protocol": "xl", "mem_len": c}
        if mem
        else {"segment_len": c, "protocol": "sliding", "stride": 1, "mem_len": 0}
    )
    return {**own, "attn_len": c, "max_targets": 33, "token_losses": f"setting_{k + 1}"}


def write_ladder_run(
    root, encoding, mem, seed, usable: dict[int, list[float]], other_kind: bool = False
):
    """A done run with the RECL ladder 10, 20, 30 on one stream of 33 targets: positions 29..32
    carry `usable[c]`, the first 29 carry JUNK (they have less than 30 tokens of context).
    `other_kind`: the ladder of the other kind too (sliding for a model with memory), with JUNK
    everywhere."""
    ladder = [(ladder_setting(c, mem, k), {"ppl": 5.0, "loss": 1.6}) for k, c in enumerate(usable)]
    if other_kind:
        ladder += [
            (ladder_setting(c, not mem, k + len(usable)), {"ppl": 9.0, "loss": 2.2})
            for k, c in enumerate(usable)
        ]
    run_dir = make_run(
        root,
        [*MODELS[(encoding, mem)], f"seed={seed}", "train.segment_len=16"],
        experiment="xl_table6",
        variant={"encoding": encoding, "model.mem_len": mem, "seed": seed},
        results=[({"segment_len": 16}, {"ppl": 6.0, "loss": 1.8}), *ladder],
    )
    arrays = {
        f"setting_{k + 1}": np.array([[JUNK] * 29 + list(values)], dtype=np.float32)
        for k, values in enumerate(usable.values())
    }
    if other_kind:
        arrays.update(
            {
                f"setting_{k + 1 + len(usable)}": np.full((1, 33), JUNK, dtype=np.float32)
                for k in range(len(usable))
            }
        )
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_write_bytes(run_dir / "token_losses.npz", buffer.getvalue())
    return run_dir


def test_token_loss_frame_keeps_the_targets_with_the_longest_context(tmp_path):
    write_ladder_run(
        tmp_path, "ours", 16, 0, {10: [1.0, 2.0, 3.0, 4.0], 20: [1.0] * 4, 30: [0.5] * 4}
    )
    frame = token_loss_frame(collect(tmp_path))
    assert sorted(frame["target"].unique()) == [29, 30, 31, 32]
    assert frame[frame["context"] == 10].sort_values("target")["loss"].tolist() == [
        1.0,
        2.0,
        3.0,
        4.0,
    ]


def test_xl_table8_layout(tmp_path):
    """A (ours, recurrence) and B (shaw, recurrence) as in the hand-computed frame; C (ours, no
    recurrence) never the best: b(c, t) is still A and B's. Seed 1 repeats seed 0 with A's last step
    smaller (stops at 20)."""
    c_losses = {c: [v + 1.0 for v in LOSSES["A"][10]] for c in (10, 20, 30)}
    for seed in (0, 1):
        a = {**LOSSES["A"], **({30: [1.5, 1.0, 2.0, 0.5]} if seed else {})}
        # its sliding ladder is not its own
        write_ladder_run(tmp_path, "ours", 16, seed, a, other_kind=True)
        write_ladder_run(tmp_path, "shaw", 16, seed, LOSSES["B"])
        write_ladder_run(tmp_path, "ours", 0, seed, c_losses)
    table, options = make_table(collect(tmp_path), TableOptions(layout="xl_table8"))
    assert options.layout == "xl_table8"
    assert table.index == ["Recurrence", "Encoding", "Loss"]
    assert table.columns == ["r = 0.1", "r = 0.5", "r = 1.0", "ppl c=10", "ppl c=20", "ppl c=30"]
    rows = {tuple(labels): values for labels, values in table.rows}
    # r = 0.5 and 1.0: seed 0 gives A >= 30 (censored), seed 1 gives 20; B stops at 10; C gains
    # nothing over b
    assert rows[("✓", "ours", "Full")][1:3] == ["≥25 ± 7", "≥25 ± 7"]
    assert rows[("✓", "shaw", "Full")][1:3] == ["10 ± 0", "10 ± 0"]
    assert rows[("✗", "ours", "Full")][:3] == ["10 ± 0"] * 3
    # each model's perplexity at c on the 4 targets used: exp of the mean loss, per seed, then mean
    # ± std
    assert (
        rows[("✗", "ours", "Full")][3:]
        == [f"{math.exp(np.mean([3.0, 2.0, 4.0, 1.5])):.2f} ± 0.00"] * 3
    )
    a30 = [math.exp(np.mean(LOSSES["A"][30])), math.exp(np.mean([1.5, 1.0, 2.0, 0.5]))]
    assert rows[("✓", "ours", "Full")][5] == f"{np.mean(a30):.2f} ± {np.std(a30, ddof=1):.2f}"
    for text in (
        "r: the fraction of hardest targets",
        "threshold: relative gain 1%",
        "contexts c = 10, 20, 30",
        "start c = 10, Δ = 10",
        "exactly c tokens of context",
        "first 33 targets",
        "the 4 with 30 tokens",
        "group of these 3 models, per seed, then mean ± std over 2 seeds",
        "models with memory: memory + same_length",
        "models without: a sliding window",
    ):
        assert text in table.caption


def test_xl_table8_errors_are_one_line(tmp_path, capsys):
    make_run(tmp_path, ["seed=0"], results=[({"segment_len": 16}, {"ppl": 6.0})])
    with pytest.raises(
        ConfigError, match=r"^layout: no RECL ladder in these runs \(set eval\.recl_contexts"
    ):
        make_table(collect(tmp_path), TableOptions(layout="xl_table8"))
    write_ladder_run(tmp_path, "ours", 16, 0, {10: [1.0] * 4, 20: [1.0] * 4})
    write_ladder_run(tmp_path, "shaw", 16, 0, {10: [1.0] * 4, 30: [1.0] * 4})
    assert main(["table", str(tmp_path), "--layout", "xl_table8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: layout: runs evaluated different RECL ladders: [(10, 20), (10, 30)]"
    )
