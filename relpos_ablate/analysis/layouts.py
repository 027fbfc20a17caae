"""`--layout`: the table layouts by name, and `make_table`, which picks one. Each layout is a function
(data, resolved options, the spec's axis orders) -> Table built on the shared machinery of tables.py;
this module sits above them all, so tables.py needs to know none of them.

- `grid` (tables.py): rows and columns by any config field, variant axis or evaluation setting.
- `xl_table6`, `xl_table8` (xl_tables.py): Transformer-XL's Table 6 (PPL init / best / Attn Len) and
  Table 8 (RECL, from the per-target losses of the RECL ladder: the only layout that reads them).
- `length_generalization` (length_generalization.py): example tasks, one row per (task, encoding),
  test-length bins and their OOD mean as columns (its rank-per-task summary: `rank_table`).
A new layout is one function of that signature and one entry in LAYOUTS.
`best_over` (best_over.py) is no layout but a choice of runs: the grid table, each cell at its row's best
value of a key (--best-over train.lr).
"""

from __future__ import annotations

from typing import Callable

import pandas as pd

from relpos_ablate.analysis.best_over import best_over_table
from relpos_ablate.analysis.length_generalization import length_generalization_table
from relpos_ablate.analysis.render import Table
from relpos_ablate.analysis.settings import table_settings
from relpos_ablate.analysis.table_options import (
    TableOptions, apply_where, axis_orders, read_spec, resolve_options, spec_options,
)
from relpos_ablate.analysis.tables import grid_table
from relpos_ablate.analysis.xl_tables import xl_table6, xl_table8
from relpos_ablate.config import ConfigError
from relpos_ablate.config.base import check_choice

Layout = Callable[[pd.DataFrame, TableOptions, dict[str, list]], Table]

LAYOUTS: dict[str, Layout] = {
    "grid": grid_table,
    "xl_table6": xl_table6,
    "xl_table8": xl_table8,
    "length_generalization": length_generalization_table,
}
READS_TOKEN_LOSSES = ("xl_table6", "xl_table8")
"""Layouts that read the RECL ladder's settings, which the others leave out (tables.py docstring): Table 8
computes RECL from them, Table 6 reads them as the evaluations at each attention length they are."""


def make_table(df: pd.DataFrame, options: TableOptions = TableOptions()) -> tuple[Table, TableOptions]:
    """The table the options ask for, and the resolved options (format, layout, ...) it used."""
    spec = read_spec(df)
    merged = options.merged(spec_options(spec))
    name = merged.layout or "grid"
    check_choice("layout", name, LAYOUTS)
    data = apply_where(df if name in READS_TOKEN_LOSSES else table_settings(df), merged.where)
    resolved = resolve_options(data, options, spec)
    if resolved.best_over:  # each row at its own best value of a key: a grid table of the chosen runs
        if name != "grid":
            raise ConfigError("best_over", f"picks a value per row of the grid layout; the {name} layout has its own")
        return best_over_table(data, resolved, axis_orders(spec)), resolved
    return LAYOUTS[name](data, resolved, axis_orders(spec)), resolved
