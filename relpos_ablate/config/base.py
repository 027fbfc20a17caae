"""Machinery shared by every config section: plain dicts <-> frozen dataclasses, validated (YAML
files and `--set` overrides into those dicts: yaml_io.py).

Each config is a frozen dataclass whose fields carry *attribute docstrings* (a string literal on
the line after the field). Those docstrings are the documentation: `field_docs` reads them for
`--help` and the README. `from_dict` maps a plain dict (from YAML) onto a dataclass and rejects
unknown keys ("did you mean"), wrong types and bad values with one line naming the key path.

`from_dict` reports every problem of a config at once (ConfigErrors, one line each): every unknown
key and wrong type, in every section, and every failed `check_choice` / `check_range` of a
`__post_init__` (while from_dict builds a config they record their error and let the checks go
on). A check that raises ConfigError itself ends that dataclass's checks, so write a field's own
check with check_choice / check_range and keep plain raises for contradictions between fields.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A bad config value. `str(err)` is one line: `<key path>: <what is wrong and what is
    allowed>`."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    @property
    def errors(self) -> list[ConfigError]:
        """Every problem, one single-line ConfigError each."""
        return [self]

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key path prefixed (`model` + `terms` -> `model.terms`)."""
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, self.message)


class ConfigErrors(ConfigError):
    """Several problems found at once; `errors` holds them (one line each), `str` joins them."""

    def __init__(self, errors: list[ConfigError], where: str = ""):
        self._errors = [problem for err in errors for problem in err.errors]
        super().__init__(where, "; ".join(map(str, self._errors)))

    @property
    def errors(self) -> list[ConfigError]:
        return list(self._errors)

    def under(self, prefix: str) -> ConfigErrors:
        return ConfigErrors([err.under(prefix) for err in self._errors])


def raise_all(errors: list[ConfigError]) -> None:
    """Raise nothing, the one error, or every error together."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


_recorded: contextvars.ContextVar[list[ConfigError] | None] = contextvars.ContextVar(
    "recorded", default=None
)
"""While from_dict builds a config: where the failed checks of its __post_init__ go."""


def reject(field: str, message: str) -> None:
    """A failed check: raised, or recorded while from_dict builds the config (see the module
    docstring)."""
    recorded = _recorded.get()
    if recorded is None:
        raise ConfigError(field, message)
    recorded.append(ConfigError(field, message))


def check_choice(field: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        reject(field, f"{value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_range(
    field: str, value: float, low: float | None = None, high: float | None = None
) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        reject(field, f"{value!r} is out of range; allowed [{lo}, {hi}]")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and of the dataclasses it extends: {field name: the
    string literal under it}."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    return docs | _own_field_docs(cls)


def _own_field_docs(cls: type) -> dict[str, str]:
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
    """(key path, default, doc) for every leaf field of a (nested) config class; a list of configs
    (eval.settings) is followed by the fields of one item (`eval.settings[i].segment_len`), read
    from its class, so the help cannot leave one out."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    # lists that live in a registry, not the source
    choices = getattr(cls, "field_choices", lambda name: None)
    for f in dataclasses.fields(cls):
        path, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, path + "."))
            continue
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            default = repr(
                to_plain(f.default if f.default is not dataclasses.MISSING else f.default_factory())
            )
        else:
            default = "(required)"
        doc, allowed = docs.get(f.name, ""), choices(f.name)
        rows.append((path, default, f"{doc} Allowed: {' | '.join(allowed)}." if allowed else doc))
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
        if named_items(tp):  # a mapping in YAML: its keys are the items' names
            rows.extend(
                row
                for row in describe(item, f"{path}.<name>.")
                if not row[0].endswith(".<name>.name")
            )
        elif dataclasses.is_dataclass(item):
            rows.extend(describe(item, f"{path}[i]."))
    return rows


