"""The packed-documents study (experiments/packed_documents.yaml, results/packed_documents/): what
changes when positions restart per document? The fair-baselines core on BPE tokens of Tiny
Shakespeare's speeches, the documents either concatenated into one stream or packed with resets
(`data.documents`: concatenate | packed_reset; docs/guide/documents.md). Its confirmatory tests are
the plan's (the spec's `analysis:`, run by analysis/planned.py before this report); everything here
is exploratory and says so:

- the spec's table (perplexity per encoding and documents mode at every evaluation setting);
- per evaluation setting, the mean ± std over the seeds of loss, doc_loss, beyond_loss and bpb;
- what changes when positions restart: per encoding, packed_reset minus concatenate of the mean
  loss at L and at 8L (sliding) and of the mean beyond_loss at 8L (sliding): differences of means,
  no test;
- the loss by place in the document at 8L (sliding), per encoding and mode (`document_curves`).

`plot --kind documents`: that loss by place, a panel per encoding, a line per documents mode (mean
over the seeds, min-max band). It keeps the per-run curves in documents.csv beside the run dirs:
they stay local, and the committed summary.csv and documents.csv are the study's data.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate import rundir
from relpos_ablate.analysis.grid_report import grid_report
from relpos_ablate.analysis.plots import save_figure
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_text
from relpos_ablate.studies import layouts

EXPERIMENT = "packed_documents"
#: the spec's order of the encodings; others found in the runs follow, sorted
ENCODINGS = ("nope", "vaswani", "rope", "alibi", "t5", "fox", "xl")
MODE = "data.documents"
MODES = ("concatenate", "packed_reset")
STATISTICS = ("loss", "doc_loss", "beyond_loss", "bpb")
#: the per-run loss by place in the document, kept beside summary.csv (the run dirs stay local)
CURVES = "documents.csv"
CURVE_COLUMNS = (
    "run_id",
    "encoding",
    MODE,
    "seed",
    "protocol",
    "segment_len",
    "bin_lo",
    "bin_hi",
    "loss",
    "tokens",
)


def _frame(df: pd.DataFrame) -> pd.DataFrame:
    """The study's evaluated rows."""
    return df[(df["experiment"] == EXPERIMENT) & df["loss"].notna()].copy()


def _train_length(frame: pd.DataFrame) -> int:
    """L, the training length (train.segment_len, one for the whole grid)."""
    return int(frame["train.segment_len"].iloc[0])


def _ranked(frame: pd.DataFrame) -> tuple[tuple[str, int], tuple[str, int]]:
    """(protocol, segment_len) of the two headline settings: L, and 8L with sliding windows."""
    length = _train_length(frame)
    return ("non_overlapping", length), ("sliding", 8 * length)


def _encodings(frame: pd.DataFrame) -> list[str]:
    found = set(frame["encoding"].dropna())
    return [e for e in ENCODINGS if e in found] + sorted(found - set(ENCODINGS))


def _at(frame: pd.DataFrame, protocol: str, length: int) -> pd.DataFrame:
    return frame[(frame["protocol"] == protocol) & (frame["segment_len"] == length)]


def _words(frame: pd.DataFrame, protocol: str, length: int) -> str:
    """A setting in words: `8L = 512, sliding (stride 64)`."""
    ratio = length / _train_length(frame)
    times = "L" if ratio == 1 else f"{ratio:g}L"
    strides = _at(frame, protocol, length).get("stride", pd.Series(dtype=float)).dropna()
    stride = f" (stride {int(strides.iloc[0])})" if protocol == "sliding" and len(strides) else ""
    return f"{times} = {length}, {protocol.replace('_', '-')}{stride}"


def document_curves(df: pd.DataFrame) -> pd.DataFrame:
    """The loss by place in the document per run and evaluation setting, a row per bin [bin_lo,
    bin_hi) of places (train/document_metrics.py's log bins; loss NaN where no token was scored):
    from the runs' eval.json ("documents" -> "position_loss"), and for the runs whose dirs are not
    here (a committed summary) from CURVES beside them, which `plot --kind documents` writes."""
    rows = []
    for _, run in df.drop_duplicates("run_dir").iterrows():
        record = rundir.read_eval(run["run_dir"]) or {}
        for setting in record.get("settings") or []:
            documents = setting.get("documents") if isinstance(setting, dict) else None
            curve = documents.get("position_loss") if isinstance(documents, dict) else None
            if not isinstance(curve, dict):
                continue
            base = {
                **{c: run.get(c) for c in ("run_id", "encoding", MODE, "seed")},
                "protocol": rundir.record_value(setting, "protocol", record),
                "segment_len": setting.get("segment_len"),
            }
            edges = curve["edges"]
            rows += [
                {
                    **base,
                    "bin_lo": lo,
                    "bin_hi": hi,
                    "loss": np.nan if loss is None else loss,
                    "tokens": tokens,
                }
                for lo, hi, loss, tokens in zip(edges, edges[1:], curve["loss"], curve["tokens"])
            ]
    parts = [pd.DataFrame(rows, columns=list(CURVE_COLUMNS))] if rows else []
    missing = set(df["run_id"]) - {row["run_id"] for row in rows}
    # beside the summary read (read_summary's results_dir), else beside the run dirs
    folders = [df.attrs.get("results_dir"), *(Path(str(d)).parent for d in df["run_dir"].iloc[:1])]
    kept = [Path(f) / CURVES for f in folders if f and (Path(f) / CURVES).is_file()]
    if missing and kept:
        stored = pd.read_csv(kept[0])
        parts.append(stored[stored["run_id"].isin(missing)])
    if not any(len(part) for part in parts):
        raise ConfigError(
            "documents",
            f"no run has a loss by place in the document ({rundir.EVAL} 'documents' of a corpus "
            f"with documents) and no {CURVES} lies beside them; draw it with `plot --kind "
            "documents` where the run dirs are",
        )
    return pd.concat([part for part in parts if len(part)], ignore_index=True)


