"""The papers' trends in the `alibi_extrapolation_cpu` report (extrapolation.py), each with its
test: sinusoidal degrading right past L, rotary holding longer, T5 degrading later than rotary,
ALiBi improving up to ~2L and degrading slowly after, xPos against RoPE, FoX improving with length,
and each zero-shot RoPE extension (EXTENSIONS) against plain RoPE. One encoding at two lengths is a
paired t-test over its runs, two encodings Welch's; the trends are one family."""

from __future__ import annotations

from relpos_ablate.analysis.stats import Family
from relpos_ablate.studies.extrapolation_samples import family_note, label_length, per_seed, ratios

EXTENSIONS = {"pi": "PI", "ntk": "NTK", "yarn": "YaRN", "llama3": "Llama 3"}


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
