"""Training curves (`plot --kind curves`): a metric of each run's metrics.csv (the training-batch
loss by default, and the validation loss beside it when training logged one) against the step, one
line per variant, the mean over its seeds, with the seeds' min-max range as a band.

The mean and the band of a variant are taken at the steps every one of its seeds logged: a mean over
a set of seeds that changes along the line (one seed still running, one failed early) would bend
where a seed stops, not where the loss does. A variant cut short that way is named in the notes.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from relpos_ablate import rundir
from relpos_ablate.analysis.run_labels import variant_label
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import run_level
from relpos_ablate.analysis.tables import runs_in_spec_order
from relpos_ablate.config import ConfigError

DEFAULT_METRICS = ("train_loss", "val_loss")
"""The panels drawn unless a metric is asked for: each one some run logged (train/module.py logs
train_<metric> every train.log_every steps, val_<metric> at each validation during fit)."""
BAND = "band: min–max over seeds"
"""What the shaded range is, as the legend says it."""


def read_metrics(run_dir: str | Path) -> pd.DataFrame | None:
    """metrics.csv as a frame indexed by step (sorted), or None when it is missing, empty or
    unreadable (a queued run, a run that failed before its first logged step)."""
    path = Path(run_dir) / rundir.METRICS
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError, pd.errors.ParserError):
        return None
    if frame.empty or "step" not in frame:
        return None
    frame = frame.dropna(subset=["step"]).astype({"step": int})
    return frame.drop_duplicates("step", keep="last").set_index("step").sort_index()


def variant_runs(df: pd.DataFrame) -> dict[str, list[pd.Series]]:
    """The runs of the collected frame grouped by variant (the fields that tell runs apart, seed
    excluded; run_labels.variant_label words them), variants and seeds in the spec's order."""
    keys, ordered = runs_in_spec_order(run_level(df), df)
    variants: dict[str, list[pd.Series]] = {}
    for run in ordered:
        name = variant_label(run, keys, df.attrs.get("variant_axes", ()))
        variants.setdefault(name, []).append(run)
    return variants


def seed_band(series: list[pd.Series]) -> pd.DataFrame:
    """mean, low, high (min and max) over the seeds' curves at the steps every one of them
    logged."""
    joined = pd.concat(series, axis=1, join="inner").dropna()
    return pd.DataFrame(
        {"mean": joined.mean(axis=1), "low": joined.min(axis=1), "high": joined.max(axis=1)}
    )


def _seed_curves(
    runs: list[pd.Series], tables: dict, metric: str, name: str, missing: dict
) -> list[pd.Series]:
    """Each run's `metric` by step (`tables`: run dir -> read_metrics); a run without it goes to
    `missing` (why -> runs)."""
    curves = []
    for run in runs:
        metrics = tables.get(run["run_dir"])
        seed = label(run.get("seed"))
        if metrics is None or metric not in metrics or metrics[metric].isna().all():
            why = f"no {rundir.METRICS}" if metrics is None else f"no {metric} in {rundir.METRICS}"
            missing.setdefault(why, []).append(f"{name} seed {seed} ({run.get('status')})")
            continue
        curves.append(metrics[metric].dropna().rename(seed))
    return curves


def draw_curves(
    ax, variants: dict[str, list[pd.Series]], metric: str, notes: list[str], tables: dict
) -> int:
    """One line per variant (the mean over its seeds) with the seeds' min-max band, on `ax`
    (`tables`: run dir -> read_metrics); returns how many variants were drawn."""
    colors = [colormaps["tab10"](k % 10) for k in range(len(variants))]
    drawn, missing = 0, {}
    for color, (name, runs) in zip(colors, variants.items()):
        curves = _seed_curves(runs, tables, metric, name, missing)
        if not curves:
            continue
        band = seed_band(curves)
        last = {str(c.name): int(c.index.max()) for c in curves}
        if band.empty:
            notes.append(f"{metric}: {name}: its seeds logged no step in common; not drawn")
            continue
        if len(set(last.values())) > 1:
            ends = ", ".join(f"seed {seed} at step {step}" for seed, step in last.items())
            notes.append(
                f"{metric}: {name}: the seeds' curves end at different steps ({ends}); the mean "
                f"and band stop at step {int(band.index.max())}, the last step every seed logged"
            )
        ax.plot(band.index, band["mean"], color=color, lw=1.4, label=f"{name} (n={len(curves)})")
        if len(curves) > 1:
            ax.fill_between(band.index, band["low"], band["high"], color=color, alpha=0.2, lw=0)
        drawn += 1
    notes += [f"{metric}: not drawn, {why}: {'; '.join(runs)}" for why, runs in missing.items()]
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    return drawn


def curves_figure(df: pd.DataFrame, metric: str | None = None) -> tuple[Figure, list[str]]:
    """A panel per metric (`metric`, else those of DEFAULT_METRICS some run logged) with the
    variants' curves; returns (figure, notes). A metric no run logged is a one-line error naming
    the ones they did."""
    variants = variant_runs(df)
    tables = {
        run["run_dir"]: read_metrics(run["run_dir"]) for runs in variants.values() for run in runs
    }
    logged = sorted({c for table in tables.values() if table is not None for c in table.columns})
    if not logged:
        raise ConfigError("kind", f"curves: no run has a {rundir.METRICS} yet")
    metrics = [metric] if metric else [m for m in DEFAULT_METRICS if m in logged]
    missing = [m for m in metrics if m not in logged]
    if missing or not metrics:
        raise ConfigError(
            "metric",
            f"{(missing or DEFAULT_METRICS)[0]!r} is in no run's {rundir.METRICS}; logged: "
            f"{', '.join(logged)}",
        )
    fig = Figure(figsize=(6.4 * len(metrics), 4.4), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    notes: list[str] = []
    for ax, name in zip(axes, metrics):
        draw_curves(ax, variants, name, notes, tables)
    handles, labels = axes[0].get_legend_handles_labels()
    band = Patch(color="0.5", alpha=0.3, label=BAND)
    mean = Line2D([], [], color="0.3", label="line: mean over seeds")
    axes[0].legend([*handles, mean, band], [*labels, mean.get_label(), BAND], fontsize=8)
    fig.suptitle("training curves: one line per variant (n = its seeds)", fontsize=10)
    return fig, notes


def save_curves(
    df: pd.DataFrame,
    out: Path,
    metric: str | None = None,
    formats: tuple[str, ...] = ("png", "pdf"),
) -> tuple[list[Path], list[str]]:
    """curves.<fmt> in `out`; returns (written files, notes)."""
    from relpos_ablate.analysis.plots import save_figure

    fig, notes = curves_figure(df, metric)
    return save_figure(fig, Path(out) / "curves", formats), notes
