"""What the evaluation settings of collected runs mean for a table or a figure: which rows a table
compares (RECL's ladder scores a subset of the targets and is left out), how a setting and a key
value are labelled (tables, figures and the summary `train` prints use the same labels), and the
caption sentence on how each protocol counts the attention length and how many tokens were
scored."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import yaml

from relpos_ablate.analysis.recl import fixed_context
from relpos_ablate.config.schedule import pattern_label

ATTN_LEN = {
    "non_overlapping": "segment_len + mem_len, the most keys a query sees (at a segment's end)",
    "sliding": "segment_len; a scored target sees segment_len - stride + 1 to segment_len keys",
    "xl": "mem_len, the keys every query sees (same_length)",
}
"""How each protocol counts the attention length (keys per query), for table captions."""
SETTING_LABELS = {
    "segment_len": "eval len",
    "mem_len": "mem",
    "clamp_len": "clamp",
    "same_length": "same len",
    "attn_len": "attn len",
    "protocol": "",
    "max_targets": "targets",
}
OPTIONAL_SETTINGS = ("stride", "rope_scaling", "rope_scale")
"""Setting columns left out of a label where unset (stride belongs to sliding settings only;
rope_scaling and its scale to RoPE context extension)."""
MISSING_WORDS = ("—", "none", "null")
"""How `--where` may name a missing value (an unscaled setting's rope_scaling): as a table labels
it, or its YAML spellings."""


def normalized(value: Any) -> Any:
    """A hashable group key: NaN and None are the same missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if isinstance(value, np.generic) else value


def label(value: Any) -> str:
    """A key value as shown in a table: YAML spelling for booleans and missing values."""
    value = normalized(value)
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    words = word_list(value)
    return pattern_label(words) if words else str(value)


def word_list(value: Any) -> list[str] | None:
    """A list of words stored as a JSON column (collect.flatten), e.g. model.layer_pattern; else
    None."""
    if not (isinstance(value, str) and value.startswith("[")):
        return None
    try:
        words = json.loads(value)
    except ValueError:
        return None
    return (
        words
        if isinstance(words, list) and words and all(isinstance(w, str) for w in words)
        else None
    )


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def column_label(cols: list[str], key: tuple, metric: str) -> str:
    if not cols:
        return metric
    parts = [
        (SETTING_LABELS.get(name, short_name(name)), v)
        for name, v in zip(cols, key)
        if not (name in OPTIONAL_SETTINGS and v is None)
    ]
    return ", ".join(f"{name} {label(v)}".strip() for name, v in parts)


SUMMARY_FIELDS = (
    "protocol",
    "segment_len",
    "stride",
    "mem_len",
    "clamp_len",
    "max_targets",
    "rope_scaling",
    "rope_scale",
    "split",
    "length_min",
    "length_max",
    "depth",
)
"""Fields of an eval.json setting record that can tell one evaluation of a run from another."""


def setting_labels(records: list[dict]) -> list[str]:
    """A label per eval.json setting record of one run, as table columns name settings: the protocol
    and length always (a stride, a RoPE extension where set), any other field where the records
    differ."""
    always = ("protocol", "segment_len", *OPTIONAL_SETTINGS)
    shown = [
        name
        for name in SUMMARY_FIELDS
        if any(name in r for r in records)
        and (name in always or len({normalized(r.get(name)) for r in records}) > 1)
    ]
    return [column_label(shown, tuple(r.get(name) for name in shown), "") for r in records]


def table_settings(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of settings that score every target: RECL's ladder (the settings of a run with
    eval.recl_contexts that save token losses at one of those contexts, fixed for every target:
    recl.fixed_context) is left out; any other setting, one the user asked to save its token losses
    (an exact-context ladder of App. B) included, stays a setting like any other."""
    if "token_losses" not in df or "eval.recl_contexts" not in df:
        return df
    contexts = df["eval.recl_contexts"].map(_contexts)
    ladder = df["token_losses"].notna() & contexts.map(bool)
    if {"protocol", "stride", "attn_len"} <= set(df.columns):
        at_context = [
            normalized(c) is not None and int(c) in cs for c, cs in zip(df["attn_len"], contexts)
        ]
        ladder &= fixed_context(df["protocol"], df["stride"]) & pd.Series(
            at_context, index=df.index
        )
    return df[~ladder]


def _contexts(value: Any) -> set[int]:
    """A run's eval.recl_contexts as collected (a list, or its text '[16, 32]'): the set of
    contexts."""
    value = normalized(value)
    if isinstance(value, str):
        value = yaml.safe_load(value)
    return {int(c) for c in value} if isinstance(value, (list, tuple)) else set()


def evaluation_note(data: pd.DataFrame, keys: list[str]) -> str:
    """How the shown settings were evaluated: each protocol with its attention-length count (when a
    protocol other than non_overlapping appears, or attn_len is a key), and the tokens scored."""
    note = ""
    protocols = sorted(set(data["protocol"].dropna())) if "protocol" in data else []
    if "attn_len" in keys or set(protocols) - {"non_overlapping"}:
        note += (
            " Attn len (keys per query): "
            + "; ".join(f"{p}: {ATTN_LEN[p]}" for p in protocols if p in ATTN_LEN)
            + "."
        )
    tokens = sorted(set(data["tokens"].dropna().astype(int))) if "tokens" in data else []
    if tokens:
        note += f" Tokens scored per setting: {tokens[0]:,}" + (
            f" to {tokens[-1]:,}." if len(tokens) > 1 else "."
        )
    return note


def layer_names(run: Any, n_layers: int, prefix: str = "layer ") -> list[str]:
    """`layer k` for each layer, with its kind where the run has a layer pattern (`layer 3 global`):
    run is a row of collect's frame (model.layer_pattern a JSON column)."""
    pattern = word_list(run.get("model.layer_pattern")) if hasattr(run, "get") else None
    return [
        f"{prefix}{k}" + (f" {pattern[k % len(pattern)]}" if pattern else "")
        for k in range(n_layers)
    ]
