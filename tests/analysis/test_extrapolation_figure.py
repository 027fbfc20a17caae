"""`plot --kind extrapolation` as a paper figure: a panel per protocol, a colour per line and a line
style per family, at most 10 lines a panel (more: rows of families), the ratio to each run's value
at its training length, a y range set by the seed means (not a wild band), coinciding lines drawn
once and named, a zoomed row for the lines that hold; and run titles that name the variant in words.
Expected values are computed here from the fixture's numbers.

Run: .venv/bin/python -m pytest tests/analysis/test_extrapolation_figure.py -q
"""

import statistics

import pytest

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect, plots
from relpos_ablate.analysis.extrapolation import build_extrapolation
from relpos_ablate.analysis.extrapolation_lines import MAX_LINES

FAMILY = {  # encoding -> (its attention fields, its family's line style)
    "vaswani": (["model.attention.absolute=sinusoid"], ":"),
    "learned": (["model.attention.absolute=learned"], ":"),
    "rope": (["model.attention.absolute=rope"], "--"),
    "alibi": (["model.attention.bias=alibi"], "-"),
    "alibi_learned": (["model.attention.bias=alibi_learned"], "-"),
    "t5": (["model.attention.bias=t5"], "-"),
    "kerple_log": (["model.attention.bias=kerple_log"], "-"),
    "kerple_power": (["model.attention.bias=kerple_power"], "-"),
    "fire": (["model.attention.bias=fire"], "-"),
    "sandwich": (["model.attention.bias=sandwich"], "-"),
    "xl_table": (["model.attention.bias=xl_table"], "-"),
    "fox": (["model.attention.forget_gate=true"], "-."),
    "xl": (["model.attention.terms=abcd"], None),
}
LENGTHS = (8, 16, 32)


def runs(root, ppl: dict, protocols=("non_overlapping", "sliding")):
    """A done run per (encoding, seed) trained at 8: ppl[(encoding, seed)][k] at LENGTHS[k], both
    protocols (sliding: windows moved by 8, ppl - 0.5)."""
    for (encoding, seed), values in ppl.items():
        terms = [] if encoding == "xl" else ["model.attention.terms=a"]
        settings = [
            (
                {"segment_len": n, "protocol": p, **({"stride": 8} if p == "sliding" else {})},
                {"ppl": v - (0.5 if p == "sliding" else 0.0)},
            )
            for p in protocols
            for n, v in zip(LENGTHS, values)
        ]
        make_run(
            root,
            [*terms, *FAMILY[encoding][0], f"seed={seed}", "train.segment_len=8", "data.offset=2"],
            variant={"encoding": encoding, "seed": seed},
            results=settings,
        )


def panels(fig):
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_lines()]


def curves(ax) -> dict:
    return {ln.get_label(): ln for ln in ax.get_lines() if ln.get_marker() == "o"}


def test_a_panel_per_protocol_a_colour_per_encoding_and_a_style_per_family(tmp_path):
    runs(
        tmp_path,
        {
            (e, 0): [10.0, 11.0 + k, 12.0 + 2 * k]
            for k, e in enumerate(["vaswani", "rope", "alibi", "fox", "xl"])
        },
    )
    fig = plots.extrapolation_figure(collect(tmp_path))
    first, second = panels(fig)
    assert [first.get_title(), second.get_title()] == ["non_overlapping", "sliding, stride 8"]
    for encoding in ("vaswani", "rope", "alibi", "fox"):
        a, b = curves(first)[encoding], curves(second)[encoding]
        assert a.get_color() == b.get_color() and a.get_linestyle() == FAMILY[encoding][1]
        assert list(b.get_ydata()) == pytest.approx(list(a.get_ydata() - 0.5))
    assert len({curves(first)[e].get_color() for e in curves(first)}) == 5
    assert first.get_xscale() == "log" and [t.get_text() for t in first.get_xticklabels()] == [
        "8",
        "16",
        "32",
    ]


def test_more_than_ten_lines_go_to_rows_of_families(tmp_path):
    # 2 absolute, 1 rotary, 8 bias, 1 data-dependent, 1 other: 13 lines; consecutive families packed
    # up to 10
    runs(
        tmp_path,
        {(e, 0): [10.0, 10.0 + k, 10.0 + 2 * k] for k, e in enumerate(FAMILY)},
        ("non_overlapping",),
    )
    fig = plots.extrapolation_figure(collect(tmp_path))
    rows = [sorted(curves(ax)) for ax in panels(fig)]
    assert rows == [
        ["learned", "rope", "vaswani"],
        sorted(e for e in FAMILY if FAMILY[e][1] in ("-", "-.", None)),
    ]
    assert all(len(r) <= MAX_LINES for r in rows) and len(rows[1]) == MAX_LINES
    assert [ax.get_title() for ax in panels(fig)] == [
        "absolute, rotary",
        "bias, data-dependent, other",
    ]
    # --family-rows: a row each
    split = plots.extrapolation_figure(collect(tmp_path), split_families=True)
    assert [len(curves(ax)) for ax in panels(split)] == [2, 1, 8, 1, 1]


