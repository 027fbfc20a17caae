"""The samples every section of the `alibi_extrapolation_cpu` report tests (extrapolation.py): the
finished evaluations (`frame`), run dir -> ppl of one encoding under one setting (`per_seed`: the
unit a paired test pairs on), each run's ppl at nL over its ppl at L (`ratios`), and how a section
writes its lengths (`label_length`: L, 2L, ...), its table rows (`verdicts`) and its family's lines
(`family_note`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import normalized
from relpos_ablate.analysis.stats import Comparison, Family
from relpos_ablate.config import ConfigError


def frame(df: pd.DataFrame) -> pd.DataFrame:
    """The finished evaluations: one row per (run, setting) with a perplexity (stride and RoPE
    extension None where unset, max_targets 0)."""
    if "encoding" not in df:
        raise ConfigError(
            "report", "alibi_extrapolation_cpu's report needs the `encoding` axis of its grid"
        )
    done = df[
        (df["status"] == "done") & np.isfinite(pd.to_numeric(df["ppl"], errors="coerce"))
    ].copy()
    # None where unset (object columns: NaN is no key)
    for key, kind in (("stride", int), ("rope_scaling", str)):
        values = done[key] if key in done else [None] * len(done)
        done[key] = pd.Series(
            [None if normalized(v) is None else kind(v) for v in values],
            index=done.index,
            dtype=object,
        )
    done["max_targets"] = (
        pd.to_numeric(done.get("max_targets", 0), errors="coerce").fillna(0).astype(int)
    )
    return done


SETTING = ["encoding", "protocol", "segment_len", "max_targets", "stride", "rope_scaling"]
_settings: list = [None, {}]  # (the frame last indexed, its rows by setting)


def per_seed(
    data: pd.DataFrame,
    encoding: str,
    protocol: str,
    length: int,
    stride=None,
    rope_scaling=None,
    max_targets: int = 0,
) -> dict[str, float]:
    """run dir -> ppl of one encoding under one setting (the run names the unit a test pairs on), in
    the frame's row order. The report asks ~800 times of one `frame`: its rows are grouped by
    setting once (the frame is not changed after `frame` made it), not filtered per call (4 s of the
    report's 11)."""
    if _settings[0] is not data:
        grouped: dict[tuple, dict[str, float]] = {}
        for *key, run, ppl in zip(*(data[c] for c in SETTING), data["run_dir"], data["ppl"]):
            # equal numbers hash alike (512 and 512.0)
            grouped.setdefault(tuple(key), {})[run] = float(ppl)
        _settings[:] = [data, grouped]
    return dict(
        _settings[1].get((encoding, protocol, length, max_targets, stride, rope_scaling), {})
    )


def ratios(
    data: pd.DataFrame, encoding: str, protocol: str, length: int, train: int, **setting
) -> dict[str, float]:
    """Per run: ppl at `length` over the same run's ppl at the training length under the plain
    setting of the protocol (sliding at L with stride L scores exactly as non-overlapping at L)."""
    stride = train if protocol == "sliding" else None
    at = per_seed(data, encoding, protocol, length, **setting)
    base = per_seed(data, encoding, protocol, train, stride=stride)
    return {run: at[run] / base[run] for run in sorted(at) if run in base}


def family_note(family: Family) -> str:
    """The lines under a section's table that name its family, its correction and its power."""
    return f"\n{family.summary()}\n"


def verdicts(row: list) -> str:
    """A table row's cells, read once their family is complete: text as it is, a comparison as its
    short verdict, (text, comparison) as `text (short verdict)`."""
    return " | ".join(
        f"{cell[0]} ({cell[1].short()})"
        if isinstance(cell, tuple)
        else cell.short()
        if isinstance(cell, Comparison)
        else str(cell)
        for cell in row
    )


def mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan


def label_length(length: int, train: int) -> str:
    if length == train:
        return "L"
    return f"{length // train}L" if length % train == 0 else str(length)
