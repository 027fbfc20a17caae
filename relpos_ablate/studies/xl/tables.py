"""Transformer-XL's tables (Dai et al. 2019) from `collect`, one row per model as the paper labels
it (Recurrence, Encoding, Loss; seeds pooled, recurrence first):

- `xl_table6`: PPL init (at the training attention length), PPL best (best over the row's settings)
  and Attn Len (the shortest attention length reaching PPL best). Each row is measured the way it
  was trained: a model with memory by the xl protocol (memory + same_length: every query sees
  mem_len keys), one without by sliding windows (stride 1 where evaluated so: every target sees the
  window), as the paper evaluates its vanilla Transformer. The RECL ladder's settings count (they
  are these evaluations, on a shared subset of targets).
- `xl_table8`: RECL at r = 0.1, 0.5, 1.0 within the group of every model in the table (recl.py), and
  each model's perplexity at every context of the ladder on the targets RECL uses, so a RECL can be
  read against the losses it comes from.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pandas as pd

from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.recl import R_VALUES, THRESHOLD, ladder_rows, recl, token_loss_frame
from relpos_ablate.analysis.render import Cell, Table
from relpos_ablate.analysis.settings import ATTN_LEN, label
from relpos_ablate.analysis.table_options import (
    TableOptions,
    default_rows,
    finished,
    metric_direction,
    run_level,
    varies,
)
from relpos_ablate.analysis.tables import (
    DECIMALS,
    mark_best,
    normalized,
    seed_caption,
    seed_cell,
    short_name,
    sort_key,
    values_by_key,
)
from relpos_ablate.config import ConfigError
from relpos_ablate.config.presets import presets

TABLE6_PROTOCOLS = ("xl", "sliding", "non_overlapping")
"""The protocols a Table 6 row falls back on, in this order, when it was not evaluated the way it
was trained."""


def model_rows(
    data: pd.DataFrame, orders: dict[str, list]
) -> tuple[list[str], list[tuple[list[str], pd.DataFrame]]]:
    """(index names, [(labels, that model's rows)]): Recurrence, Encoding, Loss, and Other when
    those three do not tell the models apart."""
    keys = default_rows(data)
    runs = run_level(data)
    attention = [
        c for c in data.columns if str(c).startswith("model.attention.") and varies(runs, c)
    ] or [
        c
        for c in ("model.attention.terms", "model.attention.bias", "model.attention.absolute")
        if c in data
    ]
    groups = defaultdict(list)
    for idx, key in zip(data.index, data[keys].itertuples(index=False)):
        groups[tuple(normalized(v) for v in key)].append(idx)
    lines = []
    for key in sorted(groups, key=lambda k: sort_key(k, keys, orders)):
        part = data.loc[groups[key]]
        first = part.iloc[0]
        recurrence = "✓" if (normalized(first.get("model.mem_len")) or 0) > 0 else "✗"
        labels = [
            recurrence,
            _encoding_label(first, attention),
            label(first.get("train.loss_on")).capitalize(),
        ]
        lines.append((labels, key, part))
    lines.sort(key=lambda line: line[0][0] != "✓")  # stable: recurrence first, as in the paper
    index = ["Recurrence", "Encoding", "Loss"]
    # other fields vary too: show them
    if len({tuple(labels) for labels, _, _ in lines}) < len(lines):
        index.append("Other")
        shown = ("encoding", "model.mem_len", "train.loss_on")  # in the three columns already
        segment = (
            ["train.segment_len"]
            if "train.segment_len" in runs and varies(runs, "train.segment_len")
            else []
        )
        for labels, key, part in lines:
            other = [f"{short_name(k)}={label(v)}" for k, v in zip(keys, key) if k not in shown]
            other += [f"{short_name(k)}={label(part.iloc[0][k])}" for k in segment if k not in keys]
            labels.append(" ".join(other))
    return index, [(labels, part) for labels, _, part in lines]


def _encoding_label(run: pd.Series, attention_fields: list[str]) -> str:
    """The run's `encoding` word; for a run configured by its attention fields (no `encoding` axis),
    the one preset those fields match, else the fields themselves."""
    if "encoding" in run.index and normalized(run["encoding"]) is not None:
        return label(run["encoding"])
    matches = [
        name
        for name, fields in presets().items()
        if all(
            str(normalized(run.get(f"model.attention.{key}"))) == str(value)
            for key, value in fields.items()
        )
    ]
    if len(matches) == 1:
        return matches[0]
    return " ".join(f"{short_name(f)}={label(run[f])}" for f in attention_fields)


# ---------------------------------------------------------------- Table 6


def row_protocol(runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The settings a Table 6 row is compared on, and their protocol: the row's training condition,
    xl (memory) for a model trained with memory, sliding (stride 1 where evaluated so) for one
    without."""
    if "protocol" not in runs:
        return runs, "non_overlapping"
    recurrent = (normalized(runs.iloc[0].get("model.mem_len")) or 0) > 0
    present = set(runs["protocol"].dropna())
    chosen = next(
        (p for p in ("xl" if recurrent else "sliding", *TABLE6_PROTOCOLS) if p in present),
        "non_overlapping",
    )
    part = runs[runs["protocol"] == chosen]
    if chosen == "sliding" and (part["stride"] == 1).any():
        part = part[part["stride"] == 1]
    return part, chosen


def _setting_cells(runs: pd.DataFrame, metric: str) -> list[tuple[dict, Cell]]:
    """(setting fields, mean ± std over seeds) for every evaluation setting of one configuration."""
    fields_ = [f for f in SETTING_FIELDS if f in runs]
    grouped = values_by_key(runs, fields_, metric)
    return [(dict(zip(fields_, key)), seed_cell(vals)) for key, vals in grouped.items()]


def _init_and_best(runs: pd.DataFrame, metric: str) -> tuple[Cell | None, Cell, str]:
    """PPL init (at the training attention length), PPL best, and the shortest attn_len reaching
    it."""
    first = runs.iloc[0]
    train_seg, train_mem = (
        normalized(first.get("train.segment_len")),
        normalized(first.get("model.mem_len")) or 0,
    )
    settings = _setting_cells(runs, metric)
    at_train = [
        (s, c)
        for s, c in settings
        if train_seg is not None and s.get("attn_len") == train_seg + train_mem
    ]
    # prefer the training segment length
    at_train.sort(key=lambda sc: sc[0].get("segment_len") != train_seg)
    sign = -1 if metric_direction(metric) == "max" else 1
    best_setting, best = min(
        settings, key=lambda sc: (sign * sc[1].mean, sc[0].get("attn_len") or 0)
    )
    return (at_train[0][1] if at_train else None), best, label(best_setting.get("attn_len"))


def xl_table6(
    df: pd.DataFrame, options: TableOptions, orders: dict[str, list] | None = None
) -> Table:
    """Transformer-XL Table 6: one row per configuration (seeds pooled), best init/best in bold, in
    options.metric."""
    metric = options.metric
    index, models = model_rows(finished(df, metric), orders or {})
    lines, protocols = [], {}
    for labels, part in models:
        settings, protocol = row_protocol(part)
        protocols[protocol] = protocols.get(protocol, 0) + 1
        lines.append((labels, list(_init_and_best(settings, metric))))
    for j in (0, 1):
        mark_best([values[j] for _, values in lines], metric)
    name = metric.upper() if metric == "ppl" else metric
    cells = [c for _, values in lines for c in values[:2] if c is not None]
    measured = "; ".join(
        f"{protocol} ({n} row{'s' * (n > 1)}): attn len = "
        f"{ATTN_LEN.get(protocol, 'segment_len + mem_len')}"
        for protocol, n in protocols.items()
    )
    return Table(
        index=index,
        columns=[f"{name} init", f"{name} best", "Attn Len"],
        rows=lines,
        caption=seed_caption(metric, cells, None)
        + f" Each row measured the way it was trained (memory: protocol xl; none: sliding "
        f"windows). Protocol {measured}. init: at the training attention length (segment + "
        f"memory); Attn Len: the shortest reaching the best.{_targets_note(df)}",
        decimals=DECIMALS.get(metric, 3),
        show_n=len({c.n for c in cells}) > 1,
    )


def _targets_note(df: pd.DataFrame) -> str:
    tokens = sorted(set(df["tokens"].dropna().astype(int))) if "tokens" in df else []
    return f" Tokens scored per setting: {tokens[0]:,}." if len(tokens) == 1 else ""


# ---------------------------------------------------------------- Table 8


def xl_table8(
    df: pd.DataFrame, options: TableOptions | None = None, orders: dict[str, list] | None = None
) -> Table:
    """Transformer-XL Table 8: RECL at each r in R_VALUES per model, the group being every model
    shown; with several seeds, RECL within each seed's group, then mean ± std (the metric is RECL:
    options choose nothing here)."""
    losses = token_loss_frame(df)
    rows = ladder_rows(df)
    index, models = model_rows(rows, orders or {})
    model_of = {run_dir: k for k, (_, part) in enumerate(models) for run_dir in part["run_dir"]}
    seed_of = run_level(rows).set_index("run_dir")["seed"]
    losses = losses.assign(
        model=losses["run_dir"].map(model_of), seed=losses["run_dir"].map(seed_of)
    )
    # RECL is relative to the group: only the seeds at which every model of the table ran make one
    complete = losses.groupby("seed")["model"].nunique()
    losses = losses[losses["seed"].isin(complete[complete == len(models)].index)]
    if losses.empty:
        raise ConfigError(
            "layout",
            f"no seed at which all {len(models)} models of the table ran; RECL compares a "
            "group (narrow the table with --where)",
        )
    found: dict[tuple[int, float], list] = defaultdict(list)
    for _, group in losses.groupby("seed"):
        for r in R_VALUES:
            for record in recl(group, r).itertuples(index=False):
                found[(record.model, r)].append((record.recl, record.censored))
    contexts = sorted(losses["context"].unique())
    ppl = _ppl_by_context(losses)
    lines = [
        (
            labels,
            [_recl_label(found[(k, r)]) for r in R_VALUES]
            + [_ppl_label(ppl.get((k, c), [])) for c in contexts],
        )
        for k, (labels, _) in enumerate(models)
    ]
    return Table(
        index=index,
        columns=[f"r = {r}" for r in R_VALUES] + [f"ppl c={c}" for c in contexts],
        rows=lines,
        caption=_table8_caption(rows, losses, len(models)),
    )


def _ppl_by_context(losses: pd.DataFrame) -> dict[tuple[int, int], list[float]]:
    """(model, context) -> the perplexity of each seed on the targets RECL uses (exp of the mean
    loss)."""
    means = losses.groupby(["model", "context", "seed"])["loss"].mean()
    found: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (model, context, _seed), loss in means.items():
        found[(int(model), int(context))].append(float(np.exp(loss)))
    return found


def _ppl_label(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"{values[0]:.2f}"
        if len(values) == 1
        else f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}"
    )


def _recl_label(values: list[tuple[int, bool]]) -> str:
    """RECL of one model: the context (one seed) or mean ± std over seeds; '≥' when the search ran
    off the ladder."""
    contexts = np.array([c for c, _ in values], dtype=float)
    bound = "≥" if any(censored for _, censored in values) else ""
    if len(contexts) == 1:
        return f"{bound}{contexts[0]:.0f}"
    return f"{bound}{contexts.mean():.0f} ± {contexts.std(ddof=1):.0f}"


def _table8_caption(rows: pd.DataFrame, losses: pd.DataFrame, n_models: int) -> str:
    contexts = sorted(int(c) for c in rows["attn_len"].unique())
    steps = sorted({b - a for a, b in zip(contexts, contexts[1:])})
    step = f"Δ = {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    seeds = losses["seed"].nunique()
    used = ", ".join(str(int(v)) for v in sorted(losses["seed"].unique()))
    targets = losses.groupby("run_dir")["target"].nunique().min()
    split = label(rows["eval.split"].iloc[0]) if "eval.split" in rows else "evaluation"
    max_targets = int(rows["max_targets"].iloc[0])
    per_seed = (
        f", per seed, then mean ± std over {seeds} seeds (those at which every model ran: {used})"
        if seeds > 1
        else f" (seed {used})"
    )
    return (
        f"RECL (Transformer-XL, Dai et al. 2019, App. C) within the group of these {n_models} "
        f"models{per_seed}. r: the fraction of hardest targets (largest group-best loss b(c, t), "
        f"re-chosen for every c); threshold: relative gain {THRESHOLD:.0%}; contexts c = "
        f"{', '.join(map(str, contexts))} (start c = {contexts[0]}, {step}). Each target's loss "
        f"at exactly c tokens of context ({_how(rows)}) on the first {max_targets:,} targets of "
        f"the {split} split; the {targets:,} with {contexts[-1]} tokens of context in their "
        f"stream are used. A step counts only while the model's own loss on those targets falls "
        f"(our guard against gains from noise). ≥: still gaining at the longest context. ppl c: "
        f"each model's perplexity at context c on the targets used."
    )


def _how(rows: pd.DataFrame) -> str:
    """How the ladder gave each kind of model its context (recl.ladder_rows)."""
    kinds = {
        "xl": "models with memory: memory + same_length, every query sees c keys",
        "sliding": "models without: a sliding window of c tokens, stride 1",
    }
    return "; ".join(kinds[p] for p in kinds if p in set(rows["protocol"]))
