"""`relpos-ablate report DIR` for a grid no study writes a report for: the table of the grid spec's
`table:` block (rows, columns, metric, where, layout as `table` resolves them) with the tests
`table` states, as Markdown. The tests against the baseline are one family, named with its
correction in the section heading and the caption; each test with its difference, 95% CI, raw and
adjusted p, then the family's power line (tables.py, stats.py). Without a baseline (in the spec or
its runs' data) one line says so and the table stands without tests.

The studies registry (relpos_ablate/studies/) falls back to this report; this module names no
study: a study's layouts reach it as `layouts`, as they reach layouts.make_table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from relpos_ablate.analysis.layouts import LayoutSpec, make_table
from relpos_ablate.analysis.render import STAR_LEGEND, Cell, render
from relpos_ablate.analysis.settings import short_name
from relpos_ablate.analysis.stats import CORRECTION_WORDS
from relpos_ablate.analysis.table_options import TableOptions, left_out_runs, read_spec
from relpos_ablate.config import ConfigError

NO_BASELINE = (
    "No baseline was given (the spec's `table: {baseline: ROW}`, a row label), so the table "
    "states no tests."
)


def has_spec(df: pd.DataFrame) -> bool:
    """Whether the runs record a grid spec that can be read: the report is that spec's."""
    return bool(read_spec(df))


def grid_report(
    df: pd.DataFrame,
    correction: str | None = None,
    layouts: Mapping[str, LayoutSpec] | None = None,
    planned: bool = False,
    preamble: str | None = None,
) -> str:
    """The Markdown report of one experiment's grid from its spec's `table:` block. `correction`:
    the family's (None: the block's `correction`, else holm). `planned`: the spec declares an
    analysis plan, so this table's tests are exploratory: no stars in its cells. `preamble`: the
    sentence under the title (a study's: what its own sections are; default: that no study
    reports on the experiment)."""
    names = sorted(str(n) for n in df["experiment"].dropna().unique()) if "experiment" in df else []
    if len(names) != 1:
        raise ConfigError("report", f"a grid's report reads one experiment; found {len(names)}")
    spec = read_spec(df)
    if not spec:
        raise ConfigError("report", f"no grid spec found for the runs of {names[0]!r}")
    table, used = make_table(df, TableOptions(correction=correction, format="markdown"), layouts)
    if planned:
        for _, values in table.rows:
            for value in values:
                if isinstance(value, Cell):
                    value.p = math.nan
        table.caption = table.caption.replace(
            f"Stars on the adjusted p: {STAR_LEGEND}.",
            "Outside the spec's analysis plan: exploratory, no stars.",
        )
    what = (
        f"{used.metric} by {', '.join(short_name(r) for r in used.rows)}"
        + (f" × {', '.join(short_name(c) for c in used.cols)}" if used.cols else "")
        + (f", where {' and '.join(used.where)}" if used.where else "")
    )
    lines = [
        f"# {names[0]}",
        "",
        preamble
        or f"No study writes a report for experiment {names[0]!r}: this is the report of its grid "
        "spec's `table:` block, the table `relpos-ablate table` prints with its tests.",
        "",
        f"## The table: {what}",
        "",
    ]
    if used.baseline:
        lines += [
            f"Tests against {used.baseline}: one family, {CORRECTION_WORDS[used.correction]}.",
            "",
        ]
    else:
        lines += [NO_BASELINE, ""]
    lines.append(render(table, "markdown").rstrip("\n"))
    left_out = left_out_runs(df, used.metric, used.rows)
    if left_out:
        lines += ["", "Left out of the table:", "", *(f"- {line}" for line in left_out)]
    return "\n".join(lines) + "\n"
