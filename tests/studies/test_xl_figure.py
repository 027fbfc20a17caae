"""The Transformer-XL study's figure, `plot --kind context` (relpos_ablate/studies/xl/figures.py):
each model at its seeds' mean on its own ladder, a panel per kind of model, and the fair control
beside the models with memory, read from the sibling results dir when Table 6's runs come alone.

Run: .venv/bin/python -m pytest tests/studies/test_xl_figure.py -q
"""

import numpy as np
import pandas as pd
import pytest

from fixtures.xl_study import CONTROL, PPL, control_rows, ladder_frame
from relpos_ablate.analysis.collect import merge_frames
from relpos_ablate.config import ConfigError


def test_the_context_figure_draws_each_model_the_way_it_was_trained(tmp_path):
    """plot --kind context: a line per model at its seeds' mean on its own ladder (never the other
    kind's 99), the ring at the training attention length, a panel per kind of model (with memory;
    without, relative; without, absolute), each on its own scale."""
    from relpos_ablate.studies.xl.figures import context_figure, save_context_figure

    fig = context_figure(ladder_frame(), train_segment=16)
    # with memory; no memory, relative; no memory, absolute: each on its own linear scale
    panels = fig.axes[:3]
    where = {
        line.get_label(): k
        for k, panel in enumerate(panels)
        for line in panel.get_lines()
        if not line.get_label().startswith("_")
    }
    assert where == {
        "xl, memory 48, full loss (n=3)": 0,
        "xl, no memory, full loss (n=3)": 1,
        "vaswani, no memory, half loss (n=3)": 2,
    }
    curves = {line.get_label(): line for panel in panels for line in panel.get_lines()}
    for (encoding, memory, loss), by_c in PPL.items():
        line = curves[f"{encoding}, {'memory 48' if memory else 'no memory'}, {loss} loss (n=3)"]
        assert list(line.get_xdata()) == [16, 64]
        np.testing.assert_allclose(line.get_ydata(), [np.mean(by_c[16]), np.mean(by_c[64])])
        assert line.get_linestyle() == ("-" if memory else "--")
    rings = [
        (float(r.get_xdata()[0]), round(float(r.get_ydata()[0]), 9))
        for panel in panels
        for r in panel.get_lines()
        if r.get_label().startswith("_") and len(r.get_xdata()) == 1
    ]
    assert sorted(rings) == sorted([(64.0, 5.1), (16.0, 6.6), (16.0, 8.1)])
    assert all(panel.get_yscale() == "linear" for panel in panels)
    assert [p.name for p in save_context_figure(ladder_frame(), tmp_path, ("png",))] == [
        "context.png"
    ]
    with pytest.raises(ConfigError, match="kind"):
        context_figure(ladder_frame().drop(columns="token_losses"), train_segment=16)


def test_the_context_figure_draws_the_fair_control_beside_memory(tmp_path):
    """Issue 58: the fair control stands in the panel with memory (black, dash-dotted, its seeds'
    means at its windows, a ring at 64, its training length), and `plot --kind context` given Table
    6's runs alone reads it from the sibling results dir; without one it says it is not drawn."""
    from relpos_ablate.studies.xl import FIGURES
    from relpos_ablate.studies.xl.figures import context_figure, with_control

    frame = pd.concat([ladder_frame(), control_rows()], ignore_index=True)
    memory, *_ = context_figure(frame, train_segment=16).axes
    assert memory.get_title().endswith(", and the fair control")
    control = next(ln for ln in memory.get_lines() if "the fair control" in ln.get_label())
    assert control.get_label() == (
        "xl, no memory, full loss, trained on 64: the fair control (xl_context_cpu) (n=3)"
    )
    assert (control.get_color(), control.get_linestyle()) == ("black", "-.")
    assert list(control.get_xdata()) == sorted(CONTROL)
    np.testing.assert_allclose(control.get_ydata(), [np.mean(CONTROL[c]) for c in sorted(CONTROL)])
    rings = [
        (float(r.get_xdata()[0]), float(r.get_ydata()[0]))
        for r in memory.get_lines()
        if r.get_label().startswith("_")
        and r.get_markeredgecolor() == "black"
        and len(r.get_xdata()) == 1
    ]
    assert rings == [(64.0, pytest.approx(np.mean(CONTROL[64])))]
    # Table 6's summary alone: the control comes from results/xl_context_cpu/summary.csv beside it
    (tmp_path / "xl_table6_cpu").mkdir()
    (tmp_path / "xl_context_cpu").mkdir()
    table6 = ladder_frame().assign(run_id=lambda f: f["run_dir"])  # as a summary.csv has them
    table6.attrs["results_dir"] = str(tmp_path / "xl_table6_cpu")
    missing = tmp_path / "xl_context_cpu" / "summary.csv"
    assert with_control(table6)[1] == [
        f"context: the fair control is not drawn ({missing} not found)"
    ]
    control = control_rows().assign(run_id=lambda f: f["run_dir"])
    # in collect's column order, as `collect` writes one (read_summary reads its axes off it)
    merge_frames(control, control.iloc[:0]).to_csv(missing, index=False)
    merged, notes = with_control(table6)
    assert notes == [] and sorted(merged["run_dir"].unique()) == sorted(
        {*table6["run_dir"], *control_rows()["run_dir"]}
    )
    written, notes = FIGURES["context"](table6, tmp_path / "figures", ("png",), None)
    assert [p.name for p in written] == ["context.png"] and notes == []
