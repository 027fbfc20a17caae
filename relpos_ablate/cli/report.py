"""`relpos-ablate collect | table | report`: results dir -> summary frame, paper-style tables, the
studies' reports (`plot`: cli/plot.py; the results each reads: cli/sources.py)."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.cli import UsageError
from relpos_ablate.cli.sources import collected, frame_of, keys, planned_only
from relpos_ablate.studies import LAYOUT_NAMES

SUFFIX_FORMATS = {".md": "markdown", ".tex": "latex", ".csv": "csv"}
SUMMARY_COLUMNS = ("run_id", "status", "seed", "segment_len", "mem_len", "attn_len")
CORRECTION_CHOICES = ("holm", "bh", "none")
SCALE_CHOICES = ("loss", "ppl", "bpc", "bpb", "doc_loss", "beyond_loss", "acc", "exact_match")
"""The scales of an analysis plan (config/plan.py SCALES; text here so --help needs no pandas)."""
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
    p.add_argument(
        "--aggregate",
        nargs=2,
        metavar=("A", "B"),
        help="instead of the report: one interval for A against B over many cells, each side "
        "FIELD=VALUE[,FIELD=VALUE...] (e.g. encoding=alibi encoding=nope): the interquartile mean "
        "of each, their difference and P(A better than B), with 95%% stratified-bootstrap "
        "intervals (seeds resampled within each cell); exploratory unless the spec's analysis: "
        "block declares it",
    )
    p.add_argument(
        "--over",
        nargs="+",
        metavar="FIELD",
        help="--aggregate's cells: every value combination of these fields (e.g. data.task "
        "segment_len)",
    )
    p.add_argument(
        "--scale",
        choices=SCALE_CHOICES,
        help="--aggregate's metric (default: the spec's analysis scale, else loss for text and "
        "the task's main metric)",
    )
    p.set_defaults(func=cmd_report)


def cmd_collect(args: argparse.Namespace) -> int:
    from relpos_ablate.io import atomic_write_bytes, atomic_write_text

    frame = collected(args.dir)
    if args.merge is not None:
        from relpos_ablate.analysis.collect import merge_frames, read_summary

        if not args.merge.is_file():
            raise UsageError(
                f"--merge: {args.merge}: not found; give a summary.csv that `collect` wrote"
            )
        frame = merge_frames(frame, read_summary(args.merge))
    if args.spec:
        frame = planned_only(frame, args.spec)
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


def cmd_report(args: argparse.Namespace) -> int:
    if args.aggregate is not None or args.over is not None or args.scale is not None:
        return _emit(_aggregate(args), args.out)
    if args.html is not None:
        _html_report(args.source, args.html)
        if args.out is None:
            return 0
    from relpos_ablate.studies import make_report

    return _emit(make_report(frame_of(args.source), args.correction), args.out)


def _aggregate(args: argparse.Namespace) -> str:
    """`report SOURCE --aggregate A B --over FIELD...` (analysis/planned.py run_aggregate)."""
    from relpos_ablate.analysis.planned import aggregate_line
    from relpos_ablate.analysis.table_options import read_spec

    if args.aggregate is None:
        raise UsageError("--over and --scale go with --aggregate A B")
    if not args.over:
        raise UsageError(
            "--aggregate A B needs --over FIELD... (the fields whose values are the cells)"
        )
    df = frame_of(args.source)
    a, b = (tuple(c.strip() for c in side.split(",") if c.strip()) for side in args.aggregate)
    return aggregate_line(df, read_spec(df), a, b, tuple(args.over), args.scale) + "\n"


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
    frame = collected(sources[0])
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
        rows=keys(args.rows),
        cols=keys(args.cols),
        metric=args.metric,
        baseline=args.baseline,
        correction=args.correction,
        layout=args.layout,
        format=fmt,
        best_over=args.best_over,
        select_split=args.select_split,
        report_split=args.report_split,
        where=keys(args.where),
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

    found = {path: frame_of(path) for path in args.dir}
    runs = {path: frame.get("run_dir", frame.index).nunique() for path, frame in found.items()}
    paths = sorted(found, key=lambda path: (-runs[path], str(path)))
    frames, lines = [found[path] for path in paths], []
    if not (args.spec or args.all_runs):
        for k, frame in enumerate(frames):
            frames[k], notes = planned_by_their_specs(frame)
            lines += notes
    frame = pool_frames(frames, [str(path) for path in paths])
    if args.spec:
        frame = planned_only(frame, args.spec)
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
