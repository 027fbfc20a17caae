"""The `encoding:` grid word as a run config key: why `train` refuses it, and what it would set. The
presets themselves live one floor down, in config/presets.py (layer kinds read them too)."""

from __future__ import annotations

from typing import Any

import yaml

from relpos_ablate.config.presets import encoding_fields, encoding_words


def not_a_run_key(value: Any) -> str:
    """Why `encoding` is no key of a run config, and what `encoding: <value>` sets in a grid spec
    (read from the preset table), for a one-line error of `train`."""
    if isinstance(value, str) and value in encoding_words():
        sets = ", ".join(f"{path}={_word(v)}" for path, v in encoding_fields(value).items())
        what = f"`encoding: {value}` sets {sets}; with train use those --set keys"
    else:
        what = (
            f"`encoding:` picks one of {', '.join(encoding_words())}, each a set of "
            f"model.attention fields or (a schedule) model.layer_kinds and model.layer_pattern; "
            f"with train set those fields"
        )
    return f"a grid spec word, not a run config key: in a grid spec {what}"


def _word(value: Any) -> str:
    """A value as --set takes it: YAML booleans, flow-style lists and mappings."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
    return str(value)
