"""Grid specs: a YAML file -> the list of runs it describes, every error reported before launch.

A spec looks like

    name: xl_terms                  # results go to <results>/<name>/<run_id>/ (default: the file's name)
    base: {model: {...}, train: {...}}   # a run config, or a path to one (relative to the spec)
    grid:                           # key path (or `encoding`, a preset) -> values; Cartesian product
      encoding: [xl, shaw, rope]
      model.mem_len: [0, 64]
    zip:                            # axes varied together (one group per list item)
      - {train.segment_len: [32, 64], data.offset: [8, 16]}
    exclude:                        # combinations to drop
      - {encoding: rope, model.mem_len: 64}
    seeds: [0, 1, 2]
    launcher: {partition: gpu, time: 240}   # SLURM settings (LauncherConfig)

Seeds are the outermost loop, so a grid stopped half way has every variant of the first seeds. A run's
id is `run_id(config)`: two specs that produce the same config share the run. Spec errors (unknown
key path, empty axis, a value the config rejects, duplicate runs) are all collected and raised
together as one GridSpecError, one line each.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from relpos_ablate.config import ConfigError, RunConfig, from_dict, read_yaml, run_id
from relpos_ablate.config.base import ConfigErrors, check_range, set_path
from relpos_ablate.config.registry import import_modules
from relpos_ablate.runner.presets import preset_fields

ENCODING = "encoding"
SEED = "seed"
SPEC_KEYS = ("name", "description", "base", "grid", "zip", "exclude", "seeds", "launcher", "table", "plots")
RUN_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig))
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class LauncherConfig:
    """SLURM settings for `--launcher slurm`: a `launcher:` block in the spec, overridden by CLI flags."""

    partition: str = ""
    """SLURM partition (empty: the cluster's default)."""
    account: str = ""
    """SLURM account charged for the jobs (empty: your default account)."""
    qos: str = ""
    """SLURM quality of service (empty: the default)."""
    time: int = 240
    """Wall-clock limit per job in minutes; a longer run is requeued and resumes from last.ckpt."""
    gpus: int = 1
    """GPUs per node of a job (each job trains one run, data-parallel over all its GPUs: one SLURM task
    per GPU; 0: a CPU job of one task)."""
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
        for name in ("time", "gpus", "nodes", "cpus", "mem_gb", "array_parallelism", "max_timeouts"):
            check_range(name, getattr(self, name), low=0 if name in ("gpus", "mem_gb", "max_timeouts") else 1)


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


class GridSpecError(ConfigErrors):
    """Every problem found in a spec; `errors` holds them, one ConfigError (one line) each."""


@dataclass
class _Axis:
    """Axes varied together (one key for a grid axis, several for a zip group); `rows` are their values."""

    keys: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    where: str
    outermost: bool = False


def is_grid_spec(data: dict) -> bool:
    """Only grid spec keys, and a base or an axis: a file for `grid` (`train` would reject every key)."""
    return set(data) <= set(SPEC_KEYS) and bool(set(data) & {"base", "grid", "zip", "seeds"})


def is_run_config(data: dict) -> bool:
    """Only run config keys (model, data, ...): a file for `train` (or a spec's `base:`), not `grid`."""
    return bool(data) and set(data) <= set(RUN_CONFIG_KEYS)


def load_grid(path: str | Path) -> GridSpec:
    """Read and validate a grid spec file (see the module docstring for the format)."""
    path = Path(path)
    return parse_grid(read_yaml(path), path)


def parse_grid(data: dict, path: Path | None = None) -> GridSpec:
    """Validate a spec mapping and expand it into runs; raise GridSpecError listing every problem."""
    errors: list[ConfigError] = []
    where = str(path) if path is not None else "grid spec"
    if is_run_config(data):
        raise ConfigError(where, f"a run config, not a grid spec; train it with: relpos-ablate train --config "
                          f"{where} --run-dir DIR (or make it the base: of a grid spec)")
    _check_top_keys(data, errors)
    name = _spec_name(data, path, errors)
    base = _base_config(data.get("base", {}), path, errors)
    if _collect(errors, import_modules, base.get("imports", ()), "base.imports") is None:  # schemes are encodings too
        base = {key: value for key, value in base.items() if key != "imports"}  # reported once, not once per run
    axes = _grid_axes(data.get("grid", {}), errors) + _zip_axes(data.get("zip", []), errors)
    axes += _seed_axes(data, axes, errors)
    _check_axis_keys_unique(axes, errors)
    excludes = _excludes(data.get("exclude", []), axes, _declared_axes(data), errors)
    launcher = _collect(errors, from_dict, LauncherConfig, data.get("launcher", {}), "launcher")
    structure_ok = not errors
    runs = _expand(base, axes, excludes, errors, check_duplicates=structure_ok)
    if not runs and not errors:
        errors.append(ConfigError("exclude", "every combination is excluded; nothing to run"))
    if errors:
        raise GridSpecError(errors, where)
    keys = tuple(key for axis in axes for key in axis.keys)
    return GridSpec(name=name, runs=tuple(runs), axes=keys, launcher=launcher, path=path)


def _collect(errors: list[ConfigError], fn, *args) -> Any:
    """fn(*args), or None with its ConfigError appended to `errors`."""
    try:
        return fn(*args)
    except ConfigError as err:
        errors.append(err)
        return None


def _check_top_keys(data: dict, errors: list[ConfigError]) -> None:
    for key in (key for key in data if key not in SPEC_KEYS):
        close = difflib.get_close_matches(str(key), SPEC_KEYS, n=1)
        hint = (f"did you mean '{close[0]}'? " if close
                else "a run config section goes under base:; " if key in RUN_CONFIG_KEYS else "")
        errors.append(ConfigError(str(key), f"unknown spec key; {hint}allowed: {', '.join(SPEC_KEYS)}"))


def _spec_name(data: dict, path: Path | None, errors: list[ConfigError]) -> str:
    name = data.get("name", path.stem if path is not None else None)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        errors.append(ConfigError("name", f"{name!r}: give a directory name of letters, digits, '_', '.', '-'"))
        return "invalid"
    return name


def _base_config(base: Any, path: Path | None, errors: list[ConfigError]) -> dict:
    """The base run config as a plain dict (inline mapping, or a YAML file relative to the spec)."""
    if isinstance(base, str):
        base_path = Path(base) if path is None else path.parent / base
        base = _collect(errors, read_yaml, base_path)
        return base if base is not None else {}
    if not isinstance(base, dict):
        errors.append(ConfigError("base", f"expected a run config mapping or a path to one, got {base!r}"))
        return {}
    return base


def check_key_path(path: str) -> None:
    """Raise ConfigError unless `path` names a field of RunConfig (or is the `encoding` preset axis)."""
    if path == ENCODING:
        return
    cls: Any = RunConfig
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(path, f"'{'.'.join(parts[:depth])}' is a value, not a section")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            options = names + ([ENCODING] if depth == 0 else [])
            close = difflib.get_close_matches(part, options, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(path, f"unknown key path; {hint}allowed here: {', '.join(options)}")
        cls = typing.get_type_hints(cls)[part]


def _axis_values(where: str, values: Any, errors: list[ConfigError], distinct: bool = True) -> list | None:
    """The axis's list of values; None (with an error) when it is not a non-empty list (of distinct
    values, unless `distinct` is False: a zip column may repeat values as long as its rows differ)."""
    if not isinstance(values, list):
        errors.append(ConfigError(where, f"expected a list of values, got {values!r}"))
        return None
    if not values:
        errors.append(ConfigError(where, "empty axis; give at least one value"))
        return None
    repeated = [v for i, v in enumerate(values) if v in values[:i]]
    if repeated and distinct:
        errors.append(ConfigError(where, f"value {repeated[0]!r} is listed twice"))
        return None
    return values


def _checked_axis(prefix: str, key: Any, values: Any, errors: list[ConfigError], distinct: bool = True) -> list | None:
    """Validate one axis of `prefix` (grid, zip[i]): its key path, its values, every preset name."""
    where = f"{prefix}.{key}"
    key_errors: list[ConfigError] = []
    if not isinstance(key, str):
        key_errors.append(ConfigError(repr(key), "an axis key must be a key path such as model.mem_len"))
    else:
        _collect(key_errors, check_key_path, key)
    errors.extend(err.under(prefix) for err in key_errors)
    values = _axis_values(where, values, errors, distinct)
    if key_errors or values is None:
        return None
    if key == ENCODING:
        preset_errors: list[ConfigError] = []
        for value in values:
            _collect(preset_errors, preset_fields, value, where)
        errors.extend(preset_errors)
        return None if preset_errors else values
    return values


def _grid_axes(grid: Any, errors: list[ConfigError]) -> list[_Axis]:
    if not isinstance(grid, dict):
        errors.append(ConfigError("grid", f"expected a mapping of key path -> list of values, got {grid!r}"))
        return []
    axes = []
    for key, values in grid.items():
        values = _checked_axis("grid", key, values, errors)
        if values is not None:
            axes.append(_Axis((key,), [(v,) for v in values], f"grid.{key}"))
    return axes


def _zip_axes(groups: Any, errors: list[ConfigError]) -> list[_Axis]:
    """`zip:` is one mapping or a list of them; inside a group every axis has the same length."""
    groups = [groups] if isinstance(groups, dict) else groups
    if not isinstance(groups, list):
        errors.append(ConfigError("zip", f"expected a mapping (or a list of them) of axes, got {groups!r}"))
        return []
    axes = []
    for i, group in enumerate(groups):
        where = f"zip[{i}]"
        if not isinstance(group, dict) or not group:
            errors.append(ConfigError(where, f"expected a non-empty mapping of key path -> values, got {group!r}"))
            continue
        columns = {key: _checked_axis(where, key, values, errors, distinct=False) for key, values in group.items()}
        if any(values is None for values in columns.values()):
            continue
        lengths = {key: len(values) for key, values in columns.items()}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{key}: {n}" for key, n in lengths.items())
            errors.append(ConfigError(where, f"zipped axes need equal lengths ({detail})"))
            continue
        rows = list(zip(*columns.values()))
        repeated = [i for i, row in enumerate(rows) if row in rows[:i]]
        if repeated:
            errors.append(ConfigError(where, f"row {repeated[0]} {dict(zip(columns, rows[repeated[0]]))} is listed twice"))
            continue
        axes.append(_Axis(tuple(columns), rows, where))
    return axes


def _seed_axes(data: dict, axes: list[_Axis], errors: list[ConfigError]) -> list[_Axis]:
    """`seeds:` becomes the `seed` axis: last in a variant, but the outermost loop of the product."""
    if "seeds" not in data:
        return []
    if any(SEED in axis.keys for axis in axes):
        errors.append(ConfigError("seeds", "the seed is already a grid/zip axis; give it in one place"))
        return []
    values = _axis_values("seeds", data["seeds"], errors)
    return [] if values is None else [_Axis((SEED,), [(v,) for v in values], "seeds", outermost=True)]


def _check_axis_keys_unique(axes: list[_Axis], errors: list[ConfigError]) -> None:
    seen: dict[str, str] = {}
    for axis in axes:
        for key in axis.keys:
            if key in seen:
                errors.append(ConfigError(axis.where, f"axis {key!r} is also varied in {seen[key]}"))
            seen[key] = axis.where


def _declared_axes(data: dict) -> set:
    """Every axis key the spec names, valid or not (an exclude on an invalid axis is not a second error)."""
    grid = data.get("grid") if isinstance(data.get("grid"), dict) else {}
    groups = data.get("zip", [])
    groups = [groups] if isinstance(groups, dict) else groups if isinstance(groups, list) else []
    zipped = {key for group in groups if isinstance(group, dict) for key in group}
    return set(grid) | zipped | ({SEED} if "seeds" in data else set())


def _excludes(entries: Any, axes: list[_Axis], declared: set, errors: list[ConfigError]) -> list[dict]:
    """Each exclude entry maps axis -> value; a combination matching every pair of one entry is dropped."""
    if not isinstance(entries, list):
        errors.append(ConfigError("exclude", f"expected a list of {{axis: value}} mappings, got {entries!r}"))
        return []
    values = {key: [row[i] for row in axis.rows] for axis in axes for i, key in enumerate(axis.keys)}
    checked = []
    for n, entry in enumerate(entries):
        where = f"exclude[{n}]"
        if not isinstance(entry, dict) or not entry:
            errors.append(ConfigError(where, f"expected a non-empty mapping of axis -> value, got {entry!r}"))
            continue
        problems = [
            _exclude_problem(f"{where}.{key}", key, value, values)
            for key, value in entry.items() if key in values or key not in declared
        ]
        problems = [p for p in problems if p is not None]
        errors.extend(problems)
        if not problems:
            checked.append(entry)
    return checked


def _exclude_problem(where: str, key: str, value: Any, values: dict[str, list]) -> ConfigError | None:
    if key not in values:
        return ConfigError(where, f"not an axis of this grid; axes: {', '.join(values) or '(none)'}")
    if value not in values[key]:
        return ConfigError(where, f"{value!r} is not a value of the axis; values: {values[key]}")
    return None


def _combinations(axes: list[_Axis]) -> Iterator[dict[str, Any]]:
    """Every combination as {axis key: value} in spec order; the `seeds` axis varies slowest."""
    loop_order = sorted(axes, key=lambda axis: not axis.outermost)
    for rows in itertools.product(*(axis.rows for axis in loop_order)):
        values = {key: value for axis, row in zip(loop_order, rows) for key, value in zip(axis.keys, row)}
        yield {key: values[key] for axis in axes for key in axis.keys}


def resolve_variant(base: dict, variant: dict[str, Any]) -> RunConfig:
    """The run config of one combination: base, then the encoding preset, then explicit key paths."""
    data = copy.deepcopy(base)
    if ENCODING in variant:
        for name, value in preset_fields(variant[ENCODING]).items():
            set_path(data, f"model.attention.{name}", value)
    for key, value in variant.items():
        if key != ENCODING:
            set_path(data, key, copy.deepcopy(value))
    return from_dict(RunConfig, data)


def format_variant(variant: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in variant.items()) or "(base)"


def _expand(
    base: dict, axes: list[_Axis], excludes: list[dict], errors: list[ConfigError], check_duplicates: bool
) -> list[PlannedRun]:
    """Resolve every kept combination; config errors are grouped (one line per distinct error)."""
    runs: list[PlannedRun] = []
    failures: dict[str, tuple[ConfigError, list[dict]]] = {}
    first_by_id: dict[str, dict] = {}
    for variant in _combinations(axes):
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
                errors.append(ConfigError(
                    "grid", f"runs {{{format_variant(first_by_id[rid])}}} and {{{format_variant(variant)}}} "
                    f"resolve to the same config (run {rid}); drop one"))
            continue
        first_by_id[rid] = variant
        runs.append(PlannedRun(run_id=rid, variant=variant, config=config))
    for err, variants in failures.values():
        more = f" and {len(variants) - 1} more" if len(variants) > 1 else ""
        errors.append(ConfigError(err.field, f"{err.message} (run {format_variant(variants[0])}{more})"))
    return runs
