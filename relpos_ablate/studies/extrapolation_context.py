"""App. B of the `alibi_extrapolation_cpu` report (extrapolation.py): windows of L at small
strides S on the first max_targets targets, next to non-overlapping segments of 2L and 4L on the
same targets (`appb_section`), and the loss at an exact context c <= L (`exact_context`: sliding
windows of c at stride 1, on the targets every such window scores in full), which says why a stride
above 1 can beat stride 1 (`context_section`). Every comparison is of the same runs: paired
t-tests, one family per section."""

from __future__ import annotations

import numpy as np
import pandas as pd

from relpos_ablate.analysis.stats import Family
from relpos_ablate.studies.extrapolation_samples import (
    family_note,
    label_length,
    mean,
    per_seed,
    verdicts,
)


def appb_section(data, encodings, train, correction) -> str:
    subset = data[data["max_targets"] > 0]
    if subset.empty:
        return (
            "## App. B: windows of L at small strides\n\nNo App. B settings in these runs (`make "
            "repro-extrapolation` adds them with `relpos-ablate evaluate`).\n"
        )
    targets = int(subset["max_targets"].iloc[0])
    strides = sorted(
        {s for s in subset.loc[subset["protocol"] == "sliding", "stride"] if s is not None},
        reverse=True,
    )
    longer = sorted(set(subset.loc[subset["protocol"] == "non_overlapping", "segment_len"]))
    head = [
        "| encoding | "
        + " | ".join(
            [f"stride {s}" for s in strides]
            + [f"non-overlapping {label_length(n, train)}" for n in longer]
        )
        + " | stride 1 vs stride L | stride 1 vs non-overlapping "
        + (label_length(longer[-1], train) if longer else "")
        + " |",
        "|:---|" + "---:|" * (len(strides) + len(longer)) + ":---|:---|",
    ]
    family = Family(
        "App. B: stride 1 vs stride L and vs the longest non-overlapping segment, each encoding",
        correction,
    )
    rows = []
    for encoding in encodings:
        sweep = {
            s: per_seed(data, encoding, "sliding", train, stride=s, max_targets=targets)
            for s in strides
        }
        plain = {
            n: per_seed(data, encoding, "non_overlapping", n, max_targets=targets) for n in longer
        }
        if not any(sweep.values()):
            continue
        cells = [
            f"{mean(v.values()):.3f}" if v else "—" for v in [*sweep.values(), *plain.values()]
        ]
        one, full = sweep.get(1, {}), sweep.get(train, {})
        tests = [
            family.compare("stride 1", one, f"stride {train}", full, decimals=3),
            family.compare("stride 1", one, "non-overlapping", plain[longer[-1]], decimals=3)
            if longer
            else "—",
        ]
        rows.append([f"| {encoding}", *cells, *tests])
    head += [verdicts(row) + " |" for row in rows]
    return (
        f"## App. B: windows of L at small strides\n\nppl on the first {targets:,} targets of the "
        f"validation split ({targets // 8:,} of each of its 8 streams), the same targets in every "
        f"column: sliding windows of L = {train} moved by S (each scored target sees L − S + 1 to "
        f"L tokens; the first window of a stream scores all its targets, with 1 to L tokens, at "
        f"every stride) and non-overlapping segments of 2L and 4L. If an encoding's gain past L "
        f"under non-overlapping evaluation came only from fewer early tokens (the early token "
        f"curse), stride 1 at L would come as close as non-overlapping at 4L; if it uses more "
        f"than L tokens of context, non-overlapping at 4L is better. Every column scores the same "
        f"runs: paired t-tests.\n\n" + "\n".join(head) + "\n" + family_note(family)
    )


