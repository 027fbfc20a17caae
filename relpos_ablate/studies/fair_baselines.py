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
the Markdown (the studies registry), `lr_figure` the figure (`plot --kind lr-sweep`). The per-preset
summary is fair_baselines_summary.py's, the figure fair_baselines_figure.py's.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import normalized
from relpos_ablate.analysis.stats import Family
from relpos_ablate.studies.fair_baselines_figure import (  # noqa: F401 (API)
    lr_figure,
    plot_lr_sweep,
    save_lr_figure,
)
from relpos_ablate.studies.fair_baselines_summary import (
    DEFAULT_LR,
    KEY,
    NEAR_TIE,
    REPORT,
    ROW,
    SELECT,
    STEPS,
    TOLERANCE,
    UNJUDGED,
    at_training_length,
    by_budget,
    over_tolerance,
    preset_summary,
    values_at,
)


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
        values = values_at(report, preset, lr)
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


# with the longer budget
REPORTS = {"fair_baselines": report, ("fair_baselines", "fair_baselines_2000"): report}
FIGURES = {"lr-sweep": plot_lr_sweep}
