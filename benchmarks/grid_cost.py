"""What a grid spec costs on one device from measured step times: `grid --dry-run`'s estimate
(relpos_ablate/runner/estimate.py) on one slot, fed the seconds per step of each run's encoding,
scaled to the run's own size by its model FLOPs per step (benchmarks/mfu.py: the same MFU assumed).
benchmarks/train_step.py --presets and the GPU check's summary print it for the paper-scale specs.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from mfu import step_flops
from relpos_ablate.config import RunConfig
from relpos_ablate.io import atomic_write_text
from relpos_ablate.runner.estimate import estimate
from relpos_ablate.runner.grid import format_variant, load_grid
from relpos_ablate.runner.store import plan_grid

COST_SPECS = "experiments/xl_table6.yaml,experiments/alibi_table2.yaml"
WT103_VOCAB = 267735  # WikiText-103's word vocabulary (Transformer-XL's and ALiBi's)
REPO = Path(__file__).resolve().parent.parent


def spec_cost(
    spec_path: str,
    seconds_per_step: float | Mapping[str, float],
    scale: Callable[[RunConfig], float] = lambda config: 1.0,
) -> dict:
    """Device-hours of a grid spec on one device: Σ over its runs of max_steps × seconds per step
    (one number, or the run's `encoding:` word's) × scale(run config), summed by `grid --dry-run`'s
    estimate on one slot (the same per-variant table it reads from train_step.json)."""
    spec = load_grid(spec_path)
    rows = {}
    for run in spec.runs:
        word = run.variant.get("encoding")
        if isinstance(seconds_per_step, Mapping) and word not in seconds_per_step:
            raise KeyError(
                f"no step time for encoding {word!r} (measured: {', '.join(seconds_per_step)})"
            )
        per_step = (
            seconds_per_step[word] if isinstance(seconds_per_step, Mapping) else seconds_per_step
        )
        variant = format_variant({k: v for k, v in run.variant.items() if k != "seed"})
        rows[variant] = per_step * scale(run.config)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp)
        table = [{"variant": v, "seconds_per_step": s} for v, s in rows.items()]
        atomic_write_text(
            results / spec.name / "train_step.json", json.dumps({"rows": table}) + "\n"
        )
        guess = estimate(plan_grid(spec, results), results, spec.name, 1)
    return {
        "spec": spec.name,
        "runs": guess.runs,
        "steps": sum(run.config.train.max_steps for run in spec.runs),
        "device_hours": guess.seconds / 3600,
        "seconds_per_step": rows,
    }


def costs(rows: list[dict], specs: list[str], vocab: int, measured_flops: int) -> list[dict]:
    """spec_cost of each spec from the rows' step times, measured at `measured_flops` per step
    (module docstring; `vocab` for a spec whose data sets it); a spec with an encoding not measured
    is named with what is missing."""
    fastest: dict[str, float] = {}
    for row in rows:
        if "step_s" in row:
            fastest[row["scheme"]] = min(fastest.get(row["scheme"], row["step_s"]), row["step_s"])

    def scale(config: RunConfig) -> float:
        model = config.model
        if not model.vocab_size:
            model = dataclasses.replace(model, vocab_size=vocab)
        t = config.train
        return step_flops(model, t.segment_len, t.batch_size) / measured_flops

    found = []
    for path in specs:
        path = path if Path(path).exists() else str(REPO / path)  # the default: from any folder
        try:
            found.append(spec_cost(path, fastest, scale))
        except KeyError as err:
            found.append({"spec": Path(path).stem, "missing": err.args[0]})
    return found


def cost_lines(found: list[dict]) -> list[str]:
    """Markdown of the specs' device-hours (costs())."""
    lines = []
    for c in found:
        if "missing" in c:
            lines.append(f"- {c['spec']}: no estimate, {c['missing']}")
        else:
            lines.append(
                f"- {c['spec']}: {c['runs']} runs, {c['steps']:,} steps: "
                f"{c['device_hours']:,.1f} device-hours on this device (each run's encoding's "
                "step time scaled by the run's model FLOPs per step: the same MFU assumed)"
            )
    return lines
