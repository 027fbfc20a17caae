"""Paper-style tables from `collect`: the machinery every layout shares (labels, seed cells, best in bold,
Welch's t-test) and the `grid` layout (rows and columns by any config field, variant axis or evaluation
setting). What a table shows (rows, columns, metric, ...) is resolved in table_options.py. The other
layouts build on this module and layouts.py, above them all, maps `--layout` names to them (`make_table`);
this module knows none of them.
Settings that save per-token losses (RECL's ladder) are left out of the grid and xl_table6 layouts
and of the extrapolation plot: they score a subset of the targets; xl_table8 reads them.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from typing import Iterable

import numpy as np
import pandas as pd
from scipy import stats

from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.render import STAR_LEGEND, Cell, Table
from relpos_ablate.analysis.settings import column_label, evaluation_note, label, normalized, short_name
from relpos_ablate.analysis.table_options import TableOptions, finished, metric_direction
from relpos_ablate.config import ConfigError

DECIMALS = {"ppl": 2, "acc": 3, "loss": 3, "bpc": 3}
MIN_WELCH_SEEDS = 3
"""Welch's t-test is run (and starred) only where both cells have at least this many seeds."""


def row_key(record: pd.Series, keys: list[str]) -> tuple:
    """The group key of one collected row for `keys` (missing values as None)."""
    return tuple(normalized(record.get(k)) for k in keys)


# ---------------------------------------------------------------- grid layout


def sort_key(key: tuple, names: list[str], orders: dict[str, list]) -> tuple:
    """Spec order for grid axes, numbers numerically, then strings; missing values first."""
    parts = []
    for name, value in zip(names, key):
        order = orders.get(name, [])
        if value in order:
            parts.append((0, order.index(value), 0, ""))
        elif value is None:
            parts.append((1, 0, 0, ""))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append((2, 0, value, ""))
        else:
            parts.append((3, 0, 0, str(value)))
    return tuple(parts)


def values_by_key(data: pd.DataFrame, keys: list[str], metric: str) -> dict[tuple, list[float]]:
    """{key tuple: metric values, one per run}; a run contributing twice to one key is an error."""
    values: dict[tuple, list[float]] = defaultdict(list)
    seen = Counter()
    for record in data[[*keys, metric, "run_dir"]].itertuples(index=False):
        key = tuple(normalized(v) for v in record[: len(keys)])
        values[key].append(float(record[len(keys)]))
        seen[(record[-1], key)] += 1
    if seen and max(seen.values()) > 1:
        mixed = [f for f in SETTING_FIELDS if f not in keys and f != "attn_len" and f in data
                 and data.groupby("run_dir")[f].agg(lambda s: s.map(normalized).nunique(dropna=False)).max() > 1]
        what = f" ({', '.join(mixed)} varies within a run)" if mixed else ""
        raise ConfigError("cols", f"a cell would average several evaluation settings of one run{what}; "
                                  "add that field to --rows or --cols")
    return values


def seed_cell(values: list[float]) -> Cell:
    arr = np.asarray(values, dtype=float)
    return Cell(mean=float(arr.mean()), std=float(arr.std(ddof=1)) if arr.size > 1 else math.nan, n=int(arr.size))


def welch_p(a: Iterable[float], b: Iterable[float]) -> float:
    """Two-sided Welch's t-test p-value; NaN with fewer than MIN_WELCH_SEEDS values a side (two seeds
    give one degree of freedom per side: a p-value, but not one to star) or zero variance."""
    a, b = np.asarray(list(a), float), np.asarray(list(b), float)
    if a.size < MIN_WELCH_SEEDS or b.size < MIN_WELCH_SEEDS:
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def mark_best(cells: list[Cell | None], metric: str) -> None:
    """Bold the best mean of a column (ties all bold)."""
    present = [c for c in cells if c is not None]
    if not present:
        return
    pick = max if metric_direction(metric) == "max" else min
    best = pick(c.mean for c in present)
    for c in present:
        c.best = c.mean == best


def _find_baseline(baseline: str, row_keys: list[tuple]) -> tuple:
    wanted = tuple(part.strip() for part in baseline.split(","))
    for key in row_keys:
        if tuple(label(v) for v in key) == wanted:
            return key
    choices = "; ".join(",".join(label(v) for v in key) for key in row_keys)
    raise ConfigError("baseline", f"{baseline!r} is not a row label; rows are: {choices}")


def grid_table(df: pd.DataFrame, options: TableOptions, orders: dict[str, list] | None = None) -> Table:
    """Rows x columns of mean ± std over seeds (options must be resolved: see resolve_options)."""
    rows, cols, metric = list(options.rows), list(options.cols), options.metric
    data = finished(df, metric)
    values = values_by_key(data, rows + cols, metric)
    orders = orders or {}
    row_keys = sorted({k[: len(rows)] for k in values}, key=lambda k: sort_key(k, rows, orders))
    col_keys = sorted({k[len(rows):] for k in values}, key=lambda k: sort_key(k, cols, orders))
    grid = [[seed_cell(values[r + c]) if r + c in values else None for c in col_keys] for r in row_keys]
    for j in range(len(col_keys)):
        mark_best([line[j] for line in grid], metric)
    base = _find_baseline(options.baseline, row_keys) if options.baseline else None
    if base is not None:
        for r, line in zip(row_keys, grid):
            for c, cell in zip(col_keys, line):
                if cell is not None and r != base and base + c in values:
                    cell.p = welch_p(values[r + c], values[base + c])
    cells = [c for line in grid for c in line if c is not None]
    return Table(
        index=[short_name(r) for r in rows],
        columns=[column_label(cols, c, metric) for c in col_keys],
        rows=[([label(v) for v in r], line) for r, line in zip(row_keys, grid)],
        caption=seed_caption(metric, cells, options.baseline) + evaluation_note(data, rows + cols),
        decimals=DECIMALS.get(metric, 3),
        show_n=len({c.n for c in cells}) > 1,
    )


def seed_caption(metric: str, cells: list[Cell], baseline: str | None) -> str:
    counts = sorted({c.n for c in cells})
    seeds = f"n={counts[0]} seed{'s' if counts[0] != 1 else ''}" if len(counts) == 1 else "n seeds (per cell)"
    better = "higher" if metric_direction(metric) == "max" else "lower"
    text = f"{metric}: mean ± std over {seeds}; best per column in bold ({better} is better)."
    if baseline:
        text += (f" Welch's t-test vs {baseline} where both cells have >= {MIN_WELCH_SEEDS} seeds: {STAR_LEGEND}"
                 f"{'' if counts[0] >= MIN_WELCH_SEEDS else ' (none here: too few seeds)'}.")
    return text


def variant_colors(count: int) -> list:
    """A colour per variant of a figure: matplotlib's cycle up to 10, tab20 beyond (distinct to 20)."""
    if count <= 10:
        return [f"C{k}" for k in range(count)]
    from matplotlib import colormaps  # figures only: tables themselves need no matplotlib

    return [colormaps["tab20"](k % 20) for k in range(count)]
