"""LightningModule: TransformerLM trained with segment recurrence and evaluated at many lengths.

- Recurrence as in Transformer-XL: every batch row is a contiguous stream, so the (detached) memory
  the model returns for batch t is the context of batch t + 1. It is reset when the streams restart
  and at the start of every evaluation setting. Each row group of gradient accumulation keeps its
  own.
- A checkpoint keeps every process's training memory and random state (dropout masks, randomized
  position draws), so a run resumed on as many processes trains exactly what the uninterrupted run
  would have; the data order needs nothing (the loader resumes from the step). Resumed on another
  number of processes, memory starts empty (like at the start of a stream) and the draws are seeded.
- Data parallel: each process trains and evaluates its own streams (train/data/streams.py). The
  step's loss is the token mean over the whole global batch, and evaluation adds every process's
  token sums before dividing, so the numbers do not depend on the number of processes (up to
  rounding).
- Loss on the whole segment or its most recent half (`train.loss_on`, XL Table 6), over the
  positions the batch mask marks (synthetic tasks count only determined targets).
- AdamW (decay on Linear weights outside bias schemes) or Adam, linear warm-up then cosine decay to
  0 or constant; after every optimizer step each bias scheme restores its parameters' range
  (KERPLE): train/optimizer.py.
- Metrics: loss and token accuracy everywhere; perplexity for text, plus bits per character for
  char/byte tokenizers. Main metric: `acc` for synthetic tasks, `ppl` for text (train/metrics.py).
- Evaluation: each setting's protocol (train/data/protocols.py) decides memory and same_length; in
  the same pass the loss by position in the segment/window (log-spaced bins) and, when asked, every
  scored target's loss (RECL).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor, nn

from relpos_ablate.config import EvalSetting, RunConfig, to_plain
from relpos_ablate.model import TransformerLM
from relpos_ablate.model.schemes import RopeScaling
from relpos_ablate.train.data.streams import TrainBatch, loss_mask
from relpos_ablate.train.diagnostics import AttentionDiagnostics, max_seen_distance
from relpos_ablate.train.metrics import MaskedMean, PositionLoss, main_metric, token_stats
from relpos_ablate.train.optimizer import (  # noqa: F401 (API: the tests)
    after_optimizer_step,
    build_optimizer,
    lr_factor,
    parameter_groups,
    without_unread_projections,
)

RESUME_STATES = "relpos_resume_states"
"""Checkpoint key: per process, in rank order, its random state and training memory."""


def random_state(device: torch.device) -> dict:
    """This process's torch random state: the CPU generator and, on CUDA, its device's."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_random_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _moved(mems: list[Tensor] | None, device) -> list[Tensor] | None:
    """A row group's memory (None without memory) on `device`."""
    return None if mems is None else [m.to(device) for m in mems]


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss; the run is recorded as failed."""


def rope_scale(config: RunConfig, setting: EvalSetting) -> float | None:
    """The factor s of the setting's RoPE context extension (None: none)."""
    if setting.rope_scaling is None:
        return None
    return setting.rope_factor(config.train_attn_len, setting.attn_len(config.model.mem_len))


