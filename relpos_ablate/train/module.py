"""LightningModule: TransformerLM trained with segment recurrence and evaluated at many lengths.

- Recurrence as in Transformer-XL: every batch row is a contiguous stream, so the (detached) memory the
  model returns for batch t is the context of batch t + 1. It is reset when the streams restart and
  at the start of every evaluation setting. Memory is not part of a checkpoint: after a resume it
  starts empty, like at the start of a stream.
- Loss on the whole segment or its most recent half (`train.loss_on`, XL Table 6), over the positions
  the batch mask marks (synthetic tasks count only determined targets).
- AdamW (decay on Linear weights only) or Adam, linear warm-up then cosine decay to 0 or constant.
- Metrics: loss and token accuracy everywhere; perplexity for text, plus bits per character for
  char/byte tokenizers. Main metric: `acc` for synthetic tasks, `ppl` for text.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from relpos_ablate.config import EvalSetting, RunConfig, TrainConfig, to_plain
from relpos_ablate.model import TransformerLM
from relpos_ablate.model.lm import masked_mean
from relpos_ablate.model.position import RopeScaling


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss; the run is recorded as failed."""


def main_metric(config: RunConfig) -> str:
    return "acc" if config.data.source == "synthetic" else "ppl"


def token_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token negative log-likelihood (nats, float32) and correctness, each [B, L]."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(targets)
    return nll, (logits.argmax(-1) == targets).float()


def loss_mask(mask: Tensor, loss_on: str) -> Tensor:
    """'half' keeps only the most recent half of the segment: positions t >= L // 2 (XL Table 6)."""
    if loss_on == "full":
        return mask
    return mask & (torch.arange(mask.shape[1], device=mask.device) >= mask.shape[1] // 2)


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step `step`: linear warm-up, then cosine to 0 or constant."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, train: TrainConfig, device: torch.device):
    """(optimizer, LambdaLR scheduler). Weight decay applies to Linear weights (incl. a tied embedding)
    only: norms, biases, u/v and position tables are not pulled towards zero."""
    decay = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    rest = [p for p in model.parameters() if id(p) not in decay]
    decay_wd = train.weight_decay if train.optimizer == "adamw" else 0.0
    groups = [{"params": list(decay.values()), "weight_decay": decay_wd}, {"params": rest, "weight_decay": 0.0}]
    optim_cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
    optimizer = optim_cls(groups, lr=train.lr, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train))
    return optimizer, scheduler


class MaskedMean(Metric):
    """Mean of a per-token value over the marked tokens, accumulated in float64 across batches.

    (torchmetrics' MeanMetric ignores its weights when nan_strategy='disable', and its other
    strategies sync with the host on every update.)"""

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor, mask: Tensor) -> None:
        self.total += (values.double() * mask).sum()
        self.count += mask.sum()

    def compute(self) -> Tensor:
        return self.total / self.count


def rope_scale(config: RunConfig, setting: EvalSetting) -> float | None:
    """The factor s of the setting's RoPE context extension (None: none)."""
    if setting.rope_scaling is None:
        return None
    mem_len = config.model.mem_len if setting.mem_len is None else setting.mem_len
    return setting.rope_factor(config.train_attn_len, setting.segment_len + mem_len)


def rope_scaling(config: RunConfig, setting: EvalSetting) -> RopeScaling | None:
    """The setting's RoPE context extension as the model takes it: a pure function of the setting."""
    scale = rope_scale(config, setting)
    return None if scale is None else RopeScaling(setting.rope_scaling, scale, config.train_attn_len)


