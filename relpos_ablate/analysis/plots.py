"""Figures from a results dir: extrapolation curves (from `collect` alone) and, for trained runs,
bias curves, attention heatmaps and score-term maps (figures.py) — one per run plus an overview.

Figures are built without pyplot (headless, notebook-safe) and written atomically as PNG/PDF/SVG.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from relpos_ablate.analysis import figures
from relpos_ablate.analysis.tables import (
    TableOptions, axis_orders, default_rows, finished, label, metric_direction, no_finished_runs, read_spec,
    resolve_options, row_key, sort_key, values_by_key,
)
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_bytes

FIGURE_FORMATS = ("png", "pdf", "svg")
MODEL_KINDS = ("bias", "attention", "terms")
UNLOADABLE = (ConfigError, OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError)
"""What loading a trained run can raise (no or a corrupt checkpoint, a config the code rejects): that
run is skipped in a grid, and a one-line error for a single run."""
X_LABELS = {"segment_len": "evaluation length (tokens per segment)", "attn_len": "attention length (segment + memory)"}


def save_figure(fig: Figure, stem: Path, formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """`stem`.png / .pdf / .svg, each written atomically; PDFs carry no date (reproducible files)."""
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


def extrapolation_figure(df: pd.DataFrame, metric: str | None = None, x: str = "segment_len") -> Figure:
    """Metric against evaluation length, one line per variant (mean over seeds, ± std as a band)."""
    spec = read_spec(df)
    options = resolve_options(df, TableOptions(metric=metric, cols=(x,)), spec)
    rows, metric = list(options.rows), options.metric
    values = values_by_key(finished(df, metric), rows + [x], metric)
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    orders = axis_orders(spec)
    for row in sorted({k[:-1] for k in values}, key=lambda k: sort_key(k, rows, orders)):
        xs = sorted(k[-1] for k in values if k[:-1] == row)
        samples = [np.asarray(values[row + (v,)]) for v in xs]
        mean = np.array([s.mean() for s in samples])
        std = np.array([s.std(ddof=1) if s.size > 1 else 0.0 for s in samples])
        (line,) = ax.plot(xs, mean, marker="o", label=_row_label(rows, row))
        if any(s.size > 1 for s in samples):
            ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
    _format_extrapolation_axes(ax, finished(df, metric), metric, x, values)
    ax.legend(fontsize=8, title=", ".join(r.rsplit(".", 1)[-1] for r in rows), title_fontsize=8)
    return fig


def _row_label(rows: list[str], key: tuple) -> str:
    return ", ".join(label(v) for v in key) if len(rows) <= 1 else ", ".join(
        f"{r.rsplit('.', 1)[-1]}={label(v)}" for r, v in zip(rows, key))


def _format_extrapolation_axes(ax, data: pd.DataFrame, metric: str, x: str, values: dict) -> None:
    """Log-2 x axis for length sweeps, log y when perplexities blow up, the training length marked."""
    xs = sorted({k[-1] for k in values})
    if xs and xs[0] > 0 and xs[-1] / xs[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [label(v) for v in xs])
    means = [np.mean(v) for v in values.values()]
    if metric == "ppl" and min(means) > 0 and max(means) / min(means) > 10:  # perplexity blowing up
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
    train = data["train.segment_len"] + (data["model.mem_len"] if x == "attn_len" else 0)
    if train.nunique() == 1:
        ax.axvline(float(train.iloc[0]), color="k", ls=":", lw=1, label="training length")
    better = "higher" if metric_direction(metric) == "max" else "lower"
    ax.set_xlabel(X_LABELS.get(x, x))
    ax.set_ylabel(f"{metric} ({better} is better)")
    ax.grid(alpha=0.3)
    experiments = sorted(data["experiment"].astype(str).unique())
    ax.set_title(f"{', '.join(experiments)}: {metric} vs {X_LABELS.get(x, x).split(' (')[0]}")


def save_extrapolation(df, out: Path, metric: str | None = None, x: str = "segment_len",
                       formats: tuple[str, ...] = ("png", "pdf")) -> tuple[list[Path], list[str]]:
    """extrapolation.<fmt> in `out`; returns (written files, notes)."""
    return save_figure(extrapolation_figure(df, metric, x), Path(out) / "extrapolation", formats), []


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


def run_title(run: pd.Series, keys: list[str]) -> str:
    """`<run_id>` over `encoding=xl, seed=0`: the keys that tell the runs apart, and the seed."""
    parts = [f"{k.rsplit('.', 1)[-1]}={label(run[k])}" for k in keys if k in run.index and k != "experiment"]
    return f"{run['run_id']}\n" + ", ".join([*parts, f"seed={label(run.get('seed'))}"])


def attention_lengths(config) -> tuple[int, int]:
    """(training attention length, longest evaluated attention length): the bias plot's x range."""
    mem = config.model.mem_len
    train = config.train.segment_len + mem
    longest = max(s.segment_len + (mem if s.mem_len is None else s.mem_len) for s in config.eval_settings())
    return train, max(train, longest)


