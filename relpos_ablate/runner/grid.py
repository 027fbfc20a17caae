"""Grid specs: a YAML file -> the list of runs it describes, every error reported before launch.

A spec looks like

    name: xl_terms             # results go to <results>/<name>/<run_id>/ (default: the file's name)
    base: {model: {...}, train: {...}}   # a run config, or a path to one (relative to the spec)
    grid:                      # key path (or `encoding`, a preset) -> values; Cartesian product
      encoding: [xl, shaw, rope]
      model.mem_len: [0, 64]
    zip:                       # axes varied together (one group per list item)
      - {train.segment_len: [32, 64], data.offset: [8, 16]}
    exclude:                   # combinations to drop
      - {encoding: rope, model.mem_len: 64}
    seeds: [0, 1, 2]
    launcher: {partition: gpu, time: 240}   # SLURM settings (LauncherConfig)

Seeds are the outermost loop, so a grid stopped half way has every variant of the first seeds. A
run's id is `run_id(config)`: two specs that produce the same config share the run. Spec errors
(unknown key path, empty axis, a value the config rejects, duplicate runs) are all collected and
raised together as one GridSpecError, one line each.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relpos_ablate.config import ConfigError, RunConfig, from_dict, read_yaml, run_id
from relpos_ablate.config.base import ConfigErrors, check_range
from relpos_ablate.config.plan import Plan, parse_plan, record
from relpos_ablate.config.presets import encoding_fields
from relpos_ablate.config.registry import import_modules
from relpos_ablate.config.schedule import shown_value
from relpos_ablate.config.yaml_io import set_path
from relpos_ablate.io import now_iso
from relpos_ablate.runner.axes import (
    ENCODING,
    Axis,
    check_axis_keys_unique,
    checked_excludes,
    collect_error,
    combinations,
    declared_axes,
    grid_axes,
    seed_axes,
    zip_axes,
)

SPEC_KEYS = (
    "name",
    "description",
    "base",
    "grid",
    "zip",
    "exclude",
    "seeds",
    "launcher",
    "table",
    "plots",
    "analysis",
)
RUN_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig))
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class LauncherConfig:
    """SLURM settings for `--launcher slurm`: a `launcher:` block in the spec, overridden by CLI
    flags."""

    partition: str = ""
    """SLURM partition (empty: the cluster's default)."""
    account: str = ""
    """SLURM account charged for the jobs (empty: your default account)."""
    qos: str = ""
    """SLURM quality of service (empty: the default)."""
    time: int = 240
    """Wall-clock limit per job in minutes; a longer run is requeued and resumes from last.ckpt."""
    gpus: int = 1
    """GPUs per node of a job (each job trains one run, data-parallel over all its GPUs: one SLURM
    task per GPU; 0: a CPU job of one task)."""
    nodes: int = 1
    """Nodes per job: one run spans nodes x gpus GPUs."""
    cpus: int = 8
    """CPU cores per task (torch threads and data loading)."""
    mem_gb: int = 0
    """Memory per node in GB (0: the partition's default)."""
    array_parallelism: int = 64
    """At most this many jobs of the array run at the same time."""
    max_timeouts: int = 10
    """Times a job that reaches its time limit is requeued before it stays interrupted."""
    setup: tuple[str, ...] = ()
    """Shell lines run before each job, e.g. 'module load cuda' or 'source .venv/bin/activate'."""

    def __post_init__(self):
        for name in (
            "time",
            "gpus",
            "nodes",
            "cpus",
            "mem_gb",
            "array_parallelism",
            "max_timeouts",
        ):
            check_range(
                name,
                getattr(self, name),
                low=0 if name in ("gpus", "mem_gb", "max_timeouts") else 1,
            )


@dataclass(frozen=True)
class PlannedRun:
    """One run of a grid: its id, the axis values that produced it (as written) and its config."""

    run_id: str
    variant: dict[str, Any]
    config: RunConfig


@dataclass(frozen=True)
class GridSpec:
    """A parsed, fully validated grid: every run resolved, no duplicates."""

    name: str
    runs: tuple[PlannedRun, ...]
    axes: tuple[str, ...]
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    path: Path | None = None
    analysis: Plan | None = None
    """The `analysis:` block (config/plan.py): the tests declared before the runs."""
    seeds: tuple[int, ...] = ()

    def analysis_record(self) -> dict | None:
        """What each run launched now records of the plan in its run.json (None: no plan)."""
        return None if self.analysis is None else record(self.analysis, self.seeds, now_iso())


class GridSpecError(ConfigErrors):
    """Every problem found in a spec; `errors` holds them, one ConfigError (one line) each."""


def is_grid_spec(data: dict) -> bool:
    """Only grid spec keys, and a base or an axis: a file for `grid` (`train` would reject every
    key)."""
    return set(data) <= set(SPEC_KEYS) and bool(set(data) & {"base", "grid", "zip", "seeds"})


def is_run_config(data: dict) -> bool:
    """Only run config keys (model, data, ...): a file for `train` (or a spec's `base:`), not
    `grid`."""
    return bool(data) and set(data) <= set(RUN_CONFIG_KEYS)


def load_grid(path: str | Path) -> GridSpec:
    """Read and validate a grid spec file (see the module docstring for the format)."""
    path = Path(path)
    return parse_grid(read_yaml(path), path)


def parse_grid(data: dict, path: Path | None = None) -> GridSpec:
    """Validate a spec mapping and expand it into runs; raise GridSpecError listing every
    problem."""
    errors: list[ConfigError] = []
    where = str(path) if path is not None else "grid spec"
    if is_run_config(data):
        raise ConfigError(
            where,
            f"a run config, not a grid spec; train it with: relpos-ablate train --config "
            f"{where} --run-dir DIR (or make it the base: of a grid spec)",
        )
    _check_top_keys(data, errors)
    name = _spec_name(data, path, errors)
    base = _base_config(data.get("base", {}), path, errors)
    # the modules that register schemes: their bias types are encodings too
    if collect_error(errors, import_modules, base.get("imports", ()), "base.imports") is None:
        # reported once, not once per run
        base = {key: value for key, value in base.items() if key != "imports"}
    axes = grid_axes(data.get("grid", {}), errors) + zip_axes(data.get("zip", []), errors)
    axes += seed_axes(data, axes, errors)
    check_axis_keys_unique(axes, errors)
    excludes = checked_excludes(data.get("exclude", []), axes, declared_axes(data), errors)
    launcher = collect_error(
        errors, from_dict, LauncherConfig, data.get("launcher", {}), "launcher"
    )
    analysis = collect_error(errors, parse_plan, data["analysis"]) if "analysis" in data else None
    structure_ok = not errors
    runs = _expand(base, axes, excludes, errors, check_duplicates=structure_ok)
    if not runs and not errors:
        errors.append(ConfigError("exclude", "every combination is excluded; nothing to run"))
    if errors:
        raise GridSpecError(errors, where)
    keys = tuple(key for axis in axes for key in axis.keys)
    seeds = tuple(data.get("seeds") or ())
    return GridSpec(name, tuple(runs), keys, launcher, path, analysis, seeds)


def _check_top_keys(data: dict, errors: list[ConfigError]) -> None:
    for key in (key for key in data if key not in SPEC_KEYS):
        # a run config's own key (model, imports, ...) is far likelier than a typo of a spec key
        close = difflib.get_close_matches(str(key), SPEC_KEYS, n=1)
        hint = (
            f"a run config's key goes under base: (base: {{{key}: ...}}); "
            if key in RUN_CONFIG_KEYS
            else f"did you mean '{close[0]}'? "
            if close
            else ""
        )
        errors.append(
            ConfigError(str(key), f"unknown spec key; {hint}allowed: {', '.join(SPEC_KEYS)}")
        )


def _spec_name(data: dict, path: Path | None, errors: list[ConfigError]) -> str:
    name = data.get("name", path.stem if path is not None else None)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        errors.append(
            ConfigError(
                "name", f"{name!r}: give a directory name of letters, digits, '_', '.', '-'"
            )
        )
        return "invalid"
    return name


def _base_config(base: Any, path: Path | None, errors: list[ConfigError]) -> dict:
    """The base run config as a plain dict (inline mapping, or a YAML file relative to the spec)."""
    if isinstance(base, str):
        base_path = Path(base) if path is None else path.parent / base
        base = collect_error(errors, read_yaml, base_path)
        return base if base is not None else {}
    if not isinstance(base, dict):
        errors.append(
            ConfigError("base", f"expected a run config mapping or a path to one, got {base!r}")
        )
        return {}
    return base


def resolve_variant(base: dict, variant: dict[str, Any]) -> RunConfig:
    """The run config of one combination: base, then the encoding preset, then explicit key
    paths."""
    data = copy.deepcopy(base)
    if ENCODING in variant:
        for path, value in encoding_fields(variant[ENCODING]).items():
            set_path(data, path, value)
    for key, value in variant.items():
        if key != ENCODING:
            set_path(data, key, copy.deepcopy(value))
    return from_dict(RunConfig, data)


def format_variant(variant: dict[str, Any]) -> str:
    return " ".join(f"{key}={shown_value(value)}" for key, value in variant.items()) or "(base)"


def _expand(
    base: dict,
    axes: list[Axis],
    excludes: list[dict],
    errors: list[ConfigError],
    check_duplicates: bool,
) -> list[PlannedRun]:
    """Resolve every kept combination; config errors are grouped (one line per distinct error)."""
    runs: list[PlannedRun] = []
    failures: dict[str, tuple[ConfigError, list[dict]]] = {}
    first_by_id: dict[str, dict] = {}
    for variant in combinations(axes):
        if any(all(variant.get(k) == v for k, v in entry.items()) for entry in excludes):
            continue
        try:
            config = resolve_variant(base, variant)
        except ConfigError as err:
            for problem in err.errors:
                failures.setdefault(str(problem), (problem, []))[1].append(variant)
            continue
        rid = run_id(config)
        if rid in first_by_id:
            if check_duplicates:
                errors.append(
                    ConfigError(
                        "grid",
                        f"runs {{{format_variant(first_by_id[rid])}}} and "
                        f"{{{format_variant(variant)}}} resolve to the same config (run {rid}); "
                        f"drop one",
                    )
                )
            continue
        first_by_id[rid] = variant
        runs.append(PlannedRun(run_id=rid, variant=variant, config=config))
    for err, variants in failures.values():
        more = f" and {len(variants) - 1} more" if len(variants) > 1 else ""
        errors.append(
            ConfigError(err.field, f"{err.message} (run {format_variant(variants[0])}{more})")
        )
    return runs