def rope_scaling(config: RunConfig, setting: EvalSetting) -> RopeScaling | None:
    """The setting's RoPE context extension as the model takes it: a pure function of the setting
    (L: the training attention length; dynamic and longrope also read each call's length)."""
    scale = rope_scale(config, setting)
    if scale is None:
        return None
    return RopeScaling(
        setting.rope_scaling,
        scale,
        config.train_attn_len,
        long_factor=setting.rope_long_factor,
        short_factor=setting.rope_short_factor,
        mscale=setting.rope_mscale,
        mscale_all_dim=setting.rope_mscale_all_dim,
        truncate=setting.rope_truncate,
    )


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
        self.eval_positions = nn.ModuleList(PositionLoss(s.segment_len) for s in self.settings)
        self.eval_results: dict[int, dict] = {}
        """Per evaluated setting: {"metrics", "position_loss"[, "token_losses": (layout index,
        loss)]}."""
        self._token_losses: dict[int, list[tuple[Tensor, Tensor]]] = {}
        # eval.diagnostics: attention statistics per setting, from the evaluation's own forward
        self.eval_diagnostics = (
            nn.ModuleList(
                AttentionDiagnostics(
                    config.model.n_layers, config.model.n_heads, max_seen_distance(config)
                )
                for _ in self.settings
            )
            if config.eval.diagnostics
            else None
        )
        self.diagnostics_results: dict[int, dict[str, list[list[float]]]] = {}
        # set from the datamodule at fit start: memory resets every this many steps
        self.train_segments = 0
        self._train_mems: dict[int, list[Tensor]] = {}  # row group -> its memory
        # data.documents packed_reset: the token that opens every document (set from the data at
        # fit and evaluation), the memory's document ids per row group, the evaluation's
        self.separator: int | None = None
        self._train_docs: dict[int, Tensor] = {}
        self._eval_docs: Tensor | None = None
        # every setting's per-target losses, not only those that ask (document metrics)
        self.every_token_loss = False
        self._step_sums = torch.zeros(2)  # this process's share of the step's (loss, accuracy)
        self._eval_mems: list[Tensor] | None = None
        self.eval_seed: int | None = None
        """Set by the final evaluation (train/evaluation.py): each setting starts from this random
        state, so randomized positions at evaluation draw the same positions whichever settings come
        before."""
        self._pending_loss: tuple[int, Tensor] | None = None
        self._resumed_state: dict | None = None
        # train.compile: the training forward compiled (a function, not a module: the state dict and
        # the checkpoints keep their keys, and evaluation calls the model uncompiled)
        self._compiled_forward = torch.compile(self.model.forward) if config.train.compile else None

    def on_fit_start(self) -> None:
        self.train_segments = self.trainer.datamodule.train_segments
        self.separator = self.trainer.datamodule.separator

    def documents(self, inputs: Tensor, memory_ids: Tensor | None) -> Tensor | None:
        """data.documents packed_reset: the document ids [B, M + L] of a segment after memory whose
        ids are `memory_ids` [B, M] (None: no memory), a new document at every separator (the
        memory's last one going on until then); else None."""
        if self.config.data.documents != "packed_reset":
            return None
        if self.separator is None:
            raise ValueError("data.documents: packed_reset needs a corpus with document separators")
        base = 0 if memory_ids is None else memory_ids[:, -1:]
        ids = base + torch.cumsum(inputs == self.separator, dim=1)
        return ids if memory_ids is None else torch.cat([memory_ids, ids], dim=1)

    def training_step(self, batch: TrainBatch, batch_idx: int) -> Tensor:
        if batch.group == 0:
            self._check_finite()
            self._step_sums = torch.zeros(2, device=self.device)
        # the streams restart: nothing to remember
        restart = self.global_step % self.train_segments == 0
        loss, acc = self.segment_loss(
            batch.inputs,
            batch.targets,
            batch.mask,
            restart=restart,
            group=batch.group,
            counted_in_step=batch.counted_in_step,
        )
        self._step_sums += torch.stack([loss.detach(), acc])
        if batch.group == self.config.train.accumulate - 1:
            self._end_step()
        # Lightning averages a step's micro-batches and DDP the processes' gradients: scaled by
        # their number, both averages become sums, and the step's gradient is that of the global
        # token mean.
        return loss * (self.trainer.world_size * self.trainer.accumulate_grad_batches)

    def _end_step(self) -> None:
        """The step's loss and accuracy over the whole global batch (summed over processes): checked
        to be finite at the next step and logged every log_every steps."""
        loss, acc = self.trainer.strategy.reduce(self._step_sums, reduce_op="sum")
        self._pending_loss = (self.global_step, loss)
        # Lightning writes logs every log_every steps; logging only then saves ~1 ms of bookkeeping
        # a step
        if (self.global_step + 1) % self.config.train.log_every == 0:
            metrics = {f"train_{name}": value for name, value in self._metrics(loss, acc).items()}
            self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=True)
            self.log("lr", self.lr_schedulers().get_last_lr()[0], on_step=True, on_epoch=False)

    def segment_loss(
        self,
        inputs: Tensor,
        targets: Tensor,
        mask: Tensor,
        restart: bool,
        group: int = 0,
        counted_in_step: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(loss, accuracy) of one training segment of the streams of row group `group`, with their
        memory of the previous segment unless `restart`: sums over the counted targets divided by
        `counted_in_step` (default: the targets counted here, i.e. this segment's own token
        means)."""
        # packed rows are independent: no memory from one segment to the next
        if restart or self.config.data.documents == "packed":
            self._train_mems.pop(group, None)
            self._train_docs.pop(group, None)
        forward = self._compiled_forward or self.model
        ids = self.documents(inputs, self._train_docs.get(group))
        logits, self._train_mems[group] = forward(
            inputs, self._train_mems.get(group), document_ids=ids
        )
        self._train_docs[group] = remembered(ids, self._train_mems[group])
        nll, correct = token_stats(logits, targets)
        counted = loss_mask(mask, self.config.train.loss_on).to(nll.dtype)
        total = counted.sum().clamp(min=1) if counted_in_step is None else counted_in_step
        return (nll * counted).sum() / total, ((correct * counted).sum() / total).detach()

    def _metrics(self, loss: Tensor, acc: Tensor) -> dict[str, Tensor]:
        """loss (nats per token) and accuracy; perplexity for text, bits per character for char/byte
        text."""
        values = {"loss": loss, "acc": acc}
        if main_metric(self.config) == "ppl":
            values["ppl"] = loss.exp()
        if self.config.data.character_level:
            values["bpc"] = loss / math.log(2)
        return values

    def _check_finite(self) -> None:
        """Checks the previous step's loss: by now it is computed, so this costs no pipeline
        stall."""
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
        inputs, targets, mask, layout_index = batch
        # a new setting starts with empty memory; windows have none
        if batch_idx == 0 or not setting.uses_memory:
            self._eval_mems = self._eval_docs = None
        if batch_idx == 0 and self.eval_seed is not None:
            torch.manual_seed(self.eval_seed)
        statistics = (
            None if self.eval_diagnostics is None else self.eval_diagnostics[index].for_batch(mask)
        )
        ids = self.documents(inputs, self._eval_docs)
        logits, self._eval_mems = self.model(
            inputs,
            self._eval_mems,
            mem_len=setting.memory(self.config.model.mem_len),
            clamp_len=setting.clamp_len,
            same_length=setting.protocol == "xl",
            statistics=statistics,
            rope_scaling=rope_scaling(self.config, setting),
            document_ids=ids,
        )
        self._eval_docs = remembered(ids, self._eval_mems)
        nll, correct = token_stats(logits, targets)
        self.eval_nll[index].update(nll, mask)
        self.eval_acc[index].update(correct, mask)
        self.eval_positions[index].update(nll, mask)
        if setting.token_losses or self.every_token_loss:
            self._token_losses.setdefault(index, []).append((layout_index[mask], nll[mask]))

    def on_validation_epoch_end(self) -> None:
        for k, index in enumerate(self.eval_indices):
            nll_metric, acc_metric, positions = (
                self.eval_nll[index],
                self.eval_acc[index],
                self.eval_positions[index],
            )
            (nll, tokens), (acc, _) = nll_metric.synced(), acc_metric.synced()
            metrics = {name: value.item() for name, value in self._metrics(nll, acc).items()}
            metrics["tokens"] = int(tokens.item())
            self.eval_results[index] = {"metrics": metrics, "position_loss": positions.compute()}
            if self.settings[index].token_losses or self.every_token_loss:
                pairs = self._all_processes(self._token_losses.pop(index, []))
                self.eval_results[index]["token_losses"] = tuple(
                    torch.cat(part).cpu() for part in zip(*pairs)
                )
            if self.trainer.state.fn == "fit" and k == 0:
                self.log_dict(
                    {f"val_{name}": value for name, value in metrics.items() if name != "tokens"}
                )
            for metric in (nll_metric, acc_metric, positions):
                metric.reset()
            if self.eval_diagnostics is not None:
                self.diagnostics_results[index] = self.eval_diagnostics[index].compute()
                self.eval_diagnostics[index].reset()

    def _all_processes(self, pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Every process's (layout index, loss) pairs: each evaluated its own streams (one process:
        its own)."""
        if self.trainer.world_size == 1:
            return pairs
        shares = self._from_every_process([(i.cpu(), loss.cpu()) for i, loss in pairs])
        return [pair for share in shares for pair in share]

    def _from_every_process(self, value) -> list:
        """`value` (picklable, on the CPU) of every process, in rank order: a collective, so every
        process calls it at the same point; one process: [value]."""
        if self.trainer.world_size == 1:
            return [value]
        gathered: list = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(gathered, value)
        return gathered

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every process's random state and training memory (all processes write a checkpoint at the
        same step)."""
        checkpoint[RESUME_STATES] = self._from_every_process(
            {
                "random": random_state(self.device),
                "memory": {group: _moved(mems, "cpu") for group, mems in self._train_mems.items()},
                "documents": {
                    group: ids.cpu() for group, ids in self._train_docs.items() if ids is not None
                },
            }
        )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Resuming a fit: this process's random state and memory, when the checkpoint has them for
        as many processes as now run. Set at the first training batch: Lightning draws from the
        generator while it sets up the loop (the loader's base seed), which the uninterrupted run
        did before. The optimizer state is laid out for this model (a checkpoint may hold
        projections it no longer builds)."""
        trainer, states = self._trainer, checkpoint.get(RESUME_STATES)
        if trainer is not None and states is not None and len(states) == trainer.world_size:
            self._resumed_state = states[trainer.global_rank]
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [
                without_unread_projections(self.model, optimizer)
                for optimizer in checkpoint["optimizer_states"]
            ]

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._resumed_state is not None:
            set_random_state(self._resumed_state["random"], self.device)
            memory = self._resumed_state["memory"]
            self._train_mems = {group: _moved(mems, self.device) for group, mems in memory.items()}
            documents = self._resumed_state.get("documents", {})
            self._train_docs = {group: ids.to(self.device) for group, ids in documents.items()}
            self._resumed_state = None

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        after_optimizer_step(self.model)

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(self.model, self.config.train, self.device)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def remembered(ids: Tensor | None, mems: list[Tensor] | None) -> Tensor | None:
    """The document ids of the memory a model kept (its last M tokens'), or None."""
    return None if ids is None or not mems else ids[:, ids.shape[1] - mems[0].shape[1] :]
