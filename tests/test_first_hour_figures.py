"""The attention overview (`plot DIR --kind attention`, several runs) has a colour bar, and its
panels one colour scale (issue 56), on two really trained tiny runs.

Run: .venv/bin/python -m pytest tests/test_first_hour_figures.py -q
"""

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import AxesImage

from fixtures.report_runs import trained_results
from relpos_ablate.analysis import collect, plots


def test_the_attention_overview_has_one_scale_and_its_colour_bar():
    runs = collect(trained_results()).drop_duplicates("run_dir")
    drawn = [(run, *plots.load_trained(Path(run["run_dir"]))) for _, run in runs.iterrows()]
    fig = plots.overview_figure("attention", drawn, ["encoding"], -1, 0, plots.sample_tokens)
    images = [a for ax in fig.axes for a in ax.get_children() if isinstance(a, AxesImage)]
    maps = [image for image in images if image.axes.get_label() != "<colorbar>"]
    assert len(maps) == 2
    top = max(float(np.nanmax(np.ma.filled(m.get_array(), np.nan))) for m in maps)
    assert 0 < top <= 1
    assert [m.get_clim() for m in maps] == [pytest.approx((0.0, top))] * 2
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1
    assert bars[0].get_ylabel() == "attention probability (mean over heads)"


def test_bias_curves_against_log_distance(tmp_path, monkeypatch):
    """`plot DIR --kind bias --log-distance`: every bias panel's distance axis on a symlog scale, in
    each run's figure and the overview; without the flag, linear."""
    from relpos_ablate.analysis import figures
    from relpos_ablate.cli import main

    saved = {}
    save = plots.save_figure

    def keep(fig, path, formats):
        saved[Path(path).name] = fig
        return save(fig, path, formats)

    monkeypatch.setattr(plots, "save_figure", keep)
    results = trained_results()
    for flag, scale in (([], "linear"), (["--log-distance"], "symlog")):
        saved.clear()
        out = tmp_path / scale
        command = ["plot", str(results), "--kind", "bias", "--out", str(out), "--formats", "png"]
        assert main([*command, *flag]) == 0
        assert len(saved) == 3 and "bias_overview" in saved  # two runs and the overview
        panels = [
            ax
            for fig in saved.values()
            for ax in fig.axes
            if ax.get_xlabel() == figures.DISTANCE_LABEL
        ]
        assert len(panels) >= 4 and {ax.get_xscale() for ax in panels} == {scale}
        assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in saved)
