"""Numbers that cannot drift: every decimal number a results README (and the summaries of the
studies in the top-level README and docs/reproductions.md) quotes appears in a committed table or
report of that study, or in its summary.csv; and every committed report.md is what `relpos-ablate
report` computes from the committed summary.csv today.

Run metadata is exempt (lines about wall time and the machine, software versions), and so are
integers (counts, lengths, seeds): the test is about measured values.

Run: .venv/bin/python -m pytest tests/test_results_numbers.py -q
"""

import io
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.studies import make_report

RESULTS = Path(__file__).resolve().parents[1] / "results"
README = RESULTS.parent / "README.md"
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.]*\d)")
EXEMPT_LINE = re.compile(
    r"wall time|machine|measured on|torch \d|lightning \d|python \d|version", re.I
)
TABLE_FILES = ("*.md", "*.tex", "grid.txt", "appb.txt")
LINKED = re.compile(r"\]\(\.\./([\w-]+)/")
STUDIES = sorted(p.parent for p in RESULTS.glob("*/README.md"))


def quoted(text: str) -> list[str]:
    """The decimal numbers of the prose and tables, outside code blocks and exempt lines."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not (fenced or line.startswith("    ") or EXEMPT_LINE.search(line)):
            found += NUMBER.findall(line)
    return found


def committed(path: Path) -> str | None:
    """A file as the last commit holds it (`make demo` rewrites results/demo/ on another machine,
    within its rounding, and a quote is checked against what was committed); the working tree's
    where git has no copy (a tree that is not a clone, a file not committed yet)."""
    shown = subprocess.run(
        ["git", "show", f"HEAD:{path.relative_to(RESULTS.parent).as_posix()}"],
        cwd=RESULTS.parent,
        capture_output=True,
        text=True,
    )
    if shown.returncode == 0:
        return shown.stdout
    return path.read_text() if path.exists() else None


def committed_numbers(study: Path) -> tuple[set[str], pd.DataFrame | None]:
    """Every decimal number in the study's committed tables and reports (as written), and its
    summary."""
    texts = [
        committed(p)
        for pattern in TABLE_FILES
        for p in study.glob(pattern)
        if p.name != "README.md"
    ]
    summary = committed(study / "summary.csv")
    numbers = {n for text in texts if text for n in NUMBER.findall(text)}
    return numbers, read_summary(io.StringIO(summary)) if summary is not None else None


def in_summary(number: str, summary: pd.DataFrame | None) -> bool:
    """Whether a value of the summary's numeric columns rounds to the number as written."""
    if summary is None:
        return False
    decimals = len(number.split(".")[1])
    values = summary.select_dtypes("number").to_numpy().ravel()
    return bool((abs(values - float(number)) <= 0.5 * 10**-decimals + 1e-12).any())


def unsourced(text: str, pools: list[tuple[set[str], pd.DataFrame | None]]) -> list[str]:
    """The numbers `text` quotes that no pool (committed_numbers of a study) holds."""
    return [
        n
        for n in quoted(text)
        if not any(n in numbers or in_summary(n, summary) for numbers, summary in pools)
    ]


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_every_number_in_a_results_readme_comes_from_its_committed_data(study):
    """From its own folder, or from a study it links to (../<name>/...)."""
    text = (study / "README.md").read_text()
    pools = [committed_numbers(study)] + [
        committed_numbers(RESULTS / name)
        for name in sorted(set(LINKED.findall(text)))
        if (RESULTS / name).is_dir()
    ]
    missing = unsourced(text, pools)
    assert missing == [], (
        f"{study.name}/README.md quotes numbers no committed table, report or summary holds"
    )


def section(title: str) -> str:
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


REPRODUCTIONS = RESULTS.parent / "docs" / "reproductions.md"
SUMMARIES = {
    "README.md#reproductions": lambda: section("Reproductions"),
    "docs/reproductions.md": REPRODUCTIONS.read_text,
}
"""The summaries of the studies outside results/: the README's and the documentation's."""


