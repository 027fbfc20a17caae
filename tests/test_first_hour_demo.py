"""`make demo` leaves `git status` clean (issue 56): it writes the report of the user's runs under
results/demo/local/ (gitignored), and the committed reference the README and the docs show stays
where they name it.

Run: .venv/bin/python -m pytest tests/test_first_hour_demo.py -q
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.skipif(
    not (shutil.which("make") and shutil.which("git") and (ROOT / ".git").exists()),
    reason="needs make and a git checkout",
)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def written() -> list[str]:
    """Every --out of `make demo`'s commands (make -n prints them, runs nothing)."""
    dry = subprocess.run(
        ["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return re.findall(r"--out (\S+)", dry.replace("$run", "RUN"))


def test_make_demo_writes_only_ignored_untracked_files():
    outs = written()
    # the report the README promises: summary, both tables, the figures
    assert sorted({Path(out).name for out in outs}) == [
        "figures",
        "summary.csv",
        "table.md",
        "table.tex",
    ], outs
    # a file in each (the figures' names as the plot commands write them)
    files = [
        f"{out}/{name}" if Path(out).name == "figures" else out
        for out in outs
        for name in ("bias_overview.png", "extrapolation.pdf", "terms.png", "attention.pdf")
    ]
    ignored = git("check-ignore", "--no-index", *files).stdout.split()
    assert sorted(set(ignored)) == sorted(set(files))
    assert git("ls-files", *files).stdout == ""


def test_the_committed_reference_stays_where_the_docs_name_it():
    named = ["results/demo/table.md", "results/demo/figures/bias_overview.png"]
    for doc in ("README.md", "docs/index.md", "docs/reproductions.md"):
        text = (ROOT / doc).read_text()
        assert any(path in text for path in named), doc
    assert sorted(git("ls-files", *named).stdout.split()) == sorted(named)
