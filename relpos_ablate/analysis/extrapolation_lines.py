"""The lines of the extrapolation figure (extrapolation.py draws them): one per variant, setting and
panel, with its runs' values per length (or their ratios to each run's value at its training
length), the encoding family of each, and how the lines are grouped into rows of panels (at most
MAX_LINES a panel; a zoomed row for the lines that hold)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import (
    column_label,
    label,
    normalized,
    short_name,
    table_settings,
)
from relpos_ablate.analysis.table_options import (
    TableOptions,
    apply_where,
    axis_orders,
    default_cols,
    finished,
    read_spec,
    resolve_column,
    resolve_options,
)
from relpos_ablate.analysis.tables import row_key, sort_key
from relpos_ablate.config.base import check_choice

FAMILIES = ("absolute", "rotary", "bias", "data-dependent", "other")
MAX_LINES = 10
"""Lines a panel holds at most (distinct colours of tab10); more, and the families go to rows of
panels."""
ZOOM = 1.15
"""y='ratio': lines within this factor of their training-length value at every length get a zoomed
row when others leave ZOOM² (the encodings that extrapolate would otherwise share a sliver of the
axis)."""
Y_MODES = ("value", "ratio")
LENGTH_FIELDS = {
    "segment_len": ("segment_len", "attn_len", "rope_scale"),
    "attn_len": ("attn_len", "segment_len", "mem_len", "rope_scale"),
}
"""Setting fields that move with the x axis (attn_len: a protocol's segment_len and memory;
rope_scale: auto follows the length): not a line each."""


def family(record) -> str:
    """The encoding family of a run, from its attention config: absolute (sinusoid / learned
    positions at the input), rotary (RoPE, xPos), data-dependent (FoX's forget gate, CoPE), bias (a
    bias type), other (XL's terms, Shaw's table, NoPE)."""

    def get(name):
        return normalized(record.get(f"model.attention.{name}"))

    absolute = get("absolute")
    if absolute in ("sinusoid", "learned", "learned_per_layer"):
        return "absolute"
    if absolute == "rope":
        return "rotary"
    if get("forget_gate") in (True, "true", "True") or (get("cope_positions") or 0) > 0:
        return "data-dependent"
    return "bias" if get("bias") not in (None, "none") else "other"


@dataclass
class Line:
    """One variant under one setting in one panel: per x, the values of its runs (seeds)."""

    key: tuple
    setting: tuple
    panel: tuple
    family: str
    xs: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    identity: tuple = ()

    @property
    def mean(self) -> np.ndarray:
        return np.array([s.mean() for s in self.samples])

    @property
    def std(self) -> np.ndarray:
        return np.array([s.std(ddof=1) if s.size > 1 else 0.0 for s in self.samples])


@dataclass
class Layout:
    """What extrapolation_lines found: the lines, the fields behind them and how to label them."""

    lines: list[Line]
    rows: list[str]
    split: list[str]
    panel_fields: list[str]
    metric: str
    y: str
    x: str
    data: pd.DataFrame
    orders: dict
    notes: list[str]
    names: dict = field(default_factory=dict)
    """identity -> legend label (set with the identities)."""


def extrapolation_lines(
    df: pd.DataFrame,
    metric: str | None = None,
    x: str = "segment_len",
    y: str = "value",
    panels: str | None = None,
    where: tuple[str, ...] | None = None,
) -> Layout:
    """The lines of the extrapolation figure: rows and metric from the options (command line, the
    spec's `table:` block, the data); settings that differ in more than x (protocol, stride, RoPE
    extension) give lines of their own, and `panels` (default: the protocol, when it varies) a panel
    each. y='ratio': each run's values over its own value at its training length (x =
    train.segment_len, + model.mem_len for attn_len), under the same setting when evaluated there,
    else its plain setting (no RoPE extension) of the same protocol."""
    check_choice("y", y, Y_MODES)
    spec = read_spec(df)
    options = resolve_options(df, TableOptions(metric=metric, cols=(x,), where=where), spec)
    rows, metric = list(options.rows), options.metric
    data = finished(apply_where(table_settings(df), options.where), metric)
    split = [
        f
        for f in default_cols(data, rows)
        if f not in LENGTH_FIELDS.get(x, (x, "attn_len", "rope_scale"))
    ]
    if panels is not None:
        panel_fields = [resolve_column(data, panels, "panels")]
    else:
        panel_fields = ["protocol"] if "protocol" in split else []
    rows = [r for r in rows if r not in panel_fields]
    split = [f for f in split if f not in panel_fields]
    train = data["train.segment_len"] + (data["model.mem_len"] if x == "attn_len" else 0)
    data = data.assign(_train=train)
    notes: list[str] = []
    reference = _references(data, x, metric, split, panel_fields) if y == "ratio" else {}
    lines: dict[tuple, Line] = {}
    for record in data.to_dict("records"):
        key, setting, panel = (row_key(record, names) for names in (rows, split, panel_fields))
        value = float(record[metric])
        if y == "ratio":
            ref = reference.get((record["run_dir"], setting, panel))
            if ref is None:
                notes.append(
                    f"{record['run_dir']}: no {metric} at its training length {record['_train']}; "
                    "left out of the ratio"
                )
                continue
            value /= ref
        line = lines.setdefault(key + setting + panel, Line(key, setting, panel, family(record)))
        if record[x] not in line.xs:
            line.xs.append(record[x])
            line.samples.append([])
        line.samples[line.xs.index(record[x])].append(value)
    for line in lines.values():
        order = np.argsort(line.xs)
        line.xs = [line.xs[k] for k in order]
        line.samples = [np.asarray(line.samples[k], dtype=float) for k in order]
    orders = axis_orders(spec)
    ordered = sorted(
        lines.values(),
        key=lambda ln: sort_key(
            ln.panel + ln.key + ln.setting, panel_fields + rows + split, orders
        ),
    )
    return Layout(
        ordered, rows, split, panel_fields, metric, y, x, data, orders, sorted(set(notes))
    )


def _references(
    data: pd.DataFrame, x: str, metric: str, split: list[str], panel_fields: list[str]
) -> dict:
    """(run_dir, setting, panel) -> the run's metric at its training length: under that setting when
    the run was evaluated there, else under its plain setting of the same panel (no RoPE extension),
    else any plain one."""
    at_train = data[data[x] == data["_train"]]
    found: dict[tuple, float] = {}
    for run_dir, rows in data.groupby("run_dir"):
        mine = at_train[at_train["run_dir"] == run_dir].to_dict("records")
        plain = [r for r in mine if normalized(r.get("rope_scaling")) is None]
        for record in rows.to_dict("records"):
            setting, panel = row_key(record, split), row_key(record, panel_fields)
            same = [
                r
                for r in mine
                if row_key(r, split) == setting and row_key(r, panel_fields) == panel
            ]
            same_panel = [r for r in plain if row_key(r, panel_fields) == panel]
            for candidates in (same, same_panel, plain):
                if candidates:
                    found[(run_dir, setting, panel)] = float(candidates[0][metric])
                    break
    return found


def family_rows(lines: list[Line], split_all: bool = False) -> list[list[str]]:
    """The families of each row of panels: one row when every panel holds at most MAX_LINES lines,
    else consecutive families packed into rows of at most MAX_LINES line identities (a family with
    more is split); `split_all`: one row per family."""
    present = [f for f in FAMILIES if any(ln.family == f for ln in lines)]
    count = {f: len({ln.identity for ln in lines if ln.family == f}) for f in present}
    per_panel = max(
        (sum(1 for ln in lines if ln.panel == p) for p in {ln.panel for ln in lines}), default=0
    )
    if split_all:
        return [[f] for f in present]
    if per_panel <= MAX_LINES:
        return [present]
    groups: list[list[str]] = []
    for f in present:
        if groups and sum(count[g] for g in groups[-1]) + count[f] <= MAX_LINES:
            groups[-1].append(f)
        else:
            groups.append([f])
    return groups


def zoomed(layout: Layout) -> list[tuple]:
    """With y='ratio': the identities whose every mean stays within a factor ZOOM of 1, when there
    are at least two and some other line leaves [1/ZOOM², ZOOM²]: the lines that hold are then
    squeezed into a sliver of their row's y range, and get a row of their own (at most MAX_LINES, in
    figure order)."""
    if layout.y != "ratio":
        return []
    means = {}
    for line in layout.lines:
        means.setdefault(line.identity, []).extend(line.mean[np.isfinite(line.mean)])
    inside = [
        i for i, m in means.items() if m and max(abs(math.log(v)) for v in m) <= math.log(ZOOM)
    ]
    wide = any(m and max(abs(math.log(v)) for v in m) > 2 * math.log(ZOOM) for m in means.values())
    return inside[:MAX_LINES] if len(inside) >= 2 and wide else []


def set_identities(layout: Layout) -> None:
    """A line's identity (its colour and legend entry): the variant and the setting fields that vary
    within some panel (a RoPE extension); a field constant within each panel (the sliding panel's
    stride) is named in the panel's title instead, so a variant keeps one colour in every panel."""
    panels = {ln.panel for ln in layout.lines}
    kept = [
        k
        for k, f in enumerate(layout.split)
        if any(len({ln.setting[k] for ln in layout.lines if ln.panel == p}) > 1 for p in panels)
    ]
    rows = layout.rows
    for line in layout.lines:
        line.identity = line.key + tuple(line.setting[k] for k in kept)
        head = (
            ", ".join(label(v) for v in line.key)
            if len(rows) <= 1
            else ", ".join(f"{short_name(r)}={label(v)}" for r, v in zip(rows, line.key))
        )
        tail = (
            column_label([layout.split[k] for k in kept], tuple(line.setting[k] for k in kept), "")
            if kept
            else ""
        )
        layout.names[line.identity] = ", ".join(filter(None, [head, tail]))


def panel_setting(layout: Layout, panel: tuple) -> str:
    """The setting fields every line of a panel shares and no identity names, as a title part
    (`stride 64`)."""
    mine = [ln for ln in layout.lines if ln.panel == panel]
    fields = [
        (f, mine[0].setting[k])
        for k, f in enumerate(layout.split)
        if len({ln.setting[k] for ln in mine}) == 1
        and not any(
            len({ln.setting[k] for ln in layout.lines if ln.panel == p}) > 1
            for p in {ln.panel for ln in layout.lines}
        )
    ]
    return column_label([f for f, _ in fields], tuple(v for _, v in fields), "") if fields else ""


def group_rows(lines: list[Line], split_families: bool) -> list[list[tuple]]:
    """The line identities of each row of panels (at most MAX_LINES each), in figure order."""
    rows = []
    for families in family_rows(lines, split_families):
        identities = list(dict.fromkeys(ln.identity for ln in lines if ln.family in families))
        rows += [identities[k : k + MAX_LINES] for k in range(0, len(identities), MAX_LINES)]
    return rows
