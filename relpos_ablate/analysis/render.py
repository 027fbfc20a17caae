"""A finished table (labels + mean ± std cells) written as GitHub Markdown, booktabs LaTeX or CSV.

`Table` is layout-neutral: tables.py builds it (the grid layout and the XL-Table-6 layout alike),
this module only writes it out, so both layouts render identically in every format.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field

FORMATS = ("markdown", "latex", "csv")
STAR_LEVELS = ((0.001, "***"), (0.01, "**"), (0.05, "*"))
"""Adjusted p-value thresholds for the significance stars (the family's correction applied:
stats.py)."""
STAR_LEGEND = "* p<0.05, ** p<0.01, *** p<0.001"


@dataclass
class Cell:
    """Mean, standard deviation (ddof=1; NaN for one seed) and count of a metric over seeds."""

    mean: float
    std: float
    n: int
    best: bool = False
    p: float = math.nan
    """The test's p-value against the baseline row, adjusted for the table's family (NaN: no
    test)."""
    p_raw: float = math.nan
    """The same test's p-value before the correction."""

    @property
    def stars(self) -> str:
        return next((s for level, s in STAR_LEVELS if self.p < level), "")


Value = Cell | str | None
"""A table entry: a statistic, a plain label (e.g. an attention length), or missing."""


@dataclass
class Table:
    """Label columns (`index`), value columns, and one (labels, values) pair per row."""

    index: list[str]
    columns: list[str]
    rows: list[tuple[list[str], list[Value]]]
    caption: str
    decimals: int = 2
    show_n: bool = False
    """Print the seed count in every cell (when counts differ between cells)."""
    notes: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)
    """One line per test the table states (its means, difference, 95% CI, raw and adjusted p);
    Markdown lists them under the caption, CSV carries the p-values per cell."""
    power: str = ""
    """The tests' power line (stats.Family.power_line), under the list."""
    appendix: Table | None = None
    """A second table of the same data (a layout's summary), written after this one in the same
    format."""


def format_stat(cell: Cell, decimals: int, show_n: bool, pm: str = "±") -> str:
    text = f"{cell.mean:.{decimals}f}"
    if not math.isnan(cell.std):
        text += f" {pm} {cell.std:.{decimals}f}"
    return text + (f" (n={cell.n})" if show_n else "")


def to_markdown(table: Table) -> str:
    """A GitHub pipe table; best cells in **bold**, stars escaped so they are not read as
    emphasis."""
    header = [*table.index, *table.columns]
    lines = [
        _md_row(header),
        "|"
        + "|".join(":---" if k < len(table.index) else "---:" for k in range(len(header)))
        + "|",
    ]
    for labels, values in table.rows:
        lines.append(_md_row([*labels, *(_md_value(v, table) for v in values)]))
    tests = "".join(f"\n- {line}" for line in table.tests) + (
        f"\n\n{table.power}" if table.power else ""
    )
    return (
        "\n".join(lines)
        + f"\n\n{table.caption}\n"
        + (f"\nTests:\n{tests}\n" if table.tests else "")
    )


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _md_value(value: Value, table: Table) -> str:
    if not isinstance(value, Cell):
        return "—" if value is None else str(value)
    text = format_stat(value, table.decimals, table.show_n)
    text = f"**{text}**" if value.best else text
    return text + value.stars.replace("*", "\\*")


LATEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "✓": r"\checkmark",
    "✗": r"$\times$",
    "—": "---",
    "<": r"$<$",
    ">": r"$>$",
    "|": r"\textbar{}",  # OT1 text fonts print < > | as other glyphs
    "α": r"$\alpha$",  # a family's level in a caption (stats.Family.heading)
}


def latex_escape(text: str) -> str:
    return "".join(LATEX_ESCAPES.get(ch, ch) for ch in str(text))


def to_latex(table: Table) -> str:
    """A `table` float with a booktabs tabular (needs \\usepackage{booktabs}, amssymb for ✓)."""
    spec = "l" * len(table.index) + "r" * len(table.columns)
    header = " & ".join(latex_escape(h) for h in [*table.index, *table.columns]) + r" \\"
    body = [
        " & ".join([*(latex_escape(x) for x in labels), *(_latex_value(v, table) for v in values)])
        + r" \\"
        for labels, values in table.rows
    ]
    return "\n".join(
        [
            r"% requires \usepackage{booktabs} (and amssymb for \checkmark)",
            r"\begin{table}[t]",
            r"\centering",
            rf"\begin{{tabular}}{{{spec}}}",
            r"\toprule",
            header,
            r"\midrule",
            *body,
            r"\bottomrule",
            r"\end{tabular}",
            rf"\caption{{{latex_escape(table.caption)}}}",
            r"\end{table}",
            "",
        ]
    )


def _latex_value(value: Value, table: Table) -> str:
    if not isinstance(value, Cell):
        return "---" if value is None else latex_escape(value)
    text = format_stat(value, table.decimals, table.show_n, pm=r"$\pm$")
    text = rf"\textbf{{{text}}}" if value.best else text
    return text + (f"$^{{{value.stars}}}$" if value.stars else "")


def to_csv(table: Table) -> str:
    """Numbers, not strings: per value column `<col>`, `<col> std`, `<col> n`, `<col> best`, `<col>
    p` (adjusted for the table's family), `<col> p raw`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    stat_cols = [
        k for k, _ in enumerate(table.columns) if any(isinstance(r[1][k], Cell) for r in table.rows)
    ]
    header = list(table.index)
    for k, name in enumerate(table.columns):
        header += (
            [name, f"{name} std", f"{name} n", f"{name} best", f"{name} p", f"{name} p raw"]
            if k in stat_cols
            else [name]
        )
    writer.writerow(header)
    for labels, values in table.rows:
        line = list(labels)
        for k, value in enumerate(values):
            line += _csv_value(value) if k in stat_cols else ["" if value is None else value]
        writer.writerow(line)
    return out.getvalue()


def _csv_value(value: Value) -> list:
    if not isinstance(value, Cell):
        return ["", "", "", "", "", ""]
    return [
        value.mean,
        _blank(value.std),
        value.n,
        value.best,
        _blank(value.p),
        _blank(value.p_raw),
    ]


def _blank(x: float) -> float | str:
    """NaN as an empty field: every CSV reader treats '' as missing."""
    return "" if math.isnan(x) else x


def render(table: Table, fmt: str) -> str:
    """The table (and its appendix after a blank line) in one of FORMATS."""
    writers = {"markdown": to_markdown, "latex": to_latex, "csv": to_csv}
    if fmt not in writers:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return writers[fmt](table) + (
        "" if table.appendix is None else "\n" + render(table.appendix, fmt)
    )
