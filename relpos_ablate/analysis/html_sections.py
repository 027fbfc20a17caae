"""The plain-HTML sections of the grid's page (html_report.py assembles it): the runs' status and
cost, a row per run and the totals (`status_section`), and the table `relpos-ablate table DIR` makes
with its tests, as an HTML table and as the Markdown the command prints (`table_section`); `esc` and
`notes_html`, which every section of the page uses."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping

import pandas as pd

from relpos_ablate.analysis.render import Cell, Table, format_stat, render
from relpos_ablate.analysis.settings import label
from relpos_ablate.config import ConfigError


def esc(text) -> str:
    return html.escape(str(text))


def notes_html(notes: list[str]) -> str:
    return "".join(f'<p class="note">{esc(line)}</p>' for line in notes)


# ---------------------------------------------------------------- status and cost


def status_section(variants: dict[str, list[pd.Series]]) -> str:
    """A row per run (variant, seed, id, state and reason, steps, wall time), then the totals."""
    rows, wall, steps, states = [], 0.0, 0, {}
    for name, runs in variants.items():
        for run in runs:
            state = str(run.get("status"))
            states[state] = states.get(state, 0) + 1
            seconds = _number(run.get("wall_time_s"))
            step = _number(run.get("step"))
            wall += 0.0 if math.isnan(seconds) else seconds
            steps += 0 if math.isnan(step) else int(step)
            reason = run.get("reason")
            cells = [
                name,
                label(run.get("seed")),
                run.get("run_id"),
                state + (f": {reason}" if isinstance(reason, str) and reason else ""),
            ]
            rows.append(
                "<tr>"
                + "".join(f'<td class="label">{esc(c)}</td>' for c in cells)
                + f"<td>{_count(step)} / {_count(_number(run.get('max_steps')))}</td>"
                + f"<td>{'—' if math.isnan(seconds) else f'{seconds:.1f}'}</td></tr>"
            )
    head = (
        "".join(f'<th class="label">{h}</th>' for h in ("variant", "seed", "run id", "state"))
        + "<th>steps / max</th><th>wall time (s)</th>"
    )
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    total = (
        f"<p>{sum(states.values())} runs ({counts}); {steps} training steps, "
        f"{wall:.1f} s of wall time in all (the runs' own clocks: runs on parallel slots "
        f"overlap).</p>"
    )
    return total + f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _count(value: float) -> str:
    return "—" if math.isnan(value) else str(int(value))


# ---------------------------------------------------------------- the table


def table_section(df: pd.DataFrame, layouts: Mapping | None = None) -> tuple[str, list[str]]:
    """The table `relpos-ablate table DIR` makes (the spec's table: block, else defaults from the
    data) with its tests against the baseline: the block's, else the first row's (`--baseline
    <first row>`); as HTML, and as the Markdown text the command prints. `layouts`: the studies'
    (relpos_ablate.studies.layouts(), which the command line passes: this layer names no study)."""
    from relpos_ablate.analysis.layouts import make_table
    from relpos_ablate.analysis.table_options import TableOptions, left_out_runs

    table, resolved = make_table(df, TableOptions(format="markdown"), layouts)
    notes = []
    if resolved.baseline is None and len(table.rows) > 1:
        first = ",".join(table.rows[0][0])
        try:
            options = TableOptions(format="markdown", baseline=first)
            table, resolved = make_table(df, options, layouts)
        except ConfigError as err:  # a label the baseline option cannot name (a comma in it)
            notes.append(f"no tests against the first row {first!r}: {err}")
    notes += left_out_runs(df, resolved.metric, resolved.rows)  # `table` warns of them likewise
    text = render(table, "markdown")
    parts = [table_html(t) for t in (table, table.appendix) if t is not None]
    source = f"<details><summary>as Markdown</summary><pre>{esc(text)}</pre></details>"
    return "".join(parts) + notes_html(notes) + source, notes


def table_html(table: Table) -> str:
    """A Table as an HTML table: best cells bold, stars after the value; caption, notes, the tests
    and their power line under it."""
    head = "".join(f'<th class="label">{esc(c)}</th>' for c in table.index) + "".join(
        f"<th>{esc(c)}</th>" for c in table.columns
    )
    body = []
    for labels, values in table.rows:
        cells = "".join(f'<td class="label">{esc(v)}</td>' for v in labels)
        cells += "".join(f"<td>{_cell(v, table)}</td>" for v in values)
        body.append(f"<tr>{cells}</tr>")
    tests = "".join(f"<li>{esc(line)}</li>" for line in table.tests)
    return (
        f"<table><tr>{head}</tr>{''.join(body)}</table><p>{esc(table.caption)}</p>"
        + notes_html(table.notes)
        + (f"<p>Tests:</p><ul>{tests}</ul>" if tests else "")
        + (f"<p>{esc(table.power)}</p>" if table.power else "")
    )


def _cell(value, table: Table) -> str:
    if not isinstance(value, Cell):
        return "—" if value is None else esc(value)
    text = esc(format_stat(value, table.decimals, table.show_n))
    return (f"<b>{text}</b>" if value.best else text) + esc(value.stars)
