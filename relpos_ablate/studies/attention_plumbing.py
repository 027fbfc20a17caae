"""The attention-plumbing study (experiments/attention_plumbing.yaml, results/attention_plumbing/):
does the ranking of NoPE, RoPE, ALiBi and FoX survive QK-norm, an output gate, a sink logit and
Canon layers? Its confirmatory tests are the plan's (the spec's `analysis:`, run by
analysis/planned.py before this report); everything here is exploratory and says so:

- the spec's table (perplexity per encoding and variant at every evaluation setting);
- the order of the four encodings' mean perplexities per variant, at L and at 8L (sliding), with no
  test (the plan's families test each encoding against RoPE);
- whether QK-norm flattens attention (a claim attributed to Cohere's "Rope to Nope and Back Again"):
  the mean attention entropy and attended distance (over layers and heads, per run) against the
  evaluation length, QK-norm against plain per encoding: differences with 95% CIs and raw p-values
  (Welch's t-test over the seeds), no verdict.

`plot --kind plumbing`: perplexity, entropy and mean attended distance against the evaluation
length, one panel per encoding, a line per variant (mean over seeds, min-max band).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from relpos_ablate.analysis.grid_report import grid_report
from relpos_ablate.analysis.plots import save_figure
from relpos_ablate.analysis.stats import fmt_p
from relpos_ablate.analysis.ttests import compare
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_text
from relpos_ablate.studies.length_generalization.figures import collect_diagnostics

EXPERIMENT = "attention_plumbing"
ENCODINGS = ("nope", "rope", "alibi", "fox")
#: each variant's field and value; `plain` sets none of them
VARIANTS = {
    "plain": None,
    "QK-norm": ("model.attention.qk_norm", "rms"),
    "output gate": ("model.attention.output_gate", "elementwise"),
    "sink logit": ("model.attention.sink_logit", "learned"),
    "Canon": ("model.attention.canon_width", 4),
}
#: (protocol, segment_len) of the ranking's two columns: L and 8L
RANKED = (("non_overlapping", 64), ("sliding", 512))
#: the per-run diagnostics, kept beside summary.csv (the run dirs stay local)
DIAGNOSTICS = "diagnostics.csv"


def variant_of(df: pd.DataFrame) -> pd.Series:
    """Each row's variant name (VARIANTS), from the four fields."""
    names = pd.Series("plain", index=df.index)
    for name, spec in VARIANTS.items():
        if spec is not None and spec[0] in df:
            names[df[spec[0]].astype(str) == str(spec[1])] = name
    return names


def _frame(df: pd.DataFrame) -> pd.DataFrame:
    out = df[(df["experiment"] == EXPERIMENT) & df["ppl"].notna()].copy()
    out["variant"] = variant_of(out)
    return out


def ranking(df: pd.DataFrame) -> str:
    """The encodings ordered by mean perplexity (best first) per variant, at L and at 8L."""
    frame = _frame(df)
    lines = [
        "## The order of the encodings per variant (exploratory: means, no test)",
        "",
        "Best first, by the mean test perplexity over the seeds; `<` is an order of means, not a "
        "tested difference (the plan's families above test each encoding against RoPE).",
        "",
        "| variant | L = 64 | 8L = 512, sliding |",
        "|---|---|---|",
    ]
    for name in VARIANTS:
        cells = []
        for protocol, length in RANKED:
            mine = frame[
                (frame["variant"] == name)
                & (frame["protocol"] == protocol)
                & (frame["segment_len"] == length)
            ]
            means = mine.groupby("encoding")["ppl"].mean().sort_values()
            cells.append(" < ".join(f"{enc} {ppl:.2f}" for enc, ppl in means.items()))
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def run_diagnostics(df: pd.DataFrame) -> pd.DataFrame:
    """Per run and non-overlapping evaluation length: the mean over layers and heads of the
    attention entropy and the mean attended distance, from the runs' eval.json, or where the run
    dirs are not here (a committed summary) from DIAGNOSTICS beside them, which `plot --kind
    plumbing` writes."""
    frame = _frame(df)
    frame = frame[frame["protocol"] == "non_overlapping"]
    try:
        diagnostics = collect_diagnostics(frame)
    except ConfigError:
        # beside the summary read (read_summary's results_dir), else beside the run dirs
        folders = [df.attrs.get("results_dir"), Path(str(frame["run_dir"].iloc[0])).parent]
        kept = [Path(f) / DIAGNOSTICS for f in folders if f and (Path(f) / DIAGNOSTICS).exists()]
        if not kept:
            raise
        return pd.read_csv(kept[0])
    diagnostics["variant"] = variant_of(diagnostics)
    return (
        diagnostics.groupby(["run_id", "encoding", "variant", "seed", "order"])[
            ["entropy", "distance"]
        ]
        .mean()
        .reset_index()
        .rename(columns={"order": "segment_len"})
    )


