"""Loss by position in the evaluated segment or window (the "early token curse", ALiBi paper App.
B): a tidy frame from the runs' eval.json and `plot --kind position-loss`.

Evaluation bins each scored target by its position p in its segment (non_overlapping, xl) or window
(sliding), 0-based, in log-spaced bins [0, 1), [1, 2), [2, 4), ... up to the segment length: a
target at position p has seen p + 1 tokens of that segment or window (plus memory, for protocols
with one).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from relpos_ablate import rundir
from relpos_ablate.analysis.collect import run_names
from relpos_ablate.analysis.settings import label, table_settings
from relpos_ablate.analysis.table_options import (
    TableOptions,
    apply_where,
    axis_orders,
    finished,
    read_spec,
    resolve_options,
)
from relpos_ablate.analysis.tables import row_key, sort_key, variant_styles
from relpos_ablate.config import ConfigError

BIN_COLUMNS = ("bin_lo", "bin_hi", "position_loss", "position_tokens")
PANEL_KEYS = ("protocol", "segment_len", "stride", "mem_len")
"""What tells one evaluation setting's panel from another's."""


def position_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, evaluation setting, position bin): the collected row's columns, then bin_lo
    and bin_hi (positions [lo, hi), 0-based), position_loss (mean loss in nats) and
    position_tokens."""
    rows = []
    for run_dir, run in df.groupby("run_dir", sort=False) if "eval_setting" in df else ():
        settings = (rundir.read_eval(run_dir) or {}).get("settings")
        for record in run.dropna(subset=["eval_setting"]).to_dict("records"):
            curve = _curve(settings, int(record["eval_setting"]))
            for lo, hi, loss, tokens in curve:
                rows.append(
                    {
                        **record,
                        "bin_lo": lo,
                        "bin_hi": hi,
                        "position_loss": loss,
                        "position_tokens": tokens,
                    }
                )
    frame = pd.DataFrame(rows, columns=[*df.columns, *BIN_COLUMNS])
    frame.attrs.update(df.attrs)
    return frame


def _curve(settings, k: int) -> list[tuple]:
    """(lo, hi, loss, tokens) per bin of eval.json settings[k], or [] when it has none."""
    if not isinstance(settings, list) or k >= len(settings) or not isinstance(settings[k], dict):
        return []
    curve = settings[k].get("position_loss") or {}
    edges, loss, tokens = curve.get("edges", []), curve.get("loss", []), curve.get("tokens", [])
    return [
        (lo, hi, np.nan if value is None else value, n)
        for lo, hi, value, n in zip(edges, edges[1:], loss, tokens)
    ]


def bin_centre(lo: float, hi: float) -> float:
    """Where a bin is drawn on the log axis: the geometric middle of the context counts lo + 1 ..
    hi."""
    return math.sqrt((lo + 1) * hi)


def first_window_only(frame: pd.DataFrame) -> pd.Series:
    """The bins of a sliding setting that only each stream's first window reaches: a window moved by
    `stride` scores its last `stride` positions, so positions below segment_len - stride are scored
    in the first window alone (a few targets per stream, the stream's opening characters): left out
    of the figure."""
    if "protocol" not in frame or "stride" not in frame:
        return pd.Series(False, index=frame.index)
    sliding = (frame["protocol"] == "sliding") & frame["stride"].notna()
    first = pd.to_numeric(frame["segment_len"], errors="coerce") - pd.to_numeric(
        frame["stride"], errors="coerce"
    )
    return sliding & (frame["bin_hi"] <= first)