def inspect_run(config, model, sampler: Callable) -> tuple[dict, int]:
    """model.inspect on a training-length segment of the run's data, memory filled first."""
    seg, mem = config.train.segment_len, config.model.mem_len
    tokens = sampler(config, figures.sample_length(seg, mem))
    return figures.inspect_sample(model, tokens, seg, mem)


def sample_decays(config, model, sampler: Callable) -> dict | None:
    """FoX's decay curves on a training-length sample of the run's data (None without a forget gate)."""
    if "decay" not in figures.bias_sources(model):
        return None
    return figures.decay_curves(model, *inspect_run(config, model, sampler))


def run_figure(kind: str, config, model, title: str, layer: int, head: int, sampler: Callable) -> Figure:
    if kind == "bias":
        train, longest = attention_lengths(config)
        return figures.bias_figure(model, longest, train, title, sample_decays(config, model, sampler))
    details, n_mem = inspect_run(config, model, sampler)
    if kind == "attention":
        return figures.attention_figure(details, n_mem, title)
    layer = figures.resolve_index(layer, len(details["terms"]), "layer")
    return figures.terms_figure(details, layer, head, n_mem, f"{title} — layer {layer}, head {head}")


def overview_figure(kind: str, items: list[tuple[str, object, object]], layer: int, head: int, sampler) -> Figure:
    """All runs side by side: layer 0's curves (bias), head-mean last-layer attention, or the terms."""
    if kind == "terms":
        return _terms_overview(items, layer, head, sampler)
    ncols = min(4, len(items))
    nrows = math.ceil(len(items) / ncols)
    fig = Figure(figsize=(4.0 * ncols, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, config, model) in zip(axes, items):
        ax.set_title(title, fontsize=8)
        if kind == "bias":
            source = figures.bias_sources(model)[0]
            train, longest = attention_lengths(config)
            name, attn = figures.bias_panels(model, source)[0]
            ax.set_title(f"{title}\n{name}", fontsize=8)
            distances = figures.distance_range(attn.config.causal, longest)
            figures.draw_bias_curves(ax, attn, source, distances, train, legend=ax is axes[0],
                                     decays=sample_decays(config, model, sampler))
        else:
            details, n_mem = inspect_run(config, model, sampler)
            k = figures.resolve_index(layer, len(details["probs"]), "layer")
            probs = details["probs"][k][0].mean(0)  # (L, M + L), mean over heads
            figures.draw_map(ax, figures.masked(probs, details["terms"][k].get("visible")), n_mem, "viridis")
    for ax in axes[len(items):]:
        ax.set_visible(False)
    where = "layer 0 or the shared module" if kind == "bias" else f"{_layer_name(layer)}, mean over heads"
    fig.suptitle(f"{kind}: all runs ({where})")
    return fig


def _terms_overview(items, layer: int, head: int, sampler) -> Figure:
    """One row per run: its terms a-d (and the bias when any run has one) for one head."""
    inspected = [(title, *inspect_run(config, model, sampler)) for title, config, model in items]
    names = ["a", "b", "c", "d"]
    if any("bias" in details["terms"][0] for _, details, _ in inspected):
        names.append("bias")
    fig = Figure(figsize=(2.8 * len(names), 2.6 * len(items)), layout="constrained")
    axes = fig.subplots(len(items), len(names), squeeze=False)
    for r, (title, details, n_mem) in enumerate(inspected):
        terms = details["terms"][figures.resolve_index(layer, len(details["terms"]), "layer")]
        for c, name in enumerate(names):
            ax = axes[r][c]
            ax.set_title(f"{title}\n{figures.TERM_NAMES[name]}" if c == 0 else figures.TERM_NAMES[name], fontsize=7)
            if name in terms:
                values = figures.masked(terms[name][0, head], terms.get("visible"))
                figures.draw_map(ax, values, n_mem, "RdBu_r", figures.diverging(values), labels=c == 0)
            else:
                figures.mark_off(ax, "off")
    fig.suptitle(f"score terms of {_layer_name(layer)}, head {head}, all runs")
    return fig


def _layer_name(layer: int) -> str:
    return "the last layer" if layer == -1 else f"layer {layer}"


def _load_drawable(run_dir: Path, kind: str, loader: Callable):
    """(config, model) of a run that can be drawn as `kind`, else a one-line ConfigError naming the run."""
    try:
        config, model = loader(run_dir)
    except UNLOADABLE as err:
        first_sentence = str(err).split(". ")[0]
        raise ConfigError(str(run_dir), f"cannot load the trained model: {first_sentence}") from None
    if kind == "bias":
        try:
            figures.check_has_bias(model, f"run {run_dir.name}")
        except ConfigError as err:
            raise ConfigError(str(run_dir), err.message) from None
    return config, model


def save_model_figures(df, kind: str, out: Path, layer: int = -1, head: int = 0,
                       formats: tuple[str, ...] = ("png", "pdf"), loader: Callable | None = None,
                       sampler: Callable | None = None) -> tuple[list[Path], list[str]]:
    """One `kind` figure per finished run (plus an overview for several); returns (files, notes).

    A single run that cannot be drawn (no checkpoint, no bias for kind='bias') is a one-line error;
    in a grid such runs are skipped with a note, and it is an error only when none can be drawn.
    loader(run_dir) -> (RunConfig, model) and sampler(config, length) -> tokens [1, length] default
    to the training package's load_run and sample_inputs.
    """
    if kind not in MODEL_KINDS:
        raise ConfigError("kind", f"{kind!r} is not allowed; choose one of {', '.join(MODEL_KINDS)}")
    loader, sampler = loader or load_trained, sampler or sample_tokens
    runs = finished_runs(df)
    single = len(runs) == 1
    keys = default_rows(runs)
    order = [*keys, "seed"]
    orders = axis_orders(read_spec(df))
    ordered = sorted((run for _, run in runs.iterrows()), key=lambda r: sort_key(row_key(r, order), order, orders))
    written, notes, items = [], [], []
    for run in ordered:
        title = run_title(run, keys)
        try:
            config, model = _load_drawable(Path(run["run_dir"]), kind, loader)
        except ConfigError as err:
            if single:
                raise
            notes.append(f"{err.field}: skipped ({err.message})")
            continue
        fig = run_figure(kind, config, model, title, layer, head, sampler)  # bad --layer/--head: raised
        written += save_figure(fig, Path(out) / (kind if single else f"{kind}_{run['run_id']}"), formats)
        items.append((title, config, model))
    if not items:
        raise ConfigError("kind", f"no run could be drawn as {kind!r}: {notes[0] if notes else ''}")
    if len(items) > 1:
        written += save_figure(overview_figure(kind, items, layer, head, sampler), Path(out) / f"{kind}_overview", formats)
    return written, notes
