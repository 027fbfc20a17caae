"""A grid's declared analysis (config/plan.py) run on its collected frame: the confirmatory families
in the plan's order, whether each was fixed before the first run, every deviation, the aggregates,
and what lies outside the plan (exploratory: differences and raw p, no verdicts).

- **Cells** are FIELD=VALUE conditions on the frame; a cell's sample is one value per run (a cell
  that leaves a run two rows, e.g. two lengths, or pools runs of two values of a variant axis, is
  ambiguous: one line says which fields differ; analysis/cells.py).
- **The test fits the scale**: a share of examples (exact_match, acc) with its examples counted is
  tested on the examples (analysis/proportions.py: quasi-binomial over runs); loss, ppl and bpc by
  the t-tests of analysis/ttests.py; a family with a margin by TOST.
- **Only the designed seeds** enter a confirmatory test; runs of other seeds are a deviation, and
  the families are shown again with them, as exploratory.
- **The plan's history** (analysis/plan_history.py) comes from what each run recorded at launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd

from relpos_ablate.analysis import proportions
from relpos_ablate.analysis.aggregate import aggregate_pair
from relpos_ablate.analysis.cells import (
    canonical,
    labelled,
    lowest_in_distribution,
    missing_values,
    not_learned,
    not_pooled,
    per_run,
    select,
)
from relpos_ablate.analysis.plan_history import Records, deviations, family_status, unfinished
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.stats import (
    CORRECTION_WORDS,
    PAIRED,
    Comparison,
    compare,
    equivalence,
    fmt_p,
)
from relpos_ablate.analysis.stats import Family as Tested
from relpos_ablate.analysis.table_options import resolve_column
from relpos_ablate.config import ConfigError
from relpos_ablate.config.plan import (
    EXAMPLE_SHARES,
    LOWER_IS_BETTER,
    AggregateSpec,
    Family,
    Plan,
    parse_plan,
    split_condition,
)

SCALE_WORDS = {
    "loss": "loss (nats per token: log perplexity)",
    "ppl": "perplexity",
    "bpc": "bits per character",
    "bpb": "bits per byte",
    "doc_loss": "loss per document (nats per token, each document weighing one)",
    "beyond_loss": "loss of document tokens at places >= the training length (nats per token)",
    "acc": "accuracy",
    "exact_match": "exact match",
}


def default_scale(plan: Plan, df: pd.DataFrame) -> str:
    """The plan's scale, else loss for text (main metric ppl or bpc), else the task's main
    metric."""
    if plan.scale:
        return plan.scale
    mains = df["main_metric"].dropna().unique() if "main_metric" in df else []
    main = str(mains[0]) if len(mains) == 1 else "ppl"
    return "loss" if main in ("ppl", "bpc", "loss") else main


@dataclass
class Outcome:
    """A family as the report states it: its tests, corrected together, and its list items."""

    family: Family
    tested: Tested
    items: list


def comparisons(df: pd.DataFrame, fam: Family) -> list[tuple[str, tuple, tuple]]:
    """(prefix, cell a, cell b) of every comparison the family declares: the rule's values and the
    `by` values in data order."""
    rows = select(df, fam.where, "where")
    by = [resolve_column(df, b, "by") for b in fam.by]
    combos = list(dict.fromkeys(zip(*(rows[c].map(label) for c in by)))) if by else [()]
    pairs = []
    if fam.each:
        column = resolve_column(df, fam.each, "each")
        values = list(fam.values) or list(dict.fromkeys(rows[column].map(label)))
        pairs = [
            ((f"{fam.each}={v}",), (f"{fam.each}={fam.vs}",))
            for v in values
            if canonical(v) != canonical(fam.vs)
        ]
    pairs += [(p.a, p.b) for p in fam.pairs]
    out = []
    for combo in combos:
        at = tuple(f"{name}={value}" for name, value in zip(fam.by, combo))
        for a, b in pairs:
            # what the two cells share beyond the family's where names the comparison
            named = (*at, *(c for c in a if c in b))
            prefix = ", ".join(named) + ": " if named else ""
            out.append((prefix, fam.where + a + at, fam.where + b + at))
    return out


def _name(cell: tuple[str, ...], other: tuple[str, ...]) -> str:
    """A side's name: the conditions it does not share with the other side."""
    own = [c for c in cell if c not in other]
    value = own[0].partition("=")[2] if len(own) == 1 else ""
    return value if value and not value[0].isdigit() else " ".join(own) or "(all)"


