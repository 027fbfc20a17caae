"""The scheme registry: every allowed value of `model.attention.bias` and of
`model.attention.term_schemes`, the class behind each, the forms it supplies, the built-in parts
(core/parts.py: schemes acting on q and k, sink slots or the output) with the field that switches
each on, and the options of the schemes that keep all of themselves in their own file
(`SchemeOptions`, fields of `model.attention`). The built-ins' lines, presets and options are in
config/registry/builtins.py; this module is the machinery that reads them and your own.

This is the one list of scheme names: config validation, `--help`, the grid's `encoding:` presets,
the kernel planner (relpos_ablate/planner.py) and the tests read it here, and the model builds a
scheme from it. It is torch-free on purpose: validating a config (and rerunning a finished grid)
must not import torch, so a built-in scheme is registered as "module:Class" text with its forms
(planner.FORMS, as its class declares them: a test checks they agree) and its module is imported
only when a model is built.

- A built-in scheme: its module under relpos_ablate/model/schemes/ and one line in builtins.py's
  BUILTIN_BIASES or BUILTIN_TERMS (its formula goes in docs/schemes/, an independent float64
  formula in tests/fixtures/reference.py).
- A built-in part: its file under relpos_ablate/model/schemes/, one line in BUILTIN_PARTS (or in
  BUILTIN_TERMS where it also adds a score term), its options in `SchemeOptions` with their checks
  in `SchemeOptions.check_options`, a preset in SCHEME_PRESETS if it has one: all in builtins.py.
- A scheme of your own: `@register_bias("name")` on a BiasScheme subclass, or
  `@register_term("name")` on a TermScheme subclass, in your module, and the module listed under
  `imports:` in the run config, so every process that reads the config (the grid runner, its
  workers, SLURM jobs) imports it before `bias: name` or `term_schemes: [name]` is checked.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from typing import Any

from relpos_ablate.config.base import ConfigError, reject
from relpos_ablate.config.registry.builtins import (
    BUILTIN_BIASES,
    BUILTIN_PARTS,
    BUILTIN_TERMS,
    SCHEME_PRESETS,
    Builtin,
    SchemeOptions,
)

__all__ = [
    "BUILTIN_BIASES",
    "BUILTIN_PARTS",
    "BUILTIN_TERMS",
    "SCHEME_PRESETS",
    "Builtin",
    "SchemeOptions",
]


HOW_TO_REGISTER = "your own: @register_bias in a module listed under `imports:`"
HOW_TO_REGISTER_TERM = "your own: @register_term in a module listed under `imports:`"

_registered: dict[
    str, type
] = {}  # register_bias: schemes defined outside the package, in this process
_registered_terms: dict[str, type] = {}  # register_term: likewise
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def bias_types() -> tuple[str, ...]:
    """Every allowed `bias`: 'none', the built-ins, then the schemes registered in this process."""
    return ("none", *BUILTIN_BIASES, *_registered)


def term_schemes() -> tuple[str, ...]:
    """Every allowed entry of `term_schemes`: the built-ins, then those registered in this
    process."""
    return (*BUILTIN_TERMS, *_registered_terms)


def register_bias(name: str):
    """Class decorator: `@register_bias("gaussian")` on a BiasScheme subclass makes `bias: gaussian`
    valid."""
    return _register("register_bias", "a BiasScheme subclass", name, _registered, BUILTIN_BIASES)


def register_term(name: str):
    """Class decorator: `@register_term("gated_alibi")` on a TermScheme subclass makes
    `term_schemes: [gated_alibi]` valid."""
    return _register(
        "register_term", "a TermScheme subclass", name, _registered_terms, BUILTIN_TERMS
    )


def _register(caller: str, what: str, name: str, registered: dict, builtins: dict):
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"{caller}: {name!r}: use lowercase letters, digits and '_' (e.g. 'gaussian')"
        )
    if name in builtins or name == "none":
        raise ValueError(f"{caller}: {name!r} is built in; register your scheme under another name")

    def add(cls: type) -> type:
        if not isinstance(cls, type):
            raise ValueError(f"{caller}({name!r}) decorates a class ({what}), not {cls!r}")
        previous = registered.get(name)
        if previous is not None and _qualified(previous) != _qualified(cls):
            raise ValueError(f"{caller}: {name!r} is already registered by {_qualified(previous)}")
        registered[name] = cls
        return cls

    return add


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def check_bias(field: str, name: Any) -> None:
    """A one-line ConfigError unless `name` is registered (with a did-you-mean and how to register);
    recorded with the config's other problems while from_dict builds it (config.base.reject)."""
    _check(field, name, bias_types(), HOW_TO_REGISTER)


