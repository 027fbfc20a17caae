"""The fair-baselines study (experiments/fair_baselines.yaml): every encoding preset at its own best
learning rate, as papers tune each baseline before comparing them.

From the collected frame (or the committed summary.csv) at the training length L: per preset, the
learning rate whose mean valid perplexity over seeds is lowest (best_over.pick_values, as `table
--best-over train.lr` picks it), the test perplexity of its seeds at that rate, its ratio to the
best preset's, and how many presets that encode position end more than TOLERANCE above the best
(`nope`, which encodes none, is reported, not judged); the same count at the default learning rate
for every preset, which is what an untuned comparison gets; the presets whose best rate is at an
edge of their own sweep (their optimum may lie beyond it); and each preset against the best, one
family of Welch's t-tests (different models), corrected together (analysis/stats.py). `report` gives
the Markdown (the studies registry), `lr_figure` the figure (`plot --kind lr-sweep`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate.analysis.best_over import pick_values
from relpos_ablate.analysis.settings import normalized, table_settings
from relpos_ablate.analysis.stats import Family
from relpos_ablate.analysis.table_options import axis_orders, read_spec
from relpos_ablate.analysis.tables import sort_key, variant_colors
from relpos_ablate.config import ConfigError
from relpos_ablate.config.run import TrainConfig

TOLERANCE = 0.10
"""A preset more than this above the best preset's test perplexity (ratio > 1.10) is not a fair
baseline."""
UNJUDGED = ("nope",)
"""Presets that encode no position: reported, not held to the tolerance."""
NEAR_TIE = 0.005
"""A pick whose runner-up rate's mean valid ppl lies within this fraction of its own is marked: on
validation the pick is not clearly better than that rate."""
KEY, ROW, METRIC = "train.lr", "encoding", "ppl"
SELECT, REPORT = "valid", "test"
DEFAULT_LR = TrainConfig().lr
"""The learning rate every preset gets untuned (TrainConfig's default)."""
GROUP_COLORS = ("0.45", "tab:orange")
"""lr-sweep figure: the bar colour of the presets of each left panel (baselines, bias types)."""


def at_training_length(df: pd.DataFrame) -> pd.DataFrame:
    """The finished rows evaluated at the training length, non_overlapping, without RECL's ladder (a
    subset of the targets): what the study compares (one line naming what is missing otherwise)."""
    missing = [
        c for c in (ROW, KEY, "split", "segment_len", "train.segment_len", METRIC) if c not in df
    ]
    if missing:
        raise ConfigError(
            "report",
            f"fair_baselines needs the columns {', '.join(missing)} (runs of "
            "experiments/fair_baselines.yaml, collected)",
        )
    df = table_settings(df)
    data = df[
        np.isfinite(pd.to_numeric(df[METRIC], errors="coerce"))
        & (df["segment_len"] == df["train.segment_len"])
    ]
    if "protocol" in data:
        data = data[data["protocol"].fillna("non_overlapping") == "non_overlapping"]
    if data.empty:
        raise ConfigError("report", f"no {METRIC} at the training length in these runs")
    return data


STEPS = "train.max_steps"


def by_budget(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[int, pd.DataFrame]]:
    """The learning-rate sweep's runs (the training budget most runs have) and, per other budget,
    its runs (experiments/fair_baselines_2000.yaml: some presets at their pick, trained longer)."""
    if STEPS not in df or df[STEPS].isna().all():
        return df, {}
    steps = pd.to_numeric(df[STEPS], errors="coerce")
    sweep = (
        int(steps[df.drop_duplicates("run_dir").index].value_counts().idxmax())
        if "run_dir" in df
        else int(steps.value_counts().idxmax())
    )
    others = {int(n): df[steps == n] for n in sorted(set(steps.dropna().astype(int))) if n != sweep}
    return df[steps == sweep], others


def preset_summary(df: pd.DataFrame, orders: dict[str, list] | None = None) -> pd.DataFrame:
    """One row per preset (in `orders`' order, else by name): best_lr (valid's pick), valid (its
    mean valid ppl), test (its seeds' test ppl, {run dir: ppl}), mean, std, n, ratio (mean / the
    best preset's mean), and the same at DEFAULT_LR: default_mean, default_ratio (NaN where the
    sweep lacks it); runner_up: how far the second-best rate's mean valid ppl lies above the pick's
    (a fraction; NaN with one rate)."""
    orders = orders or {}
    data = at_training_length(df)
    split = data["split"].map(normalized)
    select, report = data[split == SELECT], data[split == REPORT]
    picks = pick_values(select, KEY, [ROW], [], METRIC, orders)
    lines = []
    for (preset,), lr in picks.items():
        test = _values(report, preset, lr)
        valid = _values(select, preset, lr)
        default = _values(report, preset, DEFAULT_LR)
        values = list(test.values())
        rates = select[select[ROW] == preset].groupby(KEY)[METRIC].mean().sort_values()
        runner_up = rates.iloc[1] / rates.iloc[0] - 1 if len(rates) > 1 else math.nan
        lines.append(
            {
                "preset": preset,
                "best_lr": lr,
                "valid": np.mean(list(valid.values())),
                "test": test,
                "mean": np.mean(values) if values else math.nan,
                "std": np.std(values, ddof=1) if len(values) > 1 else math.nan,
                "n": len(values),
                "default_mean": np.mean(list(default.values())) if default else math.nan,
                "runner_up": runner_up,
            }
        )
    table = pd.DataFrame(lines)
    table["ratio"] = table["mean"] / table["mean"].min()
    table["default_ratio"] = table["default_mean"] / table["default_mean"].min()
    rank = table["preset"].map(lambda p: sort_key((p,), [ROW], orders))
    return (
        table.assign(_rank=rank).sort_values("_rank").drop(columns="_rank").reset_index(drop=True)
    )


def _values(frame: pd.DataFrame, preset: str, lr: float) -> dict[str, float]:
    """{run dir: metric} of every seed of `preset` at learning rate `lr` in `frame`."""
    rows = frame[(frame[ROW] == preset) & np.isclose(frame[KEY].astype(float), lr)]
    return dict(zip(rows["run_dir"], rows[METRIC].astype(float)))


def over_tolerance(summary: pd.DataFrame, column: str = "ratio") -> list[str]:
    """The judged presets (UNJUDGED aside) whose `column` ratio is above 1 + TOLERANCE, worst
    first."""
    judged = summary[~summary["preset"].isin(UNJUDGED) & (summary[column] > 1 + TOLERANCE)]
    return judged.sort_values(column, ascending=False)["preset"].tolist()


def report(df: pd.DataFrame, correction: str = "holm") -> str:
    """The study's Markdown (module docstring), then a section per longer budget (longer_budget)."""
    df, longer = by_budget(df)
    # display order only
    summary = preset_summary(df).sort_values(["mean", "preset"]).reset_index(drop=True)
    data = at_training_length(df)
    rates = {preset: sorted({float(v) for v in part[KEY]}) for preset, part in data.groupby(ROW)}
    seeds = data["seed"].nunique() if "seed" in data else 0
    best = summary.loc[summary["mean"].idxmin()]
    family = Family(f"every preset vs the best ({best['preset']})", correction)
    tests = [
        family.compare(best["preset"], best["test"], row.preset, row.test)
        for row in summary.itertuples()
        if row.preset != best["preset"]
    ]
    default = f"lr {DEFAULT_LR:g}"
    lines = [
        "# Fair baselines: each preset at its own best learning rate",
        "",
        f"Every preset trained at L = {int(data['train.segment_len'].iloc[0])} and evaluated "
        f"there (non_overlapping); learning rates {_sweep(rates)}; {seeds} seeds. Per preset, the "
        f"rate with the lowest mean {SELECT} ppl over seeds (`best lr`); {REPORT} ppl at that "
        f"rate, mean ± std over its seeds; `/ best`: over the best preset's {REPORT} mean "
        f"({best['preset']}, {best['mean']:.2f}). The last two columns give every preset the "
        f"default {default}, untuned. Rows by {REPORT} mean: a display order, not a ranking (the "
        f"tests below say which gaps hold).",
        "",
        f"| preset | best lr | {SELECT} ppl | {REPORT} ppl | / best | {REPORT} ppl at "
        f"{default} | / best at {default} |",
        "|:---|---:|---:|---:|---:|---:|---:|",
        *(_table_row(row) for row in summary.itertuples()),
        "",
        *_findings(summary, rates),
        "",
        f"## Each preset against the best ({REPORT} ppl of the seeds at each one's best rate; two "
        f"models: Welch's t-test; the best is the lowest mean, picked from the same data, so its "
        f"gaps are if anything overstated)",
        "",
        *(f"- {test}" for test in tests),
        "",
        family.summary(),
    ]
    sweep_steps = int(pd.to_numeric(data[STEPS]).iloc[0]) if STEPS in data else None
    for steps, runs in longer.items():
        lines += ["", *longer_budget(summary, runs, steps, sweep_steps, correction)]
    return "\n".join(lines) + "\n"


def longer_budget(
    summary: pd.DataFrame, runs: pd.DataFrame, steps: int, sweep_steps: int | None, correction: str
) -> list[str]:
    """Markdown lines: the presets trained for `steps` at their sweep pick, their test ppl and ratio
    to the best at both budgets, the count beyond the tolerance at the longer one, each against its
    best (Welch), and al_rfou against nope at both budgets (the sweep found the per-layer absolute
    embeddings behind no position)."""
    data = at_training_length(runs)
    report = data[data["split"].map(normalized) == REPORT]
    picks = dict(zip(summary["preset"], summary["best_lr"]))
    rows = []
    for preset, part in report.groupby(ROW):
        rates = sorted({float(v) for v in part[KEY]})
        lr = rates[0]
        values = _values(report, preset, lr)
        rows.append(
            {
                "preset": preset,
                "lr": lr,
                "test": values,
                "mean": np.mean(list(values.values())),
                "std": np.std(list(values.values()), ddof=1) if len(values) > 1 else math.nan,
                "picked": preset in picks and np.isclose(lr, picks[preset]),
            }
        )
    if not rows:
        return []
    table = pd.DataFrame(rows).sort_values(["mean", "preset"]).reset_index(drop=True)
    table["ratio"] = table["mean"] / table["mean"].min()
    short = summary.set_index("preset")
    best = table.iloc[0]
    seeds = data["seed"].nunique() if "seed" in data else 0
    before = f"{sweep_steps} steps" if sweep_steps else "the sweep's budget"
    lines = [
        f"## A longer budget: {steps} steps",
        "",
        f"{len(table)} presets trained for {steps} steps at the rate each picked at {before} "
        f"(experiments/fair_baselines_{steps}.yaml), {seeds} seeds, evaluated as above; `/ best`: "
        f"over the best preset's {REPORT} mean at that budget (at {steps} steps: "
        f"{best['preset']}, {best['mean']:.2f}, among the presets run there). Rows by the longer "
        f"budget's mean: a display order.",
        "",
        f"| preset | lr | {REPORT} ppl, {before} | / best | {REPORT} ppl, {steps} steps | / best |",
        "|:---|---:|---:|---:|---:|---:|",
    ]
    for row in table.itertuples():
        name = f"{row.preset} (no position)" if row.preset in UNJUDGED else row.preset
        lr = f"{row.lr:g}" + ("" if row.picked else " (not its pick)")
        early = short.loc[row.preset] if row.preset in short.index else None
        first = (
            f"{early['mean']:.2f} ± {early['std']:.2f} | {early['ratio']:.3f}"
            if early is not None
            else "— | —"
        )
        lines.append(
            f"| {name} | {lr} | {first} | {row.mean:.2f} ± {row.std:.2f} | {row.ratio:.3f} |"
        )
    judged = table[~table["preset"].isin(UNJUDGED)]
    over = (
        judged[judged["ratio"] > 1 + TOLERANCE]
        .sort_values("ratio", ascending=False)["preset"]
        .tolist()
    )
    lines += [
        "",
        f"- Presets that encode position more than {TOLERANCE:.0%} above the best at {steps} "
        f"steps: {len(over)} of {len(judged)}" + (f" ({', '.join(over)})." if over else "."),
    ]
    family = Family(f"every preset vs the best ({best['preset']}) at {steps} steps", correction)
    tests = [
        family.compare(best["preset"], best["test"], row.preset, row.test)
        for row in table.itertuples()
        if row.preset != best["preset"]
    ]
    lines += [
        "",
        f"Each against the best at {steps} steps ({REPORT} ppl; two models: Welch's t-test):",
        "",
        *(f"- {test}" for test in tests),
        "",
        family.summary(),
    ]
    pair = ("al_rfou", "nope")
    if all(p in set(table["preset"]) for p in pair) and all(p in short.index for p in pair):
        family = Family("al_rfou against nope, each budget", correction)
        at = {p: table.set_index("preset").loc[p, "test"] for p in pair}
        tests = [
            family.compare(
                f"al_rfou, {before}",
                short.loc["al_rfou", "test"],
                f"nope, {before}",
                short.loc["nope", "test"],
            ),
            family.compare(
                f"al_rfou, {steps} steps", at["al_rfou"], f"nope, {steps} steps", at["nope"]
            ),
        ]
        lines += [
            "",
            "Al-Rfou's per-layer learned absolute embeddings against no position at all (two "
            "models: Welch's t-test):",
            "",
            *(f"- {test}" for test in tests),
            "",
            family.summary(),
        ]
    return lines


def _table_row(row) -> str:
    spread = f" ± {row.std:.2f}" if not math.isnan(row.std) else ""
    name = f"{row.preset} (no position)" if row.preset in UNJUDGED else row.preset
    tie = " †" if row.runner_up < NEAR_TIE else ""
    return (
        f"| {name} | {row.best_lr:g}{tie} | {row.valid:.2f} | {row.mean:.2f}{spread} | "
        f"{row.ratio:.3f} | {_number(row.default_mean)} | {_number(row.default_ratio, 3)} |"
    )


def _sweep(rates: dict[str, list[float]]) -> str:
    """The rates every preset ran, then each rate only some ran, naming them: '0.001, 0.002 (and
    0.0005: fox, kerple_power)'."""
    every = sorted(set.intersection(*(set(r) for r in rates.values())))
    some = sorted({lr for r in rates.values() for lr in r} - set(every))
    extra = [f"{lr:g}: {', '.join(sorted(p for p, r in rates.items() if lr in r))}" for lr in some]
    return ", ".join(f"{lr:g}" for lr in every) + (f" (and {'; '.join(extra)})" if extra else "")


def _findings(summary: pd.DataFrame, rates: dict[str, list[float]]) -> list[str]:
    """The counts beyond the tolerance (tuned, and at the default rate) and the picks at an edge of
    the preset's own sweep (its lowest or highest rate)."""
    judged = (~summary["preset"].isin(UNJUDGED)).sum()

    def count(presets: list[str]) -> str:
        return f"{len(presets)} of {judged}" + (f" ({', '.join(presets)})." if presets else ".")

    lines = [
        f"- Presets that encode position more than {TOLERANCE:.0%} above the best at their best "
        f"rate: {count(over_tolerance(summary))}"
    ]
    if summary["default_mean"].notna().all():
        lines.append(
            f"- At lr {DEFAULT_LR:g} for every preset (untuned): "
            f"{count(over_tolerance(summary, 'default_ratio'))}"
        )
    else:
        lines.append(f"- The sweep lacks lr {DEFAULT_LR:g} for some preset: no untuned comparison.")
    edges = [
        [
            f"{row.preset} ({row.best_lr:g})"
            for row in summary.itertuples()
            if np.isclose(float(row.best_lr), rates[row.preset][end])
        ]
        for end in (0, -1)
    ]
    lines.append(
        f"- Best rate at the edge of its own sweep (the optimum may lie beyond it): at the lowest "
        f"rate: {', '.join(edges[0]) or 'none'}; at the highest: {', '.join(edges[1]) or 'none'}."
    )
    ties = [
        f"{row.preset} (+{row.runner_up:.1%})"
        for row in summary.itertuples()
        if row.runner_up < NEAR_TIE
    ]
    lines.append(
        f"- † Close calls on {SELECT} (the second-best rate's mean {SELECT} ppl within "
        f"{NEAR_TIE:.1%} of the pick's, so the pick is not clearly better): "
        f"{', '.join(ties) or 'none'}."
    )
    return lines


def _number(value: float, decimals: int = 2) -> str:
    return "—" if math.isnan(value) else f"{value:.{decimals}f}"


def lr_figure(df: pd.DataFrame, orders: dict[str, list] | None = None):
    """Left: each preset's mean valid ppl against the learning rate over the best preset's valid ppl
    at its pick (one denominator for every line, so the lines show both level and shape; each pick
    starred), a panel for the presets without a bias table (the baselines) and one for the bias
    types (at most ~10 lines a panel, a colour each within the panel, the legend beside it). Right:
    each preset's test ppl at its best rate over the best preset's, mean ± std, a bar colour per
    panel, against the tolerance; each preset's test ppl at the default rate over the same
    denominator as a cross (so a cross on its bar's end: tuning did not change it)."""
    from matplotlib.figure import Figure  # figures only: `report` needs no matplotlib
    from matplotlib.patches import Patch

    df = by_budget(df)[0]  # the sweep: a longer budget's few runs have no curve over the rates
    summary = preset_summary(df, orders)
    data = at_training_length(df)
    valid = data[data["split"].map(normalized) == SELECT]
    groups = preset_groups(data, list(summary["preset"]))
    fig = Figure(figsize=(13, 3.5 + 2.6 * len(groups)), layout="constrained")
    grid = fig.add_gridspec(len(groups), 2, width_ratios=[1, 1.05])
    lrs = sorted({float(v) for v in data[KEY]})
    best_valid = summary["valid"].min()
    lefts, bar_colors = [], {}
    for k, (title, names) in enumerate(groups):
        left = fig.add_subplot(grid[k, 0], sharex=lefts[0] if lefts else None)
        lefts.append(left)
        rows = list(summary[summary["preset"].isin(names)].itertuples())
        for row, color in zip(rows, variant_colors(len(rows))):
            means = valid[valid[ROW] == row.preset].groupby(KEY)[METRIC].mean()
            left.plot(
                means.index.astype(float),
                means.values / best_valid,
                marker="o",
                markersize=4,
                color=color,
                label=row.preset,
                linestyle=":" if row.preset in UNJUDGED else "-",
            )
            left.plot(
                [row.best_lr],
                [row.valid / best_valid],
                marker="*",
                markersize=11,
                color=color,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
            )
            bar_colors[row.preset] = GROUP_COLORS[k % 2]
        left.set(
            ylabel=f"mean {SELECT} ppl / the best preset's",
            title=f"{SELECT} ppl against the learning rate "
            f"(★ each preset's pick){': ' + title if title else ''}",
        )
        left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    lefts[0].set_xscale("log", base=2)
    lefts[0].set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    lefts[0].minorticks_off()
    lefts[-1].set_xlabel("learning rate")
    right = fig.add_subplot(grid[:, 1])
    order = summary.sort_values("ratio").reset_index(drop=True)
    ys = np.arange(len(order))
    right.barh(
        ys,
        order["ratio"] - 1,
        left=1,
        xerr=order["std"] / order["mean"].min(),
        color=[bar_colors[p] for p in order["preset"]],
        alpha=0.85,
        error_kw={"elinewidth": 0.8},
    )
    right.scatter(
        order["default_mean"] / order["mean"].min(),
        ys,
        marker="x",
        color="black",
        zorder=3,
        label=f"at lr {DEFAULT_LR:g} (untuned), over the same best",
    )
    # the best preset's bar is 1 - 1 = 0 wide: a mark at 1 shows its row is drawn, not missing
    best = order["ratio"] == order["ratio"].min()
    right.scatter(
        np.ones(int(best.sum())),
        ys[best.to_numpy()],
        marker="D",
        s=30,
        color=[bar_colors[p] for p in order.loc[best, "preset"]],
        edgecolors="black",
        linewidths=0.5,
        zorder=3,
        label="the best (its bar has no length)",
    )
    right.axvline(
        1 + TOLERANCE, color="grey", linestyle="--", linewidth=1, label=f"best + {TOLERANCE:.0%}"
    )
    right.set_yticks(
        ys, [f"{p}  (lr {lr:g})" for p, lr in zip(order["preset"], order["best_lr"])], fontsize=8
    )
    right.invert_yaxis()
    right.set(
        xlabel=f"{REPORT} ppl / the best preset's", title=f"{REPORT} ppl at each preset's best rate"
    )
    where = ("upper left", "lower left") if len(groups) == 2 else ("left",)
    handles = [
        Patch(color=color, alpha=0.85, label=f"{title} ({place} panel)")
        for (title, _), color, place in zip(groups, GROUP_COLORS, where)
        if title
    ]
    right.legend(
        handles=[*right.get_legend_handles_labels()[0], *handles], fontsize=8, loc="upper right"
    )
    return fig


def preset_groups(data: pd.DataFrame, names: list[str]) -> list[tuple[str, list[str]]]:
    """The presets without a bias table (the baselines) and those with one (the bias types), in
    `names`' order, when the runs record model.attention.bias and both groups are there; else one
    group of all."""
    if "model.attention.bias" not in data:
        return [("", names)]
    bias = data.groupby(ROW)["model.attention.bias"].first().map(normalized)
    baselines = [n for n in names if bias.get(n) in (None, "none")]
    tables = [n for n in names if n not in baselines]
    return (
        [("baselines", baselines), ("bias types", tables)]
        if baselines and tables
        else [("", names)]
    )


def save_lr_figure(
    df: pd.DataFrame,
    out: Path,
    formats: tuple[str, ...] = ("png", "pdf"),
    orders: dict[str, list] | None = None,
) -> tuple[list[Path], list[str]]:
    """lr_sweep.<fmt> in `out`; returns (written files, notes)."""
    from relpos_ablate.analysis.plots import save_figure  # plots pulls in the trained-model figures

    return save_figure(lr_figure(df, orders), Path(out) / "lr_sweep", formats), []


def _lr_sweep(
    frame: pd.DataFrame, out: Path, formats: tuple[str, ...], args
) -> tuple[list[Path], list[str]]:
    return save_lr_figure(frame, out, formats, axis_orders(read_spec(frame)))


# with the longer budget
REPORTS = {"fair_baselines": report, ("fair_baselines", "fair_baselines_2000"): report}
FIGURES = {"lr-sweep": _lr_sweep}
