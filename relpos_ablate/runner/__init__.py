"""Grid spec -> runs -> worker processes -> run directories.

grid.py parses and expands a YAML grid (axes.py its axes, presets.py the encodings), store.py owns
the run directories (status, the per-run lock, what each run needs next), worker.py starts and stops
one run's process, local.py schedules runs on device slots, slurm.py submits them through submitit,
and display.py draws the table. `relpos-ablate grid` and `relpos-ablate status` (cli/grid.py) call
these.
"""

from relpos_ablate.runner.grid import (
    GridSpec,
    GridSpecError,
    LauncherConfig,
    PlannedRun,
    load_grid,
    parse_grid,
)
from relpos_ablate.runner.local import (
    GridOutcome,
    LocalRunner,
    Slot,
    cpu_slots,
    gpu_slots,
    run_local,
)
from relpos_ablate.runner.store import plan_grid

__all__ = [
    "GridOutcome",
    "GridSpec",
    "GridSpecError",
    "LauncherConfig",
    "LocalRunner",
    "PlannedRun",
    "Slot",
    "cpu_slots",
    "gpu_slots",
    "load_grid",
    "parse_grid",
    "plan_grid",
    "run_local",
]
