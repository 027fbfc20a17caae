"""Where an attention scheme's time goes: torch.profiler over one forward + backward of
benchmarks/attention.py's layer (B=2, H=8, d_head=64, causal), the operators by self CPU time, next
to SDPA without positions at the same length. docs/performance.md quotes it for the goals a scheme
does not meet.

    python benchmarks/profile_attention.py --scheme fox --length 2048
    python benchmarks/profile_attention.py --scheme fire,cope --length 4096 --top 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import D_MODEL, SCHEMES, B, build, step


def profile_step(name: str, length: int, top: int) -> str:
    torch.manual_seed(0)
    module = build(name, torch.device("cpu"), torch.float32)
    x = torch.randn(B, length, D_MODEL, requires_grad=True)
    step(module, x)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(module, x)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    lines = [
        f"{name} at L={length}: {total / 1e3:.0f} ms of self CPU time in all",
        "| operator | calls | self CPU ms | share |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | "
        f"{e.self_cpu_time_total / total:.0%} |"
        for e in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scheme", required=True, help="comma-separated scheme names of benchmarks/attention.py"
    )
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--top", type=int, default=10, help="operators shown per scheme")
    args = parser.parse_args(argv)
    names = args.scheme.split(",")
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        parser.error(f"--scheme: unknown {unknown}; allowed: {', '.join(SCHEMES)}")
    for name in ["sdpa_nope", *names]:
        print(profile_step(name, args.length, args.top), end="\n\n")


if __name__ == "__main__":
    main()
