"""Results directory -> one pandas DataFrame: a row per (run, evaluation setting).

A results dir holds run dirs (`<experiment>/<run_id>/`, relpos_ablate/rundir.py), possibly nested
one level deeper (`results/` holding several experiments). The collector never crashes on what it
finds there: a run whose files are missing or truncated still gets a row (its status, NaN metrics),
and every problem is listed in `df.attrs["problems"]` as one line `path: what is wrong`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from relpos_ablate import rundir
from relpos_ablate.analysis import recl
from relpos_ablate.config.yaml_io import load_yaml
from relpos_ablate.io import read_json

SETTING_FIELDS = (
    "protocol",
    "segment_len",
    "stride",
    "mem_len",
    "clamp_len",
    "same_length",
    "attn_len",
    "max_targets",
    "rope_scaling",
    "rope_scale",
    "split",
)
"""Evaluation-setting columns, in this order (attn_len: the keys a query sees under its protocol;
rope_scale: the factor s of the setting's RoPE context extension, resolved; split: the text split
scored, valid or test)."""
NOT_SETTING_FIELDS = (
    "metrics",
    "error",
    "diagnostics",
    "position_loss",
    "token_losses",
    "documents",
)
"""Keys of a setting record that are not plain setting columns (diagnostics: analysis/diagnostics.py
reads them)."""
RUN_COLUMNS = (
    "run_id",
    "experiment",
    "status",
    "reason",
    "seed",
    "wall_time_s",
    "step",
    "max_steps",
    "stopped",
)
"""Per-run columns first in every collected frame (stopped: why training ended, with
train.stop_at_exact_match)."""


def flatten(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b.c": leaf}; lists become compact JSON strings so columns stay
    hashable."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        elif isinstance(value, (list, tuple)):
            flat[path] = json.dumps(value, separators=(",", ":"), default=str)
        else:
            flat[path] = value
    return flat


def _read_mapping(path: Path, problems: list[str], required: bool) -> dict | None:
    """A JSON or YAML mapping, or None with a problem line when it is missing, truncated or not a
    mapping."""
    if not path.exists():
        if required:
            problems.append(f"{path}: missing")
        return None
    if path.suffix == ".json":
        data = read_json(path)
    else:
        try:
            data = load_yaml(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            data = None
    if not isinstance(data, dict):
        problems.append(f"{path}: unreadable (truncated or not a mapping); ignored")
        return None
    return data


def _run_fields(run_dir: Path, problems: list[str]) -> dict[str, Any]:
    """The per-run columns: ids, status, variant axes, flattened config (no evaluation yet)."""
    meta = _read_mapping(run_dir / rundir.RUN_INFO, problems, required=False) or {}
    status = _read_mapping(run_dir / rundir.STATUS, problems, required=True) or {}
    config = _read_mapping(run_dir / rundir.CONFIG, problems, required=True) or {}
    row: dict[str, Any] = {
        "run_id": meta.get("run_id", run_dir.name),
        # none for a run trained by `train` alone: its folder is no experiment
        "experiment": meta.get("experiment"),
        "status": status.get("state", "unknown"),
        "reason": status.get("reason"),
        "seed": config.get("seed", np.nan),
        "wall_time_s": status.get("wall_time_s", np.nan),
        "step": status.get("step", np.nan),
        "max_steps": status.get("max_steps", np.nan),
        "stopped": status.get("stopped"),
        "run_dir": str(run_dir),
        "spec": meta.get("spec"),
        # the plan's record at the run's first launch, and when it ended (config/plan.py)
        "launched_at": meta.get("launched_at"),
        "finished_at": status.get("finished_at"),
        "analysis": json.dumps(meta["analysis"], sort_keys=True) if "analysis" in meta else None,
    }
    config_columns = flatten(config)
    variant = meta.get("variant") or {}
    if not isinstance(variant, dict):
        problems.append(f"{run_dir / rundir.RUN_INFO}: 'variant' is not a mapping; ignored")
        variant = {}
    for axis, value in variant.items():
        # a config path as axis: the resolved value wins
        if axis not in config_columns and axis not in row:
            row[axis] = json.dumps(value) if isinstance(value, (list, dict)) else value
    row.update(config_columns)
    row["_variant_axes"] = [a for a in variant if a != "seed"]
    return row


def _setting_rows(run_dir: Path, status: str, problems: list[str]) -> tuple[list[dict], dict]:
    """One dict per evaluation setting in eval.json (setting fields + metrics), and the run-level
    fields (main_metric, the reference's name and metrics)."""
    path = run_dir / rundir.EVAL
    if not path.exists():
        if status == "done":
            problems.append(f"{path}: missing although the run is done")
        return [], {}
    data = _read_mapping(path, problems, required=True)
    settings = (data or {}).get("settings")
    if data is not None and not isinstance(settings, list):
        problems.append(f"{path}: no 'settings' list; ignored")
    if not isinstance(settings, list):
        return [], {}
    rows = []
    for k, setting in enumerate(settings):
        metrics = setting.get("metrics") if isinstance(setting, dict) else None
        if not isinstance(metrics, dict):
            problems.append(f"{path}: settings[{k}] has no 'metrics' mapping; ignored")
            continue
        # older files: defaults
        row = {name: rundir.record_value(setting, name, data) for name in SETTING_FIELDS}
        # its place in eval.json: loss by position and token losses are found by it
        row["eval_setting"] = k
        row["token_losses"] = setting.get("token_losses")
        # fields a setting record adds (e.g. an example task's length_min, length_max, depth), as
        # written
        row.update(
            {
                # a list (longrope's factors) as one word, so two settings stay two cells
                name: " ".join(map(str, value)) if isinstance(value, list) else value
                for name, value in setting.items()
                if name not in (*row, *NOT_SETTING_FIELDS)
                and (value is None or isinstance(value, (str, int, float, bool, list)))
            }
        )
        row["eval_error"] = setting.get("error")  # a setting the run could not evaluate, and why
        if (
            row["attn_len"] is None
            and isinstance(row["segment_len"], int)
            and isinstance(row["mem_len"], int)
        ):
            row["attn_len"] = row["segment_len"] + row["mem_len"]
        row.update({name: _number(value) for name, value in metrics.items()})
        row["_metrics"] = list(metrics)
        rows.append(row)
    return rows, {
        "main_metric": data.get("main_metric"),
        **_reference_fields(data.get("reference")),
    }


def _add_ladder_losses(run_dir: Path, rows: list[dict], problems: list[str]) -> None:
    """ladder_loss and ladder_targets on each of a run's fixed-context settings that saved their
    token losses (sliding windows at stride 1, or memory with protocol xl: every target sees exactly
    attn_len tokens) when it has two or more: the mean loss on the targets with the longest such
    context in their stream, which every one of them scores with its full context (RECL's shared
    targets; analysis/recl.py). Unlike ppl, these compare contexts on the same targets, without each
    stream's first window; kept in summary.csv, they outlive the token-loss files."""
    ladder = [
        row
        for row in rows
        if isinstance(row.get("token_losses"), str)
        and isinstance(row.get("attn_len"), int)
        and recl.fixed_context(row.get("protocol"), row.get("stride"))
    ]
    if len(ladder) < 2:
        return
    arrays = rundir.read_token_losses(run_dir)
    if arrays is None or any(row["token_losses"] not in arrays for row in ladder):
        problems.append(f"{run_dir / rundir.TOKEN_LOSSES}: missing or unreadable; no ladder_loss")
        return
    longest = max(row["attn_len"] for row in ladder)
    for row in ladder:
        shared = recl.shared_targets(
            np.asarray(arrays[row["token_losses"]], dtype=np.float64), longest
        )
        row["ladder_loss"], row["ladder_targets"] = float(shared.mean()), int(shared.size)


def _reference_fields(reference) -> dict[str, Any]:
    """eval.json's reference (unigram or chance) as columns: reference, reference_<metric>."""
    if not isinstance(reference, dict) or not isinstance(reference.get("metrics"), dict):
        return {}
    fields = {f"reference_{name}": _number(value) for name, value in reference["metrics"].items()}
    return {"reference": reference.get("name"), **fields}


def _number(value: Any) -> float:
    """Metric values as floats; anything non-numeric (null, a string) becomes NaN, never a crash."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


def run_name(run: pd.Series) -> str:
    """What a run goes by in a title: its experiment, or its run dir's name (run_id) without one."""
    return str(run["experiment"]) if isinstance(run.get("experiment"), str) else str(run["run_id"])


def run_names(frame: pd.DataFrame) -> str:
    """The names of a frame's runs for a title: their experiments (and run dir names), sorted, once
    each."""
    return ", ".join(
        sorted({run_name(run) for _, run in frame.drop_duplicates("run_dir").iterrows()})
    )


def collect_run(run_dir: Path, problems: list[str]) -> list[dict]:
    """All rows of one run dir: one per evaluation setting, or one row with NaN metrics."""
    base = _run_fields(run_dir, problems)
    settings, run_level = _setting_rows(run_dir, base["status"], problems)
    _add_ladder_losses(run_dir, settings, problems)
    base.update({"main_metric": None, **run_level})
    return [{**base, **setting} for setting in settings] or [base]


def collect(results_dir: str | Path) -> pd.DataFrame:
    """One row per (run, evaluation setting) for every run dir at or below `results_dir`.

    Columns: run_id, experiment (None for a run trained by `train` alone, without run.json), status,
    reason, seed, wall_time_s, step, max_steps, stopped (exact_match or max_steps: why training
    ended, when train.stop_at_exact_match is set), the variant axes from run.json, the evaluation
    setting (protocol, segment_len, stride, mem_len, clamp_len, same_length, attn_len, max_targets,
    rope_scaling, rope_scale, split), the metrics (ppl, acc, loss, bpc, tokens, ... as eval.json has
    them), main_metric, eval_setting (the setting's index in eval.json), token_losses (its array in
    token_losses.npz, if saved), reference and reference_<metric> (the unigram or chance baseline),
    eval_error (why a setting was not evaluated, if so), run_dir, spec (the grid spec path from
    run.json), launched_at (run.json: the run's first launch), finished_at (status.json), analysis
    (run.json: the spec's analysis plan at the first launch, JSON; config/plan.py), then every
    flattened config field (`model.attention.terms`, ...). Runs without
    eval.json (queued, running, failed, broken) get one row with NaN metrics. The loss by position:
    analysis.positions.position_frame(df); token losses: analysis.recl.token_loss_frame(df).

    attrs: "problems" (one line each), "variant_axes", "metrics", "results_dir".
    """
    root = Path(results_dir)
    if not root.is_dir():
        frame = pd.DataFrame(columns=list(RUN_COLUMNS))
        frame.attrs.update(
            problems=[f"{root}: not a directory"],
            variant_axes=[],
            metrics=[],
            results_dir=str(root),
        )
        return frame
    found = rundir.find_run_dirs(root)
    problems = list(found.problems)
    rows = [row for run_dir in found.runs for row in collect_run(run_dir, problems)]
    axes = list(dict.fromkeys(a for row in rows for a in row.pop("_variant_axes")))
    metric_names = list(dict.fromkeys(m for row in rows for m in row.pop("_metrics", ())))
    frame = pd.DataFrame(rows, columns=_column_order(rows, axes, metric_names))
    frame.attrs.update(
        problems=problems, variant_axes=axes, metrics=metric_names, results_dir=str(root)
    )
    return frame


def _column_order(rows: list[dict], axes: list[str], metrics: list[str]) -> list[str]:
    """Run columns, variant axes, setting, metrics, main_metric, then config fields in file
    order."""
    head = [
        *RUN_COLUMNS,
        *axes,
        *SETTING_FIELDS,
        *metrics,
        "main_metric",
        "eval_setting",
        "token_losses",
        "eval_error",
        "run_dir",
        "spec",
        "launched_at",
        "finished_at",
        "analysis",
    ]
    rest = list(dict.fromkeys(k for row in rows for k in row if k not in head))
    return head + rest


def read_summary(path) -> pd.DataFrame:
    """A committed summary.csv as the frame `collect` gave (what the report functions and the
    extrapolation figure read), its attrs restored from collect's column order: run columns, variant
    axes, setting fields, metrics, then main_metric (analysis/collect.py, _column_order)."""
    frame = pd.read_csv(path)
    columns = list(frame.columns)
    first_setting = min(
        (columns.index(f) for f in SETTING_FIELDS if f in columns), default=len(columns)
    )
    last_setting = max((columns.index(f) for f in SETTING_FIELDS if f in columns), default=-1)
    end = columns.index("main_metric") if "main_metric" in columns else last_setting + 1
    frame.attrs.update(
        problems=[],
        results_dir=str(Path(path).parent) if isinstance(path, (str, Path)) else "",
        variant_axes=[c for c in columns[:first_setting] if c not in RUN_COLUMNS],
        metrics=columns[last_setting + 1 : end],
    )
    return frame


def merge_frames(found: pd.DataFrame, earlier: pd.DataFrame) -> pd.DataFrame:
    """The rows of `found` plus those of `earlier` (a summary.csv read back) for the runs `found`
    lacks.

    A committed study keeps its summary.csv, not its run dirs: seeds or runs added later are
    collected from their run dirs and merged with it. A run in both takes its rows from `found` (the
    run dirs are the source). Columns in collect's order (_column_order) over the union of both;
    attrs: the union of both."""
    kept = earlier[~earlier["run_id"].isin(set(found["run_id"]))]
    merged = _concat([earlier, found], [kept, found])
    merged.attrs.update(
        problems=list(found.attrs.get("problems", [])),
        results_dir=found.attrs.get("results_dir", ""),
    )
    return merged


def pool_frames(frames: list[pd.DataFrame], sources: list[str]) -> pd.DataFrame:
    """Every row of every frame (one per source), each marked with its source in column `_source`:
    a run in two sources is there twice, for analysis/sources.py one_copy_per_run to merge. Columns
    in collect's order over the union; attrs: the union (results_dir: the first frame's)."""
    pooled = _concat(frames, frames)
    # after the concat, whose copy leaves one block per dtype: a column added then is no insert
    # into a fragmented frame
    pooled["_source"] = np.repeat(sources, [len(frame) for frame in frames]).astype(object)
    pooled.attrs.update(
        problems=[line for frame in frames for line in frame.attrs.get("problems", [])],
        results_dir=frames[0].attrs.get("results_dir", "") if frames else "",
    )
    return pooled


def _concat(frames: list[pd.DataFrame], parts: list[pd.DataFrame]) -> pd.DataFrame:
    """The rows of `parts` in one frame, columns in collect's order (_column_order) over the union;
    attrs variant_axes and metrics: the union over `frames`, in their order."""
    axes, metrics = (
        [*dict.fromkeys(name for frame in frames for name in frame.attrs.get(key, []))]
        for key in ("variant_axes", "metrics")
    )
    present = [row for part in parts if len(part) for row in [dict.fromkeys(part.columns)]]
    columns = [c for c in _column_order(present, axes, metrics) if any(c in row for row in present)]
    parts = [part.reindex(columns=columns) for part in parts if len(part)]
    merged = (
        pd.concat(parts, ignore_index=True).copy()
        if parts
        else pd.DataFrame(columns=list(RUN_COLUMNS))
    )
    merged.attrs.update(variant_axes=axes, metrics=metrics)
    return merged
