"""`relpos-ablate collect | table | plot`: results dir -> summary frame, paper-style tables,
figures."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.cli import UsageError
from relpos_ablate.studies import (
    FIGURE_KINDS as STUDY_FIGURES,
)
from relpos_ablate.studies import (
    LAYOUT_NAMES,
)
from relpos_ablate.studies import (
    SUMMARY_FIGURES as STUDY_SUMMARY_FIGURES,
)

SUFFIX_FORMATS = {".md": "markdown", ".tex": "latex", ".csv": "csv"}
SUMMARY_COLUMNS = ("run_id", "status", "seed", "segment_len", "mem_len", "attn_len")
MAX_PROBLEMS = 20
SUMMARY_FIGURES = ("extrapolation", *STUDY_SUMMARY_FIGURES)
"""Plot kinds drawn from the collected frame alone, so also from a committed summary.csv."""
CORRECTION_CHOICES = ("holm", "bh", "none")
"""Multiple-comparison corrections (analysis/stats.py CORRECTIONS; text here so --help needs no
scipy)."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "collect",
        help="gather every run of a results dir into one table (CSV/Parquet)",
        description="One row per (run, evaluation setting); broken runs are kept and reported.",
    )
    p.add_argument("dir", type=Path, help="results dir (results/<experiment> or results/)")
    p.add_argument(
        "--out",
        type=Path,
        help="write the frame to FILE (.csv or .parquet); default: print a summary",
    )
    p.add_argument(
        "--merge",
        type=Path,
        metavar="SUMMARY.csv",
        help="keep the rows of this earlier summary.csv for the runs the dir lacks (a committed "
        "study keeps its summary, not its run dirs: merge the runs added since); --out may be the "
        "same file",
    )
    p.add_argument(
        "--spec",
        type=Path,
        nargs="+",
        metavar="SPEC",
        help="keep only the runs these grid specs plan (drops the rows of runs a changed spec no "
        "longer has, e.g. after a fix to one encoding's settings); the dropped runs are counted",
    )
    p.set_defaults(func=cmd_collect)

    p = subparsers.add_parser(
        "table",
        help="paper-style table: mean ± std over seeds, best in bold",
        description="Defaults come from the grid spec's `table:` block, else from the data.",
    )
    p.add_argument(
        "dir",
        type=Path,
        nargs="+",
        metavar="DIR|summary.csv",
        help="results dir, or the summary.csv `collect` wrote of one (a layout that reads "
        "per-target losses, xl_table8, needs the run dirs); several: their runs together (e.g. a "
        "study and its control experiment)",
    )
    p.add_argument(
        "--rows",
        nargs="+",
        help="row keys: config fields (terms or model.attention.terms), variant axes",
    )
    p.add_argument(
        "--cols",
        nargs="+",
        help="column keys, e.g. segment_len (alias eval_len), attn_len, mem_len",
    )
    p.add_argument("--metric", help="metric in the cells (default: the task's main metric)")
    p.add_argument(
        "--format",
        choices=("markdown", "latex", "csv"),
        help="default: from --out's suffix, else markdown",
    )
    p.add_argument(
        "--baseline",
        help="row label to test the others against, column by column; several keys: 'a,b'. "
        "The test is chosen from the data: a paired t-test over the matched runs where "
        "a cell holds the same runs as the baseline's (another length, protocol, "
        "stride, ...), Welch's t-test where it holds other models",
    )
    p.add_argument(
        "--correction",
        choices=CORRECTION_CHOICES,
        help="the table's tests against the baseline are one family, corrected together: holm "
        "(default), bh (Benjamini-Hochberg false discovery rate) or none; stars read the adjusted "
        "p, the Markdown test list and the CSV give the raw p beside it (spec: table: "
        "{correction: ...})",
    )
    p.add_argument(
        "--where",
        nargs="+",
        metavar="FIELD=VALUE",
        help="keep only the evaluations whose field has (FIELD=VALUE) or has not (FIELD!=VALUE) "
        "this value, e.g. max_targets=2048 or protocol=sliding (default: the spec's table: where)",
    )
    p.add_argument(
        "--layout",
        metavar="NAME",
        choices=("grid", *LAYOUT_NAMES),
        help="grid (default), Transformer-XL's Table 6 (PPL init / best / Attn Len) or Table 8 "
        "(RECL at r = 0.1, 0.5, 1.0; needs eval.recl_contexts), or length_generalization (example "
        "tasks: test-length bins + OOD mean per task and encoding, then a rank-per-task summary)",
    )
    p.add_argument(
        "--best-over",
        metavar="KEY",
        help="tune KEY per row as papers tune each baseline (e.g. train.lr): each cell reports the "
        "--report-split metric at the KEY value whose --select-split metric (seed mean, same "
        "evaluation setting) is best, and shows that value; none: off",
    )
    p.add_argument(
        "--select-split",
        choices=("valid", "test"),
        help="--best-over: the split that picks (default valid)",
    )
    p.add_argument(
        "--report-split",
        choices=("valid", "test"),
        help="--best-over: the split reported (default test)",
    )
    versions = p.add_mutually_exclusive_group()
    versions.add_argument(
        "--spec",
        type=Path,
        nargs="+",
        metavar="SPEC",
        help="keep only the runs these grid specs plan (default: the runs each run's own spec, "
        f"recorded in its {rundir.RUN_INFO}, still plans; a run of an earlier version of the "
        "spec is left out and counted)",
    )
    versions.add_argument(
        "--all-runs",
        action="store_true",
        help="keep the runs their spec no longer plans (an earlier version's, e.g. before a "
        "change of train.max_steps under the same spec name)",
    )
    p.add_argument("--out", type=Path, help="write the table to FILE instead of printing it")
    p.set_defaults(func=cmd_table)

    p = subparsers.add_parser(
        "report",
        help="a study's derived numbers (trends, the tests behind orderings) as Markdown",
        description="The report function registered for the experiment the runs belong to "
        "(relpos_ablate/studies/), from DIR (a results dir) or a "
        "committed summary.csv; for a grid no study reports on, the table of its spec's table: "
        "block with the tests against its baseline.",
    )
    p.add_argument(
        "source",
        type=Path,
        nargs="+",
        metavar="DIR|summary.csv",
        help="an experiment's results dir or its summary.csv; several: a report that reads more "
        "than one experiment (xl_table6_cpu with xl_context_cpu, its no-memory control)",
    )
    p.add_argument(
        "--correction",
        choices=CORRECTION_CHOICES,
        help="each family of tests the report states (named in its heading) is corrected "
        "together: holm (default), bh (Benjamini-Hochberg false discovery rate) or none; "
        "orderings read the adjusted p, the raw p stands beside it (a grid no study reports on: "
        "its spec's table: correction, else holm)",
    )
    p.add_argument("--out", type=Path, help="write the report to FILE instead of printing it")
    p.add_argument(
        "--html",
        type=Path,
        metavar="OUT.html",
        help="one self-contained page of any grid's results dir instead (opens offline): runs' "
        "status and cost, the table with its tests, extrapolation, training curves, each run's "
        "bias curves and attention heatmaps by variant, seed, layer and head; with --out, the "
        "Markdown report too",
    )
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser(
        "plot",
        help="bias curves, attention / term heatmaps, extrapolation, loss-by-position and "
        "training curves, length generalization, attention diagnostics, passkey retrieval",
        description="On a run dir: that run's figure. On a grid dir: one per run plus an overview "
        "(extrapolation and position-loss: one figure of every run; lengthgen: exact match "
        "against task length, one panel per task; diagnostics: one per task; passkey: the depth "
        "tasks (passkey, niah_*, variable_tracking), a row of panels per task, one panel per "
        "variant).",
    )
    p.add_argument(
        "target",
        type=Path,
        help="a run dir or a results dir; for the kinds drawn from the collected "
        f"frame alone ({', '.join(SUMMARY_FIGURES)}) also a summary.csv that "
        "collect wrote",
    )
    p.add_argument(
        "--kind",
        required=True,
        choices=(
            "bias",
            "attention",
            "terms",
            "extrapolation",
            "position-loss",
            "curves",
            *STUDY_FIGURES,
        ),
        help=f"curves: training curves from each run's {rundir.METRICS}, loss against step, a "
        "line per variant (mean over seeds, min-max band); position-loss: mean loss by position "
        "in the segment / window, one panel per evaluation setting; lengthgen: example tasks, a "
        "line per variant (mean over seeds, min-max band), training lengths shaded; lr-sweep: the "
        "fair-baselines study, valid ppl against train.lr per encoding and each one's test ppl "
        "at its best lr over the best encoding's; context: the Transformer-XL study, each "
        "model's ppl against the context it sees on its RECL ladder (memory or sliding windows)",
    )
    p.add_argument("--out", type=Path, help="folder for the figures (default: TARGET/figures)")
    p.add_argument(
        "--metric",
        help="extrapolation, lengthgen, passkey: the metric shown (default: the main metric); "
        f"curves: a {rundir.METRICS} column (default: train_loss, and val_loss when logged)",
    )
    p.add_argument(
        "--x",
        default="segment_len",
        choices=("segment_len", "attn_len"),
        help="extrapolation: x axis",
    )
    p.add_argument(
        "--y",
        default="value",
        choices=("value", "ratio"),
        help="extrapolation: the metric, or its ratio to each run's metric at its training length",
    )
    p.add_argument(
        "--panels",
        metavar="FIELD",
        help="extrapolation: a panel per value of this field (default: "
        "the protocol, when it varies)",
    )
    p.add_argument(
        "--family-rows",
        action="store_true",
        help="extrapolation: a row of panels per encoding family (absolute, rotary, bias, "
        "data-dependent, other), each with its own y range; without it, families share a row "
        "unless a panel would hold more than 10 lines",
    )
    p.add_argument(
        "--where",
        nargs="+",
        metavar="FIELD=VALUE",
        help="extrapolation: keep only these evaluations (default: the spec's table: where)",
    )
    p.add_argument("--layer", type=int, default=-1, help="terms: layer index (default: the last)")
    p.add_argument("--head", type=int, default=0, help="terms: head index")
    p.add_argument(
        "--log-distance",
        action="store_true",
        help="bias: distance on a log scale (symmetric, linear within ±1)",
    )
    p.add_argument(
        "--formats", default="png,pdf", help="comma-separated figure formats (png, pdf, svg)"
    )
    p.set_defaults(func=cmd_plot)


