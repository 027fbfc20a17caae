"""The same training as LitLM in a plain PyTorch loop: the baseline Lightning's overhead is measured
against (benchmarks/train_step.py) and a parity check of the Lightning loop
(tests/train/test_train_plain.py).

Same data order, memory carrying and reset, loss, optimizer (then each bias scheme's
`after_optimizer_step`), schedule and gradient clipping; no checkpoints, logging or evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from relpos_ablate.config import RunConfig
from relpos_ablate.model import TransformerLM
from relpos_ablate.model.lm import masked_mean
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.data.streams import loss_mask
from relpos_ablate.train.metrics import token_stats
from relpos_ablate.train.optimizer import after_optimizer_step, build_optimizer

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def train_plain(
    config: RunConfig,
    device: str | torch.device = "cpu",
    steps: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[TransformerLM, list[Tensor]]:
    """Train `steps` (default train.max_steps) steps; returns the model and the per-step losses.

    config.model.vocab_size must be resolved (non-zero). `on_step(step)` runs after each optimizer
    step.
    """
    device = torch.device(device)
    t = config.train
    streams = build_datamodule(config).streams("train", t.segment_len)
    torch.manual_seed(config.seed)
    model = TransformerLM(config.model).to(device).train()
    optimizer, scheduler = build_optimizer(model, t, device)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "16-mixed")
    autocast = (
        torch.autocast(device.type, dtype=AUTOCAST[t.precision])
        if t.precision in AUTOCAST
        else contextlib.nullcontext()
    )
    mems, losses = None, []
    for step in range(t.max_steps if steps is None else steps):
        inputs, targets, mask = (
            x.to(device, non_blocking=True) for x in streams[step % len(streams)]
        )
        if step % len(streams) == 0:
            mems = None
        with autocast:
            logits, mems = model(inputs, mems)
        nll, _correct = token_stats(logits, targets)
        loss = masked_mean(nll, loss_mask(mask, t.loss_on))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if t.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        after_optimizer_step(model)
        scheduler.step()
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step)
    return model, losses