def run_family(df: pd.DataFrame, plan: Plan, fam: Family, seeds, lowest: pd.Series) -> Outcome:
    """The family's comparisons on the runs of `seeds` (None: every seed), corrected together."""
    scale = fam.scale or default_scale(plan, df)
    column = resolve_column(df, scale, "scale")
    kept = df if seeds is None else df[df["seed"].isin(list(seeds))]
    outcome = Outcome(fam, Tested(fam.name, plan.correction, plan.alpha), [])
    for prefix, a_cell, b_cell in comparisons(kept, fam):
        name_a, name_b = _name(a_cell, b_cell), _name(b_cell, a_cell)
        a = per_run(select(kept, a_cell, "a"), column, " ".join(a_cell))
        b = per_run(select(kept, b_cell, "b"), column, " ".join(b_cell))
        why = next(
            (
                f"{n} {w}"
                for n, s in ((name_a, a), (name_b, b))
                if (w := not_learned(lowest, plan, s))
            ),
            "",
        )
        if a.empty or b.empty:
            why = f"no run in the cell {' '.join(a_cell if a.empty else b_cell)}"
        if why:
            outcome.items.append(f"{prefix}{name_a} vs {name_b}: not compared: {why}")
            continue
        outcome.items.append(
            (prefix, _test(outcome.tested, fam, scale, (name_a, a), (name_b, b), column))
        )
    outcome.tested.close()
    return outcome


def _test(tested: Tested, fam: Family, scale: str, side_a, side_b, column: str) -> Comparison:
    """Add the comparison with the test its scale calls for (module docstring)."""
    (name_a, a), (name_b, b) = side_a, side_b
    values = [dict(zip(s["run_dir"], s[column].astype(float))) for s in (a, b)]
    lower = LOWER_IS_BETTER[scale]
    counted = "examples" in a and a["examples"].notna().all() and b["examples"].notna().all()
    if scale in EXAMPLE_SHARES and counted:
        counts = [
            {
                run: (proportions.counts_from(rate, n), _whole(n))
                for run, rate, n in zip(s["run_dir"], s[column], s["examples"])
            }
            for s in (a, b)
        ]
        test = (
            proportions.proportion_equivalence(*counts, fam.margin)
            if fam.margin
            else proportions.compare_proportions(*counts)
        )
        reason = proportions.why_not(*counts) if test is None else ""
    else:
        test = equivalence(*values, fam.margin) if fam.margin else compare(*values)
        reason = ""
    return tested.add(name_a, values[0], name_b, values[1], test, lower, 3, reason)


def _whole(examples):
    """A count of examples as an int where it is one (a CSV reads it as a float); anything else
    is left for proportions.py to refuse in one line."""
    return int(examples) if float(examples).is_integer() else examples


def exploratory(comparison: Comparison) -> str:
    """A comparison outside the plan: the means, difference, interval and raw p, no verdict."""
    t = comparison.test
    means = (
        f"{comparison.name_a} {comparison.mean_a:.3f}, {comparison.name_b} {comparison.mean_b:.3f}"
    )
    if t is None:
        return f"{means}: {comparison.reason}"
    level = "90%" if t.kind == "TOST" else "95%"
    return (
        f"{means}: difference {t.difference:.4f}, {level} CI [{t.ci[0]:.4f}, {t.ci[1]:.4f}] "
        f"({t.kind}, n = {t.n if t.kind == PAIRED else f'{t.n_a} and {t.n_b}'}; raw p = "
        f"{fmt_p(t.p)}, exploratory)"
    )


