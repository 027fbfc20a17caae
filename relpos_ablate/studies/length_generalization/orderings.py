"""The tested orderings of the length-generalization report, one family corrected together
(analysis/stats.py; two variants are different models: Welch's t-test, each difference with its 95%
CI): Kazemnejad et al.'s claim, NoPE against each of T5, ALiBi, RoPE and sinusoid, then against
every other encoding run here, and randomized against sequential positions for RoPE and ALiBi
(Ruoss et al.), ID and OOD, per task and over tasks (`orderings_section`). "Over tasks" compares
per-seed means over the tasks, one value per seed a side. The trend table (`trends_table`) puts
each paper's claim beside these runs' numbers and quotes the over-tasks tests."""

from __future__ import annotations

import pandas as pd

from relpos_ablate.analysis.stats import Comparison, Family
from relpos_ablate.studies.length_generalization.descriptive_sections import ranking
from relpos_ablate.studies.length_generalization.table import variant_name, variant_order

KAZEMNEJAD = ("nope", "t5", "alibi", "rope", "vaswani")
"""Kazemnejad et al.'s five encodings: NoPE, then the explicit ones it is compared with (T5's
relative bias, ALiBi, Rotary, sinusoidal APE). Their abstract's claim, the one tested here: NoPE
outperforms the explicit ones. (Their Fig. 1 ranks all five by mean reciprocal rank; its values are
not in the paper's text.)"""
RANDOMIZED = ("rope", "alibi")
"""Encodings the study trains with randomized positions too."""


Over = dict[tuple, Comparison]
"""(variant a, variant b, id|ood) -> the over-tasks comparison, for the trend table."""


def orderings_section(scores: pd.DataFrame, tasks: list[str], family: Family) -> tuple[list, Over]:
    """The lines of the orderings section (text, or (prefix, comparison) read once the family is
    complete) and the over-tasks comparisons by (a, b, column)."""
    lines = [
        "## Orderings",
        "",
        "Each line: the two means and the test (two variants are different models: Welch's t-test "
        "over seeds; higher is better; the difference is the first minus the second, with its 95% "
        "CI).",
        "",
        "NoPE against each encoding run here with sequential positions (OOD exact match): "
        "Kazemnejad et al.'s four first, then the others:",
        "",
    ]
    over: Over = {}
    sequential = scores[scores["positions"] != "randomized"]
    present = set(sequential["encoding"])
    if KAZEMNEJAD[0] in present:
        others = [e for e in KAZEMNEJAD[1:] if e in present] + sorted(
            (e for e in present if e not in KAZEMNEJAD),
            key=lambda e: variant_order(e, "sequential"),
        )
        for other in others:
            lines += _compare(
                sequential,
                ("encoding", KAZEMNEJAD[0]),
                ("encoding", other),
                "ood",
                tasks,
                family,
                over,
            )
    lines += [
        "",
        "Randomized against sequential positions (Ruoss et al.), ID and OOD exact match:",
        "",
    ]
    for encoding in RANDOMIZED:
        mine = scores[scores["encoding"] == encoding]
        if set(mine["positions"]) >= {"sequential", "randomized"}:
            for column in ("id", "ood"):
                lines += _compare(
                    mine,
                    ("positions", "randomized"),
                    ("positions", "sequential"),
                    column,
                    tasks,
                    family,
                    over,
                )
    return [*lines, ""], over


def _compare(
    scores: pd.DataFrame,
    a: tuple[str, str],
    b: tuple[str, str],
    column: str,
    tasks: list[str],
    family: Family,
    over: Over,
) -> list:
    """One line per task and one over the tasks: variant a against variant b on `column` (id or
    ood)."""
    sides, names = variant_sides(scores, a, b)
    what = "ID" if column == "id" else "OOD"
    lines = []
    for task in tasks:
        samples = [_sample(side[side["task"] == task], column) for side in sides]
        if all(samples):
            lines.append(
                (
                    f"{task}, {what}: ",
                    family.compare(
                        names[0],
                        samples[0],
                        names[1],
                        samples[1],
                        lower_is_better=False,
                        decimals=3,
                    ),
                )
            )
    shared = [t for t in tasks if all(t in set(side["task"]) for side in sides)]
    if len(shared) >= 2:
        samples = [_per_seed(side, column, shared) for side in sides]
        comparison = family.compare(
            names[0], samples[0], names[1], samples[1], lower_is_better=False, decimals=3
        )
        over[(names[0], names[1], column)] = comparison
        lines.append((f"over {', '.join(shared)} (per-seed mean), {what}: ", comparison))
    return lines


