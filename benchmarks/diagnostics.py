"""What the attention diagnostics (eval.diagnostics) cost at evaluation: a no-grad TransformerLM
forward with and without AttentionStatistics, CPU seconds (process time, so that other load on the
machine counts less than in wall time), median of `--repeats` alternating pairs.

    python benchmarks/diagnostics.py                # d_model 128, 2 layers, 4 heads, batch 8
    python benchmarks/diagnostics.py --lengths 64,256 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM
from relpos_ablate.model.diagnostics import AttentionStatistics

ENCODINGS = {
    "nope": dict(terms="a"),
    "alibi": dict(terms="a", bias="alibi"),
    "rope": dict(terms="a", absolute="rope"),
    "xl": dict(terms="abcd"),
    "t5": dict(terms="a", bias="t5"),
}


def seconds(model: TransformerLM, tokens: torch.Tensor, diagnostics: bool) -> float:
    stats = (
        AttentionStatistics(
            model.config.n_layers, model.config.n_heads, torch.ones(tokens.shape), 63
        )
        if diagnostics
        else None
    )
    start = time.process_time()
    with torch.no_grad():
        model(tokens, statistics=stats)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,256,1024", help="comma-separated segment lengths")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"| encoding | {' | '.join(f'L={n}' for n in lengths)} |")
    print(f"|---|{'---|' * len(lengths)}")
    for name, attention in ENCODINGS.items():
        torch.manual_seed(0)
        model = TransformerLM(
            ModelConfig(
                vocab_size=64,
                d_model=128,
                n_layers=2,
                n_heads=4,
                d_head=32,
                d_inner=512,
                dropout=0.0,
                attention=AttentionConfig(**attention),
            )
        ).eval()
        cells = []
        for length in lengths:
            tokens = torch.randint(0, 64, (args.batch, length))
            seconds(model, tokens, True)  # warm-up
            pairs = [
                (seconds(model, tokens, False), seconds(model, tokens, True))
                for _ in range(args.repeats)
            ]
            plain, diagnosed = (
                statistics.median(p for p, _ in pairs),
                statistics.median(d for _, d in pairs),
            )
            cells.append(
                f"{diagnosed / plain:.2f}x ({1000 * plain:.0f} -> {1000 * diagnosed:.0f} ms)"
            )
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
