"""YAML in and out of configs: the project's YAML loader (exponent floats are floats), config files
read with a one-line error, and `--set KEY=VALUE` overrides applied to a plain dict before
`from_dict` (config/base.py)."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import yaml

from relpos_ablate.config.base import ConfigError, raise_all


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without its surprise: `3e-3` and `1e5` are numbers (PyYAML reads them as
    strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text with the project's loader (exponent floats are floats)."""
    return yaml.load(text, Loader=_Loader)


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
    """Apply `key.path=value` strings (values parsed as YAML: `3`, `true`, `[1, 2]`, `ac`); every
    malformed one is reported, one line each."""
    errors = []
    for item in overrides:
        try:
            key, value = _parse_override(item)
            set_path(data, key, value)
        except ConfigError as err:
            errors.append(err)
    raise_all(errors)
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    """(dotted key, value) of one `KEY=VALUE`, or a one-line ConfigError naming what is
    malformed."""
    if "=" not in item:
        raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
    key, raw = (part.strip() for part in item.split("=", 1))
    if not key or "" in key.split("."):
        what = "an empty key" if not key else f"an empty part in the key {key!r}"
        raise ConfigError(
            "--set",
            f"{item!r} has {what}; expected KEY=VALUE with a dotted field path as KEY, "
            "e.g. model.d_model=64",
        )
    try:
        return key, load_yaml(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError(
            key,
            f"{raw!r} is not valid YAML ({problem}); write a list as [a, b], a mapping as "
            "{key: value}, and quote a value that is meant as text",
        ) from None


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
        raise ConfigError(
            str(path), f"not a text file (byte {err.start} is not UTF-8); expected YAML"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"not valid YAML ({' '.join(str(err).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a mapping at the top level")
    return data
