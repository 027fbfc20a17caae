"""The statistics behind every star in a table and every ordering in a report.

- **The test is chosen from the data, never by the caller.** A sample is a mapping unit -> value,
  where a unit names the runs a value comes from (a run dir, or a tuple of run dirs for a value
  averaged over several runs). Two samples that share units are the same runs measured two ways
  (another length, protocol, stride, RoPE scaling, memory length at evaluation): a paired t-test
  over the matched units (`scipy.stats.ttest_rel`). Samples with no unit in common come from
  different models: Welch's t-test (`scipy.stats.ttest_ind(equal_var=False)`). There is no switch
  that runs Welch on same-run values.
- **Every set of tests a table or a report states is one family**, corrected together: Holm (1979)
  by default, Benjamini-Hochberg, or none (`statsmodels.stats.multitest.multipletests`). Stars and
  every sentence that states an ordering read the adjusted p; the raw p stands beside it.
- **A difference comes with its 95% confidence interval** (t-based over seeds: the paired one for a
  paired test, Welch's otherwise; scipy's `confidence_interval`). A result that is not significant
  is written as such, with the difference and its interval; it is never evidence that two things are
  the same. A claim of equivalence needs its margin and a TOST
  (`statsmodels.stats.weightstats.ttost_paired` / `ttost_ind`).
- **Power**: per family, the smallest difference each test could detect at 80% power given the
  observed spread (statsmodels' `TTestPower` / `TTestIndPower`), so a reader sees what "not
  significant" can mean.

Agarwal et al., "Deep RL at the Edge of the Statistical Precipice" (NeurIPS 2021) argue for the
same: interval estimates, not bare p-values.

The single tests (the choice of test, TOST, the correction, power) are in ttests.py; this module
states them: a `Comparison` and its verdict in words, a `Family` corrected together, `ordering`,
`listed`. Every name of ttests.py is importable from here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from relpos_ablate.analysis.ttests import (  # noqa: F401 (API: the tests, as stats.NAME)
    ALPHA,
    CORRECTION_WORDS,
    CORRECTIONS,
    MIN_SEEDS,
    PAIRED,
    POWER,
    TOST,
    WELCH,
    Sample,
    Test,
    adjust,
    compare,
    equivalence,
    finite,
    matched,
)
from relpos_ablate.config.base import check_choice


def fmt_p(p: float) -> str:
    return "-" if math.isnan(p) else f"{p:.2g}"


def _num(x: float, decimals: int) -> str:
    return f"{x:.{decimals}f}"


@dataclass
class Comparison:
    """One stated comparison of a family: its means, its test and, once the family is adjusted, its
    verdict."""

    family: Family
    name_a: str
    name_b: str
    mean_a: float
    mean_b: float
    test: Test | None
    reason: str
    """Why there is no test (n too small, no spread); empty when there is one."""
    lower_is_better: bool
    decimals: int

    @property
    def significant(self) -> bool:
        self.family.close()
        return self.test is not None and self.test.p_adjusted < self.family.alpha

    @property
    def winner(self) -> str | None:
        """The better side's name when the adjusted test supports it, else None (never for a
        TOST)."""
        if not self.significant or self.test.kind == TOST:
            return None
        return self.name_a if (self.test.difference < 0) == self.lower_is_better else self.name_b

    def said(self) -> str:
        """What the test says, in words: `A better`, `not significant (after correction)`,
        `equivalent within ±m`, `equivalence not shown`; why there is no test where there is
        none."""
        if self.test is None:
            return self.reason
        if self.test.kind == TOST:
            return (
                f"equivalent within ±{_num(self.test.margin, self.decimals + 1)}"
                if self.significant
                else "equivalence not shown"
            )
        if self.significant:
            return f"{self.winner} better"
        raw = self.test.p < self.family.alpha and self.family.correction != "none"
        return f"not significant{' after correction' if raw else ''}"

    def _interval(self) -> str:
        """`95% CI [lo, hi]` (TOST: the 90% interval it inverts)."""
        t, d = self.test, self.decimals + 1
        return f"{'90%' if t.kind == TOST else '95%'} CI [{_num(t.ci[0], d)}, {_num(t.ci[1], d)}]"

    def evidence(self) -> str:
        """`paired t-test, difference -0.11, 95% CI [-0.15, -0.07]; p = 0.003, Holm-adjusted p =
        0.012`."""
        self.family.close()
        t, d = self.test, self.decimals + 1
        what = f"{t.kind}, margin ±{_num(t.margin, d)}, " if t.kind == TOST else f"{t.kind}, "
        adjusted = (
            ""
            if self.family.correction == "none"
            else f", {self.family.adjusted_word} p = {fmt_p(t.p_adjusted)}"
        )
        return (
            f"{what}difference {_num(t.difference, d)}, {self._interval()}, "
            f"n = {t.n_a}{'' if t.n_a == t.n_b or t.kind == PAIRED else ' and ' + str(t.n_b)}; "
            f"p = {fmt_p(t.p)}{adjusted}"
        )

    def verdict(self) -> str:
        """The part after the means: `A better (...)`, `not significant (...)`, `equivalent within
        ±m (...)`."""
        return self.said() if self.test is None else f"{self.said()} ({self.evidence()})"

    def short(self) -> str:
        """The verdict for a table cell whose row already names the test: `A better; 95% CI [lo,
        hi]; p = 0.003, adj. 0.012` or `not significant; ...`."""
        self.family.close()
        if self.test is None:
            return self.reason
        adjusted = (
            "" if self.family.correction == "none" else f", adj. {fmt_p(self.test.p_adjusted)}"
        )
        return f"{self.said()}; {self._interval()}; p = {fmt_p(self.test.p)}{adjusted}"

    def __str__(self) -> str:
        means = ", ".join(
            f"{name} {'-' if math.isnan(m) else _num(m, self.decimals)}"
            for name, m in ((self.name_a, self.mean_a), (self.name_b, self.mean_b))
        )
        return f"{means}: {self.verdict()}"


@dataclass
class Family:
    """A set of tests stated together, corrected together (module docstring). Add comparisons first;
    the first time a verdict is read the family closes and adjusts, and adding to it after that is
    an error."""

    name: str
    correction: str = "holm"
    alpha: float = ALPHA
    comparisons: list[Comparison] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self):
        check_choice("correction", self.correction, CORRECTIONS)

    @property
    def adjusted_word(self) -> str:
        return {"holm": "Holm-adjusted", "bh": "BH-adjusted", "none": "unadjusted"}[self.correction]

    def compare(
        self,
        name_a: str,
        a: Sample,
        name_b: str,
        b: Sample,
        lower_is_better: bool = True,
        decimals: int = 2,
    ) -> Comparison:
        """Add the test of a against b that the data calls for (paired for shared units, else
        Welch)."""
        return self._add(name_a, a, name_b, b, compare(a, b), lower_is_better, decimals)

    def equivalent(
        self, name_a: str, a: Sample, name_b: str, b: Sample, margin: float, decimals: int = 2
    ) -> Comparison:
        """Add a TOST of |a - b| < margin (a claim that two things are equivalent needs one)."""
        return self._add(name_a, a, name_b, b, equivalence(a, b, margin), True, decimals)

    def add(
        self,
        name_a: str,
        a: Sample,
        name_b: str,
        b: Sample,
        test: Test | None,
        lower_is_better: bool = True,
        decimals: int = 2,
        reason: str = "",
    ) -> Comparison:
        """Add a test made elsewhere (e.g. analysis/proportions.py's on the examples) with the
        values whose means the comparison states; `reason`: why there is none, when None."""
        comparison = self._add(name_a, a, name_b, b, test, lower_is_better, decimals)
        comparison.reason = reason or comparison.reason
        return comparison

    def _add(self, name_a, a, name_b, b, test, lower_is_better, decimals) -> Comparison:
        if self.closed:
            raise RuntimeError(
                f"family {self.name!r} was already corrected; add every comparison before "
                f"reading one"
            )
        a, b = finite(a), finite(b)
        reason = (
            ""
            if test is not None
            else (
                "n too small to test"
                if min(len(a), len(b)) < MIN_SEEDS
                or (matched(a, b) and len(matched(a, b)) < MIN_SEEDS)
                else "no test (no spread)"
            )
        )
        comparison = Comparison(
            self,
            name_a,
            name_b,
            float(np.mean(list(a.values()))) if a else math.nan,
            float(np.mean(list(b.values()))) if b else math.nan,
            test,
            reason,
            lower_is_better,
            decimals,
        )
        self.comparisons.append(comparison)
        return comparison

    @property
    def tests(self) -> list[Test]:
        return [c.test for c in self.comparisons if c.test is not None]

    def close(self) -> None:
        """Adjust every test's p for the family (once)."""
        if self.closed:
            return
        self.closed = True
        for test, p in zip(self.tests, adjust([t.p for t in self.tests], self.correction)):
            test.p_adjusted = p

    def heading(self) -> str:
        """`Family "NAME": 12 tests, Holm-corrected at α = 0.05 (...)`: the line that names the
        family."""
        self.close()
        kinds = sorted({t.kind for t in self.tests})
        return (
            f'Family "{self.name}": {len(self.tests)} test{"s" if len(self.tests) != 1 else ""} '
            f"({', '.join(kinds) or 'none run'}), {CORRECTION_WORDS[self.correction]} "
            f"at α = {self.alpha}; {'equivalence' if kinds == [TOST] else 'an ordering'} is "
            f"stated only where the {'' if self.correction == 'none' else 'adjusted '}p < "
            f"{self.alpha}."
        )

    def summary(self) -> str:
        """The lines under a family's list or table: its heading, a blank line, its power line."""
        return f"{self.heading()}\n\n{self.power_line()}"

    def power_line(self) -> str:
        """The smallest differences the family's t-tests could detect at 80% power (observed
        spread)."""
        self.close()
        tests = [t for t in self.tests if t.kind != TOST and not math.isnan(t.spread)]
        if not tests:
            if not self.tests:
                return "Power: no test was run."
            if all(t.kind == TOST for t in self.tests):
                return (
                    "Power: not stated for equivalence tests (what they can show is set by "
                    "their margin and interval, above)."
                )
            return (
                "Power: not stated (a test on the examples has no single spread to state it from)."
            )
        m = len(self.tests)
        plain = [t.detectable(self.alpha) for t in tests]
        strict = (
            [t.detectable(self.alpha / m) for t in tests]
            if self.correction != "none" and m > 1
            else []
        )
        ns = sorted({t.n for t in tests})
        text = (
            f"Power: with n = {'/'.join(map(str, ns))} per side, the smallest difference a test "
            f"of this family could detect at {POWER:.0%} power is {_spread(plain)} at α = "
            f"{self.alpha}"
        )
        if strict:
            text += f", {_spread(strict)} at α/{m} (the strictest step of the correction)"
        return text + " (in the compared values' units; from each test's observed spread)."


def listed(items: list) -> list[str]:
    """A report's lines once their families are complete: text as it is, (prefix, comparison) as a
    list item `- prefix` + the comparison (its means and verdict)."""
    return [item if isinstance(item, str) else f"- {item[0]}{item[1]}" for item in items]


def _spread(values: list[float]) -> str:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return "not reachable at this n"
    median = float(np.median(finite))
    unreachable = len(values) - len(finite)
    text = (
        f"median {median:.3g} (range {finite[0]:.3g}-{finite[-1]:.3g})"
        if len(finite) > 1
        else f"{median:.3g}"
    )
    return text + (f", not reachable for {unreachable}" if unreachable else "")


def ordering(
    name_a: str, a: Sample, name_b: str, b: Sample, lower_is_better: bool = True, decimals: int = 2
) -> str:
    """One comparison stated on its own (a family of one test: no correction to make), the test
    chosen from the data as in `compare`: `A 6.41, B 6.52: A better (paired t-test, difference ...,
    95% CI [...]; p = ...)`. A report that states several tests puts them in one Family instead."""
    family = Family(f"{name_a} vs {name_b}", correction="none")
    return str(family.compare(name_a, a, name_b, b, lower_is_better, decimals))