class LitLM(L.LightningModule):
    """TransformerLM + recurrence + metrics. Validation dataloader k evaluates config setting
    `eval_indices[k]` (run.py sets all usable settings for the final evaluation)."""

    def __init__(self, config: RunConfig):
        super().__init__()
        self.save_hyperparameters({"config": to_plain(config)})
        self.config = config
        self.model = TransformerLM(config.model)
        self.settings = config.eval_settings()
        self.eval_indices: list[int] = [0]
        self.eval_nll = nn.ModuleList(MaskedMean() for _ in self.settings)
        self.eval_acc = nn.ModuleList(MaskedMean() for _ in self.settings)
        self.eval_results: dict[int, dict[str, float]] = {}
        self.train_segments = 0  # set from the datamodule at fit start: memory resets every this many steps
        self._train_mems: list[Tensor] | None = None
        self._eval_mems: list[Tensor] | None = None
        self._pending_loss: tuple[int, Tensor] | None = None

    def on_fit_start(self) -> None:
        self.train_segments = self.trainer.datamodule.train_segments

    def training_step(self, batch, batch_idx: int) -> Tensor:
        self._check_finite()
        restart = self.global_step % self.train_segments == 0  # the streams restart: nothing to remember
        loss, acc = self.segment_loss(*batch, restart=restart)
        self._pending_loss = (self.global_step, loss.detach())
        # Lightning writes logs every log_every steps; logging only then saves ~1 ms of bookkeeping a step
        if (self.global_step + 1) % self.config.train.log_every == 0:
            metrics = {f"train_{name}": value for name, value in self._metrics(loss.detach(), acc).items()}
            self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=True)
            self.log("lr", self.lr_schedulers().get_last_lr()[0], on_step=True, on_epoch=False)
        return loss

    def segment_loss(self, inputs: Tensor, targets: Tensor, mask: Tensor, restart: bool) -> tuple[Tensor, Tensor]:
        """(loss, accuracy) of one training segment, with the memory of the previous one unless `restart`."""
        if restart:
            self._train_mems = None
        logits, self._train_mems = self.model(inputs, self._train_mems)
        nll, correct = token_stats(logits, targets)
        counted = loss_mask(mask, self.config.train.loss_on)
        return masked_mean(nll, counted), masked_mean(correct, counted).detach()

    def _metrics(self, loss: Tensor, acc: Tensor) -> dict[str, Tensor]:
        """loss (nats per token) and accuracy; perplexity for text, bits per character for char/byte text."""
        values = {"loss": loss, "acc": acc}
        if main_metric(self.config) == "ppl":
            values["ppl"] = loss.exp()
        if self.config.data.character_level:
            values["bpc"] = loss / math.log(2)
        return values

    def _check_finite(self) -> None:
        """Checks the previous step's loss: by now it is computed, so this costs no pipeline stall."""
        if self._pending_loss is not None:
            step, loss = self._pending_loss
            self._pending_loss = None
            if not torch.isfinite(loss):
                raise NonFiniteLoss(f"non-finite loss at step {step}")

    def on_train_end(self) -> None:
        self._check_finite()

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        index = self.eval_indices[dataloader_idx]
        setting = self.settings[index]
        inputs, targets, mask = batch
        if batch_idx == 0:  # a new setting starts with empty memory
            self._eval_mems = None
        logits, self._eval_mems = self.model(inputs, self._eval_mems, mem_len=setting.mem_len,
                                             clamp_len=setting.clamp_len, same_length=setting.same_length,
                                             rope_scaling=rope_scaling(self.config, setting))
        nll, correct = token_stats(logits, targets)
        self.eval_nll[index].update(nll, mask)
        self.eval_acc[index].update(correct, mask)

    def on_validation_epoch_end(self) -> None:
        for k, index in enumerate(self.eval_indices):
            nll_metric, acc_metric = self.eval_nll[index], self.eval_acc[index]
            nll, acc = nll_metric.compute(), acc_metric.compute()
            result = {name: value.item() for name, value in self._metrics(nll, acc).items()}
            result["tokens"] = int(nll_metric.count.item())
            self.eval_results[index] = result
            if self.trainer.state.fn == "fit" and k == 0:
                self.log_dict({f"val_{name}": value for name, value in result.items() if name != "tokens"})
            nll_metric.reset()
            acc_metric.reset()

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(self.model, self.config.train, self.device)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
