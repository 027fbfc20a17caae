"""Transformer-XL's tables (Dai et al. 2019) from `collect`, one row per model as the paper labels it
(Recurrence, Encoding, Loss; seeds pooled, recurrence first):

- `xl_table6`: PPL init (at the training attention length), PPL best (best over the evaluation
  settings of one protocol: xl when there is one) and Attn Len (the shortest attention length
  reaching PPL best, counted as that protocol counts it).
- `xl_table8`: RECL at r = 0.1, 0.5, 1.0 within the group of every model in the table (recl.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pandas as pd

from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.recl import R_VALUES, THRESHOLD, ladder_rows, recl, token_loss_frame
from relpos_ablate.analysis.render import Cell, Table
from relpos_ablate.analysis.settings import ATTN_LEN
from relpos_ablate.analysis.tables import (
    DECIMALS, TableOptions, default_rows, finished, label, mark_best, metric_direction, normalized, run_level,
    seed_caption, seed_cell, short_name, sort_key, values_by_key, varies,
)

TABLE6_PROTOCOLS = ("xl", "non_overlapping", "sliding")
"""Table 6 compares the settings of one protocol, the first of these the runs were evaluated with."""


def model_rows(data: pd.DataFrame, orders: dict[str, list]) -> tuple[list[str], list[tuple[list[str], pd.DataFrame]]]:
    """(index names, [(labels, that model's rows)]): Recurrence, Encoding, Loss, and Other when those
    three do not tell the models apart."""
    keys = default_rows(data)
    runs = run_level(data)
    attention = [c for c in data.columns if str(c).startswith("model.attention.") and varies(runs, c)] or [
        c for c in ("model.attention.terms", "model.attention.bias", "model.attention.absolute") if c in data]
    groups = defaultdict(list)
    for idx, key in zip(data.index, data[keys].itertuples(index=False)):
        groups[tuple(normalized(v) for v in key)].append(idx)
    lines = []
    for key in sorted(groups, key=lambda k: sort_key(k, keys, orders)):
        part = data.loc[groups[key]]
        first = part.iloc[0]
        recurrence = "✓" if (normalized(first.get("model.mem_len")) or 0) > 0 else "✗"
        labels = [recurrence, _encoding_label(first, attention), label(first.get("train.loss_on")).capitalize()]
        lines.append((labels, key, part))
    lines.sort(key=lambda line: line[0][0] != "✓")  # stable: recurrence first, as in the paper
    index = ["Recurrence", "Encoding", "Loss"]
    if len({tuple(labels) for labels, _, _ in lines}) < len(lines):  # other fields vary too: show them
        index.append("Other")
        for labels, key, _ in lines:
            labels.append(" ".join(f"{short_name(k)}={label(v)}" for k, v in zip(keys, key) if k != "encoding"))
    return index, [(labels, part) for labels, _, part in lines]


def _encoding_label(run: pd.Series, attention_fields: list[str]) -> str:
    if "encoding" in run.index and normalized(run["encoding"]) is not None:
        return label(run["encoding"])
    return " ".join(f"{short_name(f)}={label(run[f])}" for f in attention_fields)


# ---------------------------------------------------------------- Table 6


def one_protocol(data: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of the protocol Table 6 compares (xl, else non_overlapping, else sliding)."""
    if "protocol" not in data:
        return data, "non_overlapping"
    present = set(data["protocol"].dropna())
    chosen = next((p for p in TABLE6_PROTOCOLS if p in present), "non_overlapping")
    return data[data["protocol"] == chosen], chosen


def _setting_cells(runs: pd.DataFrame, metric: str) -> list[tuple[dict, Cell]]:
    """(setting fields, mean ± std over seeds) for every evaluation setting of one configuration."""
    fields_ = [f for f in SETTING_FIELDS if f in runs]
    grouped = values_by_key(runs, fields_, metric)
    return [(dict(zip(fields_, key)), seed_cell(vals)) for key, vals in grouped.items()]


def _init_and_best(runs: pd.DataFrame, metric: str) -> tuple[Cell | None, Cell, str]:
    """PPL init (at the training attention length), PPL best, and the shortest attn_len reaching it."""
    first = runs.iloc[0]
    train_seg, train_mem = normalized(first.get("train.segment_len")), normalized(first.get("model.mem_len")) or 0
    settings = _setting_cells(runs, metric)
    at_train = [(s, c) for s, c in settings if train_seg is not None and s.get("attn_len") == train_seg + train_mem]
    at_train.sort(key=lambda sc: sc[0].get("segment_len") != train_seg)  # prefer the training segment length
    sign = -1 if metric_direction(metric) == "max" else 1
    best_setting, best = min(settings, key=lambda sc: (sign * sc[1].mean, sc[0].get("attn_len") or 0))
    return (at_train[0][1] if at_train else None), best, label(best_setting.get("attn_len"))


def xl_table6(df: pd.DataFrame, options: TableOptions, orders: dict[str, list] | None = None) -> Table:
    """Transformer-XL Table 6: one row per configuration (seeds pooled), best init/best in bold, in
    options.metric."""
    metric = options.metric
    data, protocol = one_protocol(finished(df, metric))
    index, models = model_rows(data, orders or {})
    lines = [(labels, list(_init_and_best(part, metric))) for labels, part in models]
    for j in (0, 1):
        mark_best([values[j] for _, values in lines], metric)
    name = metric.upper() if metric == "ppl" else metric
    cells = [c for _, values in lines for c in values[:2] if c is not None]
    return Table(
        index=index,
        columns=[f"{name} init", f"{name} best", "Attn Len"],
        rows=lines,
        caption=seed_caption(metric, cells, None) + f" Protocol: {protocol}. init: at the training attention length; "
                f"Attn Len: the shortest reaching the best, counted as {ATTN_LEN.get(protocol, 'segment_len + mem_len')}.",
        decimals=DECIMALS.get(metric, 3),
        show_n=len({c.n for c in cells}) > 1,
    )


# ---------------------------------------------------------------- Table 8


def xl_table8(df: pd.DataFrame, options: TableOptions | None = None, orders: dict[str, list] | None = None) -> Table:
    """Transformer-XL Table 8: RECL at each r in R_VALUES per model, the group being every model shown;
    with several seeds, RECL within each seed's group, then mean ± std (the metric is RECL: options
    choose nothing here)."""
    losses = token_loss_frame(df)
    rows = ladder_rows(df)
    index, models = model_rows(rows, orders or {})
    model_of = {run_dir: k for k, (_, part) in enumerate(models) for run_dir in part["run_dir"]}
    seed_of = run_level(rows).set_index("run_dir")["seed"]
    losses = losses.assign(model=losses["run_dir"].map(model_of), seed=losses["run_dir"].map(seed_of))
    found: dict[tuple[int, float], list] = defaultdict(list)
    for _, group in losses.groupby("seed"):
        for r in R_VALUES:
            for record in recl(group, r).itertuples(index=False):
                found[(record.model, r)].append((record.recl, record.censored))
    lines = [(labels, [_recl_label(found[(k, r)]) for r in R_VALUES]) for k, (labels, _) in enumerate(models)]
    return Table(index=index, columns=[f"r = {r}" for r in R_VALUES], rows=lines,
                 caption=_table8_caption(rows, losses, len(models)))


def _recl_label(values: list[tuple[int, bool]]) -> str:
    """RECL of one model: the context (one seed) or mean ± std over seeds; '≥' when the search ran off the ladder."""
    contexts = np.array([c for c, _ in values], dtype=float)
    bound = "≥" if any(censored for _, censored in values) else ""
    if len(contexts) == 1:
        return f"{bound}{contexts[0]:.0f}"
    return f"{bound}{contexts.mean():.0f} ± {contexts.std(ddof=1):.0f}"


def _table8_caption(rows: pd.DataFrame, losses: pd.DataFrame, n_models: int) -> str:
    contexts = sorted(int(c) for c in rows["segment_len"].unique())
    steps = sorted({b - a for a, b in zip(contexts, contexts[1:])})
    step = f"Δ = {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    seeds = losses["seed"].nunique()
    targets = losses.groupby("run_dir")["target"].nunique().min()
    split = label(rows["eval.split"].iloc[0]) if "eval.split" in rows else "evaluation"
    max_targets = int(rows["max_targets"].iloc[0])
    per_seed = f", per seed, then mean ± std over {seeds} seeds" if seeds > 1 else ""
    return (f"RECL (Transformer-XL, Dai et al. 2019, App. C) within the group of these {n_models} models{per_seed}. "
            f"r: the fraction of hardest targets (largest group-best loss b(c, t), re-chosen for every c); "
            f"threshold: relative gain {THRESHOLD:.0%}; contexts c = {', '.join(map(str, contexts))} "
            f"(start c = {contexts[0]}, {step}). Each target's loss at exactly c tokens of context (sliding "
            f"window of c tokens, stride 1) on the first {max_targets:,} targets of the {split} split; the "
            f"{targets:,} with {contexts[-1]} tokens of context in their stream are used. ≥: still gaining at the "
            f"longest context.")
