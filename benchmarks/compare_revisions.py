"""Bit-for-bit check of a refactor: every scheme's outputs and gradients here against another
revision.

Probes RelPosAttention for every term subset x bias type (plus RoPE, Shaw values, a clamped R) x
causal/bidirectional x memory x backend (explicit, sdpa, blocks; flex forward, CPU eager), forward
and backward, their `score_terms` maps, and TransformerLM with every absolute baseline over two
segments with memory; all on fixed seeds in float64. The other revision's package is exported with
`git archive` into a temporary folder, and each side runs in its own process. Prints the tensors
that differ.

    python benchmarks/compare_revisions.py HEAD~1        # exit 1 when anything differs

With --time it compares speed instead: benchmarks/attention.py of this tree times the attention of
each revision (the same benchmark, the other revision's package: RELPOS_PACKAGE_ROOT), the two
alternating round by round, each ratio to SDPA without positions measured in its own process:

    python benchmarks/compare_revisions.py ea3d084 --time --schemes t5,xl_table,xl_abcd \\
        --lengths 1024 --rounds 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def probe(path: str) -> None:
    """Every case's tensors, saved to `path` (run inside the revision under test)."""
    from relpos_ablate import (
        AttentionConfig,
        ConfigError,
        ModelConfig,
        RelPosAttention,
        TransformerLM,
    )
    from relpos_ablate.config import registry  # (BUILTIN_BIASES: in every revision since a1e4c80)
    from relpos_ablate.model import AttentionOptions

    bias_types = ("none", *registry.BUILTIN_BIASES)

    torch.set_num_threads(1)
    subsets = ["".join(c) for n in range(1, 5) for c in itertools.combinations("abcd", n)]
    cases = [dict(terms=t, bias=b) for t in subsets for b in bias_types] + [
        dict(terms="a", absolute="rope"),
        dict(terms="ab", rel="learned", clamp_len=3, shaw_values=True),
        dict(terms="abcd", clamp_len=2),
        # the score terms and the call's other parts (causal only: the bidirectional cases of
        # these are config errors, skipped on both sides)
        dict(terms="a", forget_gate=True),
        dict(terms="a", bias="alibi", forget_gate=True),
        dict(terms="a", bias="alibi_learned"),
        dict(terms="a", cope_positions=3),
        dict(terms="a", bias="alibi", sinks=2),
        dict(terms="ab", bias="t5", score_scale="log_n", log_n_length=4),
        dict(terms="a", bias="kerple_log", learned_temperature=True),
        dict(terms="a", forget_gate=True, score_scale="ssmax", log_n_length=4),
        dict(terms="a", bias="fire", forget_gate=True),
    ]
    out = {}
    for k, fields in enumerate(cases):
        for causal, n_mem, backend in itertools.product(
            [True, False], [0, 3], ["explicit", "sdpa", "blocks", "flex", "auto"]
        ):
            torch.manual_seed(k)
            try:
                config = AttentionConfig(
                    causal=causal,
                    backend=backend,
                    query_chunk=2,
                    num_buckets=8,
                    max_distance=6,
                    **fields,
                )
            except ConfigError:
                continue
            attn = RelPosAttention(16, 2, 8, config).double()
            with torch.no_grad():
                for p in attn.parameters():
                    p.copy_(torch.randn_like(p) * 0.5)
                if fields.get("bias") == "fire":
                    attn.bias_scheme.threshold.fill_(2.5)
            gen = torch.Generator().manual_seed(k + 100)
            x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
            mems = torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None
            key = f"{fields} causal={causal} mem={n_mem} {backend}"
            if backend == "flex":  # no CPU backward
                if not fields.get("shaw_values"):
                    with torch.no_grad():
                        out[key] = [attn(x, mems)[0]]
                continue
            y, _ = attn(x, mems, AttentionOptions(window=2) if causal and n_mem else None)
            weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
            grads = torch.autograd.grad(
                (y * weights).sum(), [x, *attn.parameters()], allow_unused=True
            )
            out[key] = [y.detach(), *(g for g in grads if g is not None)]
            out[key + " maps"] = list(attn.score_terms(x.detach(), mems).values())
    for encoding in (
        dict(terms="a", absolute="sinusoid"),
        dict(terms="a", absolute="learned"),
        dict(terms="a", absolute="learned_per_layer"),
        dict(terms="abcd"),
        dict(terms="a", absolute="rope"),
        dict(terms="a", bias="alibi"),
    ):
        torch.manual_seed(0)
        lm = TransformerLM(
            ModelConfig(
                vocab_size=11,
                d_model=16,
                n_heads=2,
                d_head=8,
                d_inner=32,
                dropout=0.0,
                mem_len=4,
                attention=AttentionConfig(**encoding),
            )
        )
        tokens = torch.randint(0, 11, (2, 6))
        first, mems = lm(tokens)
        second, _ = lm(tokens, mems)
        grads = torch.autograd.grad(
            lm.loss(second, tokens), list(lm.parameters()), allow_unused=True
        )
        out[f"lm {encoding}"] = [
            first.detach(),
            second.detach(),
            *(g for g in grads if g is not None),
        ]
    torch.save(out, path)