def _mean_std(values: pd.Series) -> str:
    if values.notna().sum() == 0:
        return "—"
    std = values.std()
    return f"{values.mean():.4f}" + ("" if math.isnan(std) else f" ± {std:.4f}")


def setting_tables(df: pd.DataFrame) -> str:
    """Per evaluation setting, the mean ± std over the seeds of each STATISTICS per encoding and
    documents mode."""
    frame = _frame(df)
    statistics = [s for s in STATISTICS if s in frame]
    lines = [
        "## Loss, loss per document, loss past L and bits per byte (exploratory: means, no test)",
        "",
        "Per evaluation setting, the mean ± standard deviation (pandas' std, ddof 1) over the "
        "seeds of each run's test loss (nats per token), doc_loss (the mean over documents of "
        "each one's mean loss), beyond_loss (the document tokens at places >= L) and bpb (bits "
        "per UTF-8 byte); summary.csv holds every run's value.",
    ]
    settings = frame[["segment_len", "protocol"]].drop_duplicates()
    for length, protocol in settings.sort_values(["segment_len", "protocol"]).itertuples(False):
        at = _at(frame, protocol, length)
        lines += [
            "",
            f"### {_words(frame, protocol, length)}",
            "",
            f"| encoding | documents | {' | '.join(statistics)} |",
            "|---|---|" + "---|" * len(statistics),
        ]
        for encoding in _encodings(frame):
            for mode in MODES:
                mine = at[(at["encoding"] == encoding) & (at[MODE] == mode)]
                if len(mine):
                    cells = " | ".join(_mean_std(mine[s]) for s in statistics)
                    lines.append(f"| {encoding} | {mode} | {cells} |")
    return "\n".join(lines) + "\n"


