"""Speed of one or more functions against their versions at another revision, in one process.

Separate processes (`compare_revisions.py --time`) cannot resolve a change of a few percent on a
machine whose speed moves by a third between minutes. Here one process builds
benchmarks/attention.py's layer for the scheme and SDPA without positions, then alternates steps
(forward + backward) of the layer as it is, of the layer with each `--swap`ped attribute replaced
by its source at REV, and of SDPA-NoPE: both versions see the same phases of the machine. Prints
each version's median and fastest step as ratios to SDPA-NoPE's.

    python benchmarks/swap_timing.py --scheme cope --length 1024 --rounds 20 \\
        --swap relpos_ablate/model/kernels/block_maps.py:MaterialisedMaps._masked@bcd4456~1

A swap is FILE:QUALNAME@REV: the file's text at REV (`git show`) is run as a module of its own
(its imports are the current package's), and QUALNAME, a module function or a class attribute, is
read from it and set in its place in the current module. A module function reaches only callers
that look it up through its module (not those that imported its name). Several swaps (repeat
--swap) make one old version.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import D_MODEL, SCHEMES, B, build, timed

ROOT = Path(__file__).resolve().parent.parent


def module_at(source: str, name: str, origin: str) -> types.ModuleType:
    """`source` run as a module of its own, named NAME@ORIGIN (origin: REV:FILE)."""
    module = types.ModuleType(f"{name}@{origin}")
    module.__file__ = origin
    sys.modules[module.__name__] = module  # (dataclasses look their module up there)
    exec(compile(source, origin, "exec"), module.__dict__)
    return module


def _owner_and_name(module: types.ModuleType, qualname: str) -> tuple[object, str]:
    *path, name = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def raw_attribute(module: types.ModuleType, qualname: str):
    """The attribute as stored (a staticmethod stays one), raising a one-line error where it is
    missing."""
    owner, name = _owner_and_name(module, qualname)
    stored = vars(owner)
    if name not in stored:
        raise SystemExit(f"--swap: {qualname} is not defined in {module.__name__}")
    return stored[name]


class Swap:
    """One --swap: the current and the old value of one attribute, set in turn."""

    def __init__(self, spec: str):
        try:
            location, rev = spec.rsplit("@", 1)
            path, qualname = location.split(":", 1)
        except ValueError:
            raise SystemExit(f"--swap: {spec!r} is not FILE:QUALNAME@REV") from None
        name = path.removesuffix(".py").replace("/", ".")
        current = __import__(name, fromlist=["_"])
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode:
            raise SystemExit(f"--swap: no {path} at {rev}: {shown.stderr.strip()}")
        self.owner, self.name = _owner_and_name(current, qualname)
        self.new = raw_attribute(current, qualname)
        self.old = raw_attribute(module_at(shown.stdout, name, f"{rev}:{path}"), qualname)

    def set(self, old: bool) -> None:
        setattr(self.owner, self.name, self.old if old else self.new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scheme", required=True, help=f"one of benchmarks/attention.py's: {', '.join(SCHEMES)}"
    )
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument(
        "--rounds", type=int, default=10, help="steps of each version (and of SDPA-NoPE)"
    )
    parser.add_argument(
        "--swap", action="append", required=True, help="FILE:QUALNAME@REV (module docstring)"
    )
    args = parser.parse_args(argv)
    if args.scheme not in SCHEMES:
        parser.error(f"--scheme: unknown {args.scheme!r}; allowed: {', '.join(SCHEMES)}")
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1, got {args.rounds}")
    swaps = [Swap(spec) for spec in args.swap]
    torch.manual_seed(0)
    layers = {
        name: build(name, torch.device("cpu"), torch.float32) for name in ("sdpa_nope", args.scheme)
    }
    x = torch.randn(B, args.length, D_MODEL, requires_grad=True)
    times: dict[str, list[float]] = {"old": [], "new": [], "sdpa_nope": []}
    # the first round warms every version up (a kernel choice timed at first use)
    for r in range(args.rounds + 1):
        for version in ("old", "new", "sdpa_nope"):
            for swap in swaps:
                swap.set(old=version == "old")
            seconds = timed(
                layers["sdpa_nope" if version == "sdpa_nope" else args.scheme], x, x.device
            )
            if r:
                times[version].append(seconds)
    for swap in swaps:
        swap.set(old=False)
    median = {v: statistics.median(t) for v, t in times.items()}
    fastest = {v: min(t) for v, t in times.items()}
    print(
        f"{args.scheme} at L={args.length}, {args.rounds} rounds; swapped: {', '.join(args.swap)}"
    )
    for version in ("old", "new"):
        print(
            f"  {version}: median {median[version] * 1e3:.1f} ms = "
            f"{median[version] / median['sdpa_nope']:.3f}x, fastest {fastest[version] * 1e3:.1f} "
            f"ms = {fastest[version] / fastest['sdpa_nope']:.3f}x"
        )
    print(
        f"  sdpa_nope: median {median['sdpa_nope'] * 1e3:.1f} ms, fastest "
        f"{fastest['sdpa_nope'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
