"""`table --best-over KEY`: each row at its own best value of KEY, as papers tune every baseline's
learning rate before comparing them.

For every row (the row keys, KEY not among them) and column (an evaluation setting), the cell reads
the runs of the KEY value whose metric on the selection split (valid) is best: the mean over seeds
of the same row, the same column and that value, scored on the selection split. It then reports the
metric of those runs on the report split (test): mean ± std over their seeds, bold and the tests
against a baseline as in any grid table (tables.grid_table, on the chosen runs). The picked value is
shown next to the cell: one label column when the table has one column, else a column after each
value column. Ties go to the value first in the spec's axis order (else the smaller number).

Selecting on the split that is reported would be tuning on the test set; the two splits are the same
runs scored twice (an evaluation setting's `split`), so a row's pick and its report come from the
same trained models.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from relpos_ablate.analysis.render import Table
from relpos_ablate.analysis.settings import column_label, label, normalized, short_name
from relpos_ablate.analysis.table_options import TableOptions, finished, metric_direction
from relpos_ablate.analysis.tables import grid_table, sort_key, values_by_key
from relpos_ablate.config import ConfigError


def best_over_table(
    df: pd.DataFrame, options: TableOptions, orders: dict[str, list] | None = None
) -> Table:
    """The grid table at each cell's best value of options.best_over (module docstring); options
    resolved."""
    orders = orders or {}
    key, rows, cols, metric = (
        options.best_over,
        list(options.rows),
        list(options.cols),
        options.metric,
    )
    select, report = options.select_split, options.report_split
    data = _check(finished(df, metric), key, rows, cols, metric, (select, report))
    picks = pick_values(
        data[data["split"].map(normalized) == select], key, rows, cols, metric, orders
    )
    reported = data[data["split"].map(normalized) == report]
    keys = [
        tuple(normalized(v) for v in t) for t in reported[[*rows, *cols]].itertuples(index=False)
    ]
    chosen = reported[
        [picks.get(k, _NOTHING) == normalized(v) for k, v in zip(keys, reported[key])]
    ]
    if chosen.empty:
        raise ConfigError(
            "report_split",
            f"no {report} {metric} at any picked {key}; evaluate those runs on {report}",
        )
    table = grid_table(chosen, replace(options, best_over=None), orders)
    found = {
        tuple(normalized(v) for v in t) for t in chosen[[*rows, *cols]].itertuples(index=False)
    }
    missing = sorted({", ".join(label(v) for v in k[: len(rows)]) for k in picks if k not in found})
    # a column reported but never scored on the selection split has no pick, so no cell: named
    picked = {k[len(rows) :] for k in picks}
    unpicked = sorted(
        {
            column_label(cols, k, metric)
            for k in (
                tuple(normalized(v) for v in t) for t in reported[cols].itertuples(index=False)
            )
            if k not in picked
        }
    )
    return _with_picks(table, picks, key, rows, cols, metric, options, missing, unpicked)


_NOTHING = object()
"""No pick for a cell: equal to no value of the key."""


def _check(
    data: pd.DataFrame,
    key: str,
    rows: list[str],
    cols: list[str],
    metric: str,
    splits: tuple[str, str],
) -> pd.DataFrame:
    """One-line errors for a key or split the table cannot use; the finished rows otherwise."""
    if key in rows or key in cols:
        raise ConfigError(
            "best_over", f"{key} is picked per row; leave it out of --rows and --cols"
        )
    if "split" in rows or "split" in cols:
        raise ConfigError(
            "best_over",
            "the split is --select-split / --report-split; leave it out of --rows and --cols",
        )
    if "split" not in data:
        raise ConfigError(
            "best_over", "these runs record no split (collected before settings named one)"
        )
    values = sorted({label(v) for v in data[key]})
    if len(values) < 2:
        raise ConfigError(
            "best_over", f"{key} has one value in these runs ({', '.join(values)}): nothing to pick"
        )
    present = sorted({str(s) for s in data["split"].dropna()})
    for name, split in zip(("select_split", "report_split"), splits):
        if split not in present:
            raise ConfigError(
                name,
                f"no {metric} on the {split} split in these runs (they have "
                f"{', '.join(present) or 'none'}); evaluate them with a setting's split: {split}",
            )
    return data


def pick_values(
    select: pd.DataFrame,
    key: str,
    rows: list[str],
    cols: list[str],
    metric: str,
    orders: dict[str, list],
) -> dict[tuple, object]:
    """{row + column key: the value of `key` with the best seed-mean metric in `select`} (ties: the
    first in sort_key order)."""
    means: dict[tuple, list[tuple[object, float]]] = {}
    for k, values in values_by_key(select, [*rows, key, *cols], metric).items():
        cell = k[: len(rows)] + k[len(rows) + 1 :]
        means.setdefault(cell, []).append((k[len(rows)], float(np.mean(values))))
    sign = -1.0 if metric_direction(metric) == "max" else 1.0
    return {
        cell: min(found, key=lambda vm: (sign * vm[1], sort_key((vm[0],), [key], orders)))[0]
        for cell, found in means.items()
    }


def _with_picks(
    table: Table,
    picks: dict[tuple, object],
    key: str,
    rows: list[str],
    cols: list[str],
    metric: str,
    options: TableOptions,
    missing: list[str],
    unpicked: list[str] = (),
) -> Table:
    """The table with the picked value of every cell beside it, and a caption saying how it was
    picked."""
    row_of = {tuple(label(v) for v in k[: len(rows)]): k[: len(rows)] for k in picks}
    col_of = {column_label(cols, k[len(rows) :], metric): k[len(rows) :] for k in picks}
    name = short_name(key)
    lines = []
    for labels, values in table.rows:
        r = row_of[tuple(labels)]
        shown = [
            label(picks[r + col_of[c]]) if r + col_of[c] in picks else None for c in table.columns
        ]
        if len(table.columns) == 1:
            lines.append(([*labels, shown[0] or "—"], values))
        else:
            lines.append((labels, [x for pair in zip(values, shown) for x in pair]))
    header = [f"{options.report_split} {c}" if c == metric else c for c in table.columns]
    if len(table.columns) == 1:
        index, columns = [*table.index, name], header
    else:
        index, columns = table.index, [x for c in header for x in (c, f"{name} ({c})")]
    better = "highest" if metric_direction(metric) == "max" else "lowest"
    caption = (
        f"{options.report_split} {metric} at each row's best {key}: per cell, the {key} whose "
        f"mean {options.select_split} {metric} over seeds at the same evaluation setting is "
        f"{better} (ties: the first in the spec's order), shown in the {name} "
        f"column{'' if len(table.columns) == 1 else 's'}. "
        + table.caption
        + (
            f" No {options.report_split} {metric} at the picked {key} for: {'; '.join(missing)}."
            if missing
            else ""
        )
        + (
            f" Left out: {'; '.join(unpicked)}: no {options.select_split} {metric} there to pick "
            f"{key} on (evaluate those settings with split: {options.select_split} too)."
            if unpicked
            else ""
        )
    )
    return replace(table, index=index, columns=columns, rows=lines, caption=caption)