def run_aggregate(
    df: pd.DataFrame, plan: Plan, spec: AggregateSpec, seeds, lowest: pd.Series
) -> str:
    """One aggregate as a list item: a run's rows within a cell averaged (e.g. over depths), the
    cells where a side did not learn the task in distribution left out and named."""
    scale = spec.scale or default_scale(plan, df)
    column = resolve_column(df, scale, "scale")
    kept = select(df if seeds is None else df[df["seed"].isin(list(seeds))], spec.where, "where")
    over = [resolve_column(df, o, "over") for o in spec.over]
    head = f"- **{spec.name}**, on {SCALE_WORDS[scale]}: "
    sides, left_out = [], set()
    for cell, side in ((spec.a, "a"), (spec.b, "b")):
        rows = select(kept, cell, side)
        for key, group in rows.groupby(over, dropna=False):
            not_pooled(group, f"{' '.join(cell)} at {', '.join(map(label, key))}")
            if not_learned(lowest, plan, group):
                left_out.add(key)
        sides.append(
            rows.groupby([*over, "run_dir"], as_index=False, dropna=False).agg(
                {column: "mean", "seed": "first"}
            )
        )
    sides = [s[~s[over].apply(tuple, axis=1).isin(left_out)] for s in sides]
    if left_out and any(side.empty for side in sides):
        return head + "not computed: in every cell a side did not learn the task in distribution"
    try:
        result = aggregate_pair(
            *sides,
            cells=over,
            value=column,
            name_a=_name(spec.a, spec.b),
            name_b=_name(spec.b, spec.a),
            lower_is_better=LOWER_IS_BETTER[scale],
            reps=spec.reps,
            seed=0,
        )
    except ConfigError as err:
        return head + f"not computed: {err}"
    note = (
        f" Left out: {len(left_out)} cell(s) where a side did not learn the task in distribution "
        f"({'; '.join(', '.join(map(label, k)) for k in sorted(left_out, key=str))})."
        if left_out
        else ""
    )
    return head + str(result) + note


def aggregate_line(
    df: pd.DataFrame,
    grid_spec: dict,
    a: tuple[str, ...],
    b: tuple[str, ...],
    over: tuple[str, ...],
    scale: str | None = None,
) -> str:
    """`report --aggregate A B --over ...`: the plan's own aggregate where it declares this one (its
    designed seeds, where, scale, resamples), else one on every seed under the plan's settings (its
    scale, its learned threshold), said to be exploratory."""
    block = grid_spec.get("analysis")
    plan = parse_plan(block) if block else Plan(aggregate=(AggregateSpec("-", a, b, over),))
    wanted = scale or default_scale(plan, df)
    declared = next(
        (
            d
            for d in plan.aggregate
            if (d.a, d.b, d.over) == (a, b, over) and (d.scale or default_scale(plan, df)) == wanted
        ),
        None,
    )
    if block and declared is not None:
        seeds = tuple(plan.seeds or grid_spec.get("seeds") or ()) or None
        frame = labelled(df, plan)
        return run_aggregate(frame, plan, declared, seeds, lowest_in_distribution(frame, plan))
    spec = AggregateSpec(f"{' '.join(a)} vs {' '.join(b)}", a, b, over, scale=scale or "")
    frame = labelled(df, replace(plan, aggregate=(*plan.aggregate, spec)))
    line = run_aggregate(frame, plan, spec, None, lowest_in_distribution(frame, plan))
    return line + " (exploratory: not in the spec's analysis plan)"


