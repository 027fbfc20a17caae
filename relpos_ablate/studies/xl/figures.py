"""The Transformer-XL study's figure (`plot --kind context`): each model's perplexity against the
context c it sees, measured the way it was trained (the RECL ladder: memory for a recurrent model,
sliding windows of c for one without; analysis/recl.ladder_rows), so the comparison Table 6 is about
-- does recurrence let a model use more context? -- is a curve per model rather than one cell.

A panel per kind of model (PANELS), each on its own linear scale: with memory; without memory,
relative encodings; without memory, absolute encodings (which jump by about 3x past their training
length). Colour: encoding and loss; solid: with memory, dashed: without; band: the seeds' min-max; a
ring: the training attention length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate.config import ConfigError
from relpos_ablate.studies.xl.report import ENCODINGS, ladder_ppl, row_label

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

    ladders = ladder_ppl(df)
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
            by_c = ladders[key]
            cs = np.array(sorted(by_c))
            values = [np.asarray(by_c[c]) for c in cs]
            mean = np.array([v.mean() for v in values])
            color = COLORS.get((key[0], key[2]), "grey")
            style = "-" if key[1] else "--"
            n = min(len(v) for v in values)
            panel.plot(
                cs,
                mean,
                style,
                color=color,
                marker="o",
                markersize=3,
                label=f"{row_label(key)} (n={n})",
            )
            panel.fill_between(
                cs,
                [v.min() for v in values],
                [v.max() for v in values],
                color=color,
                alpha=0.15,
                linewidth=0,
            )
            trained = train_segment + key[1]
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


def save_context_figure(
    df: pd.DataFrame, out: Path, formats: tuple[str, ...] = ("png", "pdf")
) -> list[Path]:
    """context.<fmt> in `out`."""
    from relpos_ablate.analysis.plots import save_figure

    done = df[df["status"] == "done"] if "status" in df else df
    segments = pd.to_numeric(done["train.segment_len"], errors="coerce").dropna().unique()
    if len(segments) != 1:
        raise ConfigError(
            "train.segment_len",
            f"context: the runs must share one training segment length, found {sorted(segments)}",
        )
    return save_figure(context_figure(df, int(segments[0])), Path(out) / "context", formats)
