"""How to batch example tasks: CPU time per training step (forward, backward, AdamW) of plain
padding (every batch padded to the longest training example), of batches grouped by length and cut
after their longest example (what ExampleDataModule does), and a lower bound for packing several
examples into a row: the same real tokens in fewer full rows, without the block-diagonal mask and
per-row positions packing would also need. Process time, so that other load on the machine counts
less than in wall time.

    python benchmarks/example_batches.py
"""

from __future__ import annotations

import time

import torch

from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM
from relpos_ablate.config import DataConfig
from relpos_ablate.train.data.examples import PAD, TrimmedSegments, as_streams, by_length, generate
from relpos_ablate.train.data.streams import SegmentStreams

BATCH, BATCHES = 32, 120
CASES = (("copy", (1, 10)), ("copy", (1, 20)), ("flip_flop", (1, 20)))
ENCODINGS = {"nope": dict(terms="a"), "xl": dict(terms="abcd")}


def ms_per_step(attention: dict, batches) -> float:
    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(
            vocab_size=40,
            d_model=64,
            n_layers=2,
            n_heads=4,
            d_head=16,
            d_inner=256,
            dropout=0.0,
            attention=AttentionConfig(**attention),
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    start = time.process_time()
    for inputs, targets, mask in batches:
        logits, _ = model(inputs)
        model.loss(logits, targets, mask).backward()
        optimizer.step()
        optimizer.zero_grad()
    return 1000 * (time.process_time() - start) / len(batches)


def main() -> None:
    torch.set_num_threads(1)
    print("| task, n | encoding | padded | by length | packed (lower bound) |")
    print("|---|---|---|---|---|")
    for task, lengths in CASES:
        data = DataConfig(task=task, train_lengths=lengths, test_lengths=(lengths,))
        examples = generate(data, 0, "train", BATCH * BATCHES, lengths)
        width = data.input_length(lengths[1])
        padded = SegmentStreams(*as_streams(examples, BATCH, width), width)
        grouped = TrimmedSegments(*as_streams(by_length(examples, BATCH, 0), BATCH, width), width)
        real = float((examples.inputs != PAD).sum()) / examples.inputs.numel()
        rows = round(BATCH * real)  # the batch's real tokens in full rows of the same width
        packed = [
            (torch.randint(3, 40, (rows, width)),) * 2
            + (torch.ones(rows, width, dtype=torch.bool),)
            for _ in range(BATCHES)
        ]
        for name, attention in ENCODINGS.items():
            times = [
                ms_per_step(attention, [s[t] for t in range(len(s))]) for s in (padded, grouped)
            ]
            times.append(ms_per_step(attention, packed))
            cells = [f"{times[0]:.1f} ms"] + [
                f"{t:.1f} ms ({1 - t / times[0]:.0%} less)" for t in times[1:]
            ]
            print(f"| {task}, {lengths[0]}-{lengths[1]} | {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
