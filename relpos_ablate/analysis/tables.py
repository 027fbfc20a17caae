"""Paper-style tables from `collect`: the machinery every layout shares (labels, seed cells, best in
bold, the tests against a baseline row: paired or Welch's as the data says, one family corrected
together, see stats.py) and the `grid` layout (rows and columns by any config field, variant axis or
evaluation setting). What a table shows (rows, columns, metric, ...) is resolved in
table_options.py. The other layouts build on this module and layouts.py, above them all, maps
`--layout` names to them (`make_table`); this module knows none of them.
Settings that save per-token losses (RECL's ladder) are left out of the grid layout and of the
extrapolation plot: they score a subset of the targets (a study layout that reads them says so:
layouts.LayoutSpec.reads_token_losses).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pandas as pd

from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.render import STAR_LEGEND, Cell, Table
from relpos_ablate.analysis.settings import (
    column_label,
    evaluation_note,
    label,
    normalized,
    short_name,
)
from relpos_ablate.analysis.stats import MIN_SEEDS, Family
from relpos_ablate.analysis.table_options import (
    TableOptions,
    axis_orders,
    default_rows,
    finished,
    metric_direction,
    read_spec,
)
from relpos_ablate.config import ConfigError

DECIMALS = {"ppl": 2, "acc": 3, "loss": 3, "bpc": 3, "bpb": 3, "doc_loss": 3, "beyond_loss": 3}


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


def runs_in_spec_order(runs: pd.DataFrame, df: pd.DataFrame) -> tuple[list[str], list[pd.Series]]:
    """The fields that tell `runs` apart (seed aside) and the runs in the spec's order of them, then
    by seed (figures that draw a line or a panel per run or variant)."""
    keys = default_rows(runs)
    order = [*keys, "seed"]
    orders = axis_orders(read_spec(df))
    ordered = sorted(
        (run for _, run in runs.iterrows()),
        key=lambda r: sort_key(row_key(r, order), order, orders),
    )
    return keys, ordered


def samples_by_key(
    data: pd.DataFrame, keys: list[str], metric: str
) -> dict[tuple, dict[str, float]]:
    """{key tuple: {run dir: metric value}}: which run each value comes from, so that a test can see
    whether two cells hold the same runs (stats.compare); a run contributing twice to one key is an
    error."""
    samples: dict[tuple, dict[str, float]] = defaultdict(dict)
    twice = False
    for record in data[[*keys, metric, "run_dir"]].itertuples(index=False):
        key = tuple(normalized(v) for v in record[: len(keys)])
        twice = twice or record[-1] in samples[key]
        samples[key][record[-1]] = float(record[len(keys)])
    if twice:
        mixed = [
            f
            for f in SETTING_FIELDS
            if f not in keys
            and f != "attn_len"
            and f in data
            and data.groupby("run_dir")[f]
            .agg(lambda s: s.map(normalized).nunique(dropna=False))
            .max()
            > 1
        ]
        what = f" ({', '.join(mixed)} varies within a run)" if mixed else ""
        raise ConfigError(
            "cols",
            f"a cell would average several evaluation settings of one run{what}; "
            "add that field to --rows or --cols",
        )
    return samples


def values_by_key(data: pd.DataFrame, keys: list[str], metric: str) -> dict[tuple, list[float]]:
    """{key tuple: metric values, one per run} (samples_by_key without the run names)."""
    return {
        key: list(sample.values()) for key, sample in samples_by_key(data, keys, metric).items()
    }


def seed_cell(values: list[float]) -> Cell:
    arr = np.asarray(values, dtype=float)
    return Cell(
        mean=float(arr.mean()),
        std=float(arr.std(ddof=1)) if arr.size > 1 else math.nan,
        n=int(arr.size),
    )


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


def grid_table(
    df: pd.DataFrame, options: TableOptions, orders: dict[str, list] | None = None
) -> Table:
    """Rows x columns of mean ± std over seeds (options must be resolved: see resolve_options); with
    a baseline, every other cell tested against the baseline row's cell of its column, one
    family."""
    rows, cols, metric = list(options.rows), list(options.cols), options.metric
    data = finished(df, metric)
    samples = samples_by_key(data, rows + cols, metric)
    orders = orders or {}
    row_keys = sorted({k[: len(rows)] for k in samples}, key=lambda k: sort_key(k, rows, orders))
    col_keys = sorted({k[len(rows) :] for k in samples}, key=lambda k: sort_key(k, cols, orders))
    grid = [
        [seed_cell(list(samples[r + c].values())) if r + c in samples else None for c in col_keys]
        for r in row_keys
    ]
    for j in range(len(col_keys)):
        mark_best([line[j] for line in grid], metric)
    columns = [column_label(cols, c, metric) for c in col_keys]
    family = None
    if options.baseline:
        base = _find_baseline(options.baseline, row_keys)
        family = baseline_tests(grid, row_keys, col_keys, samples, base, options, columns)
    cells = [c for line in grid for c in line if c is not None]
    return Table(
        index=[short_name(r) for r in rows],
        columns=columns,
        rows=[([label(v) for v in r], line) for r, line in zip(row_keys, grid)],
        caption=seed_caption(metric, cells, family) + evaluation_note(data, rows + cols),
        decimals=DECIMALS.get(metric, 3),
        show_n=len({c.n for c in cells}) > 1,
        tests=[] if family is None else [str(c) for c in family.comparisons],
        power="" if family is None else family.power_line(),
    )


def baseline_tests(
    grid: list[list[Cell | None]],
    row_keys: list[tuple],
    col_keys: list[tuple],
    samples: dict[tuple, dict],
    base: tuple,
    options: TableOptions,
    columns: list[str],
) -> Family:
    """Each cell against the baseline row's cell of its column, all in one family (stats.Family):
    the test the data calls for (paired where both cells hold the same runs), corrected by
    options.correction; each tested cell gets its adjusted p (its stars) and its raw p."""
    baseline = ", ".join(label(v) for v in base)
    family = Family(f"every row vs {baseline}, column by column", options.correction or "holm")
    tested = []
    for r, line in zip(row_keys, grid):
        for c, cell, column in zip(col_keys, line, columns):
            if cell is not None and r != base and base + c in samples:
                name = ", ".join(label(v) for v in r)
                tested.append(
                    (
                        cell,
                        family.compare(
                            f"{name} ({column})",
                            samples[r + c],
                            f"{baseline} ({column})",
                            samples[base + c],
                            lower_is_better=metric_direction(options.metric) == "min",
                            decimals=DECIMALS.get(options.metric, 3),
                        ),
                    )
                )
    family.close()
    for cell, comparison in tested:
        if comparison.test is not None:
            cell.p, cell.p_raw = comparison.test.p_adjusted, comparison.test.p
    return family


def seed_caption(metric: str, cells: list[Cell], family: Family | None) -> str:
    counts = sorted({c.n for c in cells})
    seeds = (
        f"n={counts[0]} seed{'s' if counts[0] != 1 else ''}"
        if len(counts) == 1
        else "n seeds (per cell)"
    )
    better = "higher" if metric_direction(metric) == "max" else "lower"
    text = f"{metric}: mean ± std over {seeds}; best per column in bold ({better} is better)."
    if family is not None:
        kinds = sorted({t.kind for t in family.tests})
        text += (
            f" Each cell against the baseline row's: a paired t-test where both hold the same "
            f"runs, Welch's t-test where they hold different models (here: "
            f"{', '.join(kinds) if kinds else f'none, fewer than {MIN_SEEDS} seeds'}). "
            f"{family.heading()} Stars on the adjusted p: {STAR_LEGEND}."
        )
    return text


def variant_styles(count: int) -> list[tuple]:
    """(colour, line style) per variant of a line figure: the 10 distinct colours of matplotlib's
    cycle, solid, then again dashed, then dotted, so that no two variants share a look and none is a
    paler shade of another."""
    styles = ("-", "--", ":", "-.")
    return [(f"C{k % 10}", styles[(k // 10) % len(styles)]) for k in range(count)]
