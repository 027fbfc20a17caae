"""The axes of a grid spec: `grid:`, `zip:` groups and `seeds:`, checked one by one (every problem
collected as a one-line ConfigError), the `exclude:` entries checked against them, and their
combinations in loop order. grid.py turns the combinations into runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from relpos_ablate.config import ConfigError, RunConfig
from relpos_ablate.config.base import named_items
from relpos_ablate.config.presets import encoding_fields

ENCODING = "encoding"
SEED = "seed"


@dataclass
class Axis:
    """Axes varied together (one key for a grid axis, several for a zip group); `rows` are their
    values."""

    keys: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    where: str
    outermost: bool = False


def collect_error(errors: list[ConfigError], fn, *args) -> Any:
    """fn(*args), or None with its ConfigError appended to `errors`."""
    try:
        return fn(*args)
    except ConfigError as err:
        errors.append(err)
        return None


def check_key_path(path: str) -> None:
    """Raise ConfigError unless `path` names a field of RunConfig (or is the `encoding` preset
    axis)."""
    if path == ENCODING:
        return
    cls: Any = RunConfig
    parts = path.split(".")
    # the item class of a field written as a mapping by name (model.layer_kinds.<name>.window)
    named = None
    for depth, part in enumerate(parts):
        if named is not None:  # `part` is an item's name: any name
            cls, named = named, None
            continue
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(path, f"'{'.'.join(parts[:depth])}' is a value, not a section")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            options = names + ([ENCODING] if depth == 0 else [])
            close = difflib.get_close_matches(part, options, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(path, f"unknown key path; {hint}allowed here: {', '.join(options)}")
        cls = typing.get_type_hints(cls)[part]
        named = named_items(cls)


def _axis_values(
    where: str, values: Any, errors: list[ConfigError], distinct: bool = True
) -> list | None:
    """The axis's list of values; None (with an error) when it is not a non-empty list (of distinct
    values, unless `distinct` is False: a zip column may repeat values as long as its rows
    differ)."""
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


def _checked_axis(
    prefix: str, key: Any, values: Any, errors: list[ConfigError], distinct: bool = True
) -> list | None:
    """Validate one axis of `prefix` (grid, zip[i]): its key path, its values, every preset name."""
    where = f"{prefix}.{key}"
    key_errors: list[ConfigError] = []
    if not isinstance(key, str):
        key_errors.append(
            ConfigError(repr(key), "an axis key must be a key path such as model.mem_len")
        )
    else:
        collect_error(key_errors, check_key_path, key)
    errors.extend(err.under(prefix) for err in key_errors)
    values = _axis_values(where, values, errors, distinct)
    if key_errors or values is None:
        return None
    if key == ENCODING:
        preset_errors: list[ConfigError] = []
        for value in values:
            collect_error(preset_errors, encoding_fields, value, where)
        errors.extend(preset_errors)
        return None if preset_errors else values
    return values


def grid_axes(grid: Any, errors: list[ConfigError]) -> list[Axis]:
    if not isinstance(grid, dict):
        errors.append(
            ConfigError("grid", f"expected a mapping of key path -> list of values, got {grid!r}")
        )
        return []
    axes = []
    for key, values in grid.items():
        values = _checked_axis("grid", key, values, errors)
        if values is not None:
            axes.append(Axis((key,), [(v,) for v in values], f"grid.{key}"))
    return axes


def zip_axes(groups: Any, errors: list[ConfigError]) -> list[Axis]:
    """`zip:` is one mapping or a list of them; inside a group every axis has the same length."""
    groups = [groups] if isinstance(groups, dict) else groups
    if not isinstance(groups, list):
        errors.append(
            ConfigError("zip", f"expected a mapping (or a list of them) of axes, got {groups!r}")
        )
        return []
    axes = []
    for i, group in enumerate(groups):
        where = f"zip[{i}]"
        if not isinstance(group, dict) or not group:
            errors.append(
                ConfigError(
                    where, f"expected a non-empty mapping of key path -> values, got {group!r}"
                )
            )
            continue
        columns = {
            key: _checked_axis(where, key, values, errors, distinct=False)
            for key, values in group.items()
        }
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
            errors.append(
                ConfigError(
                    where,
                    f"row {repeated[0]} {dict(zip(columns, rows[repeated[0]]))} is listed twice",
                )
            )
            continue
        axes.append(Axis(tuple(columns), rows, where))
    return axes


def seed_axes(data: dict, axes: list[Axis], errors: list[ConfigError]) -> list[Axis]:
    """`seeds:` becomes the `seed` axis: last in a variant, but the outermost loop of the
    product."""
    if "seeds" not in data:
        return []
    if any(SEED in axis.keys for axis in axes):
        errors.append(
            ConfigError("seeds", "the seed is already a grid/zip axis; give it in one place")
        )
        return []
    values = _axis_values("seeds", data["seeds"], errors)
    return (
        [] if values is None else [Axis((SEED,), [(v,) for v in values], "seeds", outermost=True)]
    )


def check_axis_keys_unique(axes: list[Axis], errors: list[ConfigError]) -> None:
    seen: dict[str, str] = {}
    for axis in axes:
        for key in axis.keys:
            if key in seen:
                errors.append(
                    ConfigError(axis.where, f"axis {key!r} is also varied in {seen[key]}")
                )
            seen[key] = axis.where


def declared_axes(data: dict) -> set:
    """Every axis key the spec names, valid or not (an exclude on an invalid axis is not a second
    error)."""
    grid = data.get("grid") if isinstance(data.get("grid"), dict) else {}
    groups = data.get("zip", [])
    groups = [groups] if isinstance(groups, dict) else groups if isinstance(groups, list) else []
    zipped = {key for group in groups if isinstance(group, dict) for key in group}
    return set(grid) | zipped | ({SEED} if "seeds" in data else set())


def checked_excludes(
    entries: Any, axes: list[Axis], declared: set, errors: list[ConfigError]
) -> list[dict]:
    """Each exclude entry maps axis -> value; a combination matching every pair of one entry is
    dropped."""
    if not isinstance(entries, list):
        errors.append(
            ConfigError("exclude", f"expected a list of {{axis: value}} mappings, got {entries!r}")
        )
        return []
    values = {
        key: [row[i] for row in axis.rows] for axis in axes for i, key in enumerate(axis.keys)
    }
    checked = []
    for n, entry in enumerate(entries):
        where = f"exclude[{n}]"
        if not isinstance(entry, dict) or not entry:
            errors.append(
                ConfigError(where, f"expected a non-empty mapping of axis -> value, got {entry!r}")
            )
            continue
        problems = [
            _exclude_problem(f"{where}.{key}", key, value, values)
            for key, value in entry.items()
            if key in values or key not in declared
        ]
        problems = [p for p in problems if p is not None]
        errors.extend(problems)
        if not problems:
            checked.append(entry)
    return checked


def _exclude_problem(
    where: str, key: str, value: Any, values: dict[str, list]
) -> ConfigError | None:
    if key not in values:
        return ConfigError(
            where, f"not an axis of this grid; axes: {', '.join(values) or '(none)'}"
        )
    if value not in values[key]:
        return ConfigError(where, f"{value!r} is not a value of the axis; values: {values[key]}")
    return None


def combinations(axes: list[Axis]) -> Iterator[dict[str, Any]]:
    """Every combination as {axis key: value} in spec order; the `seeds` axis varies slowest."""
    loop_order = sorted(axes, key=lambda axis: not axis.outermost)
    for rows in itertools.product(*(axis.rows for axis in loop_order)):
        values = {
            key: value for axis, row in zip(loop_order, rows) for key, value in zip(axis.keys, row)
        }
        yield {key: values[key] for axis in axes for key in axis.keys}