def run_probe(package_root: Path, path: Path) -> None:
    """The probe in a fresh process that imports the package under `package_root`."""
    subprocess.run(
        [sys.executable, "-W", "ignore", __file__, "--probe", str(path)],
        check=True,
        # fixed order
        env={**os.environ, "PYTHONPATH": str(package_root), "RELPOS_ABLATE_CALIBRATE": "0"},
        cwd=package_root,
    )


def export(revision: str, tmp: str) -> Path:
    """The revision's package, extracted into tmp/old."""
    old_root = Path(tmp) / "old"
    old_root.mkdir()
    archive = subprocess.run(
        ["git", "archive", revision, "relpos_ablate"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive, check=True)
    return old_root


def _largest_difference(old: list, new: list | None) -> str:
    """', largest |new - old| = ... of the case's largest |old|' over its tensors of equal shapes.
    Relative to the whole case, since some gradients are zero up to rounding (a bias b2 the softmax
    cancels)."""
    if new is None or len(old) != len(new):
        return " (missing or a different number of tensors)"
    pairs = [(a.double(), b.double()) for a, b in zip(old, new) if a.shape == b.shape and a.numel()]
    if not pairs:
        return ""
    scale = max(float(a.abs().max()) for a, _ in pairs) or 1.0
    return (
        f", largest |new - old| = "
        f"{max(float((b - a).abs().max()) for a, b in pairs) / scale:.1e} of the largest |old|"
    )


def compare_speed(args: argparse.Namespace) -> int:
    """Rounds of (revision, this tree) timings; prints each scheme's ratio to SDPA per round and
    side."""
    sides = {args.revision: None, "this tree": ROOT}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sides[args.revision] = export(args.revision, tmp)
        for round_ in range(args.rounds):
            for side, root in sides.items():
                out = Path(tmp) / f"{round_}.json"
                cmd = [
                    sys.executable,
                    str(ROOT / "benchmarks" / "attention.py"),
                    "--schemes",
                    args.schemes,
                    "--lengths",
                    args.lengths,
                    "--pairs",
                    str(args.pairs),
                    "--memory",
                    "none",
                    "--out",
                    str(out),
                ]
                subprocess.run(
                    cmd,
                    check=True,
                    capture_output=True,
                    env={**os.environ, "RELPOS_PACKAGE_ROOT": str(root)},
                )
                for row in json.loads(out.read_text())["rows"]:
                    for length in args.lengths.split(","):
                        ratios.setdefault((row["scheme"], length, side), []).append(
                            row[length]["ratio"]
                        )
    print(
        f"| scheme | L | {args.revision}: ratio per round | this tree: ratio per round |\n"
        f"|---|---|---|---|"
    )
    for scheme in args.schemes.split(","):
        for length in args.lengths.split(","):
            cells = [
                " / ".join(f"{r:.2f}x" for r in ratios[(scheme, length, side)]) for side in sides
            ]
            print(f"| {scheme} | {length} | {cells[0]} | {cells[1]} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "revision", nargs="?", help="git revision to compare the working tree against"
    )
    parser.add_argument(
        "--time", action="store_true", help="compare attention speed (benchmarks/attention.py)"
    )
    parser.add_argument(
        "--schemes",
        default="t5,xl_table,xl_abcd",
        help="--time: schemes of benchmarks/attention.py",
    )
    parser.add_argument("--lengths", default="1024", help="--time: comma-separated lengths")
    parser.add_argument(
        "--pairs", type=int, default=5, help="--time: alternating timing pairs per measurement"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="--time: alternating rounds of the two sides"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return 0
    if not args.revision:
        parser.error("give a git revision, e.g. HEAD~1")
    if args.time:
        return compare_speed(args)
    with tempfile.TemporaryDirectory() as tmp:
        old_root = export(args.revision, tmp)
        run_probe(old_root, Path(tmp) / "old.pt")
        run_probe(ROOT, Path(tmp) / "new.pt")
        old, new = torch.load(Path(tmp) / "old.pt"), torch.load(Path(tmp) / "new.pt")
    differ = [
        key
        for key in old
        if key not in new
        or len(old[key]) != len(new[key])
        or not all(torch.equal(a, b) for a, b in zip(old[key], new[key]))
    ]
    for key in differ:
        print(f"differs: {key}{_largest_difference(old[key], new.get(key))}")
    print(
        f"{len(old)} cases, {sum(map(len, old.values()))} tensors: {len(differ)} differ from "
        f"{args.revision}"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
