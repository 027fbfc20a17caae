"""The reports of the Transformer-XL study at CPU scale (`relpos-ablate report`, the studies
registry): every number its README quotes besides Tables 6 and 8 themselves, from the collected
frame or summary.csv.

- `xl_table6_cpu`: each model's perplexity at every attention length of the ladder, measured the way
  it was trained (recl.ladder_rows: memory for the recurrent rows, sliding windows for the others),
  its PPL init and PPL best, and the comparisons Table 6 is about (two models: Welch's t-test over
  seeds), then each model at its best attention length against its training one (the same runs: a
  paired t-test).
- `xl_context_cpu`: how much context a model without memory uses (perplexity at sliding windows of
  c).
Each list of tests is one family, corrected together (analysis/stats.py), each difference with its
95% CI.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from relpos_ablate.analysis.recl import ladder_rows
from relpos_ablate.analysis.stats import Family, listed
from relpos_ablate.config import ConfigError

ROW = ("encoding", "model.mem_len", "train.loss_on")
"""What tells the study's models apart (seeds pooled)."""
ENCODINGS = ("xl", "shaw", "vaswani", "al_rfou")
"""Table 6's order of encodings."""
# (what the comparison asks, row a, row b, context of a, context of b: "init" | "best" | c)
COMPARISONS = (
    (
        "recurrence, XL encoding (full loss), each at its training attention length",
        ("xl", 48, "full"),
        ("xl", 0, "full"),
        "init",
        "init",
    ),
    (
        "recurrence, XL encoding (full loss), each at its best attention length",
        ("xl", 48, "full"),
        ("xl", 0, "full"),
        "best",
        "best",
    ),
    (
        "recurrence, Shaw encoding (full loss), at the training attention length",
        ("shaw", 48, "full"),
        ("shaw", 0, "full"),
        "init",
        "init",
    ),
    (
        "XL vs Shaw encoding with recurrence, at the training attention length",
        ("xl", 48, "full"),
        ("shaw", 48, "full"),
        "init",
        "init",
    ),
    (
        "XL vs Shaw encoding without recurrence, at the training attention length",
        ("xl", 0, "full"),
        ("shaw", 0, "full"),
        "init",
        "init",
    ),
    (
        "relative (XL) vs absolute (Vaswani) without recurrence, half loss",
        ("xl", 0, "half"),
        ("vaswani", 0, "half"),
        "init",
        "init",
    ),
    (
        "relative (XL) vs absolute (Al-Rfou) without recurrence, half loss",
        ("xl", 0, "half"),
        ("al_rfou", 0, "half"),
        "init",
        "init",
    ),
    (
        "full vs half loss, XL with recurrence",
        ("xl", 48, "full"),
        ("xl", 48, "half"),
        "init",
        "init",
    ),
)

CONTROL = "xl_context_cpu"
"""The experiment of the fair no-memory control: XL attention without memory trained on 64-character
segments (as many characters per step), scored by sliding windows of c characters on the same
validation targets."""
CONTROL_KEY = ("xl", 0, "full", 64)
CONTROL_QUESTION = (
    "memory vs no memory at equal keys and equal training context (the fair control: no memory, "
    "trained on 64-character segments, its window 64)"
)


def _key(run: pd.Series) -> tuple:
    return (str(run["encoding"]), int(run["model.mem_len"]), str(run["train.loss_on"]))


def row_label(key: tuple) -> str:
    """(encoding, memory, loss[, training segment]) -> "xl, memory 48, full loss"; the figure names
    its lines the same way. The fair control (CONTROL_KEY) names its training segments."""
    encoding, memory, loss = key[:3]
    trained = f", trained on {key[3]}" if len(key) > 3 else ""
    return f"{encoding}, {'memory ' + str(memory) if memory else 'no memory'}, {loss} loss{trained}"


def control_samples(df: pd.DataFrame) -> dict[int, dict[str, float]]:
    """The fair control's {window c: {run dir: ppl}} (sliding windows, stride 1), from CONTROL's
    runs in the frame; empty when the frame has none."""
    if "experiment" not in df:
        return {}
    rows = df[
        (df["experiment"] == CONTROL)
        & (df["status"] == "done")
        & (df["protocol"] == "sliding")
        & (df["stride"] == 1)
    ]
    found: dict[int, dict[str, float]] = {}
    for _, run in rows.sort_values("seed").iterrows():
        found.setdefault(int(run["segment_len"]), {})[run["run_dir"]] = float(run["ppl"])
    return found


