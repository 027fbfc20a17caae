"""A grid spec's `analysis:` block: the tests a study will state, declared before its runs.

    analysis:
      scale: loss              # the scale every test is on (default: loss, i.e. log perplexity, for
                               # text; the task's main metric, e.g. exact_match, for tasks)
      alpha: 0.05
      correction: holm         # holm | bh | none, within each family
      seeds: [0, 1, 2]         # the designed seeds (default: the spec's); others: exploratory
      learned: {metric: exact_match, min: 0.9, where: [segment_len=21]}   # a side whose runs did
                               # not learn the task in distribution is not compared
      families:
        - name: each encoding vs NoPE
          role: primary        # primary | secondary
          where: [protocol=non_overlapping]
          each: encoding       # every value of this field ...
          vs: nope             # ... against this one
          by: [segment_len]    # ... at every value of these fields
        - name: memory vs its fair control
          role: secondary
          pairs: [{a: [encoding=xl], b: [encoding=xl_control]}]
          margin: 0.02         # a claim of no difference: TOST at ± margin on the family's scale
      aggregate:               # one interval for a headline (IQM, stratified bootstrap, P(A > B))
        - {name: alibi vs nope, a: [encoding=alibi], b: [encoding=nope],
           over: [data.task, segment_len]}

A cell is a list of FIELD=VALUE conditions on the collected frame (as `table --where` reads them).
`grid` checks the block before it launches anything and records in each run's run.json the hash of
every family as it stood when the run was first launched (`recorded`); `report` compares those
records with the spec's plan to say, family by family, whether it was fixed before the first run.
This module reads and hashes plans (no torch, no pandas); analysis/planned.py runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, from_dict, to_plain

ROLES = ("primary", "secondary")
SCALES = ("loss", "ppl", "bpc", "bpb", "doc_loss", "beyond_loss", "acc", "exact_match")
"""The scales a plan tests on (cli/report.py SCALE_CHOICES repeats them for --help)."""
LOWER_IS_BETTER = {
    "loss": True,
    "ppl": True,
    "bpc": True,
    "bpb": True,
    "doc_loss": True,
    "beyond_loss": True,
    "acc": False,
    "exact_match": False,
}
EXAMPLE_SHARES = ("exact_match",)
"""Scales that are shares of examples: tested with the examples (analysis/proportions.py). Not acc,
a share of answer tokens, which a t-test over runs tests."""
CORRECTIONS = ("holm", "bh", "none")


def split_condition(condition: str) -> tuple[str, bool, str]:
    """FIELD=VALUE or FIELD!=VALUE -> (FIELD, negated, VALUE), each stripped."""
    key, _, value = condition.partition("=")
    return key.removesuffix("!").strip(), key.endswith("!"), value.strip()


def _check_conditions(field: str, conditions: tuple[str, ...]) -> None:
    for condition in conditions:
        key, sep, value = condition.partition("=")
        if not sep or not key.rstrip("!").strip() or not value.strip():
            raise ConfigError(field, f"{condition!r}: write FIELD=VALUE, e.g. segment_len=64")


@dataclass(frozen=True)
class Pair:
    """One comparison written as two cells."""

    a: tuple[str, ...]
    """The first cell: FIELD=VALUE conditions."""
    b: tuple[str, ...]
    """The second cell; the difference is a - b."""

    def __post_init__(self):
        _check_conditions("a", self.a)
        _check_conditions("b", self.b)


@dataclass(frozen=True)
class Family:
    """Comparisons corrected together; a rule (`each` against `vs`) or `pairs`, or both."""

    name: str
    """How the report names the family."""
    role: str = "primary"
    """primary: the study's claims; secondary: declared too, reported after the primary ones."""
    scale: str = ""
    """This family's scale (empty: the plan's)."""
    where: tuple[str, ...] = ()
    """Conditions every cell of the family meets (FIELD=VALUE)."""
    each: str = ""
    """A rule: every value of this field (except `vs`) against `vs`."""
    vs: str = ""
    """The value of `each` every other value is compared with."""
    values: tuple[str, ...] = ()
    """The values of `each` the rule compares (empty: every value the data have)."""
    pairs: tuple[Pair, ...] = ()
    """Comparisons written as two cells each."""
    by: tuple[str, ...] = ()
    """Make every comparison at each value (combination) of these fields."""
    margin: float = 0.0
    """> 0: a claim of no difference, TOST at ± margin on the family's scale."""

    def __post_init__(self):
        check_choice("role", self.role, ROLES)
        if self.scale:
            check_choice("scale", self.scale, SCALES)
        _check_conditions("where", self.where)
        if bool(self.each) != bool(self.vs):
            raise ConfigError("each", "a rule needs both `each: FIELD` and `vs: VALUE`")
        if not self.each and not self.pairs:
            raise ConfigError(
                "pairs", "a family compares something: give `each` and `vs`, or `pairs`"
            )
        if self.values and not self.each:
            raise ConfigError("values", "`values` restricts a rule: give `each` and `vs` too")
        if not self.margin >= 0:
            raise ConfigError("margin", f"{self.margin!r}: give 0 (no margin) or a positive number")


