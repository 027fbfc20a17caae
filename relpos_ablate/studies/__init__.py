"""The committed studies, one module (or small package) each, found by the grid spec's `name:`
through STUDIES, the one registry. The generic analysis layer (relpos_ablate/analysis/: collect,
tables, the statistics, rendering, plot primitives) names no study; a study builds on it, never the
other way.

A study module exposes up to three maps, and its entry here names what they hold, so that the
command line can list a study's layouts and figure kinds without importing pandas:
- `REPORTS`: experiment name (or a sorted tuple of names: a report that reads several experiments'
  runs together) -> report function (frame, correction) -> Markdown (`relpos-ablate report`);
- `LAYOUTS`: layout name -> analysis.layouts.LayoutSpec (`table --layout NAME`);
- `FIGURES`: plot kind -> function (collected frame, out dir, formats, parsed args) -> (written,
  notes).
A new study is one module plus its spec, and one entry below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from relpos_ablate.config import ConfigError


@dataclass(frozen=True)
class Study:
    module: str
    """Where its code lives."""
    experiments: tuple[str, ...]
    """The grid specs' names whose report it writes."""
    layouts: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    run_figures: tuple[str, ...] = ()
    """Those of its figures that read the run dirs (eval.json, checkpoints): not drawable from a
    summary.csv."""

    def load(self):
        return importlib.import_module(self.module)


STUDIES = (
    Study(
        "relpos_ablate.studies.xl",
        ("xl_table6_cpu", "xl_context_cpu"),
        ("xl_table6", "xl_table8"),
        ("context",),
    ),
    Study("relpos_ablate.studies.extrapolation", ("alibi_extrapolation_cpu",)),
    Study(
        "relpos_ablate.studies.fair_baselines",
        ("fair_baselines", "fair_baselines_2000"),
        figures=("lr-sweep",),
    ),
    Study(
        "relpos_ablate.studies.hybrid_schedules", ("hybrid_schedules", "hybrid_schedules_retrieval")
    ),
    Study(
        "relpos_ablate.studies.attention_plumbing",
        ("attention_plumbing",),
        figures=("plumbing",),
        run_figures=("plumbing",),
    ),
    Study(
        "relpos_ablate.studies.packed_documents",
        ("packed_documents",),
        figures=("documents",),
        run_figures=("documents",),
    ),
    Study(
        "relpos_ablate.studies.length_generalization",
        ("length_generalization", "length_generalization_cap"),
        ("length_generalization",),
        ("lengthgen", "diagnostics", "passkey"),
        run_figures=("diagnostics",),
    ),
)
LAYOUT_NAMES = tuple(name for study in STUDIES for name in study.layouts)
FIGURE_KINDS = tuple(kind for study in STUDIES for kind in study.figures)
SUMMARY_FIGURES = tuple(
    kind for study in STUDIES for kind in study.figures if kind not in study.run_figures
)


def make_report(df, correction: str | None = "holm") -> str:
    """The report of the one experiment the frame holds (one line naming what is wrong otherwise);
    every family of tests in it corrected by `correction` (analysis/stats.py; None: holm, or for a
    grid's own report its spec's `table: {correction: ...}`). An experiment no study reports on
    gets the report of its grid spec's `table:` block (analysis/grid_report.py) when its runs
    record a spec."""
    names = (
        sorted(str(name) for name in df["experiment"].dropna().unique())
        if "experiment" in df
        else []
    )
    if not names:
        raise ConfigError("report", "needs the runs of an experiment; found none")
    key = names[0] if len(names) == 1 else tuple(names)
    study = next((s for s in STUDIES if set(names) <= set(s.experiments)), None)
    reports = study.load().REPORTS if study else {}
    if key not in reports and len(names) == 1:
        from relpos_ablate.analysis.grid_report import grid_report, has_spec
        from relpos_ablate.analysis.table_options import read_spec

        if has_spec(df):
            planned = "analysis" in read_spec(df)
            return _planned(df, grid_report(df, correction, layouts(), planned))
    if key not in reports:
        known = sorted(
            " + ".join(k) if isinstance(k, tuple) else k for s in STUDIES for k in s.load().REPORTS
        )
        what = (
            f"experiment {names[0]!r}"
            if len(names) == 1
            else f"the experiments {' + '.join(names)} together"
        )
        # a grid's own report needs its spec (the `table:` block; each run's record names it)
        own = (
            ", and no grid spec readable from its runs' records for a report of its `table:` block"
            if len(names) == 1
            else ""
        )
        raise ConfigError(
            "report", f"no report for {what}{own}; reports exist for: {', '.join(known)}"
        )
    return _planned(df, reports[key](df, correction or "holm"))


def _planned(df, body: str) -> str:
    """The report under the `analysis:` plan of each experiment's grid spec that declares one
    (analysis/planned.py: each plan on its own experiment's runs and those of the experiments its
    cells name, `experiment=NAME`), else as it is."""
    from relpos_ablate.analysis.planned import experiments_named, with_plan
    from relpos_ablate.analysis.table_options import read_spec

    plans = []
    for name in sorted(str(n) for n in df["experiment"].dropna().unique()):
        spec = read_spec(df[df["experiment"] == name])
        if "analysis" in spec:
            named = {name, *experiments_named(spec["analysis"])}
            plans.append((name, df[df["experiment"].isin(named)], spec))
    return with_plan(plans, body) if plans else body


def layouts() -> dict:
    """Every study's table layouts by name (analysis.layouts.LayoutSpec)."""
    return {name: study.load().LAYOUTS[name] for study in STUDIES for name in study.layouts}


def make_table(df, options=None):
    """analysis.layouts.make_table with every study's layouts beside the generic ones."""
    # pandas and scipy only when a table is made
    from relpos_ablate.analysis.layouts import make_table as generic
    from relpos_ablate.analysis.table_options import TableOptions

    return generic(df, options or TableOptions(), layouts())


def figure(kind: str):
    """The figure function of a study's plot kind."""
    study = next((s for s in STUDIES if kind in s.figures), None)
    if study is None:
        raise ConfigError(
            "kind", f"{kind!r} is no study's figure; studies draw: {', '.join(FIGURE_KINDS)}"
        )
    return study.load().FIGURES[kind]
