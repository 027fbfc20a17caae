"""The README's "Your own bias scheme" example, exactly as printed: its fenced blocks by file name,
and the scheme imported from a directory outside the package, in a registry of its own (so the
name it registers does not leak into other tests). Helpers only; the tests are in
test_user_scheme.py and test_bias_registry.py."""

from __future__ import annotations

import importlib
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from relpos_ablate.config import registry

README = Path(__file__).resolve().parent.parent / "README.md"
MODULE = "my_schemes"


def readme_block(name: str) -> str:
    """The fenced code block of README.md whose first line is `# <name>`."""
    blocks = re.findall(r"^```\w*\n(# (\S+)\n.*?)^```$", README.read_text(), flags=re.S | re.M)
    found = [text for text, title in blocks if title == name]
    assert len(found) == 1, f"README.md should have one code block starting with '# {name}'"
    return found[0]


def write_example(directory: Path) -> Path:
    """my_schemes.py, test_my_schemes.py and gaussian.yaml from the README, written to
    `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (f"{MODULE}.py", f"test_{MODULE}.py", "gaussian.yaml"):
        (directory / name).write_text(readme_block(name))
    return directory


@contextmanager
def registered_example(directory: Path):
    """Import the README's my_schemes from `directory`; on exit the registry and sys.modules are as
    before."""
    write_example(directory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_registered", dict(registry._registered))
        patch.syspath_prepend(str(directory))
        for name in (MODULE, f"test_{MODULE}"):
            patch.delitem(sys.modules, name, raising=False)
        try:
            yield importlib.import_module(MODULE)
        finally:
            for name in (MODULE, f"test_{MODULE}"):
                sys.modules.pop(name, None)
