"""The Transformer-XL study's figure (`plot --kind context`): each model's perplexity against the
context c it sees, measured the way it was trained (the RECL ladder: memory for a recurrent model,
sliding windows of c for one without; analysis/recl.ladder_rows), so the comparison Table 6 is about
-- does recurrence let a model use more context? -- is a curve per model rather than one cell.

A panel per kind of model (PANELS), each on its own linear scale: with memory; without memory,
relative encodings; without memory, absolute encodings (which jump by about 3x past their training
length). Colour: encoding and loss; solid: with memory, dashed: without; band: the seeds' min-max; a
ring: the training attention length. The fair control for memory (report.CONTROL: no memory, trained
on 64-character segments, scored by sliding windows) stands in the panel with memory, black and
dash-dotted, when its runs are in the frame; `with_control` adds them from the sibling results dir
(results/xl_context_cpu/summary.csv beside results/xl_table6_cpu/) when `plot` is given Table 6's
runs alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate.config import ConfigError
from relpos_ablate.studies.xl.report import (
    CONTROL,
    CONTROL_KEY,
    ENCODINGS,
    control_samples,
    ladder_ppl,
    row_label,
)

RELATIVE = ("xl", "shaw")
"""The encodings of the zoomed panel."""
COLORS = {
    ("xl", "full"): "#1f4e99",
    ("xl", "half"): "#7ea6e0",
    ("shaw", "full"): "#b2182b",
    ("shaw", "half"): "#f4a582",
    ("vaswani", "half"): "#1b7837",
    ("vaswani", "full"): "#5aae61",
    ("al_rfou", "half"): "#762a83",
    ("al_rfou", "full"): "#9970ab",
}


def _order(key: tuple) -> tuple:
    encoding, memory, loss = key
    return (
        ENCODINGS.index(encoding) if encoding in ENCODINGS else len(ENCODINGS),
        -memory,
        loss != "full",
    )


PANELS = (
    ("with memory (protocol xl: c = segment + memory)", lambda key: key[1] > 0),
    (
        "no memory, relative encodings (sliding windows of c)",
        lambda key: key[1] == 0 and key[0] in RELATIVE,
    ),
    (
        "no memory, absolute encodings (sliding windows of c)",
        lambda key: key[1] == 0 and key[0] not in RELATIVE,
    ),
)
"""A panel per kind of model, each on its own linear scale: recurrence's effect is a few percent,
the absolute encodings' jump past their training length about 3x; one axis for all hid the first
under the second."""


def context_figure(df: pd.DataFrame, train_segment: int):
    """The figure (matplotlib Figure) of every model's ladder; train_segment: the training segment
    length."""
    from matplotlib.figure import Figure  # figures only: `report` needs no matplotlib

    control = control_samples(df)
    ladders = ladder_ppl(df[df["experiment"] != CONTROL] if "experiment" in df else df)
    if not ladders:
        raise ConfigError(
            "kind", "context: these runs hold no RECL ladder (set eval.recl_contexts)"
        )
    groups = [
        (title, sorted((k for k in ladders if belongs(k)), key=_order)) for title, belongs in PANELS
    ]
    groups = [(title, keys) for title, keys in groups if keys]
    fig = Figure(figsize=(5.2 * len(groups), 5.4), layout="constrained")
    panels = np.atleast_1d(fig.subplots(1, len(groups)))
    for panel, (title, keys) in zip(panels, groups):
        for key in keys:
            color = COLORS.get((key[0], key[2]), "grey")
            _curve(panel, ladders[key], row_label(key), color, "-" if key[1] else "--")
            _ring(panel, ladders[key], train_segment + key[1], color)
        if control and any(key[1] for key in keys):  # the panel with memory: what it controls
            label = f"{row_label(CONTROL_KEY)}: the fair control ({CONTROL})"
            by_c = {c: list(runs.values()) for c, runs in control.items()}
            _curve(panel, by_c, label, "black", "-.")
            _ring(panel, by_c, CONTROL_KEY[3], "black")
            title += ", and the fair control"
        panel.set(
            xlabel="context c: keys every query sees", ylabel="validation ppl (lower is better)"
        )
        panel.set_title(title, fontsize=10)
        panel.grid(alpha=0.3)
    handles = [h for panel in panels for h in panel.get_legend_handles_labels()[0]]
    labels = [label for panel in panels for label in panel.get_legend_handles_labels()[1]]
    ring = panels[0].plot(
        [], [], "o", markersize=10, markerfacecolor="none", markeredgecolor="black"
    )[0]
    fig.legend(
        handles + [ring],
        labels + ["training attention length (segment + memory)"],
        loc="outside lower center",
        ncol=3,
        fontsize=8,
    )
    fig.suptitle(
        "Perplexity against context, each model measured the way it was trained (mean over seeds, "
        "band: min-max; each panel its own scale)",
        fontsize=11,
    )
    return fig


def _curve(panel, by_c: dict[int, list[float]], label: str, color, style: str) -> None:
    """A model's mean over seeds against c, and the seeds' min-max as a band."""
    cs = np.array(sorted(by_c))
    values = [np.asarray(by_c[c]) for c in cs]
    n = min(len(v) for v in values)
    panel.plot(
        cs,
        [v.mean() for v in values],
        style,
        color=color,
        marker="o",
        markersize=3,
        label=f"{label} (n={n})",
    )
    panel.fill_between(
        cs,
        [v.min() for v in values],
        [v.max() for v in values],
        color=color,
        alpha=0.15,
        linewidth=0,
    )


def _ring(panel, by_c: dict[int, list[float]], trained: int, color) -> None:
    """A ring at the training attention length, where the model was scored there."""
    if trained in by_c:
        panel.plot(
            [trained],
            [np.mean(by_c[trained])],
            "o",
            markersize=10,
            markerfacecolor="none",
            markeredgecolor=color,
            markeredgewidth=1.5,
        )


def with_control(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The frame with the fair control's runs: as it is when it holds them, else with the rows of
    the control's summary.csv in the sibling results dir (df.attrs["results_dir"]/../CONTROL);
    a note when there is none."""
    from relpos_ablate.analysis.collect import merge_frames, read_summary

    if "experiment" in df and (df["experiment"] == CONTROL).any():
        return df, []
    sibling = Path(df.attrs.get("results_dir", ".")).parent / CONTROL / "summary.csv"
    if not sibling.is_file():
        return df, [f"context: the fair control is not drawn ({sibling} not found)"]
    return merge_frames(read_summary(sibling), df), []


def save_context_figure(
    df: pd.DataFrame, out: Path, formats: tuple[str, ...] = ("png", "pdf")
) -> list[Path]:
    """context.<fmt> in `out`."""
    from relpos_ablate.analysis.plots import save_figure

    done = df[df["status"] == "done"] if "status" in df else df
    if "experiment" in done:  # the control trains on 64: the segment of Table 6's own runs
        done = done[done["experiment"] != CONTROL]
    segments = pd.to_numeric(done["train.segment_len"], errors="coerce").dropna().unique()
    if len(segments) != 1:
        raise ConfigError(
            "train.segment_len",
            f"context: the runs must share one training segment length, found {sorted(segments)}",
        )
    return save_figure(context_figure(df, int(segments[0])), Path(out) / "context", formats)
