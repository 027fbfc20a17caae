"""How long the runs a grid still has to train will take (`grid --dry-run`).

From the spec's finished runs where there are any: each one's wall time per training step (start-up,
training and evaluation together), the mean per variant (seeds aside), else over every finished run
of the spec. Else from `benchmarks/train_step.py --spec`'s measurement
(results/<spec>/train_step.json: seconds per training step per variant, training only). A run to
resume or retry counts the steps its status has left. Runs are packed on the slots as the runner
does (the next run on the first free slot), so the estimate is the longest slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.runner.grid import format_variant
from relpos_ablate.runner.store import RUNNABLE


@dataclass(frozen=True)
class Estimate:
    seconds: float  # wall time of the remaining runs on the slots
    runs: int  # runs to train or resume
    source: str  # where the seconds per step come from


def _variant(run) -> str:
    return format_variant({k: v for k, v in run.variant.items() if k != "seed"})


def _finished(plans) -> dict[str, list[float]]:
    """Seconds per step of the spec's done runs, per variant."""
    per_variant: dict[str, list[float]] = {}
    for plan in plans:
        status = rundir.read_status(plan.run_dir) or {}
        wall, steps = status.get("wall_time_s"), status.get("step")
        if (
            status.get("state") == "done"
            and isinstance(wall, (int, float))
            and isinstance(steps, int)
            and steps > 0
        ):
            per_variant.setdefault(_variant(plan.run), []).append(wall / steps)
    return per_variant


def _measured(results: Path, spec_name: str) -> dict[str, float]:
    try:
        data = json.loads((results / spec_name / "train_step.json").read_text())
        return {row["variant"]: float(row["seconds_per_step"]) for row in data["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def estimate(plans, results: Path, spec_name: str, n_slots: int) -> Estimate | None:
    """The remaining runs' wall time (module docstring); None where nothing to estimate from."""
    todo = [plan for plan in plans if plan.action in RUNNABLE]
    if not todo:
        return Estimate(0.0, 0, "nothing to run")
    finished = _finished(plans)
    if finished:
        per_step = {variant: sum(v) / len(v) for variant, v in finished.items()}
        fallback = sum(sum(v) for v in finished.values()) / sum(len(v) for v in finished.values())
        source = f"{sum(len(v) for v in finished.values())} finished run(s) of this spec"
    else:
        per_step = _measured(results, spec_name)
        if not per_step:
            return None
        fallback = sum(per_step.values()) / len(per_step)
        source = f"{results / spec_name / 'train_step.json'} (training steps only)"
    durations = []
    for plan in todo:
        status = rundir.read_status(plan.run_dir) or {}
        # resumed from last.ckpt
        done_steps = status.get("step") if isinstance(status.get("step"), int) else 0
        remaining = max(plan.run.config.train.max_steps - done_steps, 0)
        durations.append(per_step.get(_variant(plan.run), fallback) * remaining)
    slots = [0.0] * max(n_slots, 1)
    for seconds in durations:  # in the runner's order: the next run on the first free slot
        slots[slots.index(min(slots))] += seconds
    return Estimate(max(slots), len(todo), source)
