"""The low-rank kernel's query blocks: its time and its rounding against the block size
(model/kernels/low_rank.py).

    python benchmarks/low_rank_blocks.py  # Markdown: time per block size, then error per block size

1. Time: KeyOffsetAttention forward + backward at B=2, H=8, L=4096, d_head=64, fp32, FoX-like key
   offsets (Λ rising 0.62-0.82 per key, as the benchmark's randomly initialised gates, with their
   gradient), per block size with the queries' channels zero (the kernel where sums are not in
   order), and in one block with them (where they are: `low_rank.ordered_sums`), against SDPA's
   causal call at 64, 72 and 80 channels (the low-rank kernel's head widths without and with the
   gradient blocks' channels); best of 2 after a warm-up.
2. The blocks the kernel picks in benchmarks/attention.py's FoX and learned ALiBi (random
   initialisation, seed 0), and how far their key offsets rise over the queries.
3. Rounding: ALiBi's slopes (2^(-8h/H), steepest 1/2) at B=1, L=4096: the output's largest absolute
   and relative (norm) error against softmax(s·q·kᵀ + e) computed in float64, per block size
   (spread = slope · block), and in one block with the queries' channels where sums are in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import torch
import torch.nn.functional as F

from relpos_ablate.model.kernels import key_offset_attention, low_rank
from relpos_ablate.model.kernels.calibration import processor

BLOCKS = (64, 128, 256, 512, 1024, 4096)


def best(fn, repeats: int = 2) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timing(length: int) -> list[str]:
    torch.manual_seed(0)
    b, h, d = 2, 8, 64
    q, k, v = (torch.randn(b, h, length, d, requires_grad=True) for _ in range(3))
    offsets = torch.cumsum(
        torch.rand(b, h, length, dtype=torch.float64) * 0.2 + 0.62, -1
    ).requires_grad_()

    def kernel(block, ordered=False):
        return lambda: (
            key_offset_attention.KeyOffsetAttention.apply(q, k, v, offsets, d**-0.5, block, ordered)
            .sum()
            .backward()
        )

    def sdpa(width):
        x = [torch.randn(b, h, length, width, requires_grad=True) for _ in range(3)]
        return lambda: (
            F.scaled_dot_product_attention(*x, is_causal=True, scale=d**-0.5).sum().backward()
        )

    lines = [
        "| path | fwd + bwd s |",
        "|---|---|",
        *(f"| SDPA causal, {w} channels | {best(sdpa(w)):.3f} |" for w in (64, 72, 80)),
        *(
            f"| low-rank kernel, blocks of {n} | {best(kernel(n)):.3f} |"
            for n in BLOCKS
            if n <= length
        ),
    ]
    if low_rank.ordered_sums():
        lines.append(
            f"| low-rank kernel, one block, sums in order | {best(kernel(length, True)):.3f} |"
        )
    return lines


def chosen_blocks(length: int) -> list[str]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import attention as bench  # benchmarks/attention.py: its schemes, as timed

    seen, pick = {}, low_rank.block_size

    def spy(offsets, n_queries):  # the kernel's own choice, with the offsets it was made from
        queries = offsets[..., offsets.shape[-1] - n_queries :].detach()
        seen.update(
            block=pick(offsets, n_queries), rise=float((queries[..., -1] - queries[..., 0]).max())
        )
        return seen["block"]

    lines = [
        "| scheme | L | block | largest rise of e over the queries | per 128 queries |",
        "|---|---|---|---|---|",
    ]
    low_rank.block_size = spy
    try:
        for name in ("fox", "alibi_learned"):
            torch.manual_seed(0)
            module = bench.build(name, torch.device("cpu"), torch.float32)
            module.config = dataclasses.replace(module.config, backend="low_rank")
            bench.step(module, torch.randn(bench.B, length, bench.D_MODEL, requires_grad=True))
            lines.append(
                f"| {name} | {length} | {seen['block']} | {seen['rise']:.0f} | "
                f"{seen['rise'] * 128 / (length - 1):.0f} |"
            )
    finally:
        low_rank.block_size = pick
    return lines


def rounding(length: int) -> list[str]:
    torch.manual_seed(0)
    h, d = 8, 64
    scale = d**-0.5
    q, k, v = (torch.randn(1, h, length, d) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float64)
    offsets = (slopes[:, None] * torch.arange(length, dtype=torch.float64))[None]
    scores = scale * q.double() @ k.double().transpose(-1, -2) + offsets[:, :, None, :]
    scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, -1) @ v.double()
    del scores
    lines = [
        "| block | spread (steepest slope · block) | largest error | relative error (norm) |",
        "|---|---|---|---|",
    ]
    runs = [(str(n), n, False) for n in BLOCKS] + (
        [(f"{length}, sums in order", length, True)] if low_rank.ordered_sums() else []
    )
    for label, n, ordered in runs:
        attend = key_offset_attention.KeyOffsetAttention.apply
        got = attend(q, k, v, offsets, scale, n, ordered).double()
        lines.append(
            f"| {label} | {float(slopes.max()) * n:.0f} | {(got - want).abs().max().item():.2e} | "
            f"{((got - want).norm() / want.norm()).item():.2e} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args(argv)
    print(
        f"{processor()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{platform.python_version()}, SPREAD_LIMIT {low_rank.SPREAD_LIMIT}, EXTRA "
        f"{key_offset_attention.EXTRA}, sums in order: {low_rank.ordered_sums()}\n"
    )
    print("\n".join(timing(args.length)) + "\n")
    print("\n".join(chosen_blocks(args.length)) + "\n")
    print("\n".join(rounding(args.length)))


if __name__ == "__main__":
    main()