def _collect(directory: Path):
    """collect() with its problems printed as warnings; a missing dir is a one-line error."""
    from relpos_ablate.analysis.collect import collect

    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory")
    frame = collect(directory)
    problems = frame.attrs["problems"]
    for line in problems[:MAX_PROBLEMS]:
        print(f"warning: {line}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS:
        print(f"warning: ... and {len(problems) - MAX_PROBLEMS} more problems", file=sys.stderr)
    return frame


def _frame(source: Path | list[Path]):
    """The collected frame of a results dir, or of the summary.csv `collect` wrote of one (the
    committed studies' data: their run dirs stay local); of several, their runs together."""
    from relpos_ablate.analysis.collect import merge_frames, read_summary

    if isinstance(source, list):
        frames = [_frame(one) for one in source]
        merged = frames[0]
        for frame in frames[1:]:
            merged = merge_frames(frame, merged)
        return merged
    if source.suffix == ".csv":
        if not source.is_file():
            raise UsageError(
                f"{source}: not found; give a results dir or a summary.csv that `collect` wrote"
            )
        return read_summary(source)
    return _collect(source)


def cmd_collect(args: argparse.Namespace) -> int:
    from relpos_ablate.io import atomic_write_bytes, atomic_write_text

    frame = _collect(args.dir)
    if args.merge is not None:
        from relpos_ablate.analysis.collect import merge_frames, read_summary

        if not args.merge.is_file():
            raise UsageError(
                f"--merge: {args.merge}: not found; give a summary.csv that `collect` wrote"
            )
        frame = merge_frames(frame, read_summary(args.merge))
    if args.spec:
        frame = _planned_only(frame, args.spec)
    runs = frame.drop_duplicates("run_id") if "run_id" in frame else frame
    states = (
        ", ".join(f"{n} {s}" for s, n in runs["status"].value_counts().items())
        if len(runs)
        else "none"
    )
    if args.out is None:
        shown = [
            c
            for c in (
                *SUMMARY_COLUMNS[:2],
                *frame.attrs["variant_axes"],
                *SUMMARY_COLUMNS[2:],
                *frame.attrs["metrics"],
            )
            if c in frame
        ]
        print(frame[shown].to_string(index=False) if len(frame) else "(no runs)", flush=True)
    elif args.out.suffix == ".csv":
        atomic_write_text(args.out, frame.to_csv(index=False))
    elif args.out.suffix == ".parquet":
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        atomic_write_bytes(args.out, buffer.getvalue())
    else:
        raise UsageError(
            f"--out: {args.out.suffix or args.out.name!r} is not supported; use .csv or .parquet"
        )
    where = f" -> {args.out}" if args.out else ""
    print(f"{len(runs)} runs ({states}), {len(frame)} rows{where}", file=sys.stderr)
    return 0


def _planned_only(frame, specs: list[Path]):
    """The rows of the runs the grid specs plan; the others are dropped with a one-line note."""
    from relpos_ablate.config import ConfigError
    from relpos_ablate.runner.grid import load_grid

    planned: set[str] = set()
    for spec in specs:
        try:
            planned |= {run.run_id for run in load_grid(spec).runs}
        except (OSError, ConfigError) as err:
            raise UsageError(f"--spec: {spec}: {err}") from None
    kept = frame[frame["run_id"].isin(planned)]
    dropped = sorted(set(frame["run_id"]) - planned)
    if dropped:
        print(
            f"--spec: dropped {len(dropped)} runs no spec plans ({', '.join(dropped[:5])}"
            f"{', ...' if len(dropped) > 5 else ''})",
            file=sys.stderr,
        )
    kept.attrs.update(frame.attrs)
    return kept


def cmd_report(args: argparse.Namespace) -> int:
    if args.html is not None:
        _html_report(args.source, args.html)
        if args.out is None:
            return 0
    from relpos_ablate.studies import make_report

    return _emit(make_report(_frame(args.source), args.correction), args.out)


def _html_report(sources: list[Path], out: Path) -> None:
    """`report DIR --html OUT.html` (analysis/html_report.py): the page reads the run dirs
    (the training metrics, checkpoints), so one results dir, not a summary.csv."""
    from relpos_ablate.analysis.html_report import write_html_report
    from relpos_ablate.studies import layouts

    if len(sources) != 1 or sources[0].suffix == ".csv":
        raise UsageError(
            "--html: give one results dir (the page reads its run dirs: training curves, "
            "trained weights), not a summary.csv or several sources"
        )
    frame = _collect(sources[0])
    for line in write_html_report(frame, out, str(sources[0]), layouts=layouts()):
        print(f"warning: {line}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)


def cmd_table(args: argparse.Namespace) -> int:
    from relpos_ablate.analysis.render import render
    from relpos_ablate.analysis.table_options import TableOptions, left_out_runs
    from relpos_ablate.studies import make_table

    if args.format is None and args.out is not None and args.out.suffix not in SUFFIX_FORMATS:
        raise UsageError(
            f"--out: {args.out.suffix or 'no suffix'!r} does not say the format; "
            f"use {', '.join(SUFFIX_FORMATS)} or give --format"
        )
    fmt = args.format or (SUFFIX_FORMATS.get(args.out.suffix) if args.out else None)
    options = TableOptions(
        rows=_keys(args.rows),
        cols=_keys(args.cols),
        metric=args.metric,
        baseline=args.baseline,
        correction=args.correction,
        layout=args.layout,
        format=fmt,
        best_over=args.best_over,
        select_split=args.select_split,
        report_split=args.report_split,
        where=_keys(args.where),
    )
    frame = _table_frame(args)
    table, resolved = make_table(frame, options)
    for line in left_out_runs(frame, resolved.metric, resolved.rows):
        print(f"warning: {line}", file=sys.stderr)
    return _emit(render(table, resolved.format), args.out)


def _table_frame(args: argparse.Namespace):
    """cmd_table's runs: each source's runs (those their spec still plans, or --spec's), pooled,
    each run once with its evaluations merged over its copies (analysis/sources.py). The order
    they are given in never changes the table: the source with the most runs comes first (a study
    before its control; its spec's table: block is read), then by name."""
    from relpos_ablate.analysis.collect import pool_frames
    from relpos_ablate.analysis.sources import one_copy_per_run, planned_by_their_specs

    found = {path: _frame(path) for path in args.dir}
    runs = {path: frame.get("run_dir", frame.index).nunique() for path, frame in found.items()}
    paths = sorted(found, key=lambda path: (-runs[path], str(path)))
    frames, lines = [found[path] for path in paths], []
    if not (args.spec or args.all_runs):
        for k, frame in enumerate(frames):
            frames[k], notes = planned_by_their_specs(frame)
            lines += notes
    frame = pool_frames(frames, [str(path) for path in paths])
    if args.spec:
        frame = _planned_only(frame, args.spec)
    frame, notes = one_copy_per_run(frame)
    for line in [*lines, *notes]:
        print(f"warning: {line}", file=sys.stderr)
    return frame.drop(columns="_source")


def _emit(text: str, out: Path | None) -> int:
    """Print the text, or write it to `out` atomically."""
    from relpos_ablate.io import atomic_write_text

    if out:
        atomic_write_text(out, text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text, end="")


def _keys(values: list[str] | None) -> tuple[str, ...] | None:
    """`--rows a b` and `--rows a,b` alike."""
    if values is None:
        return None
    return tuple(part for value in values for part in value.split(",") if part)


def cmd_plot(args: argparse.Namespace) -> int:
    from relpos_ablate.analysis import plots

    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bad = [f for f in formats if f not in plots.FIGURE_FORMATS]
    if bad or not formats:
        raise UsageError(
            f"--formats: {','.join(bad) or 'nothing'} not allowed; choose from "
            f"{', '.join(plots.FIGURE_FORMATS)}"
        )
    from_csv = args.target.suffix == ".csv"
    if from_csv and args.kind not in SUMMARY_FIGURES:
        raise UsageError(
            f"--kind {args.kind} reads the run dirs (trained models, evaluation records), not a "
            f"summary.csv; from a summary.csv: {', '.join(SUMMARY_FIGURES)}"
        )
    if not (args.target.is_file() if from_csv else args.target.is_dir()):
        raise UsageError(f"{args.target}: not {'found' if from_csv else 'a directory'}")
    out = args.out or (args.target.parent if from_csv else args.target) / "figures"
    if args.kind in STUDY_FIGURES:
        from relpos_ablate.studies import figure

        written, notes = figure(args.kind)(_frame(args.target), out, formats, args)
    # from the runs, or from the summary.csv collect wrote of them
    elif args.kind == "extrapolation":
        written, notes = plots.save_extrapolation(
            _frame(args.target),
            out,
            metric=args.metric,
            x=args.x,
            y=args.y,
            panels=args.panels,
            split_families=args.family_rows,
            where=_keys(args.where),
            formats=formats,
        )
    elif args.kind == "curves":
        from relpos_ablate.analysis.curves import save_curves

        written, notes = save_curves(_collect(args.target), out, args.metric, formats)
    elif args.kind == "position-loss":
        from relpos_ablate.analysis.positions import save_position_loss

        written, notes = save_position_loss(_collect(args.target), out, formats=formats)
    else:
        written, notes = plots.save_model_figures(
            _collect(args.target),
            args.kind,
            out,
            layer=args.layer,
            head=args.head,
            formats=formats,
            log_distance=args.log_distance,
        )
    for line in notes:
        print(f"warning: {line}", file=sys.stderr)
    for path in written:
        print(path)
    return 0
