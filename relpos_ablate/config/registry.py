"""The bias-type registry: every allowed value of `model.attention.bias` and the class behind it.

This is the one list of bias names: config validation, `--help`, the grid's `encoding:` presets and
the tests read it here, and the model builds a scheme from it. It is torch-free on purpose:
validating a config (and rerunning a finished grid) must not import torch, so a built-in scheme is
registered as "module:Class" text and its module is imported only when a model is built.

- A built-in scheme: its module under relpos_ablate/model/position/ and one line in BUILTIN_BIASES
  (its formula goes in docs/schemes/index.md, an independent float64 formula in tests/reference.py).
- A scheme of your own: `@register_bias("name")` on a BiasScheme subclass in your module, and the
  module listed under `imports:` in the run config, so every process that reads the config (the
  grid runner, its workers, SLURM jobs) imports it before `bias: name` is checked.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from typing import Any

from relpos_ablate.config.base import ConfigError, reject

#: Built-in bias types: name -> "module:Class" of the implementation (imported when a model is
#: built).
BUILTIN_BIASES: dict[str, str] = {
    "xl_table": "relpos_ablate.model.position.tables:XLTableBias",
    "t5": "relpos_ablate.model.position.tables:T5Bias",
    "alibi": "relpos_ablate.model.position.alibi:ALiBiBias",
    "alibi_learned": "relpos_ablate.model.position.alibi:LearnedALiBiBias",
    "kerple_log": "relpos_ablate.model.position.kerple:KerpleLogBias",
    "kerple_power": "relpos_ablate.model.position.kerple:KerplePowerBias",
    "fire": "relpos_ablate.model.position.mlp:FIREBias",
    "dynamic": "relpos_ablate.model.position.mlp:DynamicBias",
    "sandwich": "relpos_ablate.model.position.sandwich:SandwichBias",
}
HOW_TO_REGISTER = "your own: @register_bias in a module listed under `imports:`"

_registered: dict[
    str, type
] = {}  # register_bias: schemes defined outside the package, in this process
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def bias_types() -> tuple[str, ...]:
    """Every allowed `bias`: 'none', the built-ins, then the schemes registered in this process."""
    return ("none", *BUILTIN_BIASES, *_registered)


def register_bias(name: str):
    """Class decorator: `@register_bias("gaussian")` on a BiasScheme subclass makes `bias: gaussian`
    valid."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"register_bias: {name!r}: use lowercase letters, digits and '_' (e.g. 'gaussian')"
        )
    if name in BUILTIN_BIASES or name == "none":
        raise ValueError(
            f"register_bias: {name!r} is built in; register your scheme under another name"
        )

    def add(cls: type) -> type:
        if not isinstance(cls, type):
            raise ValueError(
                f"register_bias({name!r}) decorates a class (a BiasScheme subclass), not {cls!r}"
            )
        previous = _registered.get(name)
        if previous is not None and _qualified(previous) != _qualified(cls):
            raise ValueError(
                f"register_bias: {name!r} is already registered by {_qualified(previous)}"
            )
        _registered[name] = cls
        return cls

    return add


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def check_bias(field: str, name: Any) -> None:
    """A one-line ConfigError unless `name` is registered (with a did-you-mean and how to register);
    recorded with the config's other problems while from_dict builds it (config.base.reject)."""
    allowed = bias_types()
    if name in allowed:
        return
    close = difflib.get_close_matches(str(name), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    reject(
        field,
        f"{name!r} is not registered; {hint}registered: {', '.join(allowed)} ({HOW_TO_REGISTER})",
    )


def bias_class(name: str) -> type:
    """The class registered under `name`, importing a built-in's module on first use."""
    check_bias("bias", name)
    if name == "none":
        raise ValueError("bias 'none' has no class: the attention adds no bias")
    if name in _registered:
        return _registered[name]
    module, _, cls = BUILTIN_BIASES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def import_modules(modules: Any, field: str = "imports") -> tuple[str, ...]:
    """Import each module a run config names under `imports:` (your schemes register on import);
    returns them.

    Modules are looked up on sys.path, then in the working directory (after everything else, so it
    never shadows an installed package): a module next to your config is found by the
    `relpos-ablate` command too, as `python -m` would find it. Grid workers and SLURM jobs inherit
    the working directory and PYTHONPATH of the command that launched them."""
    if not isinstance(modules, (list, tuple)):
        raise ConfigError(
            field, f"expected a list of module names, e.g. [my_schemes], got {modules!r}"
        )
    for i, name in enumerate(modules):
        where = f"{field}[{i}]"
        if not isinstance(name, str) or not _MODULE.fullmatch(name) or name.endswith(".py"):
            stem = name.removesuffix(".py").rpartition("/")[2] if isinstance(name, str) else ""
            example = stem if _MODULE.fullmatch(stem) else "my_schemes"
            raise ConfigError(
                where, f"{name!r}: give a Python module name such as {example!r}, not a file path"
            )
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
        try:
            importlib.import_module(name)
        except Exception as err:  # the user's module: whatever fails there is reported in one line
            detail = " ".join(str(err).split())
            raise ConfigError(
                where,
                f"cannot import {name!r} ({type(err).__name__}: {detail}); the module must "
                "be on PYTHONPATH or in the working directory",
            ) from err
    return tuple(modules)
