"""Figures from a results dir: extrapolation curves (from `collect` alone) and, for trained runs,
bias curves, attention heatmaps and score-term maps (figures.py) — one per run plus an overview.

Figures are built without pyplot (headless, notebook-safe) and written atomically as PNG/PDF/SVG.
This module saves them; a trained run's figure and the overview of several are drawn in
model_figures.py, and runs are named in titles and file names by run_labels.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate.analysis import figures
from relpos_ablate.analysis.extrapolation import build_extrapolation, extrapolation_figure  # noqa: F401 (API)
from relpos_ablate.analysis.model_figures import (  # noqa: F401 (API: plots.NAME)
    attention_lengths,
    inspect_run,
    left_out_note,
    overview_figure,
    run_figure,
    sample_decays,
)
from relpos_ablate.analysis.run_labels import (  # noqa: F401 (API: plots.NAME)
    attention_words,
    run_slug,
    run_title,
    unique_titles,
    variant_label,
)
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import (
    no_finished_runs,
)
from relpos_ablate.analysis.tables import runs_in_spec_order
from relpos_ablate.analysis.trained import check_imports, load_drawable
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_bytes

FIGURE_FORMATS = ("png", "pdf", "svg")
MODEL_KINDS = ("bias", "attention", "terms")


def save_figure(fig: Figure, stem: Path, formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """`stem`.png / .pdf / .svg, each written atomically; PDFs carry no date (reproducible
    files)."""
    written = []
    for fmt in formats:
        buffer = io.BytesIO()
        metadata = {"CreationDate": None} if fmt == "pdf" else None
        fig.savefig(buffer, format=fmt, dpi=150, metadata=metadata)
        path = stem.with_name(f"{stem.name}.{fmt}")
        atomic_write_bytes(path, buffer.getvalue())
        written.append(path)
    return written


# ---------------------------------------------------------------- extrapolation (collect only)


def save_extrapolation(
    df,
    out: Path,
    metric: str | None = None,
    x: str = "segment_len",
    y: str = "value",
    panels: str | None = None,
    split_families: bool = False,
    where: tuple[str, ...] | None = None,
    formats: tuple[str, ...] = ("png", "pdf"),
) -> tuple[list[Path], list[str]]:
    """extrapolation.<fmt> in `out` (analysis/extrapolation.py); returns (written files, notes)."""
    fig, notes = build_extrapolation(df, metric, x, y, panels, split_families, where)
    return save_figure(fig, Path(out) / "extrapolation", formats), notes


# ---------------------------------------------------------------- figures of trained runs


def load_trained(run_dir: Path):
    """(RunConfig, TransformerLM in eval mode) from a finished run dir's checkpoint."""
    from relpos_ablate.train.run import load_run

    config, model = load_run(run_dir)
    return config, model.eval()


def sample_tokens(config, length: int):
    """A [1, length] token sample from the run's own evaluation data."""
    from relpos_ablate.train.data import sample_inputs

    return sample_inputs(config, length, batch_size=1)


def finished_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run whose state is done (the ones with a final checkpoint)."""
    runs = df[df["status"] == "done"].drop_duplicates("run_dir") if len(df) else df
    if runs.empty:
        raise no_finished_runs(df)
    return runs


def save_model_figures(
    df,
    kind: str,
    out: Path,
    layer: int = -1,
    head: int = 0,
    formats: tuple[str, ...] = ("png", "pdf"),
    loader: Callable | None = None,
    sampler: Callable | None = None,
    log_distance: bool = False,
) -> tuple[list[Path], list[str]]:
    """One `kind` figure per finished run, named by the fields that tell the runs apart with the run
    id last (`bias_encoding-xl_seed-0_<id>.png`), plus an overview for several; returns (files,
    notes).

    A single run that cannot be drawn (no checkpoint, no bias for kind='bias') is a one-line error;
    in a grid such runs are skipped with a note (and named in the overview), and it is an error only
    when none can be drawn. loader(run_dir) -> (RunConfig, model) and sampler(config, length) ->
    tokens [1, length] default to the training package's load_run and sample_inputs.
    `log_distance`: bias curves against distance on a log scale (figures.log_distance).
    """
    scaled = figures.log_distance if log_distance and kind == "bias" else (lambda fig: fig)
    if kind not in MODEL_KINDS:
        raise ConfigError(
            "kind", f"{kind!r} is not allowed; choose one of {', '.join(MODEL_KINDS)}"
        )
    loader, sampler = loader or load_trained, sampler or sample_tokens
    runs = finished_runs(df)
    check_imports(runs)
    single = len(runs) == 1
    keys, ordered = runs_in_spec_order(runs, df)
    titles = unique_titles(ordered, keys, df.attrs.get("variant_axes", ()))
    written, notes, drawn, left_out = [], [], [], []
    for run in ordered:
        try:
            config, model = load_drawable(Path(run["run_dir"]), kind, loader)
        except ConfigError as err:
            if single:
                raise
            notes.append(f"{err.field}: skipped ({err.message})")
            reason = err.message.split("; try")[0].removeprefix("this run has ")
            left_out.append((variant_label(run, keys), label(run.get("seed")), reason))
            continue
        fig = run_figure(
            kind,
            config,
            model,
            titles[run["run_dir"]],
            layer,
            head,
            sampler,  # bad --layer/--head: raised
            Path(run["run_dir"]),
        )
        written += save_figure(
            scaled(fig), Path(out) / (kind if single else f"{kind}_{run_slug(run, keys)}"), formats
        )
        drawn.append((run, config, model))
    if not drawn:
        raise ConfigError("kind", f"no run could be drawn as {kind!r}: {notes[0] if notes else ''}")
    if len(drawn) > 1:
        overview = overview_figure(kind, drawn, keys, layer, head, sampler, left_out, titles)
        written += save_figure(scaled(overview), Path(out) / f"{kind}_overview", formats)
        if left_out:
            notes.append(f"{kind}_overview: {left_out_note(left_out)}")
    return written, notes
