"""Docs that cannot drift: the README's and the documentation site's runnable Python blocks run, and
every path, module, link, anchor, command, flag and make target they name exists.

Run alone: `.venv/bin/python -m pytest tests/test_docs.py`. The site itself is built by `make docs`
(`mkdocs build --strict`, in `.ci/run`), which checks the links between its pages.

A Python block runs when the line `<!-- runnable -->` stands directly above its ```python fence. A
page's runnable blocks run in order, in one namespace, in a process forked from the test's (a block
may register a scheme, which must not leak into other tests) whose working directory is a temporary
folder; a traceback names the Markdown file and line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import traceback
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted(
    {
        *(ROOT / name for name in ("README.md", "CHANGELOG.md")),
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("results/README.md"),
        *ROOT.glob("results/*/README.md"),
        *ROOT.glob("benchmarks/results/**/README.md"),
        *ROOT.glob("experiments/README.md"),
        *ROOT.glob("notebooks/README.md"),
    }
)
MARKER = "<!-- runnable -->"
TOP_LEVEL = (
    "relpos_ablate",
    "tests",
    "experiments",
    "benchmarks",
    "docs",
    "notebooks",
    "results",
    ".ci",
)
TOP_FILES = ("Makefile", "pyproject.toml", "mkdocs.yml", "CHANGELOG.md", "README.md")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    info: str  # the fence's info string: python, bash, yaml, ...
    code: str
    line: int  # the first code line, 1-based
    runnable: bool


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text (``` or ~~~ fences, indented or not)."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, mark, info = fence.groups()
        runnable = i > 0 and lines[i - 1].strip() == MARKER
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(mark):
            end += 1
        code = "\n".join(
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        )
        found.append(Block(info.lower(), code, i + 2, runnable))
        i = end + 1
    return found


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^\s*(```+|~~~+).*?^\s*\1\s*$", "", text, flags=re.M | re.S)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


# --- runnable blocks ------------------------------------------------------------------------------

RUNNABLE = [path for path in DOC_FILES if any(block.runnable for block in blocks(path.read_text()))]


def run_blocks(path: Path, runnable: list[Block], workdir: Path, timeout_s: float = 300) -> str:
    """Run a page's blocks in order, in one namespace, in a process forked from this one (torch and
    the package already imported: seconds less a page than a new interpreter; a scheme a block
    registers stays in the child), in `workdir`. Returns what they printed; fails on an
    exception."""
    import torch  # noqa: F401  (imported before the fork, not in each child)

    output = workdir / "output.txt"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.chdir(workdir)
            sys.stdout = sys.stderr = open(output, "w", buffering=1)
            namespace = {"__name__": "__main__"}
            for block in runnable:
                exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"{rel(path)}: its runnable blocks ran past {timeout_s} s")
    printed = output.read_text() if output.exists() else ""
    assert os.waitstatus_to_exitcode(done[1]) == 0, (
        f"{rel(path)}: a runnable block failed\n{printed}"
    )
    return printed


def test_runnable_blocks_exist():
    """The marker is in use (a typo in it would silently turn every test below off)."""
    assert {rel(path) for path in RUNNABLE} >= {"docs/extending/new-bias.md"}


@pytest.mark.parametrize("path", RUNNABLE, ids=rel)
def test_runnable_blocks_run(path, tmp_path):
    runnable = [block for block in blocks(path.read_text()) if block.runnable]
    assert all(block.info == "python" for block in runnable), (
        f"{rel(path)}: {MARKER} must stand above ```python"
    )
    run_blocks(path, runnable, tmp_path)


def test_marker_stands_above_a_fence():
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == MARKER:
                assert i + 1 < len(lines) and lines[i + 1].strip().startswith("```python"), (
                    f"{rel(path)}:{i + 1}: {MARKER} is not directly above a ```python fence"
                )


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_quoted_files_match(path):
    """A code block whose first line is `# <repo path>` shows that file, whole and as it is."""
    for block in blocks(path.read_text()):
        first, _, body = block.code.partition("\n")
        named = first.removeprefix("# ").strip()
        if first.startswith("# ") and named.split("/")[0] in TOP_LEVEL and (ROOT / named).is_file():
            assert body.strip() == (ROOT / named).read_text().strip(), (
                f"{rel(path)}:{block.line}: differs from {named}"
            )


# --- paths, modules, links, anchors ---------------------------------------------------------------


def repo_paths(text: str) -> set[str]:
    """Words in code spans and code blocks that name a file or folder of the repository."""
    words = [word for span in code_spans(text) for word in span.split()]
    words += [word for block in blocks(text) for word in block.code.split()]
    found = set()
    for word in words:
        word = word.strip("'\"(),;[]").removeprefix("./")
        word = re.split(r"[#:]", word)[0].rstrip(".")
        if re.search(r"[<>*{}$…]|\.\.\.", word) or "=" in word:
            continue
        if word in TOP_FILES or word.split("/")[0] in TOP_LEVEL and "/" in word:
            found.add(word.rstrip("/"))
    return found


def made_by_a_run(path: str) -> bool:
    """results/<name>/... of an experiment this repository does not commit: a guide's example
    output, made (or half made) when a reader runs the example."""
    study = "/".join(path.split("/")[:2])
    return path.startswith("results/") and not any(
        name.startswith(f"{study}/") for name in tracked("results")
    )


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_named_paths_exist(path):
    missing = sorted(
        name
        for name in repo_paths(path.read_text())
        if not (ROOT / name).exists() and not made_by_a_run(name)
    )
    assert not missing, f"{rel(path)} names paths that do not exist: {missing}"


def resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_named_modules_exist(path):
    names = {
        m.group(1)
        for span in code_spans(path.read_text())
        for m in [re.match(r"^(relpos_ablate(\.\w+)+)(\(\))?$", span)]
        if m
    }
    missing = sorted(name for name in names if not resolves(name))
    assert not missing, f"{rel(path)} names modules or objects that do not exist: {missing}"


def slug(heading: str) -> set[str]:
    """A heading's anchor as MkDocs (toc's slugify) and as GitHub make it."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip()
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())
    github = re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text.lower()))
    return {mkdocs, github}


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file: its headings' (or their `{#id}`) and `<a id="...">`."""
    found = set()
    for line in prose(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", line)
        if heading:
            found |= {heading.group(2)} if heading.group(2) else slug(heading.group(1))
        found |= set(re.findall(r'<a (?:id|name)="([\w-]+)"', line))
    return frozenset(found)


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_links_resolve(path):
    """Relative Markdown links point at files that exist, and at headings that exist in them."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(path.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if where.is_relative_to(
            ROOT / "docs" / "results"
        ):  # study figures the site takes in (docs/hooks.py)
            where = ROOT / where.relative_to(ROOT / "docs")
        if not where.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{rel(path)}: broken links: {broken}"


def test_docs_anchors_cited_in_code_exist():
    """The code's docstrings and comments cite docs pages by anchor (`docs/schemes/...md#fox`)."""
    broken = set()
    sources = [
        *ROOT.glob("relpos_ablate/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tests/**/*.py"),
    ]
    for source in (path for path in sources if path.name != Path(__file__).name):
        for page, anchor in re.findall(r"\b(docs/[\w/.-]+\.md)(?:#([\w-]+))?", source.read_text()):
            target = ROOT / page
            if not target.exists() or anchor and anchor not in anchors(target):
                broken.add(f"{rel(source)}: {page}#{anchor}")
    assert not broken, f"citations of docs pages that do not exist: {sorted(broken)}"


# --- commands, flags and make targets -------------------------------------------------------------


@cache
def subcommands() -> dict[str, set[str]]:
    import argparse

    from relpos_ablate.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {flag for act in sub._actions for flag in act.option_strings}
        for name, sub in action.choices.items()
    }