@pytest.mark.parametrize("where", SUMMARIES)
def test_the_summaries_quote_only_committed_numbers(where):
    pools = [committed_numbers(study) for study in RESULTS.iterdir() if study.is_dir()]
    assert unsourced(SUMMARIES[where](), pools) == []


READ_WITH = {
    "xl_table6_cpu": ("xl_context_cpu",),
    "length_generalization": ("length_generalization_cap",),
    "fair_baselines": ("fair_baselines_2000",),
    "hybrid_schedules": ("hybrid_schedules_retrieval",),
}
"""The reports written from more than one study's summary.csv (the Makefile's repro-xl, lengthgen
and fair-baselines): Table 6 with its fair no-memory control, the length study with its step-cap
runs, the fair baselines with their longer budget."""


@pytest.mark.parametrize("report", sorted(RESULTS.glob("*/report.md")), ids=lambda p: p.parent.name)
def test_a_committed_report_is_what_its_summary_gives_today(report):
    from relpos_ablate.analysis.collect import merge_frames

    frame = read_summary(report.parent / "summary.csv")
    for other in READ_WITH.get(report.parent.name, ()):
        if (
            RESULTS / other / "summary.csv"
        ).exists():  # a part not run yet (the step-cap runs) is not read
            frame = merge_frames(read_summary(RESULTS / other / "summary.csv"), frame)
    assert make_report(frame) == report.read_text()


def test_the_checks_see_a_typed_number(tmp_path):
    """Not vacuous: a number typed into prose that no table holds is found; metadata and code are
    not."""
    text = (
        "ALiBi reaches 6.45 at 4L.\n**Wall time:** 47.6 min\n```\nmake 1.5\n```\ntorch 2.13, 3 "
        "seeds\n"
    )
    assert quoted(text) == ["6.45"]
    assert not in_summary("6.45", pd.DataFrame({"ppl": [6.4649]})) and in_summary(
        "6.46", pd.DataFrame({"ppl": [6.4649]})
    )


NOT_SIGNIFICANT = re.compile(
    r"not significant|not significantly|n\.s\.|no significant|no ordering", re.I
)
SAMENESS = re.compile(
    r"\b(ties|tied|tie with|matches|matched|(?<!exact )match|matching|equally|unaffected|"
    r"indistinguishable|alike|no different|as good as|on par)\b|\bsame\b(?! (runs?|targets?|seeds?|"
    r"models?|data|settings?|lengths?|spec|rates?|shares?|way|first|budget|steps|characters|tokens|"
    r"validation|preset|configuration|threshold|examples?|task))",
    re.I,
)
RANK_TIE = re.compile(r"\bties (share|averaged|all bold)")
WORDED = sorted({*RESULTS.glob("*/report.md"), *RESULTS.glob("*/README.md"), README, REPRODUCTIONS})


def clauses(text: str) -> list[str]:
    """Table cells, lines, sentences and semicolon-separated parts: the span a verdict speaks
    for."""
    return [
        c
        for line in text.splitlines()
        for cell in line.split("|")
        for c in re.split(r";|\. ", cell)
    ]


@pytest.mark.parametrize("path", WORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_not_significant_is_never_worded_as_sameness(path):
    """A test that finds no difference is no evidence of sameness: with n = 3 seeds it is mostly low
    power. Such a result is written "not significant (difference, 95% CI)", never "ties", "matches",
    "the same", "unaffected" (a claim of equivalence needs a margin and a TOST:
    analysis/stats.py)."""
    text = path.read_text()
    worded = [c.strip() for c in clauses(text) if NOT_SIGNIFICANT.search(c) and SAMENESS.search(c)]
    assert worded == [], f"{path}: a non-significant result worded as sameness"
    ties = [
        line
        for line in text.splitlines()
        if re.search(r"\bties\b", line) and not RANK_TIE.search(line)
    ]
    assert ties == [], f"{path}: 'ties' for results"