def check_term(field: str, name: Any) -> None:
    """A one-line ConfigError unless `name` is a registered term scheme (as check_bias)."""
    _check(field, name, term_schemes(), HOW_TO_REGISTER_TERM)


def _check(field: str, name: Any, allowed: tuple[str, ...], how: str) -> None:
    if name in allowed:
        return
    close = difflib.get_close_matches(str(name), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    reject(field, f"{name!r} is not registered; {hint}registered: {', '.join(allowed)} ({how})")


def bias_class(name: str) -> type:
    """The class registered under `name`, importing a built-in's module on first use."""
    check_bias("bias", name)
    if name == "none":
        raise ValueError("bias 'none' has no class: the attention adds no bias")
    if name in _registered:
        return _registered[name]
    return _imported(BUILTIN_BIASES[name].target)


def term_class(name: str) -> type:
    """The term scheme registered under `name`, importing a built-in's module on first use."""
    check_term("term_schemes", name)
    if name in _registered_terms:
        return _registered_terms[name]
    return _imported(BUILTIN_TERMS[name].target)


def _imported(target: str) -> type:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def bias_forms(name: str) -> frozenset[str]:
    """The forms of bias `name` (planner.FORMS): a built-in's from its registry line (no torch),
    one of your own from its class (`forms`, a frozenset)."""
    if name in BUILTIN_BIASES:
        return frozenset(BUILTIN_BIASES[name].forms.split())
    return frozenset(getattr(bias_class(name), "forms", ()))


def term_forms(name: str) -> frozenset[str]:
    """The forms of the terms scheme `name` makes: a built-in's from its registry line, one of your
    own from its class (`Term.forms`)."""
    if name in BUILTIN_TERMS:
        return frozenset(BUILTIN_TERMS[name].forms.split())
    return frozenset(term_class(name).Term.forms)


def switched_terms(config: Any) -> tuple[str, ...]:
    """The built-in term schemes a config switches on by their own field (e.g. forget_gate)."""
    return tuple(name for name, entry in BUILTIN_TERMS.items() if switched_on(config, entry))


def active_parts(config: Any) -> tuple[str, ...]:
    """The built-in parts (BUILTIN_PARTS) a config switches on, in the registry's order."""
    return tuple(name for name, entry in BUILTIN_PARTS.items() if switched_on(config, entry))


def part_class(name: str) -> type:
    """The class of built-in part `name`, importing its module."""
    return _imported(BUILTIN_PARTS[name].target)


def switched_on(config: Any, entry: Builtin) -> bool:
    """Whether the config sets the entry's switch (Builtin.switch)."""
    field, _, value = (entry.switch or "").partition("=")
    got = getattr(config, field, None)
    return got == value if value else got not in (None, False, 0, "none")


def slot_forms(config: Any) -> bool:
    """Whether a part or term the config switches on prepends sink slots (the form `sinks`)."""
    entries = [BUILTIN_PARTS[n] for n in active_parts(config)]
    entries += [BUILTIN_TERMS[n] for n in switched_terms(config)]
    return any("sinks" in entry.forms.split() for entry in entries) or any(
        "sinks" in term_forms(name) for name in getattr(config, "term_schemes", ())
    )


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