def ladder_samples(df: pd.DataFrame) -> dict[tuple, dict[int, dict[str, float]]]:
    """row key -> {attention length c: {run dir: ppl}} on the ladder's shared targets, seeds in
    order."""
    found: dict[tuple, dict[int, dict[str, float]]] = {}
    for _, run in ladder_rows(df).sort_values("seed").iterrows():
        found.setdefault(_key(run), {}).setdefault(int(run["attn_len"]), {})[run["run_dir"]] = (
            float(run["ppl"])
        )
    return found


def ladder_ppl(df: pd.DataFrame) -> dict[tuple, dict[int, list[float]]]:
    """row key -> {attention length c: the ppl of each seed} on the ladder's shared targets."""
    return {
        key: {c: list(runs.values()) for c, runs in by_c.items()}
        for key, by_c in ladder_samples(df).items()
    }


def _init(key: tuple, train_segment: int) -> int:
    """The training attention length: segment + memory."""
    return train_segment + key[1]


def _best(by_c: dict[int, dict[str, float]]) -> int:
    """The shortest c reaching the lowest mean ppl."""
    return min(by_c, key=lambda c: (np.mean(list(by_c[c].values())), c))


def _cell(values) -> str:
    values = list(values.values()) if isinstance(values, dict) else list(values)
    return (
        f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
        if len(values) > 1
        else f"{values[0]:.3f}"
    )


def _tested(family: Family, items: list) -> list[str]:
    """The lines of a family's list (stats.listed), then its heading and power line."""
    return [*listed(items), "", family.summary()]


def table6_report(df: pd.DataFrame, correction: str = "holm") -> str:
    """Markdown: the ladder per model, PPL init / best, and the comparisons (module docstring)."""
    control = control_samples(df)
    df = df[df["experiment"] != CONTROL] if "experiment" in df else df
    ladders = ladder_samples(df)
    if not ladders:
        raise ConfigError(
            "report", "no RECL ladder in these runs (eval.recl_contexts): nothing to compare"
        )
    segment = int(df["train.segment_len"].dropna().iloc[0])
    contexts = sorted({c for by_c in ladders.values() for c in by_c})
    keys = sorted(
        ladders, key=lambda k: (k[1] == 0, ENCODINGS.index(k[0]) if k[0] in ENCODINGS else 99, k[2])
    )
    seeds = sorted({len(v) for by_c in ladders.values() for v in by_c.values()})
    lines = [
        f"Perplexity on the ladder's {_targets(df)} validation targets, mean ± std over "
        f"{_seeds(seeds)} seeds; each model measured the way it was trained (with memory: "
        f"protocol xl, every query sees c keys; without: sliding windows of c characters, stride "
        f"1).",
        "",
        "| model | " + " | ".join(f"c = {c}" for c in contexts) + " | init (c) | best (c) |",
        "|:---|" + "---:|" * (len(contexts) + 2),
    ]
    for key in keys:
        by_c = ladders[key]
        init, best = _init(key, segment), _best(by_c)
        cells = [_cell(by_c[c]) if c in by_c else "-" for c in contexts]
        lines.append(
            f"| {row_label(key)} | "
            + " | ".join(cells)
            + f" | {_cell(by_c[init]) if init in by_c else '-'} ({init}) | {_cell(by_c[best])} "
            f"({best}) |"
        )
    if control:
        init, best = CONTROL_KEY[3], _best(control)
        cells = [_cell(control[c]) if c in control else "-" for c in contexts]
        lines.append(
            f"| {row_label(CONTROL_KEY)} ({CONTROL}) | "
            + " | ".join(cells)
            + f" | {_cell(control[init]) if init in control else '-'} ({init}) | "
            f"{_cell(control[best])} ({best}) |"
        )
        lines += [
            "",
            f"The last row is the fair control for memory ({CONTROL}, results/{CONTROL}): the "
            f"same model without memory, trained on 64-character segments (16 x 64 characters per "
            f"step, as many as the rows above), scored by sliding windows of c characters, stride "
            f"1, on the same validation targets; evaluated at c = "
            f"{', '.join(map(str, sorted(control)))}. A row above without memory was trained on "
            f"{segment} characters: at c > {segment} it extrapolates, so comparing memory with it "
            f"at an equal c measures extrapolation as much as memory.",
        ]
    family = Family("Table 6's comparisons", correction)
    items, asked = [], {}
    for question, a, b, at_a, at_b in COMPARISONS:
        if a in ladders and b in ladders:
            ca, cb = (
                _context(ladders[key], at, key, segment) for key, at in ((a, at_a), (b, at_b))
            )
            if (
                a,
                ca,
                b,
                cb,
            ) in asked:  # e.g. both rows best at their training attention length: one test, once
                items.append(
                    f'- {question}: the cells of "{asked[(a, ca, b, cb)]}" above, not tested twice'
                )
                continue
            asked[(a, ca, b, cb)] = question
            items.append(
                (
                    f"{question}: ",
                    family.compare(
                        f"{row_label(a)} (c = {ca})",
                        ladders[a].get(ca, {}),
                        f"{row_label(b)} (c = {cb})",
                        ladders[b].get(cb, {}),
                        decimals=3,
                    ),
                )
            )
    memory = ("xl", 48, "full")
    if control and memory in ladders:
        c = CONTROL_KEY[3]
        items.insert(
            2,
            (
                f"{CONTROL_QUESTION}: ",
                family.compare(
                    f"{row_label(memory)} (c = {c})",
                    ladders[memory].get(c, {}),
                    f"{row_label(CONTROL_KEY)} (c = {c})",
                    control.get(c, {}),
                    decimals=3,
                ),
            ),
        )
    lines += [
        "",
        "Comparisons (two models: Welch's t-test over seeds; first minus second):",
        "",
        *_tested(family, items),
        *_detectable_share(family, ladders.get(memory, {}).get(segment + 48)),
    ]
    family = Family("each model at its best attention length vs its training one", correction)
    items = []
    for key in keys:
        init, best = _init(key, segment), _best(ladders[key])
        if best != init and init in ladders[key]:
            items.append(
                (
                    f"{row_label(key)}: ",
                    family.compare(
                        f"c = {best}",
                        ladders[key][best],
                        f"c = {init}",
                        ladders[key][init],
                        decimals=3,
                    ),
                )
            )
        elif best == init:
            items.append(f"- {row_label(key)}: best at its training attention length, c = {init}")
    lines += [
        "",
        "Longer attention at evaluation than in training (each model: its best attention length "
        "against its training one; the same runs: a paired t-test):",
        "",
        *_tested(family, items),
    ]
    return "\n".join(lines) + "\n"


