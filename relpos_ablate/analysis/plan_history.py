"""When a grid's analysis plan was declared, from what its runs recorded at their first launch.

Each run's run.json keeps the plan it was first launched under (config/plan.py `record`: every
family's hash, the designed seeds) and `launched_at`; status.json its `finished_at`. From those:

- a family is **fixed before the first run** when the first launched run recorded it as it stands;
- **declared after runs existed** when only later runs record it as it stands (or none does: a plan
  written after the runs, as for the studies committed before plans existed);
- **changed after runs existed** when some runs record another version of it;
- **seeds added after a look**: runs of seeds outside the first runs' designed seeds, launched
  after runs of the designed seeds had finished (their results could have been read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pandas as pd

from relpos_ablate.config.plan import AggregateSpec, Family, Plan, family_hash
from relpos_ablate.rundir import RUN_INFO


@dataclass(frozen=True)
class Run:
    seed: int | None
    launched_at: str
    """ISO 8601 UTC ('' where the run.json predates the record: launched before any that has it)."""
    finished_at: str
    families: dict | None
    """family name -> hash, as recorded at launch (None: no plan recorded)."""
    seeds: tuple[int, ...] | None


@dataclass(frozen=True)
class Records:
    runs: tuple[Run, ...]

    @classmethod
    def of(cls, df: pd.DataFrame) -> Records:
        """One record per run of the collected frame (its `analysis`, `launched_at`,
        `finished_at` columns; a summary.csv written before they existed has none)."""
        runs = []
        for _, row in df.drop_duplicates("run_dir").iterrows():
            raw = row.get("analysis")
            plan = json.loads(raw) if isinstance(raw, str) and raw else None
            seed = row.get("seed")
            runs.append(
                Run(
                    int(seed) if seed is not None and not _missing(seed) else None,
                    _text(row.get("launched_at")),
                    _text(row.get("finished_at")),
                    plan.get("families") if plan else None,
                    tuple(plan.get("seeds", ())) if plan else None,
                )
            )
        return cls(tuple(sorted(runs, key=lambda r: r.launched_at)))

    @property
    def first(self) -> Run | None:
        return self.runs[0] if self.runs else None


def _missing(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _text(value) -> str:
    return "" if value is None or _missing(value) else str(value)


def family_status(plan: Plan, fam: Family | AggregateSpec, records: Records) -> str:
    """One line: the family, its role, and when it was declared as it stands."""
    role = "aggregate" if isinstance(fam, AggregateSpec) else fam.role
    head = f"**{fam.name}** ({role}): "
    if not records.runs:
        return head + "no runs yet"
    digest = family_hash(plan, fam)
    same = [r for r in records.runs if r.families and r.families.get(fam.name) == digest]
    other = [r for r in records.runs if r.families and fam.name in r.families and r not in same]
    n = len(records.runs)
    if not any(r.families for r in records.runs):
        return head + (
            f"declared after the runs: none of the {n} runs records a plan (it was written "
            "after they were launched)"
        )
    if records.first in same:
        text = f"fixed before the first run (launched {records.first.launched_at or '?'})"
        return head + text + (f"; {len(other)} runs record another version" if other else "")
    since = (
        f"as it stands first recorded by a run launched {same[0].launched_at}"
        if same
        else "no run records it as it stands"
    )
    if other:
        return (
            head + f"changed after runs existed: {len(other)} of the {n} runs record another "
            f"version; {since}"
        )
    if not same:
        return head + f"added after the runs: none of the {n} runs records it"
    before = [r for r in records.runs if r.launched_at < same[0].launched_at]
    return head + f"declared after runs existed: {since}, after {len(before)} runs without it"


def deviations(plan: Plan, records: Records, seeds: tuple[int, ...] | None) -> list[str]:
    """The plan-wide deviations: seeds outside the plan, designed seeds changed, seeds launched
    after results of the designed ones existed (or whose launch time no run.json records),
    families recorded at launch that the plan no longer has."""
    out = []
    seen = sorted({r.seed for r in records.runs if r.seed is not None})
    extra = [s for s in seen if seeds and s not in seeds]
    if extra:
        out.append(
            f"runs of seeds {_seeds(extra)} are not among the plan's designed seeds "
            f"{_seeds(seeds)}: left out of the confirmatory tests (shown with them as exploratory)"
        )
    # the earliest run that recorded a plan says what was designed at launch
    first = next((r for r in records.runs if r.seeds is not None), None)
    if first is not None and seeds and tuple(first.seeds) != seeds:
        out.append(
            f"the designed seeds were {_seeds(first.seeds)} when the first run was launched; the "
            f"plan now says {_seeds(seeds)}"
        )
    designed = set(first.seeds) if first is not None else set(seeds or seen)
    finished = sorted(r.finished_at for r in records.runs if r.seed in designed and r.finished_at)
    for seed in sorted({r.seed for r in records.runs} - designed - {None}):
        launched = sorted(r.launched_at for r in records.runs if r.seed == seed and r.launched_at)
        if not launched:
            out.append(
                f"seed {seed}: no {RUN_INFO} records its launch time, so whether it was added "
                "after results of the designed seeds existed cannot be told"
            )
            continue
        after = [f for f in finished if f < launched[0]]
        if after:
            out.append(
                f"seed {seed} was first launched {launched[0]}, after {len(after)} runs of the "
                f"designed seeds had finished: their results could have been read"
            )
    names = {f.name for f in (*plan.families, *plan.aggregate)}
    dropped = sorted({n for r in records.runs if r.families for n in r.families} - names)
    if dropped:
        out.append(
            f"families recorded when runs were launched that the plan no longer has (dropped or "
            f"renamed): {', '.join(dropped)}"
        )
    return out


def unfinished(df: pd.DataFrame) -> list[str]:
    """One line naming the runs without results (failed, interrupted, not yet run): their tests
    have fewer seeds than planned."""
    if "status" not in df:
        return []
    runs = df.drop_duplicates("run_dir")
    missing = runs[runs["status"] != "done"]
    if missing.empty:
        return []
    named = ", ".join(
        f"{r.run_id} (seed {int(r.seed) if r.seed == r.seed else '?'}, {r.status})"
        for r in missing.itertuples(index=False)
    )
    return [f"{len(missing)} runs have no results, so their families test fewer seeds: {named}"]


def _seeds(seeds) -> str:
    return ", ".join(map(str, seeds))