def planned_report(
    df: pd.DataFrame,
    plan: Plan,
    spec_seeds: tuple[int, ...],
    experiment: str = "",
    label_heading: bool = False,
) -> list[str]:
    """The report's sections for the plan: what was declared and when, the deviations, the
    confirmatory families (primary, then secondary), the aggregates, and the families again with
    every seed where runs of other seeds exist (exploratory). `experiment`: the plan's own (its
    runs alone make the history; `df` may hold the runs of experiments its cells name too);
    `label_heading`: name it in the headings (a report of several plans)."""
    own = df[df["experiment"] == experiment] if experiment and "experiment" in df else df
    records = Records.of(own)
    df = labelled(df, plan)
    missing = missing_values(df, plan)
    lowest = lowest_in_distribution(df, plan)
    seeds = tuple(plan.seeds or spec_seeds) or None
    scale = default_scale(plan, df)
    of = f" of {experiment}" if label_heading else ""
    lines = [
        f"## The declared analysis{of}",
        "",
        f"From the grid spec's `analysis:` block: every test on {SCALE_WORDS[scale]} unless its "
        f"family says otherwise; each family {CORRECTION_WORDS[plan.correction]} at α = "
        f"{plan.alpha}; the designed seeds {', '.join(map(str, seeds)) if seeds else '(all)'}. "
        "The families below are confirmatory; every other test in this report is exploratory.",
        "",
        *(f"- {family_status(plan, f, records)}" for f in (*plan.families, *plan.aggregate)),
        "",
        "Deviations from the plan:",
        "",
        *(
            f"- {d}"
            for d in [
                *deviations(plan, records, seeds),
                *(f"the plan names {m}" for m in missing),
                *unfinished(own),
            ]
            or ["none found"]
        ),
    ]
    for role in ("primary", "secondary"):
        for fam in (f for f in plan.families if f.role == role):
            outcome = run_family(df, plan, fam, seeds, lowest)
            lines += ["", f"## {role.capitalize()}{of}: {fam.name}", ""]
            lines += [f"- {i}" if isinstance(i, str) else f"- {i[0]}{i[1]}" for i in outcome.items]
            lines += ["", outcome.tested.summary()]
    if plan.aggregate:
        lines += ["", f"## Aggregates{of} (stratified bootstrap over seeds within each cell)", ""]
        lines += [run_aggregate(df, plan, spec, seeds, lowest) for spec in plan.aggregate]
    extra = sorted(set(own["seed"].dropna().astype(int)) - set(seeds or ()))
    if seeds and extra and plan.families:
        lines += [
            "",
            f"## Exploratory{of}: the families with seeds {', '.join(map(str, extra))} too",
            "",
            "Not in the plan's seeds: differences and raw p only, no verdict.",
        ]
        for fam in plan.families:
            outcome = run_family(df, plan, fam, None, lowest)
            lines += ["", f"{fam.name}:", ""]
            lines += [
                f"- {i}" if isinstance(i, str) else f"- {i[0]}{exploratory(i[1])}"
                for i in outcome.items
            ]
    return lines


def experiments_named(block: dict) -> set[str]:
    """The experiments a plan's cells name (`experiment=NAME`): its families read their runs too
    (e.g. a control trained as another experiment)."""
    conditions = (split_condition(c) for c in parse_plan(block).conditions())
    return {value for field, negated, value in conditions if field == "experiment" and not negated}


KEPT_SECTIONS = ("Threats to validity",)
"""Sections of a study's report that state no test and stay at their level, after the exploratory
ones (every other section of the study's own report is exploratory under a plan)."""


def with_plan(plans: list[tuple[str, pd.DataFrame, dict]], body: str) -> str:
    """A report under its specs' plans, (experiment, its rows, its spec) each: the body's title,
    each plan's sections, then the body's own sections as exploratory (one level down), then its
    KEPT_SECTIONS."""
    title, _, rest = body.partition("\n") if body.startswith("# ") else ("", "", body)
    opening, *sections = rest.split("\n## ")
    kept = [s for s in sections if s.startswith(KEPT_SECTIONS)]
    explored = [opening.strip("\n"), *("## " + s.strip("\n") for s in sections if s not in kept)]
    demoted = "\n".join(
        "#" + ln if ln.startswith("#") else ln for ln in "\n\n".join(explored).splitlines()
    )
    lines = [*([title, ""] if title else [])]
    for name, rows, spec in plans:
        plan = parse_plan(spec["analysis"])
        seeds = tuple(spec.get("seeds") or ())
        lines += [*planned_report(rows, plan, seeds, name, len(plans) > 1), ""]
    lines += [
        "## Exploratory: the report's own sections",
        "",
        "Not declared in the plan: each section's tests are corrected within it, but which tests, "
        "on which scale and in which family was not fixed before the runs. Read their verdicts as "
        "hypotheses.",
        "",
        demoted.strip("\n"),
        *("\n## " + s.rstrip("\n") for s in kept),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