def named_items(tp: Any) -> type | None:
    """The item class of a `tuple[Item, ...]` annotation whose items have a `name` field
    (model.layer_kinds), else None. YAML may write such a field as a mapping {name: fields} (key
    paths then reach into it by name: `model.layer_kinds.local.window`) or as a list of items with
    their names."""
    if typing.get_origin(tp) is not tuple:
        return None
    item = typing.get_args(tp)[0]
    named = dataclasses.is_dataclass(item) and "name" in {f.name for f in dataclasses.fields(item)}
    return item if named else None


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
        raise (
            errors[0]
            if len(errors) == 1
            else ConfigError(field, f"expected {_type_name(tp)}, got {value!r}")
        )
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        paths = None
        if named_items(tp) and isinstance(value, dict):
            paths = [f"{field}.{name}" for name in value]
            value = [
                _named(name, fields, path) for (name, fields), path in zip(value.items(), paths)
            ]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(field, f"expected a list, got {value!r}")
        paths = paths or [f"{field}[{i}]" for i in range(len(value))]
        items, errors = _convert_each({i: (item_tp, v, paths[i]) for i, v in enumerate(value)})
        raise_all(errors)
        return tuple(items.values())
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


def _named(name: Any, fields: Any, where: str) -> dict:
    """One item of a mapping {name: fields}, as the list form writes it: {name, **fields}."""
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise ConfigError(where, f"expected a mapping of fields, got {fields!r}")
    if "name" in fields and fields["name"] != name:
        raise ConfigError(
            f"{where}.name", f"{fields['name']!r} differs from its key {name!r}; leave name out"
        )
    return {"name": name, **fields}


def _convert_each(fields: dict[Any, tuple[Any, Any, str]]) -> tuple[dict, list[ConfigError]]:
    """_convert every {key: (annotation, value, key path)}: (converted values, every error)."""
    values, errors = {}, []
    for key, (tp, value, path) in fields.items():
        try:
            values[key] = _convert(tp, value, path)
        except ConfigError as err:
            errors.append(err)
    return values, errors


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build config `cls` from a plain dict; every error names the full key path, and all of them
    are raised together (ConfigErrors) when there are several."""
    where = prefix or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a mapping of fields, got {data!r}")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    hints = typing.get_type_hints(cls)
    errors, meant = [], set()
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            meant.update(close)
            hint = f"did you mean '{close[0]}'? " if close else ""
            errors.append(
                ConfigError(_join(prefix, key), f"unknown key; {hint}allowed: {', '.join(names)}")
            )
    before_fields = getattr(cls, "before_fields", None)
    # RunConfig imports the modules under `imports:` before validating the rest
    if before_fields is not None:
        try:
            before_fields(data, prefix)
        except ConfigError as err:  # the rest cannot be checked without those modules: stop here
            raise_all(errors + [err])
    missing = dataclasses.MISSING
    required = [f.name for f in fields if f.default is missing and f.default_factory is missing]
    # a misspelt required key is one error
    errors += [
        ConfigError(_join(prefix, name), "missing; this field has no default")
        for name in required
        if name not in data and name not in meant
    ]
    kwargs, conversion_errors = _convert_each(
        {
            key: (hints[key], value, _join(prefix, key))
            for key, value in data.items()
            if key in names
        }
    )
    errors += conversion_errors
    if set(required) - set(kwargs):
        raise_all(errors)
    config, check_errors = _build(cls, kwargs, checks_only=bool(errors))
    errors += [err.under(prefix) if prefix else err for err in check_errors]
    raise_all(_in_field_order(errors, names, prefix))
    return config


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _build(cls: type, kwargs: dict, checks_only: bool) -> tuple[Any, list[ConfigError]]:
    """cls(**kwargs) with the failed checks of its __post_init__ recorded: (config or None, errors).

    `checks_only`: some given fields were dropped (wrong type), so their defaults stand in; only the
    recorded field checks count then, not a contradiction the stand-ins may cause."""
    recorded: list[ConfigError] = []
    token = _recorded.set(recorded)
    try:
        config = cls(**kwargs)
    except ConfigError as err:
        return None, recorded + ([] if checks_only else err.errors)
    except Exception:
        if not recorded:  # not caused by a value a check let through
            raise
        return None, recorded
    finally:
        _recorded.reset(token)
    return (None if recorded else config), recorded


def _in_field_order(errors: list[ConfigError], names: list[str], prefix: str) -> list[ConfigError]:
    """Every problem once per key path (a bad value often fails a later check of the same field
    too), in the order the dataclass declares its fields."""
    kept: dict[str, ConfigError] = {}
    for err in (problem for error in errors for problem in error.errors):
        kept.setdefault(err.field, err)

    def position(err: ConfigError) -> int:
        key = re.split(r"[.\[]", err.field.removeprefix(f"{prefix}."))[0]
        return names.index(key) if key in names else len(names)

    return sorted(kept.values(), key=position)
