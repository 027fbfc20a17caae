"""`--layout`: the table layouts by name, and `make_table`, which picks one. Each layout is a
function (data, resolved options, the spec's axis orders) -> Table built on the shared machinery of
tables.py; this module sits above them, so tables.py needs to know none of them.

Here lives one generic layout, `grid` (tables.py): rows and columns by any config field, variant
axis or evaluation setting. A study adds its paper's layouts (Transformer-XL's Table 6 and 8, the
length-generalization table) in its own module under relpos_ablate/studies/ and hands them to
`make_table` as `layouts` (`relpos_ablate.studies.make_table` passes every study's); this layer
names none of them.
`best_over` (best_over.py) is no layout but a choice of runs: the grid table, each cell at its row's
best value of a key (--best-over train.lr).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pandas as pd

from relpos_ablate.analysis.best_over import best_over_table
from relpos_ablate.analysis.render import Table
from relpos_ablate.analysis.settings import table_settings
from relpos_ablate.analysis.table_options import (
    TableOptions,
    apply_where,
    axis_orders,
    read_spec,
    resolve_options,
    spec_options,
    unscaled_unless_asked,
)
from relpos_ablate.analysis.tables import grid_table
from relpos_ablate.config import ConfigError
from relpos_ablate.config.base import check_choice

Layout = Callable[[pd.DataFrame, TableOptions, dict[str, list]], Table]


@dataclass(frozen=True)
class LayoutSpec:
    """A named layout: its function, whether it reads the settings that save per-token losses (the
    RECL ladder, which every other layout leaves out: they score a subset of the targets), and an
    optional second table printed after it (e.g. a rank summary) from the same data and options."""

    build: Layout
    reads_token_losses: bool = False
    appendix: Layout | None = None


LAYOUTS: dict[str, LayoutSpec] = {"grid": LayoutSpec(grid_table)}
"""The generic layouts; a study's own come through make_table's `layouts`."""


def make_table(
    df: pd.DataFrame,
    options: TableOptions = TableOptions(),
    layouts: Mapping[str, LayoutSpec] | None = None,
) -> tuple[Table, TableOptions]:
    """The table the options ask for, and the resolved options (format, layout, ...) it used.
    `layouts`: more layouts by name (a study's) beside the generic ones."""
    known = {**LAYOUTS, **(layouts or {})}
    spec = read_spec(df)
    merged = options.merged(spec_options(spec))
    name = merged.layout or "grid"
    check_choice("layout", name, known)
    data = apply_where(df if known[name].reads_token_losses else table_settings(df), merged.where)
    resolved = resolve_options(data, options, spec)
    data, left_out = unscaled_unless_asked(data, resolved)
    # each row at its own best value of a key: a grid table of the chosen runs
    if resolved.best_over:
        if name != "grid":
            raise ConfigError(
                "best_over",
                f"picks a value per row of the grid layout; the {name} layout has its own",
            )
        table = best_over_table(data, resolved, axis_orders(spec))
    else:
        table = known[name].build(data, resolved, axis_orders(spec))
        if known[name].appendix is not None:
            table.appendix = known[name].appendix(data, resolved, axis_orders(spec))
    table.caption += f" {left_out}" if left_out else ""
    return table, resolved