def qk_norm_entropy(df: pd.DataFrame) -> str:
    """QK-norm against plain per encoding and evaluation length: entropy and distance."""
    runs = run_diagnostics(df)
    lines = [
        "## Does QK-norm flatten attention? (exploratory)",
        "",
        "Mean attention entropy (nats) and mean attended distance (tokens) over every layer and "
        "head, per run, on non-overlapping segments of each length; QK-norm minus plain, Welch's "
        "t-test over the 3 seeds of each, 95% CI, raw p (no correction, no verdict). A flatter "
        "attention has a higher entropy.",
        "",
        "| encoding | L | entropy plain | entropy QK-norm | difference [95% CI] | p | "
        "distance plain | distance QK-norm | difference [95% CI] | p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for encoding in ENCODINGS:
        for length in sorted(runs["segment_len"].unique()):
            at = runs[(runs["encoding"] == encoding) & (runs["segment_len"] == length)]
            cells = []
            for statistic in ("entropy", "distance"):
                plain, normed = (
                    at[at["variant"] == v].set_index("run_id")[statistic]
                    for v in ("plain", "QK-norm")
                )
                test = compare(normed.to_dict(), plain.to_dict())
                cells += [
                    f"{plain.mean():.3f}",
                    f"{normed.mean():.3f}",
                    "—"
                    if test is None
                    else f"{test.difference:+.3f} [{test.ci[0]:+.3f}, {test.ci[1]:+.3f}]",
                    "—" if test is None else fmt_p(test.p),
                ]
            lines.append(f"| {encoding} | {int(length)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def report(df: pd.DataFrame, correction: str = "holm") -> str:
    from relpos_ablate.studies import layouts

    table = grid_report(
        df,
        correction,
        layouts(),
        planned=True,
        preamble="The study's own sections (relpos_ablate/studies/attention_plumbing.py): the "
        "spec's `table:` block, the order of the encodings per variant, QK-norm's attention "
        "entropy.",
    )
    return "\n".join([table, ranking(df), qk_norm_entropy(df)])


def figure(df: pd.DataFrame, out: Path, formats, args) -> tuple[list[Path], list[str]]:
    """Perplexity (sliding and non-overlapping), entropy and attended distance against the
    evaluation length: a row per quantity, a panel per encoding, a line per variant."""
    frame = _frame(df)
    runs = run_diagnostics(df)
    kept = Path(str(frame["run_dir"].iloc[0])).parent / DIAGNOSTICS
    if kept.parent.exists():
        atomic_write_text(kept, runs.to_csv(index=False, float_format="%.12g"))
    rows = [
        ("test perplexity, sliding windows", frame[frame["protocol"] == "sliding"], "ppl"),
        ("test perplexity, non-overlapping", frame[frame["protocol"] == "non_overlapping"], "ppl"),
        ("attention entropy (nats)", runs, "entropy"),
        ("mean attended distance", runs, "distance"),
    ]
    fig = Figure(figsize=(3.2 * len(ENCODINGS), 2.6 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(ENCODINGS), squeeze=False)
    colours = dict(zip(VARIANTS, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
    for r, (label, data, column) in enumerate(rows):
        for c, encoding in enumerate(ENCODINGS):
            ax = axes[r][c]
            for name in VARIANTS:
                mine = data[(data["encoding"] == encoding) & (data["variant"] == name)]
                if mine.empty:
                    continue
                by = mine.groupby("segment_len")[column]
                x = np.array(sorted(mine["segment_len"].unique()), dtype=float)
                ax.plot(x, by.mean().to_numpy(), marker="o", ms=3, color=colours[name], label=name)
                ax.fill_between(
                    x, by.min().to_numpy(), by.max().to_numpy(), color=colours[name], alpha=0.15
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks([64, 128, 256, 512], ["64", "128", "256", "512"])
            ax.axvline(64, color="grey", lw=0.6, ls=":")
            if r == 0:
                ax.set_title(encoding)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("evaluation length (trained at 64)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        "Attention plumbing: each encoding with and without it (mean of 3 seeds, band: min-max)",
        fontsize=10,
    )
    written = save_figure(fig, out / "plumbing", formats)
    return [*written, kept], []


REPORTS = {EXPERIMENT: report}
FIGURES = {"plumbing": figure}
