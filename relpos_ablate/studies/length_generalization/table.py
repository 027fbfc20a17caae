"""The length-generalization table (Kazemnejad et al. 2023) from `collect`'s frame of example-task
runs.

`table DIR --layout length_generalization`:
- one row per (task, encoding), columns = the test-length bins of n, then "OOD mean" (the mean over
  the bins that start beyond the longest training length); a cell is the mean ± std over seeds of
  each run's metric in that bin (depth tasks: first averaged over their depths); best per task and
  column in bold;
- `rank_table`: each encoding's rank per task by its OOD mean (1 = best, ties share their mean
  rank), its ID mean beside it (a rank of a task not learnt at the training lengths says little),
  and its mean rank over the tasks, as Kazemnejad et al.'s Figs. 1-2 summarise their tasks.
Rows are the run's varying fields other than the task (e.g. encoding and model.attention.positions).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pandas as pd

from relpos_ablate.analysis.render import Cell, Table
from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import TableOptions, finished, metric_direction
from relpos_ablate.analysis.tables import DECIMALS, mark_best, row_key, seed_cell, sort_key
from relpos_ablate.config import ConfigError
from relpos_ablate.config.data import EXAMPLE_TASKS

TASK = "data.task"
BIN_FIELDS = ("length_min", "length_max")
OOD = "OOD mean"
IID = "ID mean"
"""A run's mean over the bins within its training lengths (the rank summary shows it beside each
rank)."""


def example_rows(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The finished rows of example-task runs (those with test-length bins), or a one-line error."""
    data = finished(df, metric)
    if not set(BIN_FIELDS) <= set(data.columns) or data["length_min"].isna().all():
        raise ConfigError(
            "layout",
            f"length_generalization needs example-task runs (data.task one of "
            f"{', '.join(EXAMPLE_TASKS)}): these runs have no test-length bins",
        )
    return data[data["length_min"].notna()]


def train_range(run: pd.Series) -> tuple[int, int]:
    """A run's training task lengths [min, max] (data.train_lengths, flattened by collect as
    JSON)."""
    value = run.get("data.train_lengths")
    low, high = json.loads(value) if isinstance(value, str) else value
    return int(low), int(high)


def train_max(run: pd.Series) -> int:
    """The longest training task length of a run."""
    return train_range(run)[1]