def exact_context(data: pd.DataFrame, encoding: str) -> dict[int, dict[str, float]]:
    """context c -> run dir -> ppl with exactly c tokens of context (sliding windows of c at
    stride 1) on the targets every such window scores in full (collect's ladder_loss: no stream's
    first window)."""
    if "ladder_loss" not in data:
        return {}
    rows = data[
        (data["encoding"] == encoding)
        & (data["protocol"] == "sliding")
        & (data["max_targets"] > 0)
        & data["stride"].map(lambda v: v == 1)
        & np.isfinite(pd.to_numeric(data["ladder_loss"], errors="coerce"))
    ]
    found: dict[int, dict[str, float]] = {}
    for run, c, loss in zip(rows["run_dir"], rows["segment_len"], rows["ladder_loss"]):
        found.setdefault(int(c), {})[run] = float(np.exp(float(loss)))
    return found


def context_section(data, encodings, train, correction) -> str:
    """Perplexity at an exact context c <= L, on targets every window scores in full, per encoding;
    the best c against c = L, and the best stride of App. B against stride 1 (the same runs:
    paired)."""
    curves = {e: exact_context(data, e) for e in encodings}
    curves = {e: by_c for e, by_c in curves.items() if len(by_c) > 1}
    if not curves:
        return ""
    contexts = sorted({c for by_c in curves.values() for c in by_c})
    targets = sorted(
        set(pd.to_numeric(data.loc[data["ladder_loss"].notna(), "ladder_targets"]).astype(int))
    )
    subset = data[data["max_targets"] > 0]
    strides = sorted(
        {
            s
            for s in subset.loc[
                (subset["protocol"] == "sliding") & (subset["segment_len"] == train), "stride"
            ]
            if s is not None
        }
    )
    family = Family(
        "exact context: the best context vs L, and the best stride vs stride 1, each encoding",
        correction,
    )
    head = [
        "| encoding | "
        + " | ".join(f"c = {c}" for c in contexts)
        + " | best c vs c = L | best stride vs stride 1 |",
        "|:---|" + "---:|" * len(contexts) + ":---|:---|",
    ]
    rows = []
    for encoding, by_c in curves.items():
        best = min(by_c, key=lambda c: (mean(by_c[c].values()), -c))
        cells = [f"{mean(by_c[c].values()):.3f}" if c in by_c else "—" for c in contexts]
        at_context = (
            family.compare(
                f"c = {best}", by_c[best], f"c = {train}", by_c.get(train, {}), decimals=3
            )
            if best != train
            else "best at c = L"
        )
        sweep = {
            st: per_seed(
                data,
                encoding,
                "sliding",
                train,
                stride=st,
                max_targets=int(subset["max_targets"].iloc[0]),
            )
            for st in strides
        }
        sweep = {st: v for st, v in sweep.items() if v}
        fastest = min(sweep, key=lambda st: (mean(sweep[st].values()), st)) if sweep else None
        at_stride = (
            family.compare(
                f"stride {fastest}", sweep[fastest], "stride 1", sweep.get(1, {}), decimals=3
            )
            if fastest not in (None, 1)
            else "best at stride 1"
        )
        rows.append([f"| {encoding}", *cells, at_context, at_stride])
    head += [verdicts(row) + " |" for row in rows]
    return (
        f"## Loss at an exact context: why a stride can beat stride 1\n\nppl with exactly c "
        f"tokens of context (sliding windows of c moved by 1) on the {targets[0]:,} targets of "
        f"App. B's that every window scores in full (each stream's first {contexts[-1] - 1} "
        f"targets left out: the first window scores them with fewer tokens), the same targets in "
        f"every column and run. Stride 1 gives every target c = L = {train} tokens; stride S "
        f"gives a target between L − S + 1 and L. If the loss is lowest below c = L, a stride "
        f"above 1 scores targets at those shorter contexts and beats stride 1. best c: the lowest "
        f"mean; best stride: App. B's lowest mean at L (its columns, on all of App. B's targets). "
        f"Each comparison: the same runs, a paired t-test.\n\n"
        + "\n".join(head)
        + "\n"
        + family_note(family)
    )
