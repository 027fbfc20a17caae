"""The worked example of docs/extending/new-bias.md, exactly as printed: its fenced blocks by file
name, and the scheme imported from a directory outside the package, in a registry of its own (so the
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

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending" / "new-bias.md"
MODULE = "my_schemes"


def page_block(name: str, page: Path = PAGE) -> str:
    """The fenced code block of the page whose first line is `# <name>`."""
    blocks = re.findall(r"^```\w*\n(# (\S+)\n.*?)^```$", page.read_text(), flags=re.S | re.M)
    found = [text for text, title in blocks if title == name]
    assert len(found) == 1, f"{page.name} should have one code block starting with '# {name}'"
    return found[0]


def write_example(directory: Path) -> Path:
    """my_schemes.py, test_my_schemes.py and gaussian.yaml from the page, written to
    `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (f"{MODULE}.py", f"test_{MODULE}.py", "gaussian.yaml"):
        (directory / name).write_text(page_block(name))
    return directory


@contextmanager
def registered_example(directory: Path):
    """Import the worked example's my_schemes from `directory`; on exit the registry and sys.modules
    are as before."""
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