def per_run_bins(data: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per (run, bin): the run's metric in that bin (depth tasks: the mean over the depths),
    the bin's bounds, and whether the bin lies beyond the run's training lengths (`ood`) or within
    them (`iid`)."""
    grouped = data.groupby(["run_dir", *BIN_FIELDS], sort=False)[metric].mean().reset_index()
    limits = grouped["run_dir"].map(
        data.drop_duplicates("run_dir").set_index("run_dir").apply(train_max, axis=1)
    )
    grouped["ood"] = grouped["length_min"] > limits
    grouped["iid"] = grouped["length_max"] <= limits
    return grouped


ENCODING_NAMES = {
    "nope": "NoPE",
    "vaswani": "sinusoid",
    "learned": "learned absolute",
    "rope": "RoPE",
    "t5": "T5",
    "alibi": "ALiBi",
    "kerple_log": "KERPLE",
    "fire": "FIRE",
    "xl": "Transformer-XL",
    "p_rope": "p-RoPE",
    "ssmax": "SSMax",
    "stick_breaking": "stick-breaking",
    "path": "PaTH",
    "dape": "DAPE",
    "dape_v2": "DAPE v2",
}
"""The study's encodings (runner presets) in words, in the order its tables and figures list
them."""


def variant_name(encoding, positions=None) -> str:
    """An encoding in words, `(randomized)` after it when its positions are: e.g. 'RoPE
    (randomized)'."""
    name = ENCODING_NAMES.get(encoding, label(encoding))
    return f"{name} (randomized)" if positions == "randomized" else name


def task_order(task) -> tuple:
    """Sort key: the tasks in the config's order (data.EXAMPLE_TASKS), others after by name."""
    return (EXAMPLE_TASKS.index(task) if task in EXAMPLE_TASKS else len(EXAMPLE_TASKS), str(task))


def variant_order(encoding, positions=None) -> tuple:
    """Sort key: the study's encodings in ENCODING_NAMES order, others after by name; sequential
    first."""
    names = list(ENCODING_NAMES)
    return (
        names.index(encoding) if encoding in names else len(names),
        str(encoding),
        positions == "randomized",
    )


def _bin_label(bounds: tuple[int, int]) -> str:
    lo, hi = bounds
    return f"n={lo}" if lo == hi else f"n={lo}-{hi}"


def _scores(data: pd.DataFrame, rows: list[str], metric: str):
    """{(task, row key): {bin or OOD: [one value per run]}} and the bins in order."""
    runs = data.drop_duplicates("run_dir").set_index("run_dir")
    bins = per_run_bins(data, metric)
    cells: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    for run_dir, part in bins.groupby("run_dir", sort=False):
        run = runs.loc[run_dir]
        key = (run.get(TASK), row_key(run, rows))
        for record in part.itertuples(index=False):
            cells[key][(int(record.length_min), int(record.length_max))].append(
                float(getattr(record, metric))
            )
        for flag, name in (("ood", OOD), ("iid", IID)):
            if part[flag].any():
                cells[key][name].append(float(part.loc[part[flag], metric].mean()))
    order = sorted({b for values in cells.values() for b in values if b not in (OOD, IID)})
    return cells, order


def length_generalization_table(
    df: pd.DataFrame, options: TableOptions, orders: dict | None = None
) -> Table:
    """Rows (task, *options.rows) x test-length bins + OOD mean of options.metric (module
    docstring). The columns are fixed."""
    orders, metric, rows = orders or {}, options.metric, list(options.rows)
    data = example_rows(df, metric)
    rows = study_order([r for r in rows if r != TASK]) or ["experiment"]
    cells, bins = _scores(data, rows, metric)
    columns = [*bins, OOD] if any(OOD in v for v in cells.values()) else list(bins)
    keys = sorted(cells, key=lambda k: sort_key((k[0], *k[1]), [TASK, *rows], orders))
    grid = [[seed_cell(cells[k][c]) if cells[k].get(c) else None for c in columns] for k in keys]
    for task in dict.fromkeys(k[0] for k in keys):
        block = [line for k, line in zip(keys, grid) if k[0] == task]
        for j in range(len(columns)):
            mark_best([line[j] for line in block], metric)
    present = [c for line in grid for c in line if c is not None]
    counts = sorted({c.n for c in present})
    better = "higher" if metric_direction(metric) == "max" else "lower"
    caption = (
        f"{metric} per test length n: mean ± std over {_seeds(counts)}; best per task and column "
        f"in bold ({better} is better). {OOD}: the mean over the bins that start beyond the "
        f"training lengths."
    )
    return Table(
        index=["task", *(r.rsplit(".", 1)[-1] for r in rows)],
        columns=[c if c == OOD else _bin_label(c) for c in columns],
        rows=[([label(k[0]), *(label(v) for v in k[1])], line) for k, line in zip(keys, grid)],
        caption=caption,
        decimals=DECIMALS.get(metric, 3),
        show_n=len(counts) > 1,
    )


def study_order(rows: list[str]) -> list[str]:
    """The variant fields as the study names a variant: the encoding, then its positions, then the
    rest (a spec may list them in another order, e.g. the encoding in a zip after the grid's
    fields)."""
    first = [key for key in ("encoding", "model.attention.positions") if key in rows]
    return first + [key for key in rows if key not in first]


def rank_table(df: pd.DataFrame, metric: str, rows: list[str], orders: dict | None = None) -> Table:
    """Each encoding's rank per task by its mean OOD score over seeds (1 = best, ties averaged), and
    its mean rank over the tasks; best mean rank in bold."""
    orders = orders or {}
    data = example_rows(df, metric)
    rows = study_order([r for r in rows if r != TASK]) or ["experiment"]
    cells, _ = _scores(data, rows, metric)
    ood = {k: float(np.mean(v[OOD])) for k, v in cells.items() if v.get(OOD)}
    if not ood:
        raise ConfigError(
            "layout", "no run has a test bin beyond its training lengths: nothing to rank"
        )
    tasks = sorted({k[0] for k in ood}, key=lambda t: sort_key((t,), [TASK], orders))
    encodings = sorted({k[1] for k in ood}, key=lambda e: sort_key(e, rows, orders))
    ascending = metric_direction(metric) == "min"
    ranks = {
        task: pd.Series({k[1]: v for k, v in ood.items() if k[0] == task}).rank(ascending=ascending)
        for task in tasks
    }
    lines = []
    for encoding in encodings:
        mine = [ranks[t].get(encoding, math.nan) for t in tasks]
        known = [r for r in mine if not math.isnan(r)]
        mean = Cell(mean=float(np.mean(known)), std=math.nan, n=len(known)) if known else None
        shown = [
            None if math.isnan(r) else f"{r:g}{_in_distribution(cells.get((t, encoding), {}))}"
            for r, t in zip(mine, tasks)
        ]
        lines.append(([label(v) for v in encoding], [*shown, mean]))
    mark_best([line[1][-1] for line in lines], "rank")  # a lower rank is better
    return Table(
        index=[r.rsplit(".", 1)[-1] for r in rows],
        columns=[*map(label, tasks), "mean rank"],
        rows=lines,
        caption=f"Rank by {OOD} of {metric} per task (1 = best; ties share their mean rank), in "
        f"brackets the {IID} of {metric} over seeds (a low one: the task not learnt at the "
        f"training lengths), and the mean rank over the tasks (best in bold).",
        decimals=2,
    )


def _in_distribution(cell: dict) -> str:
    return f" (ID {np.mean(cell[IID]):.2f})" if cell.get(IID) else ""


def _seeds(counts: list[int]) -> str:
    return (
        f"n={counts[0]} seed{'s' if counts[0] != 1 else ''}"
        if len(counts) == 1
        else "n seeds (per cell)"
    )