def restart_differences(df: pd.DataFrame) -> str:
    """Per encoding, packed_reset minus concatenate of the mean over the seeds: loss at L and at 8L
    (sliding), beyond_loss at 8L (sliding)."""
    frame = _frame(df)
    at_l, at_8l = _ranked(frame)
    columns = ((at_l, "loss"), (at_8l, "loss"), (at_8l, "beyond_loss"))
    heads = [f"{statistic} at {_words(frame, *setting)}" for setting, statistic in columns]
    lines = [
        "## What changes when positions restart (exploratory: differences of means, no test)",
        "",
        "Per encoding, the mean over the seeds under packed_reset minus that under concatenate "
        "(nats per token; negative: the model scores better when told where documents start). "
        "Differences of means only: the plan's families above hold the tests.",
        "",
        f"| encoding | {' | '.join(heads)} |",
        "|---|" + "---|" * len(columns),
    ]
    for encoding in _encodings(frame):
        cells = []
        for setting, statistic in columns:
            at = _at(frame, *setting)
            means = at[at["encoding"] == encoding].groupby(MODE)[statistic].mean()
            difference = means.get("packed_reset", np.nan) - means.get("concatenate", np.nan)
            cells.append("—" if math.isnan(difference) else f"{difference:+.4f}")
        lines.append(f"| {encoding} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def place_table(frame: pd.DataFrame, curves: pd.DataFrame) -> str:
    """The mean over the seeds of each run's loss in each place bin below L and pooled from L on,
    at 8L (sliding), per encoding and documents mode."""
    length = _train_length(frame)
    protocol, long = _ranked(frame)[1]
    at = _at(curves, protocol, long)
    low = at[at["bin_lo"] < length]
    high = at[(at["bin_lo"] >= length) & (at["tokens"] > 0)]
    # pooled per run, token-weighted: the run's loss on the places from L on (its beyond_loss)
    weighted = (high["loss"] * high["tokens"]).groupby(high["run_id"]).sum()
    pooled = weighted / high.groupby("run_id")["tokens"].sum()
    tops = low.groupby("bin_lo")["bin_hi"].max()
    heads = [f"[{lo},{hi})" for lo, hi in tops.items()] + [f">= {length}"]
    lines = [
        f"| encoding | documents | {' | '.join(heads)} |",
        "|---|---|" + "---|" * len(heads),
    ]
    for encoding in _encodings(frame):
        for mode in MODES:
            mine = low[(low["encoding"] == encoding) & (low[MODE] == mode)]
            if mine.empty:
                continue
            means = mine.groupby("bin_lo")["loss"].mean()
            runs = at[(at["encoding"] == encoding) & (at[MODE] == mode)]["run_id"].unique()
            cells = [means.get(lo, np.nan) for lo in tops.index]
            cells.append(pooled.reindex(runs).mean())
            text = ["—" if math.isnan(c) else f"{c:.3f}" for c in cells]
            lines.append(f"| {encoding} | {mode} | {' | '.join(text)} |")
    tokens = [
        *low.groupby("bin_lo")["tokens"].mean(),
        high.groupby("run_id")["tokens"].sum().mean(),
    ]
    counts = " | ".join("—" if math.isnan(t) else f"{t:.0f}" for t in tokens)
    lines.append(f"| tokens per run (mean) | | {counts} |")
    return "\n".join(lines)


def place_section(df: pd.DataFrame) -> str:
    frame = _frame(df)
    protocol, long = _ranked(frame)[1]
    lines = [
        f"## The loss by place in the document at {_words(frame, protocol, long)} (exploratory: "
        "means, no test)",
        "",
        "Each run's mean loss (nats) of the targets at places [lo, hi) in their document (place 0: "
        "the document's first token, predicted from its separator alone), then the mean over the "
        f"seeds; `>= {_train_length(frame)}`: each run's bins from L on pooled (token-weighted: "
        f"its beyond_loss), then the mean over the seeds. Per run in {CURVES} "
        "(`document_curves`).",
        "",
    ]
    try:
        lines.append(place_table(frame, document_curves(frame)))
    except ConfigError as err:
        lines.append(f"Not tabulated: {err}.")
    return "\n".join(lines) + "\n"


def report(df: pd.DataFrame, correction: str = "holm") -> str:
    table = grid_report(
        df,
        correction,
        layouts(),
        planned=True,
        preamble="The study's own sections (relpos_ablate/studies/packed_documents.py): the "
        "spec's `table:` block, the document metrics per evaluation setting, what changes when "
        "positions restart, the loss by place in the document.",
    )
    return "\n".join([table, setting_tables(df), restart_differences(df), place_section(df)])


def figure(df: pd.DataFrame, out: Path, formats, args) -> tuple[list[Path], list[str]]:
    """The loss by place in the document at 8L (sliding): a panel per encoding (two rows), a line
    per documents mode (mean over the seeds of each run's bin loss, band: min-max), x at the bin
    centres on a log2 axis, a vertical line at L."""
    frame = _frame(df)
    curves = document_curves(frame)
    kept = Path(str(frame["run_dir"].iloc[0])).parent / CURVES
    saved = []
    if kept.parent.is_dir():
        atomic_write_text(kept, curves.to_csv(index=False, float_format="%.12g"))
        saved.append(kept)
    length = _train_length(frame)
    protocol, long = _ranked(frame)[1]
    at = _at(curves, protocol, long).assign(centre=lambda c: (c["bin_lo"] + c["bin_hi"]) / 2)
    encodings = _encodings(frame)
    columns = math.ceil(len(encodings) / 2)
    fig = Figure(figsize=(max(3.0 * columns, 6.0), 5.6), layout="constrained")
    axes = fig.subplots(2, columns, squeeze=False, sharex=True, sharey=True)
    colours = dict(zip(MODES, ("tab:blue", "tab:orange")))
    for ax, encoding in zip(axes.flat, encodings):
        for mode in MODES:
            mine = at[(at["encoding"] == encoding) & (at[MODE] == mode) & at["loss"].notna()]
            if mine.empty:
                continue
            by = mine.groupby("bin_lo")
            x = by["centre"].mean().to_numpy()
            loss = by["loss"]
            ax.plot(x, loss.mean().to_numpy(), marker="o", ms=3, color=colours[mode], label=mode)
            ax.fill_between(
                x, loss.min().to_numpy(), loss.max().to_numpy(), color=colours[mode], alpha=0.2
            )
        ax.set_xscale("log", base=2)
        ax.axvline(length, color="grey", lw=0.6, ls=":")
        ax.set_title(encoding)
    for ax in axes.flat[len(encodings) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("test loss (nats)", fontsize=8)
    # the lowest panel of each column: the top one where the bottom one is empty
    for ax in (column[-1] if column[-1].get_visible() else column[0] for column in axes.T):
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel(f"place in the document (bin centre; trained at {length})", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"Test loss by place in the document at {_words(frame, protocol, long)}\n"
        "mean of the seeds, band: min-max",
        fontsize=10,
    )
    return [*save_figure(fig, out / "documents", formats), *saved], []


REPORTS = {EXPERIMENT: report}
FIGURES = {"documents": figure}