def position_loss_figure(df: pd.DataFrame) -> Figure:
    """One panel per evaluation setting (rows: protocols, columns: lengths), one line per variant
    (mean over seeds, ± std as a band; distinct colour and line style each), the training segment
    length marked; y shared by every panel. Sliding panels start where every window scores
    (first_window_only)."""
    spec = read_spec(df)
    options = resolve_options(table_settings(df), TableOptions(metric="loss"), spec)
    # the spec's table: where (e.g. full-target settings)
    data = apply_where(table_settings(df), options.where)
    rows = list(options.rows)
    frame = position_frame(finished(data, "loss")).dropna(subset=["position_loss"])
    frame = frame[~first_window_only(frame)]
    # a panel whose remaining positions fall in one log bin draws points, not curves: left out (its
    # loss by position is that of non_overlapping at the same length, past its first window)
    spans = frame.groupby([*[k for k in PANEL_KEYS if k in frame]], dropna=False)[
        "bin_lo"
    ].transform("nunique")
    frame = frame[spans > 1]
    if frame.empty:
        raise ConfigError(
            "kind",
            f"no loss by position in these runs' {rundir.EVAL} (evaluated before it was recorded?)",
        )
    frame["_panel"] = [row_key(r, list(PANEL_KEYS)) for _, r in frame.iterrows()]
    # RoPE extended: a line of its own
    if "rope_scaling" in frame and frame["rope_scaling"].notna().any():
        rows = rows + ["rope_scaling"]
    frame["_variant"] = [row_key(r, rows) for _, r in frame.iterrows()]
    panels = sorted(set(frame["_panel"]), key=lambda k: sort_key(k, list(PANEL_KEYS), {}))
    protocols = list(dict.fromkeys(p[0] for p in panels))
    ncols = max(sum(p[0] == name for p in panels) for name in protocols)
    # + the legend
    fig = Figure(figsize=(4.2 * ncols + 2.2, 3.6 * len(protocols) + 0.8), layout="constrained")
    axes = fig.subplots(len(protocols), ncols, squeeze=False, sharey=True)
    orders = axis_orders(spec)
    variants = sorted(set(frame["_variant"]), key=lambda k: sort_key(k, rows, orders))
    colors = dict(zip(variants, variant_styles(len(variants))))
    for r, protocol in enumerate(protocols):
        mine = [p for p in panels if p[0] == protocol]
        for c in range(ncols):
            if c >= len(mine):
                axes[r][c].set_visible(False)
                continue
            _draw_panel(axes[r][c], frame[frame["_panel"] == mine[c]], rows, orders, colors)
            axes[r][c].set_title(_panel_title(mine[c]), fontsize=9)
    handles = [
        Line2D([], [], color=color, ls=style, marker=".", label=_variant_label(key))
        for key, (color, style) in colors.items()
    ]
    handles.append(Line2D([], [], color="k", ls=":", lw=1, label="training length"))
    fig.legend(
        handles=handles,
        fontsize=7,
        title=", ".join(r.rsplit(".", 1)[-1] for r in rows),
        title_fontsize=7,
        loc="outside right upper",
    )
    sliding = (
        " (sliding: the positions every window scores, L - stride and up)"
        if "sliding" in protocols
        else ""
    )
    fig.suptitle(
        f"{run_names(frame)}: loss by position in the segment / window, log-spaced bins, mean ± "
        f"std over seeds{sliding}"
    )
    return fig


def _panel_title(key: tuple) -> str:
    protocol, segment_len, stride, mem_len = key
    parts = [f"{protocol}, L={label(segment_len)}"]
    if stride is not None:
        parts.append(f"stride {label(stride)}")
    if mem_len:
        parts.append(f"mem {label(mem_len)}")
    return ", ".join(parts)


def _variant_label(key: tuple) -> str:
    return ", ".join(label(v) for v in key if not pd.isna(v))  # an unset rope_scaling is left out


def _draw_panel(ax, part: pd.DataFrame, rows: list[str], orders: dict, colors: dict) -> None:
    for key in sorted(set(part["_variant"]), key=lambda k: sort_key(k, rows, orders)):
        mine = part[part["_variant"] == key]
        stats = (
            mine.groupby(["bin_lo", "bin_hi"])["position_loss"]
            .agg(["mean", "std", "count"])
            .reset_index()
        )
        xs = [bin_centre(lo, hi) for lo, hi in zip(stats["bin_lo"], stats["bin_hi"])]
        color, style = colors[key]
        (line,) = ax.plot(
            xs, stats["mean"], marker=".", color=color, ls=style, label=_variant_label(key)
        )
        if (stats["count"] > 1).any():
            spread = stats["std"].fillna(0.0)
            ax.fill_between(
                xs,
                stats["mean"] - spread,
                stats["mean"] + spread,
                color=line.get_color(),
                alpha=0.2,
                lw=0,
            )
    train = part["train.segment_len"].dropna().unique() if "train.segment_len" in part else []
    if len(train) == 1:
        ax.axvline(float(train[0]), color="k", ls=":", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("tokens seen in the segment / window", fontsize=8)
    ax.set_ylabel("loss (nats per token)", fontsize=8)
    ax.grid(alpha=0.3)


def save_position_loss(
    df: pd.DataFrame, out: Path, formats: tuple[str, ...] = ("png", "pdf")
) -> tuple[list[Path], list[str]]:
    """position_loss.<fmt> in `out`; returns (written files, notes)."""
    from relpos_ablate.analysis.plots import save_figure

    return save_figure(position_loss_figure(df), Path(out) / "position_loss", formats), []