@dataclass(frozen=True)
class Learned:
    """Runs must reach `min` on `metric` where `where` holds (in distribution) to be compared."""

    metric: str
    min: float
    where: tuple[str, ...] = ()

    def __post_init__(self):
        check_choice("metric", self.metric, SCALES)
        _check_conditions("where", self.where)
        if self.metric in ("acc", "exact_match") and not 0 <= self.min <= 1:
            raise ConfigError("min", f"{self.min!r}: a share between 0 and 1, e.g. 0.9")


@dataclass(frozen=True)
class AggregateSpec:
    """One headline over many cells: IQM of each side, the difference, P(a better than b)."""

    name: str
    a: tuple[str, ...]
    b: tuple[str, ...]
    over: tuple[str, ...]
    """The fields whose value combinations are the cells (tasks x lengths)."""
    where: tuple[str, ...] = ()
    scale: str = ""
    reps: int = 2000
    """Bootstrap resamples."""

    def __post_init__(self):
        for field, conditions in (("a", self.a), ("b", self.b), ("where", self.where)):
            _check_conditions(field, conditions)
        if not self.over:
            raise ConfigError(
                "over", "name the fields whose values are the cells, e.g. [segment_len]"
            )
        if self.scale:
            check_choice("scale", self.scale, SCALES)
        if self.reps < 100:
            raise ConfigError("reps", f"{self.reps}: at least 100 resamples")


@dataclass(frozen=True)
class Plan:
    """The `analysis:` block."""

    scale: str = ""
    """loss | ppl | bpc | acc | exact_match (empty: loss for text, else the task's main metric)."""
    alpha: float = 0.05
    correction: str = "holm"
    seeds: tuple[int, ...] = ()
    """The designed seeds (empty: the spec's `seeds`)."""
    learned: Learned | None = None
    families: tuple[Family, ...] = ()
    aggregate: tuple[AggregateSpec, ...] = ()

    def __post_init__(self):
        if self.scale:
            check_choice("scale", self.scale, SCALES)
        check_choice("correction", self.correction, CORRECTIONS)
        if not 0 < self.alpha < 1:
            raise ConfigError("alpha", f"{self.alpha!r}: a level between 0 and 1, e.g. 0.05")
        names = [f.name for f in (*self.families, *self.aggregate)]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ConfigError(
                "families", f"{twice!r} names two families or aggregates; names are unique"
            )
        if not self.families and not self.aggregate:
            raise ConfigError("families", "declare at least one family or one aggregate")

    def conditions(self) -> list[str]:
        """Every FIELD=VALUE the plan writes, once each in order: its cells and `where`s, a
        rule's `vs` and `values` (as EACH=VALUE), `learned.where`."""
        found = [
            c
            for f in self.families
            for c in (*f.where, *(c for p in f.pairs for c in (*p.a, *p.b)))
        ]
        found += [f"{f.each}={v}" for f in self.families if f.each for v in (f.vs, *f.values)]
        found += [c for a in self.aggregate for c in (*a.where, *a.a, *a.b)]
        found += list(self.learned.where) if self.learned is not None else []
        return list(dict.fromkeys(found))

    def fields(self) -> list[str]:
        """Every field the plan names: in its conditions, `by`, `each` and `over`."""
        named = [split_condition(c)[0] for c in self.conditions()]
        named += [n for f in self.families for n in f.by]
        named += [n for a in self.aggregate for n in a.over]
        return list(dict.fromkeys(named))


def parse_plan(block: object) -> Plan:
    """The spec's `analysis:` mapping as a Plan; every error names its key path (analysis.…)."""
    return from_dict(Plan, block, "analysis")


def family_hash(plan: Plan, family: Family | AggregateSpec) -> str:
    """What identifies a family's declaration: its fields and the plan-wide settings it is read
    under (scale, alpha, correction), canonical JSON, SHA-256, 12 hex digits."""
    settings = {"scale": plan.scale, "alpha": plan.alpha, "correction": plan.correction}
    if isinstance(family, AggregateSpec):
        settings = {"scale": plan.scale, "aggregate": True}
    declared = {
        f.name: to_plain(getattr(family, f.name))
        for f in dataclasses.fields(family)
        if getattr(family, f.name) != f.default
    }
    text = json.dumps({**settings, **declared}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def record(plan: Plan, seeds: tuple[int, ...], at: str) -> dict:
    """What run.json keeps of the plan a run was launched under: each family's hash, the designed
    seeds, and when."""
    return {
        "families": {f.name: family_hash(plan, f) for f in (*plan.families, *plan.aggregate)},
        "seeds": list(plan.seeds or seeds),
        "recorded_at": at,
    }