def commands(text: str) -> list[str]:
    """`relpos-ablate ...` invocations in shell blocks and code spans, continuation lines joined."""
    shell = [
        b.code.replace("\\\n", " ")
        for b in blocks(text)
        if b.info in ("bash", "sh", "shell", "console")
    ]
    lines = [line for code in shell for line in code.splitlines()] + code_spans(text)
    return [
        m.group(1)
        for line in lines
        for m in re.finditer(r"(?:^|[\s;&|(])(relpos-ablate(?:\s+[^;&|#]*)?)", line)
    ]


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_commands_and_flags_exist(path):
    known, wrong = subcommands(), []
    for command in commands(path.read_text()):
        words = command.split()
        if len(words) == 1 or words[1].startswith(("-", "<")):
            continue
        if words[1] not in known:
            wrong.append(f"{command!r}: no command {words[1]!r}")
            continue
        flags = {word.split("=")[0] for word in words[2:] if re.match(r"^--[a-z]", word)}
        wrong += [
            f"{command!r}: {words[1]} has no flag {flag}"
            for flag in sorted(flags - known[words[1]])
        ]
    assert not wrong, f"{rel(path)}: {wrong}"


def test_version_is_pyprojects(capsys):
    """`relpos-ablate --version` prints the version pyproject.toml gives (the changelog names it
    too)."""
    from relpos_ablate.cli import main

    version = re.search(
        r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M
    ).group(1)
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"relpos-ablate {version}"
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_make_targets_exist(path):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    text = path.read_text()
    named = set(
        re.findall(
            r"\bmake ([a-z][\w-]*)", "\n".join(code_spans(text) + [b.code for b in blocks(text)])
        )
    )
    assert named <= targets, (
        f"{rel(path)} names make targets that do not exist: {sorted(named - targets)}"
    )


# --- the front door -------------------------------------------------------------------------------


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300"
    head = "\n".join(lines[:40])
    assert "make demo" in head and "make test" in head, (
        "make demo and make test belong in the README's first 40 lines"
    )


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {rel(page).removeprefix("docs/") for page in ROOT.glob("docs/**/*.md")}
    assert not {page for page in pages if page not in nav}, (
        "docs pages missing from mkdocs.yml's nav"
    )


def tracked(folder: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def test_every_study_folder_has_a_readme():
    studies = sorted({path.split("/")[1] for path in tracked("results") if path.count("/") >= 2})
    index = (ROOT / "results" / "README.md").read_text()
    assert not [s for s in studies if not (ROOT / "results" / s / "README.md").exists()], (
        "study folders without a README"
    )
    assert not [s for s in studies if f"results/{s}" not in index and f"{s}/" not in index], (
        "study folders missing from results/README.md"
    )


def test_benchmark_results_are_indexed():
    index = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    files = [
        p.removeprefix("benchmarks/results/")
        for p in tracked("benchmarks/results")
        if not p.endswith("README.md")
    ]
    assert not [f for f in files if f not in index], (
        "benchmarks/results files missing from its README.md"
    )
