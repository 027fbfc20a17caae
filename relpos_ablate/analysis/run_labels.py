"""A run in words, for figure titles, legends and file names: its variant (`variant_label`: the
fields that tell the runs apart, else its variant's axes, else its attention as far as it differs
from the defaults, else its name), `run_title` (the variant and the seed), `unique_titles` (a run id
added only where two runs share a title) and `run_slug` (a file-name stem)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable

import pandas as pd

from relpos_ablate.analysis.collect import run_name
from relpos_ablate.analysis.settings import label


def variant_label(run: pd.Series, keys: list[str], axes: Iterable[str] = ()) -> str:
    """The run's variant in words: `encoding=xl, mem_len=64`, the fields that tell the runs apart
    (seed excluded); for a run with nothing to tell apart, every axis of its variant (run.json),
    else its attention as far as it differs from the defaults (`terms=a, bias=alibi`), else its
    name."""
    shown = [k for k in keys if k in run.index and k not in ("experiment", "run_id")]
    shown = shown or [a for a in axes if a in run.index and a not in ("seed", "experiment")]
    parts = [f"{k.rsplit('.', 1)[-1]}={label(run[k])}" for k in shown] or attention_words(run)
    return ", ".join(parts) or run_name(run)


def attention_words(run: pd.Series) -> list[str]:
    """`field=value` for each attention field of the run's config that differs from
    AttentionConfig's default."""
    from dataclasses import fields

    from relpos_ablate.config import AttentionConfig

    words = []
    for f in fields(AttentionConfig):
        value = run.get(f"model.attention.{f.name}")
        default = f.default
        if isinstance(default, tuple):  # a list field is collected as its JSON (collect.flatten)
            default = json.dumps(list(default), separators=(",", ":"))
        if (
            value is not None
            and not (isinstance(value, float) and math.isnan(value))
            and value != default
        ):
            words.append(f"{f.name}={label(value)}")
    return words


def run_title(run: pd.Series, keys: list[str], axes: Iterable[str] = ()) -> str:
    """`encoding=xl, terms=abcd, seed=0`: the variant in words and the seed (a run id only where
    save_model_figures finds two runs with the same title)."""
    return f"{variant_label(run, keys, axes)}, seed={label(run.get('seed'))}"


def run_slug(run: pd.Series, keys: list[str]) -> str:
    """A file-name stem from the same fields: `encoding-xl_seed-0_fa7211269c`."""
    parts = [
        f"{k.rsplit('.', 1)[-1]}-{label(run[k])}"
        for k in keys
        if k in run.index and k != "experiment"
    ]
    parts += [f"seed-{label(run.get('seed'))}", str(run["run_id"])]
    return "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", part) for part in parts)


def unique_titles(
    runs: list[pd.Series], keys: list[str], axes: Iterable[str] = ()
) -> dict[str, str]:
    """run_dir -> run_title; the run id is added only to titles two runs share (runs otherwise
    identical)."""
    titles = {run["run_dir"]: run_title(run, keys, axes) for run in runs}
    counts = Counter(titles.values())
    return {
        run["run_dir"]: titles[run["run_dir"]]
        + (f" ({run['run_id']})" if counts[titles[run["run_dir"]]] > 1 else "")
        for run in runs
    }
