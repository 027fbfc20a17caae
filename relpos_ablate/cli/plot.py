"""`relpos-ablate plot DIR`: figures of a run, a grid or a summary.csv (bias curves, attention and
term heatmaps, extrapolation, loss by position, training curves, the studies' figures)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.cli import UsageError
from relpos_ablate.cli.sources import collected, frame_of, keys
from relpos_ablate.studies import (
    FIGURE_KINDS as STUDY_FIGURES,
)
from relpos_ablate.studies import (
    SUMMARY_FIGURES as STUDY_SUMMARY_FIGURES,
)

SUMMARY_FIGURES = ("extrapolation", *STUDY_SUMMARY_FIGURES)
"""Plot kinds drawn from the collected frame alone, so also from a committed summary.csv."""


def register(subparsers) -> None:
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

        written, notes = figure(args.kind)(frame_of(args.target), out, formats, args)
    # from the runs, or from the summary.csv collect wrote of them
    elif args.kind == "extrapolation":
        written, notes = plots.save_extrapolation(
            frame_of(args.target),
            out,
            metric=args.metric,
            x=args.x,
            y=args.y,
            panels=args.panels,
            split_families=args.family_rows,
            where=keys(args.where),
            formats=formats,
        )
    elif args.kind == "curves":
        from relpos_ablate.analysis.curves import save_curves

        written, notes = save_curves(collected(args.target), out, args.metric, formats)
    elif args.kind == "position-loss":
        from relpos_ablate.analysis.positions import save_position_loss

        written, notes = save_position_loss(collected(args.target), out, formats=formats)
    else:
        written, notes = plots.save_model_figures(
            collected(args.target),
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
