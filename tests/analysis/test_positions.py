"""Loss by position: the tidy frame from eval.json, `plot --kind position-loss` (one line per
variant, the seed spread as a band, one panel per setting, the training length marked), the
collected protocol and reference columns, and the extrapolation plot's reference line and
per-protocol lines.

Run: .venv/bin/python -m pytest tests/analysis/test_positions.py -q
"""

import statistics

import pytest

from fixtures.report_runs import make_run
from relpos_ablate.analysis import collect, plots
from relpos_ablate.analysis.positions import bin_centre, position_frame, position_loss_figure
from relpos_ablate.cli import main
from relpos_ablate.io import atomic_write_json, read_json

# (encoding, seed) -> mean loss per bin [0, 1), [1, 2), [2, 4), [4, 8) of an 8-token window
CURVES = {
    ("alibi", 0): [3.0, 2.5, 2.0, 1.8],
    ("alibi", 1): [3.2, 2.7, 2.0, 1.6],
    ("rope", 0): [3.1, 2.4, 2.2, 2.4],
    ("rope", 1): [2.9, 2.6, 2.2, 2.6],
}
BINS = {"edges": [0, 1, 2, 4, 8], "tokens": [10, 10, 20, 40]}


def curve_runs(root):
    for encoding, seed in CURVES:
        bias = (
            ["model.attention.bias=alibi"]
            if encoding == "alibi"
            else ["model.attention.absolute=rope"]
        )
        make_run(
            root,
            [
                "model.attention.terms=a",
                *bias,
                f"seed={seed}",
                "train.segment_len=4",
                "data.offset=2",
            ],
            variant={"encoding": encoding, "seed": seed},
            results=[
                ({"segment_len": 8, "protocol": "non_overlapping"}, {"ppl": 8.0, "loss": 2.1}),
                (
                    {"segment_len": 8, "protocol": "sliding", "stride": 2, "attn_len": 8},
                    {"ppl": 7.0, "loss": 1.9},
                ),
            ],
        )
    # both settings get the curves (the sliding one shifted by -1)
    for path in root.glob("*/*/eval.json"):
        data, variant = read_json(path), read_json(path.parent / "run.json")["variant"]
        for k, setting in enumerate(data["settings"]):
            setting["position_loss"] = {
                **BINS,
                "loss": [v - k for v in CURVES[(variant["encoding"], variant["seed"])]],
            }
        data["reference"] = {"name": "unigram", "metrics": {"ppl": 30.0, "loss": 3.4}}
        atomic_write_json(path, data)


def test_position_frame_is_one_row_per_run_setting_and_bin(tmp_path):
    curve_runs(tmp_path)
    frame = position_frame(collect(tmp_path))
    assert len(frame) == 4 * 2 * 4
    one = frame[
        (frame["encoding"] == "rope") & (frame["seed"] == 1) & (frame["protocol"] == "sliding")
    ]
    assert one["bin_lo"].tolist() == [0, 1, 2, 4] and one["bin_hi"].tolist() == [1, 2, 4, 8]
    assert one["position_loss"].tolist() == pytest.approx([v - 1 for v in CURVES[("rope", 1)]])
    assert one["position_tokens"].tolist() == BINS["tokens"]


def test_position_loss_figure_lines_bands_panels_and_training_length(tmp_path):
    curve_runs(tmp_path)
    fig = position_loss_figure(collect(tmp_path))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    # windows of 8 moved by 2 score positions 6 and 7 but in a stream's first window: the sliding
    # panel keeps only the bins at or past 8 - 2, here one bin, and a panel of one bin is left out
    assert [ax.get_title() for ax in panels] == ["non_overlapping, L=8"]
    edges = [(0, 1), (1, 2), (2, 4), (4, 8)]
    for k, (ax, kept) in enumerate(zip(panels, ([0, 1, 2, 3],))):
        for encoding in ("alibi", "rope"):
            (line,) = [ln for ln in ax.get_lines() if ln.get_label() == encoding]
            assert list(line.get_xdata()) == pytest.approx([bin_centre(*edges[b]) for b in kept])
            expected = [statistics.mean(CURVES[(encoding, s)][b] for s in (0, 1)) - k for b in kept]
            assert list(line.get_ydata()) == pytest.approx(expected)
        assert len(ax.collections) == 2  # a band per encoding (two seeds)
        lows = sorted(band.get_paths()[0].vertices[:, 1].min() for band in ax.collections)
        expected_lows = sorted(
            min(
                statistics.mean(CURVES[(e, s)][b] for s in (0, 1))
                - statistics.stdev([CURVES[(e, s)][b] for s in (0, 1)])
                for b in kept
            )
            - k
            for e in ("alibi", "rope")
        )
        assert lows == pytest.approx(expected_lows)
        training = [ln for ln in ax.get_lines() if ln.get_label() == "training length"]
        assert len(training) == 1 and training[0].get_xdata()[0] == 4.0


def test_cli_plot_position_loss(tmp_path, capsys):
    curve_runs(tmp_path)
    assert main(["plot", str(tmp_path), "--kind", "position-loss", "--formats", "png"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "figures" / "position_loss.png")]
    make_run(
        tmp_path / "old", ["seed=0"], results=[({"segment_len": 8}, {"ppl": 8.0, "loss": 2.1})]
    )
    assert main(["plot", str(tmp_path / "old"), "--kind", "position-loss"]) == 2
    assert "error: kind: no loss by position in these runs' eval.json" in capsys.readouterr().err


def test_collected_protocol_reference_and_setting_index(tmp_path):
    curve_runs(tmp_path)
    # an eval.json written before protocols
    make_run(
        tmp_path,
        ["seed=5", "model.mem_len=8"],
        results=[
            ({"segment_len": 8}, {"ppl": 8.0}),
            ({"segment_len": 8, "same_length": True}, {"ppl": 7.0}),
        ],
    )
    df = collect(tmp_path)
    old = df[df["seed"] == 5]
    # same_length was Transformer-XL's evaluation
    assert old["protocol"].tolist() == ["non_overlapping", "xl"]
    assert old["max_targets"].tolist() == [0, 0] and old["eval_setting"].tolist() == [0, 1]
    new = df[(df["seed"] == 0) & (df["encoding"] == "alibi")].sort_values("eval_setting")
    assert (
        new["protocol"].tolist() == ["non_overlapping", "sliding"]
        and new["stride"].tolist()[1] == 2
    )
    assert new["reference"].tolist() == ["unigram"] * 2 and new["reference_ppl"].tolist() == [
        30.0,
        30.0,
    ]


def test_extrapolation_has_a_panel_per_protocol_and_the_reference_in_its_legend(tmp_path):
    curve_runs(tmp_path)
    fig = plots.extrapolation_figure(collect(tmp_path))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["non_overlapping", "sliding, stride 2"]
    # both encodings score the same in both panels: drawn once, named so
    for ax, ppl in zip(panels, (8.0, 7.0)):
        (line,) = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
        assert (
            line.get_label() == "alibi"
            and list(line.get_ydata()) == [ppl]
            and line.get_linestyle() == "-"
        )
    # the unigram (30) lies far outside 7-8:
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    # off the axis, so out of the legend too
    assert legend == ["alibi / rope (overlap)", "training length"]