def _detectable_share(family: Family, reference: dict[str, float] | None) -> list[str]:
    """The family's smallest detectable difference as a share of XL-with-memory's perplexity (the
    power line gives it in ppl): what a gain from memory must be, relative, for these seeds to show
    it."""
    found = [t.detectable() for t in family.tests]
    found = [d for d in found if np.isfinite(d)]
    if not found or not reference:
        return []
    base = float(np.mean(list(reference.values())))
    return [
        "",
        f"Relative to the perplexity of XL with memory ({base:.3f}), that smallest detectable "
        f"difference is {np.median(found) / base:.1%} (median; range "
        f"{min(found) / base:.1%}-{max(found) / base:.1%}) at α = 0.05 before correction.",
    ]


def _context(by_c: dict[int, dict[str, float]], at, key: tuple, segment: int) -> int:
    return _init(key, segment) if at == "init" else _best(by_c) if at == "best" else int(at)


def _targets(df: pd.DataFrame) -> str:
    tokens = sorted(set(ladder_rows(df)["tokens"].dropna().astype(int)))
    return (
        f"{tokens[0]:,}"
        if len(tokens) == 1
        else " to ".join(f"{t:,}" for t in (tokens[0], tokens[-1]))
    )


def _seeds(counts: list[int]) -> str:
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def context_report(df: pd.DataFrame, correction: str = "holm") -> str:
    """Markdown: the perplexity of a model without memory at sliding windows of c, and whether each
    doubling of c still lowers it (module docstring)."""
    rows = df[(df["status"] == "done") & (df["protocol"] == "sliding") & (df["stride"] == 1)]
    by_c = {
        int(c): dict(zip(part["run_dir"], part["ppl"].astype(float)))
        for c, part in rows.sort_values("seed").groupby("segment_len")
    }
    contexts = sorted(by_c)
    seeds = sorted({len(v) for v in by_c.values()})
    tokens = sorted(set(rows["tokens"].dropna().astype(int)))
    lines = [
        f"Perplexity at sliding windows of c characters (stride 1) on {tokens[0]:,} validation "
        f"targets, mean ± std over {_seeds(seeds)} seeds:",
        "",
        "| " + " | ".join(f"c = {c}" for c in contexts) + " |",
        "|" + "---:|" * len(contexts),
        "| " + " | ".join(_cell(by_c[c]) for c in contexts) + " |",
        "",
        "Does doubling the context still help? The same models at two windows: a paired t-test "
        "over the runs (first minus second).",
        "",
    ]
    family = Family("each doubling of the window", correction)
    items = [
        ("", family.compare(f"c = {long}", by_c[long], f"c = {short}", by_c[short], decimals=3))
        for short, long in zip(contexts, contexts[1:])
    ]
    return "\n".join(lines + _tested(family, items)) + "\n"
