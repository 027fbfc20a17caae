"""The plain PyTorch loop (the benchmark baseline) and the Lightning loop train identically.

Same seed, data, memory, loss, optimizer, schedule and clipping: the per-step losses of the two
loops agree, so the throughput comparison in benchmarks/train_step.py compares equal work.
Run: pytest tests/train/test_train_plain.py
"""

import csv

import torch

from fixtures.training import tiny
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.plain import train_plain
from relpos_ablate.train.run import resolve_vocab, train_run


def test_plain_loop_matches_the_lightning_loop_step_by_step(tmp_path):
    # 10 segments: the streams restart twice
    cfg = tiny(
        "model.mem_len=8",
        "data.train_tokens=160",
        "train.max_steps=25",
        "train.log_every=1",
        "train.grad_clip=0.5",
        "train.loss_on=half",
    )
    assert train_run(cfg, tmp_path) == "done"
    with open(tmp_path / "metrics.csv", newline="") as f:
        lightning_losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
    _model, plain_losses = train_plain(resolve_vocab(cfg, build_datamodule(cfg).vocab_size))
    torch.testing.assert_close(
        torch.tensor(lightning_losses), torch.stack(plain_losses), rtol=1e-4, atol=1e-5
    )