def variant_sides(
    scores: pd.DataFrame, a: tuple[str, str], b: tuple[str, str]
) -> tuple[list[pd.DataFrame], list[str]]:
    sides = [scores[scores[field] == value] for field, value in (a, b)]
    return sides, [
        side["variant"].iloc[0] if len(side) else value for side, (_, value) in zip(sides, (a, b))
    ]


def _sample(runs: pd.DataFrame, column: str) -> dict[str, float]:
    """{run dir: value} of the runs that have one."""
    runs = runs.dropna(subset=[column])
    return dict(zip(runs["run_dir"], runs[column].astype(float)))


def _per_seed(side: pd.DataFrame, column: str, shared: list[str]) -> dict[tuple, float]:
    """Each seed's mean over the `shared` tasks, keyed by the runs it averages (a seed counts where
    it has every one of them, so each task weighs the same)."""
    found = {}
    for _, runs in side[side["task"].isin(shared)].dropna(subset=[column]).groupby("seed"):
        if set(runs["task"]) == set(shared) and len(runs) == len(shared):
            found[tuple(sorted(runs["run_dir"]))] = float(runs[column].mean())
    return found


def trends_table(scores: pd.DataFrame, tasks: list[str], over: Over) -> list[str]:
    """The trend table the README quotes: each paper's claim beside what these runs give, every
    number of the right column computed here; the tests are the orderings' over-tasks ones (`over`),
    not run again."""
    rows = []
    fitted = scores.groupby(["task", "variant"])["id"].mean()
    below = [
        f"{variant} on {task} ({value:.3f})"
        for (task, variant), value in fitted.items()
        if value < 0.99
    ]
    rows.append(
        (
            "Kazemnejad et al.: in most tasks every model is perfect or nearly so at the training "
            "lengths (their Section 4, Fig. 3)",
            f"{len(fitted) - len(below)} of {len(fitted)} (task, variant) pairs reach a mean ID "
            f"exact match of 0.99" + (f"; below it: {'; '.join(below)}" if below else ""),
        )
    )
    reciprocal = (1 / ranking(scores)).mean(axis=1)  # over the tasks each variant has
    five = [e for e in KAZEMNEJAD if variant_name(e) in reciprocal.index]
    if five:
        ours = ", ".join(
            f"{variant_name(e)} {reciprocal[variant_name(e)]:.2f}"
            for e in sorted(five, key=lambda e: -reciprocal[variant_name(e)])
        )
        nope = KAZEMNEJAD[0]
        tested = [
            f"{variant_name(nope)} vs {variant_name(y)}: {comparison}"
            for y in five
            if y != nope
            if (comparison := over.get((variant_name(nope), variant_name(y), "ood")))
        ]
        rows.append(
            (
                "Kazemnejad et al.: NoPE outperforms the explicit encodings (T5's relative bias, "
                "ALiBi, Rotary, APE), and ALiBi, Rotary and APE are not well suited for length "
                "generalization (abstract); their Fig. 1 ranks the five by mean reciprocal rank "
                "over their tasks",
                f"MRR of these over {', '.join(tasks)} (ranks among all {len(reciprocal)} "
                f"variants run here, as in the rank table): {ours}. Over the tasks (per-seed mean "
                f"OOD): " + "; ".join(tested),
            )
        )
    for encoding in RANDOMIZED:
        mine = scores[scores["encoding"] == encoding]
        if set(mine["positions"]) >= {"sequential", "randomized"}:
            names = variant_sides(mine, ("positions", "randomized"), ("positions", "sequential"))[1]
            ood, iid = (over.get((*names, column)) for column in ("ood", "id"))
            rows.append(
                (
                    f"Ruoss et al.: randomized positions raise test accuracy on longer inputs, by "
                    f"12.0% on average over 15 tasks (abstract), and leave in-domain accuracy "
                    f"unaffected (Section 1); {variant_name(encoding)}",
                    f"OOD {ood or '-'}; ID {iid or '-'}",
                )
            )
    return [
        "## Trends: the papers' and ours",
        "",
        "| trend in the paper | these runs |",
        "|---|---|",
        *(f"| {claim} | {ours} |" for claim, ours in rows),
        "",
    ]
