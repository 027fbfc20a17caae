"""The report of `alibi_extrapolation_cpu` (the studies registry): every derived number its README
quotes, computed from the collected frame or the committed summary.csv.

Sections: T5's bucket configuration (where its far bucket starts), perplexity at L ... 16L relative
to L per encoding and protocol, sliding minus non-overlapping per length, App. B's stride sweep
(windows of L at strides S on the first max_targets targets, next to non-overlapping at 2L and 4L on
the same targets), T5 against rotary, and the paper's trends. Each section that states tests is one
family (analysis/stats.py): the test is chosen from the data (the same runs at two lengths,
protocols or strides: paired; two encodings: Welch's), corrected together, each difference with its
95% CI, and the family's power line.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.settings import normalized
from relpos_ablate.analysis.stats import Comparison, Family
from relpos_ablate.analysis.table_options import axis_orders, read_spec
from relpos_ablate.analysis.tables import sort_key
from relpos_ablate.config import ConfigError

EXTENSIONS = {"pi": "PI", "ntk": "NTK", "yarn": "YaRN", "llama3": "Llama 3"}


def frame(df: pd.DataFrame) -> pd.DataFrame:
    """The finished evaluations: one row per (run, setting) with a perplexity (stride and RoPE
    extension None where unset, max_targets 0)."""
    if "encoding" not in df:
        raise ConfigError(
            "report", "alibi_extrapolation_cpu's report needs the `encoding` axis of its grid"
        )
    done = df[
        (df["status"] == "done") & np.isfinite(pd.to_numeric(df["ppl"], errors="coerce"))
    ].copy()
    # None where unset (object columns: NaN is no key)
    for key, kind in (("stride", int), ("rope_scaling", str)):
        values = done[key] if key in done else [None] * len(done)
        done[key] = pd.Series(
            [None if normalized(v) is None else kind(v) for v in values],
            index=done.index,
            dtype=object,
        )
    done["max_targets"] = (
        pd.to_numeric(done.get("max_targets", 0), errors="coerce").fillna(0).astype(int)
    )
    return done


SETTING = ["encoding", "protocol", "segment_len", "max_targets", "stride", "rope_scaling"]
_settings: list = [None, {}]  # (the frame last indexed, its rows by setting)


def per_seed(
    data: pd.DataFrame,
    encoding: str,
    protocol: str,
    length: int,
    stride=None,
    rope_scaling=None,
    max_targets: int = 0,
) -> dict[str, float]:
    """run dir -> ppl of one encoding under one setting (the run names the unit a test pairs on), in
    the frame's row order. The report asks ~800 times of one `frame`: its rows are grouped by
    setting once (the frame is not changed after `frame` made it), not filtered per call (4 s of the
    report's 11)."""
    if _settings[0] is not data:
        grouped: dict[tuple, dict[str, float]] = {}
        for *key, run, ppl in zip(*(data[c] for c in SETTING), data["run_dir"], data["ppl"]):
            # equal numbers hash alike (512 and 512.0)
            grouped.setdefault(tuple(key), {})[run] = float(ppl)
        _settings[:] = [data, grouped]
    return dict(
        _settings[1].get((encoding, protocol, length, max_targets, stride, rope_scaling), {})
    )


def ratios(
    data: pd.DataFrame, encoding: str, protocol: str, length: int, train: int, **setting
) -> dict[str, float]:
    """Per run: ppl at `length` over the same run's ppl at the training length under the plain
    setting of the protocol (sliding at L with stride L scores exactly as non-overlapping at L)."""
    stride = train if protocol == "sliding" else None
    at = per_seed(data, encoding, protocol, length, **setting)
    base = per_seed(data, encoding, protocol, train, stride=stride)
    return {run: at[run] / base[run] for run in sorted(at) if run in base}


def family_note(family: Family) -> str:
    """The lines under a section's table that name its family, its correction and its power."""
    return f"\n{family.summary()}\n"


def verdicts(row: list) -> str:
    """A table row's cells, read once their family is complete: text as it is, a comparison as its
    short verdict, (text, comparison) as `text (short verdict)`."""
    return " | ".join(
        f"{cell[0]} ({cell[1].short()})"
        if isinstance(cell, tuple)
        else cell.short()
        if isinstance(cell, Comparison)
        else str(cell)
        for cell in row
    )


def mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan


def report(df: pd.DataFrame, correction: str = "holm") -> str:
    data = frame(df)
    trains = sorted(set(pd.to_numeric(data["train.segment_len"]).astype(int)))
    if len(trains) != 1:
        raise ConfigError("report", f"needs one training length; found {trains}")
    train = trains[0]
    orders = axis_orders(read_spec(df))
    encodings = sorted(set(data["encoding"]), key=lambda e: sort_key((e,), ["encoding"], orders))
    main = data[data["max_targets"] == 0]
    lengths = sorted(
        set(
            main.loc[
                (main["protocol"] == "non_overlapping") & main["rope_scaling"].isna(), "segment_len"
            ]
        )
    )
    seeds = data.groupby("encoding")["seed"].nunique()
    parts = [
        "# alibi_extrapolation_cpu: derived numbers\n",
        f"Generated by `relpos-ablate report` from {data['run_dir'].nunique()} runs (seeds per "
        f"encoding: {', '.join(sorted({str(n) for n in seeds}))}); training length L = {train}. "
        f"Perplexities are means over the seeds. Each section's tests are one family, corrected "
        f"together ("
        + correction
        + "); an ordering is stated only where the adjusted p < 0.05. The same runs at two "
        "lengths, protocols or strides are compared by a paired t-test over the runs, two "
        "encodings by Welch's t-test; each difference (first minus second) comes with its 95% CI; "
        "fewer than 3 seeds a side: not tested.\n",
        t5_section(df, train),
        ratio_section(data, encodings, lengths, train),
        sliding_section(data, encodings, lengths, train, correction),
        appb_section(data, encodings, train, correction),
        context_section(data, encodings, train, correction),
        t5_rope_section(data, lengths, train, correction),
        trends_section(data, lengths, train, correction),
    ]
    return "\n".join(p for p in parts if p)


def label_length(length: int, train: int) -> str:
    if length == train:
        return "L"
    return f"{length // train}L" if length % train == 0 else str(length)


def t5_section(df: pd.DataFrame, train: int) -> str:
    """Where T5's far bucket starts, from the model's bucket function and the runs' own num_buckets
    / max_distance, next to the paper's (HuggingFace's defaults, 32 and 128, at L = 512)."""
    t5 = df[df["encoding"] == "t5"]
    if t5.empty:
        return ""
    # torch: only where a T5 run is reported
    from relpos_ablate.model.position.tables import far_bucket_start

    paper = far_bucket_start(32, 128)
    lines = [
        "## T5's buckets\n",
        f"- The paper (HuggingFace's T5 bias: 32 buckets, max_distance 128, causal) at L = 512: "
        f"the far bucket 31 starts at distance {paper} ({paper / 512:.2f} L); max_distance = "
        f"{128 / 512:g} L.",
    ]
    for (buckets, distance), _ in t5.groupby(
        ["model.attention.num_buckets", "model.attention.max_distance"]
    ):
        start = far_bucket_start(int(buckets), int(distance))
        trained = (
            f"distances {start}..{train - 1} train it"
            if start < train
            else "no training distance reaches it"
        )
        lines.append(
            f"- These runs: num_buckets {int(buckets)}, max_distance {int(distance)} "
            f"({distance / train:g} L): the far bucket {int(buckets) - 1} starts at distance "
            f"{start} ({start / train:.2f} L); at L = {train}, {trained}."
        )
    return "\n".join(lines) + "\n"


def ratio_section(data, encodings, lengths, train) -> str:
    head = "| encoding | protocol | " + " | ".join(label_length(n, train) for n in lengths) + " |"
    rows = [head, "|:---|:---|" + "---:|" * len(lengths)]
    for encoding in encodings:
        for protocol in ("non_overlapping", "sliding"):
            stride = train if protocol == "sliding" else None
            cells = [
                f"{mean(per_seed(data, encoding, protocol, n, stride=stride).values()):.2f} "
                f"({mean(ratios(data, encoding, protocol, n, train, stride=stride).values()):.3f})"
                for n in lengths
            ]
            if any(not c.startswith("nan") for c in cells):
                rows.append(f"| {encoding} | {protocol} | " + " | ".join(cells) + " |")
    return (
        "## Perplexity at each length, and relative to L\n\nppl (ppl at nL / ppl at L, the mean "
        "of each seed's ratio); sliding: windows of nL moved by L.\n\n" + "\n".join(rows) + "\n"
    )


def sliding_section(data, encodings, lengths, train, correction) -> str:
    longer = [n for n in lengths if n > train]
    family = Family("sliding vs non-overlapping, each encoding at each length", correction)
    rows = []
    for encoding in encodings:
        cells = []
        for n in longer:
            sliding = per_seed(data, encoding, "sliding", n, stride=train)
            plain = per_seed(data, encoding, "non_overlapping", n)
            if not sliding or not plain:
                cells.append("—")
                continue
            delta = mean(sliding.values()) - mean(plain.values())
            cells.append(
                (f"{delta:+.2f}", family.compare("sliding", sliding, "non-overlapping", plain))
            )
        rows.append([f"| {encoding}", *cells])
    lines = [
        "| encoding | " + " | ".join(label_length(n, train) for n in longer) + " |",
        "|:---|" + "---:|" * len(longer),
        *(verdicts(row) + " |" for row in rows),
    ]
    return (
        "## Sliding minus non-overlapping\n\nppl under sliding evaluation (windows of nL moved by "
        "L: every scored token sees at least nL − L + 1 tokens) minus ppl under non-overlapping "
        "segments of nL; negative: sliding is better. In brackets the paired t-test over the runs "
        "(each run scored both ways).\n\n" + "\n".join(lines) + "\n" + family_note(family)
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


def t5_rope_section(data, lengths, train, correction) -> str:
    if not {"t5", "rope"} <= set(data["encoding"]):
        return ""
    family = Family("T5 vs rotary, ppl at nL over ppl at L, each length", correction)
    rows = []
    for n in (n for n in lengths if n > train):
        t5, rope = (ratios(data, e, "non_overlapping", n, train) for e in ("t5", "rope"))
        rows.append(
            [
                f"| {label_length(n, train)}",
                f"{mean(t5.values()):.3f}",
                f"{mean(rope.values()):.3f}",
                family.compare("t5", t5, "rope", rope, decimals=3),
            ]
        )
    lines = [
        "| length | t5: ppl / ppl at L | rope: ppl / ppl at L | test |",
        "|:---|---:|---:|:---|",
    ]
    return (
        "## T5 against rotary (non-overlapping)\n\nEach seed's ppl at nL over its ppl at L; lower "
        "degrades less (two encodings: Welch's t-test).\n\n"
        + "\n".join(lines + [verdicts(r) + " |" for r in rows])
        + "\n"
        + family_note(family)
    )


def trends_section(data, lengths, train, correction) -> str:
    """The paper's trends next to ours, each with its test."""
    if len(lengths) < 2:
        return ""
    two, longest = lengths[1], lengths[-1]

    def plain(encoding, n, **setting):
        return per_seed(data, encoding, "non_overlapping", n, **setting)

    def ratio(encoding, n):
        return ratios(data, encoding, "non_overlapping", n, train)

    name = {n: label_length(n, train) for n in lengths}
    family = Family("the papers' trends", correction)
    ordering = family.compare
    checks = [  # (claim, the encodings it needs, the test)
        (
            "sinusoidal degrades right past L",
            {"vaswani"},
            lambda: ordering(
                "vaswani at L", plain("vaswani", train), f"at {name[two]}", plain("vaswani", two)
            ),
        ),
        (
            "rotary holds longer than sinusoidal",
            {"rope", "vaswani"},
            lambda: ordering(
                f"rope {name[two]}/L",
                ratio("rope", two),
                f"vaswani {name[two]}/L",
                ratio("vaswani", two),
                decimals=3,
            ),
        ),
        (
            "T5 degrades later than rotary",
            {"t5", "rope"},
            lambda: ordering(
                f"t5 {name[longest]}/L",
                ratio("t5", longest),
                f"rope {name[longest]}/L",
                ratio("rope", longest),
                decimals=3,
            ),
        ),
        (
            "ALiBi improves up to ~2L",
            {"alibi"},
            lambda: ordering(
                f"alibi at {name[two]}", plain("alibi", two), "at L", plain("alibi", train)
            ),
        ),
        (
            "ALiBi degrades slowly after ~2L",
            {"alibi"},
            lambda: ordering(
                f"alibi at {name[two]}",
                plain("alibi", two),
                f"at {name[longest]}",
                plain("alibi", longest),
            ),
        ),
        (
            "xPos keeps RoPE's perplexity at L (Sun et al.)",
            {"rope_xpos", "rope"},
            lambda: ordering(
                "rope_xpos at L", plain("rope_xpos", train), "rope at L", plain("rope", train)
            ),
        ),
        (
            "xPos extrapolates better than RoPE",
            {"rope_xpos", "rope"},
            lambda: ordering(
                f"rope_xpos at {name[longest]}",
                plain("rope_xpos", longest),
                f"rope at {name[longest]}",
                plain("rope", longest),
            ),
        ),
        (
            "FoX improves with length (Lin et al.)",
            {"fox"},
            lambda: ordering(
                f"fox at {name[longest]}", plain("fox", longest), "at L", plain("fox", train)
            ),
        ),
    ]
    if longest == two:  # runs evaluated up to 2L only: "after 2L" has nothing to compare
        checks = [check for check in checks if check[0] != "ALiBi degrades slowly after ~2L"]
    for kind in EXTENSIONS:
        for n in (
            n for n in lengths if per_seed(data, "rope", "non_overlapping", n, rope_scaling=kind)
        ):
            checks.append(
                (
                    f"RoPE + {EXTENSIONS[kind]} beats plain RoPE at {name[n]} (zero-shot)",
                    {"rope"},
                    lambda kind=kind, n=n: ordering(
                        f"{kind} at {name[n]}",
                        plain("rope", n, rope_scaling=kind),
                        f"plain at {name[n]}",
                        plain("rope", n),
                    ),
                )
            )
    present = set(data["encoding"])
    tested = [(claim, check()) for claim, needs, check in checks if needs <= present]
    rows = ["| trend (paper) | this run: means over seeds, the test |", "|:---|:---|"]
    rows += [f"| {claim} | {comparison} |" for claim, comparison in tested]
    return (
        f"## The papers' trends, tested\n\nEach row compares one encoding at two lengths (the "
        f"same runs: a paired t-test) or two encodings (Welch's t-test); encodings here: "
        f"{', '.join(sorted(present))}.\n\n" + "\n".join(rows) + "\n" + family_note(family)
    )


REPORTS = {"alibi_extrapolation_cpu": report}
