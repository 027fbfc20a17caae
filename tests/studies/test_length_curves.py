"""The length-generalization study's main figure (`plot --kind lengthgen`,
relpos_ablate/studies/length_generalization/curves.py) on the hand-made runs of
tests/studies/test_length_report.py: a panel per task in the config's order, a line per variant at
the bins' middle n with its mean over seeds, the seeds' min-max as its band, the training lengths
shaded, a colour and marker per encoding (no two encodings alike) and dashes for randomized
positions, the variants named in words, and the lines that lie on each other at zero or at one past
the training lengths named in their panel.
Run: pytest tests/studies/test_length_curves.py -q"""

import statistics

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from fixtures.length_study import SCORES, build
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.studies.length_generalization.curves import lengthgen_figure


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return build(tmp_path_factory.mktemp("curves"))


def test_a_panel_per_task_a_line_per_variant_with_its_seed_band(results):
    fig = lengthgen_figure(collect(results))
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["copy", "reverse"]
    for ax, task in zip(panels, ("copy", "reverse")):
        lines = ax.get_lines()
        keys = [k for k in SCORES if k[0] == task]  # nope, t5, rope, rope randomized
        order = [
            ("nope", "sequential"),
            ("rope", "sequential"),
            ("rope", "randomized"),
            ("t5", "sequential"),
        ]
        assert len(lines) == 4
        for line, variant in zip(lines, order):
            seeds = np.array(SCORES[(task, *variant)])
            # bins 1-4, 5-6, 7-8 at their middle
            np.testing.assert_allclose(line.get_xdata(), [2.5, 5.5, 7.5])
            np.testing.assert_allclose(line.get_ydata(), seeds.mean(0))
        assert {k[1:] for k in keys} == set(order)
        bands = ax.collections
        assert len(bands) == 4
        np.testing.assert_allclose(
            bands[0].get_paths()[0].vertices[:, 1].min(),
            np.array(SCORES[(task, "nope", "sequential")]).min(0).min(),
        )
        span = ax.patches[0]  # the shaded training lengths, n = 1-4
        assert (span.get_x(), span.get_x() + span.get_width()) == (0.5, 4.5)
    rope, randomized = panels[0].get_lines()[1:3]
    assert to_rgba(rope.get_color()) == to_rgba(randomized.get_color())
    assert rope.get_linestyle() == "-" and randomized.get_linestyle() == "--"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["NoPE", "RoPE", "RoPE (randomized)", "T5", "training lengths"]
    assert fig.legends[0].get_title().get_text() == "mean over 3 seeds\nband: min-max over seeds"
    # by hand
    assert panels[0].get_lines()[0].get_ydata()[1] == pytest.approx(
        statistics.mean([0.6, 0.5, 0.7])
    )
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["1-4", "5-6", "7-8"]
    assert panels[0].get_ylabel() == "exact match"
    # no two lines lie on zero past n = 4 here
    assert panels[0].get_xlabel() == "task length n (test bin)"


@pytest.mark.parametrize(
    "where, far",
    [("below 0.01", lambda seed: [0.0, 0.004 * seed]), ("above 0.99", lambda seed: [1.0, 1.0])],
)
def test_lines_on_each_other_past_training_are_named_in_their_panel(tmp_path, where, far):
    """RoPE and T5 are 0 (or 1) in every bin past n = 4 on copy (in every seed): their lines hide
    each other, and the panel says which they are; NoPE (between) is not named."""
    from fixtures.length_study import BINS, VARIANTS
    from fixtures.report_runs import make_run
    from relpos_ablate.io import atomic_write_json

    for encoding in ("nope", "t5", "rope"):
        for seed in range(2):
            overrides = [
                "data.task=copy",
                "data.train_lengths=[1, 4]",
                "train.segment_len=9",
                f"data.test_lengths={[list(b) for b in BINS]}",
                f"seed={seed}",
                *VARIANTS[(encoding, "sequential")],
            ]
            run_dir = make_run(
                tmp_path,
                overrides,
                experiment="length_generalization",
                variant={
                    "data.task": "copy",
                    "encoding": encoding,
                    "model.attention.positions": "sequential",
                    "seed": seed,
                },
            )
            scores = [1.0, 0.3, 0.1] if encoding == "nope" else [1.0, *far(seed)]
            atomic_write_json(
                run_dir / "status.json", {"state": "done", "step": 10, "max_steps": 10}
            )
            atomic_write_json(
                run_dir / "eval.json",
                {
                    "main_metric": "exact_match",
                    "step": 10,
                    "settings": [
                        {
                            "segment_len": 2 * hi + 1,
                            "mem_len": 0,
                            "clamp_len": None,
                            "same_length": False,
                            "attn_len": 2 * hi + 1,
                            "length_min": lo,
                            "length_max": hi,
                            "metrics": {"exact_match": score},
                        }
                        for (lo, hi), score in zip(BINS, scores)
                    ],
                },
            )
    (panel,) = [
        ax
        for ax in lengthgen_figure(collect(tmp_path / "length_generalization")).axes
        if ax.get_title()
    ]
    first, *note = panel.get_xlabel().split("\n")
    assert first == "task length n (test bin)"
    assert " ".join(note) == f"{where} past the training lengths, lines on each other: RoPE, T5"


def test_every_encoding_has_its_own_colour_and_marker():
    """Thirteen variants as the study has them: the randomized ones share their twin's look but
    their dashes, no two encodings share a colour (tab20's paired light and dark hues made NoPE and
    the sinusoid, T5 and ALiBi look related: issue 58), and none shares a marker with its
    neighbour in the legend."""
    from relpos_ablate.studies.length_generalization.variants import variant_styles

    encodings = [
        "nope", "vaswani", "learned", "rope", "t5", "alibi", "kerple_log", "fire", "xl", "p_rope",
        "ssmax",
    ]  # fmt: skip
    variants = [(e, "sequential") for e in encodings] + [
        ("rope", "randomized"),
        ("alibi", "randomized"),
    ]
    styles = variant_styles(["encoding", "model.attention.positions"], variants)
    sequential = [styles[(e, "sequential")] for e in encodings]
    assert len({to_rgba(color) for color, _, _ in sequential}) == len(encodings)
    markers = [marker for _, _, marker in sequential]
    assert all(a != b for a, b in zip(markers, markers[1:]))
    for encoding in ("rope", "alibi"):
        color, dashes, marker = styles[(encoding, "randomized")]
        assert (color, marker) == styles[(encoding, "sequential")][::2] and dashes == "--"


def test_plot_command_writes_the_figure(results, tmp_path, capsys):
    assert (
        main(
            [
                "plot",
                str(results),
                "--kind",
                "lengthgen",
                "--formats",
                "png",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split() == [str(tmp_path / "lengthgen.png")]