def test_the_ratio_is_each_seeds_value_over_its_own_at_the_training_length(tmp_path):
    ppl = {
        ("alibi", 0): [10.0, 9.5, 9.0],
        ("alibi", 1): [11.0, 11.0, 11.0],
        ("alibi", 2): [12.0, 12.5, 13.0],
        ("rope", 0): [10.0, 12.0, 10.0],
        ("rope", 1): [10.0, 12.0, 10.0],
        ("rope", 2): [10.0, 12.0, 100.0],
    }
    runs(tmp_path, ppl, ("non_overlapping",))
    fig, notes = build_extrapolation(collect(tmp_path), y="ratio")
    (ax,) = panels(fig)
    for encoding in ("alibi", "rope"):
        expected = [
            statistics.mean(ppl[(encoding, s)][k] / ppl[(encoding, s)][0] for s in range(3))
            for k in range(3)
        ]
        assert list(curves(ax)[encoding].get_ydata()) == pytest.approx(expected)
    # ratios 1, 1, 10: mean 4, the band reaches 9.2
    wild = [ppl[("rope", s)][2] / 10.0 for s in range(3)]
    assert (
        ax.get_ylim()[1]
        < statistics.mean(wild) * 1.2
        < statistics.mean(wild) + statistics.stdev(wild)
    )
    assert ax.get_yscale() == "log" and notes == []
    assert "ppl / ppl at the training length" in fig.get_suptitle()


def test_lines_that_hold_get_a_zoomed_row_when_others_blow_up(tmp_path):
    runs(
        tmp_path,
        {
            ("vaswani", 0): [10.0, 20.0, 30.0],
            ("alibi", 0): [10.0, 9.8, 9.9],
            ("fox", 0): [10.0, 9.7, 9.6],
        },
        ("non_overlapping",),
    )
    fig = plots.extrapolation_figure(collect(tmp_path), y="ratio")
    main, zoom = panels(fig)
    assert sorted(curves(main)) == ["alibi", "fox", "vaswani"] and sorted(curves(zoom)) == [
        "alibi",
        "fox",
    ]
    assert "zoom" in zoom.get_title() and zoom.get_ylim()[1] < 1.05 and main.get_ylim()[1] > 2.9
    assert curves(zoom)["alibi"].get_color() == curves(main)["alibi"].get_color()


def test_coinciding_lines_are_drawn_once_and_named_together(tmp_path):
    for terms, acc in (("abcd", 1.0), ("ab", 1.0), ("ad", 1.0), ("a", 0.2)):
        make_run(
            tmp_path,
            [f"model.attention.terms={terms}", "train.segment_len=8", "data.offset=2"],
            variant={"encoding": "xl", "model.attention.terms": terms},
            main_metric="acc",
            results=[({"segment_len": n}, {"acc": v}) for n, v in ((8, acc), (16, acc - 0.1))],
        )
    make_run(
        tmp_path,
        [
            "model.attention.terms=a",
            "model.attention.bias=t5",
            "train.segment_len=8",
            "data.offset=2",
        ],
        variant={"encoding": "t5", "model.attention.terms": "a"},
        main_metric="acc",
        results=[({"segment_len": 8}, {"acc": 0.99}), ({"segment_len": 16}, {"acc": 0.5})],
    )
    fig = plots.extrapolation_figure(collect(tmp_path))
    (ax,) = panels(fig)
    # ab first
    assert sorted(curves(ax)) == [
        "encoding=t5, terms=a",
        "encoding=xl, terms=a",
        "encoding=xl, terms=ab",
    ]
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert (
        "encoding=xl, terms=ab / abcd / ad (overlap)" in legend and "encoding=xl, terms=a" in legend
    )


def test_titles_name_the_variant_in_words_and_a_run_id_only_to_tell_twins_apart(tmp_path):
    made = [
        make_run(
            tmp_path / name,
            ["model.attention.terms=a", "model.attention.bias=alibi"],
            variant={"encoding": "alibi", "seed": 0},
            results=[({"segment_len": 8}, {"ppl": 3.0})],
        )
        for name in ("a", "b", "c")
    ]
    single = collect(made[0])
    assert (
        plots.run_title(single.iloc[0], ["experiment"], single.attrs["variant_axes"])
        == "encoding=alibi, seed=0"
    )
    (made[2] / "run.json").unlink()  # trained by `train` alone: its attention config in words
    assert plots.run_title(collect(made[2]).iloc[0], ["run_id"]) == "terms=a, bias=alibi, seed=0"
    twins = collect(tmp_path / "a").pipe(lambda a: [r for _, r in a.iterrows()]) + [
        r for _, r in collect(tmp_path / "b").iterrows()
    ]
    # the same variant and seed in two results dirs
    titles = plots.unique_titles(twins, ["encoding"])
    assert sorted(titles.values()) == sorted(f"encoding=alibi, seed=0 ({d.name})" for d in made[:2])
