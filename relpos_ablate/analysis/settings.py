"""What the evaluation settings of collected runs mean for a table or a figure: which rows a table
compares (RECL's ladder scores a subset of the targets and is left out), and the caption sentence on
how each protocol counts the attention length and how many tokens were scored."""

from __future__ import annotations

import pandas as pd

ATTN_LEN = {
    "non_overlapping": "segment_len + mem_len, the most keys a query sees (at a segment's end)",
    "sliding": "segment_len; a scored target sees segment_len - stride + 1 to segment_len keys",
    "xl": "mem_len, the keys every query sees (same_length)",
}
"""How each protocol counts the attention length (keys per query), for table captions."""


def table_settings(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of settings that score every target: RECL's ladder (settings saving token losses) is left out."""
    if "token_losses" not in df:
        return df
    return df[df["token_losses"].isna()]


def evaluation_note(data: pd.DataFrame, keys: list[str]) -> str:
    """How the shown settings were evaluated: each protocol with its attention-length count (when a
    protocol other than non_overlapping appears, or attn_len is a key), and the tokens scored."""
    note = ""
    protocols = sorted(set(data["protocol"].dropna())) if "protocol" in data else []
    if "attn_len" in keys or set(protocols) - {"non_overlapping"}:
        note += " Attn len (keys per query): " + "; ".join(f"{p}: {ATTN_LEN[p]}" for p in protocols if p in ATTN_LEN) + "."
    tokens = sorted(set(data["tokens"].dropna().astype(int))) if "tokens" in data else []
    if tokens:
        note += f" Tokens scored per setting: {tokens[0]:,}" + (f" to {tokens[-1]:,}." if len(tokens) > 1 else ".")
    return note
