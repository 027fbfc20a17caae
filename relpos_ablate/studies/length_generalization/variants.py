"""How the study's figures name and style its variants: the fields that tell the finished runs
apart, the task excluded (`with_variants`, in the spec's order), a variant in words ('RoPE
(randomized)', else field=value: `variant_words`), and a colour and marker per encoding, dashed for
randomized positions (`variant_styles`)."""

from __future__ import annotations

import pandas as pd

from relpos_ablate.analysis.settings import label
from relpos_ablate.analysis.table_options import axis_orders, default_rows, read_spec
from relpos_ablate.analysis.tables import row_key, sort_key
from relpos_ablate.config import ConfigError
from relpos_ablate.studies.length_generalization.table import variant_name

TASK = "data.task"
POSITIONS = "model.attention.positions"
COLORS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9", "k", "C7")
"""A colour per encoding: matplotlib's ten distinct hues and black. Not tab20: its paired light and
dark hues made unrelated encodings (NoPE and the sinusoid, T5 and ALiBi) look like variants of one
(issue 58)."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
"""A marker per encoding as well, so that lines of one colour (the 12th encoding on) still differ
and lines drawn on each other show every marker."""


def with_variants(
    frame: pd.DataFrame, df: pd.DataFrame
) -> tuple[pd.DataFrame, list[str], list[tuple]]:
    """`frame` with a `variant` column (the values of the fields that tell runs apart, the task
    excluded), those fields, and the variants in the spec's order."""
    runs = finished_runs_frame(df).drop_duplicates("run_dir")
    # one variant: named by its encoding
    keys = (
        [k for k in default_rows(runs) if k not in (TASK, "experiment")]
        or [k for k in ("encoding", POSITIONS) if k in runs]
        or ["experiment"]
    )
    # fields an encoding fixes (T5's buckets, zipped with it) name no variant of their own
    if "encoding" in keys:
        keys = [
            k
            for k in keys
            if k in ("encoding", POSITIONS)
            or k not in runs
            or runs.groupby("encoding")[k].nunique(dropna=False).max() > 1
        ]
        keys = [k for k in ("encoding", POSITIONS) if k in keys] + [
            k for k in keys if k not in ("encoding", POSITIONS)
        ]
    frame = frame.assign(
        variant=[row_key(r, keys) for _, r in frame[[k for k in keys if k in frame]].iterrows()]
    )
    orders = axis_orders(read_spec(df))
    return frame, keys, sorted(set(frame["variant"]), key=lambda v: sort_key(v, keys, orders))


def finished_runs_frame(df: pd.DataFrame) -> pd.DataFrame:
    runs = df[df["status"] == "done"] if "status" in df else df
    if runs.empty:
        raise ConfigError("kind", "no finished runs to draw")
    return runs


def _variant_label(keys: list[str], value: tuple) -> str:
    return (
        ", ".join(label(v) for v in value)
        if len(keys) == 1
        else ", ".join(f"{k.rsplit('.', 1)[-1]}={label(v)}" for k, v in zip(keys, value))
    )


def variant_words(keys: list[str], value: tuple) -> str:
    """A variant as titles and legends name it: the study's (encoding, positions) in words ('RoPE
    (randomized)'), other fields as field=value."""
    fields = dict(zip(keys, value))
    if "encoding" in fields and set(keys) <= {"encoding", POSITIONS}:
        return variant_name(fields["encoding"], fields.get(POSITIONS))
    return _variant_label(keys, value)


def variant_styles(keys: list[str], variants: list[tuple]) -> dict[tuple, tuple]:
    """(colour, line style, marker) per variant: a colour and a marker per encoding and dashes for
    randomized positions when the variants are (encoding, positions), so a randomized variant shares
    its sequential twin's colour and marker and no other variant does; else a look each."""
    if keys and keys[0] == "encoding":
        encodings = list(dict.fromkeys(v[0] for v in variants))
        styles = {}
        for v in variants:
            color, marker = _look(encodings.index(v[0]))
            randomized = dict(zip(keys, v)).get(POSITIONS) == "randomized"
            styles[v] = (color, "--" if randomized else "-", marker)
        return styles
    return {v: (_look(k)[0], "-", _look(k)[1]) for k, v in enumerate(variants)}


def _look(k: int) -> tuple[str, str]:
    """The k-th (colour, marker): no two alike for k < len(COLORS) * len(MARKERS)."""
    return COLORS[k % len(COLORS)], MARKERS[k % len(MARKERS)]
