"""Machinery shared by every config section: dict/YAML <-> frozen dataclasses, validated.

Each config is a frozen dataclass whose fields carry *attribute docstrings* (a string literal on
the line after the field). Those docstrings are the documentation: `field_docs` reads them for
`--help` and the README. `from_dict` maps a plain dict (from YAML) onto a dataclass and rejects
unknown keys ("did you mean"), wrong types and bad values with one line naming the key path.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without its surprise: `3e-3` and `1e5` are numbers (PyYAML reads them as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text with the project's loader (exponent floats are floats)."""
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A bad config value. `str(err)` is one line: `<key path>: <what is wrong and what is allowed>`."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key path prefixed (`model` + `terms` -> `model.terms`)."""
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, self.message)


def check_choice(field: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(field, f"{value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_range(field: str, value: float, low: float | None = None, high: float | None = None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ConfigError(field, f"{value!r} is out of range; allowed [{lo}, {hi}]")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field name: the string literal under it}."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, default, doc) for every leaf field of a (nested) config class."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    choices = getattr(cls, "field_choices", lambda name: None)  # lists that live in a registry, not the source
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe(hints[f.name], path + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc, allowed = docs.get(f.name, ""), choices(f.name)
        rows.append((path, repr(to_plain(default)), f"{doc} Allowed: {' | '.join(allowed)}." if allowed else doc))
    return rows


def to_plain(value: Any) -> Any:
    """A config (or any value inside one) as plain dicts/lists/scalars, ready for YAML/JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, field: str) -> Any:
    """Check `value` against annotation `tp`, recursing into dataclasses and tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, field)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else ConfigError(field, f"expected {_type_name(tp)}, got {value!r}")
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(field, f"expected a list, got {value!r}")
        return tuple(_convert(item_tp, v, f"{field}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, field)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(field, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(field, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(field, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(field, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {field}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build config `cls` from a plain dict; every error names the full key path."""
    where = prefix or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a mapping of fields, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            path = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(path, f"unknown key; {hint}allowed: {', '.join(names)}")
    before_fields = getattr(cls, "before_fields", None)
    if before_fields is not None:  # RunConfig imports the modules under `imports:` before validating the rest
        before_fields(data, prefix)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _convert(hints[key], value, path)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) if prefix else err


def set_path(data: dict, dotted: str, value: Any) -> None:
    """`set_path(d, "model.attention.terms", "ac")` — creates intermediate mappings as needed."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, f"'{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply `key.path=value` strings (values parsed as YAML: `3`, `true`, `[1, 2]`, `ac`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        set_path(data, key.strip(), load_yaml(raw))
    return data


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from `path`, with a one-line error when it is missing or not a mapping."""
    path = Path(path)
    try:
        data = load_yaml(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "file not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "is a directory; expected a YAML file") from None
    except PermissionError:
        raise ConfigError(str(path), "not readable (permission denied)") from None
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), f"not a text file (byte {err.start} is not UTF-8); expected YAML") from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"not valid YAML ({' '.join(str(err).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a mapping at the top level")
    return data
