"""Training until in-distribution success (`train.stop_at_exact_match`), with max_steps as the cap.

Out-of-distribution accuracy means little for a model that has not learnt the task at the training
lengths, so a length-generalization run may train until it has: every `stop_check_every` steps the
callback measures exact match on a held-out set of in-distribution examples and stops the run once
it reaches the threshold.

- The held-out set: `stop_examples` examples with n drawn from data.train_lengths, from a stream of
  its own (STOP_STREAM), apart from the training examples and the test bins (only short examples, of
  which there are few distinct ones, coincide with some of those by chance).
- Deterministic: each check runs in eval mode, without gradients, from a fixed random state
  (randomized positions draw the same positions at every check) inside a forked generator, so
  training draws exactly what it would without checks: a run that never reaches the threshold trains
  the same weights as one with no stopping at all.
- Resume: the checks so far and the step it stopped at are part of the checkpoint (the callback's
  state). The checkpoint of the stopping step is written at that step (by ModelCheckpoint when the
  step is one of its own, else here), so last.ckpt holds the model the final evaluation scores, and
  a run resumed from it (killed before eval.json was written) stops again at once instead of
  training on.
- Several processes: each scores its share of the held-out set (rows rank, rank + W, ...) and the
  counts are summed over processes before dividing (one all-reduce), so every process computes the
  same share and they all stop at the same step.
- Recorded: eval.json and status.json `stopped` (run.py): why training ended (`exact_match` or
  `max_steps`), the step, the threshold and every check as [step, exact match].
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import lightning as L

from relpos_ablate.config import RunConfig
from relpos_ablate.train.data import examples
from relpos_ablate.train.evaluation import example_totals

log = logging.getLogger("relpos_ablate.train")

STOP_STREAM = (0, 1)
"""The held-out set's stream of the eval split: test bins use (lo, hi[, depth]) with lo >= 1, and
the evaluation streams of example tasks (0,)."""


class StopAtExactMatch(L.Callback):
    """Stops training once held-out in-distribution exact match reaches `train.stop_at_exact_match`
    (module docstring). `checkpoint`: the run's last.ckpt."""

    def __init__(self, config: RunConfig, checkpoint: Path):
        self.config, self.checkpoint = config, checkpoint
        self.threshold, self.every = config.train.stop_at_exact_match, config.train.stop_check_every
        self.checks: list[list] = []  # [step, exact match] of every check
        self.stopped_at: int | None = None

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict:
        return {"checks": [list(c) for c in self.checks], "stopped_at": self.stopped_at}

    def load_state_dict(self, state_dict: dict) -> None:
        self.checks = [list(c) for c in state_dict.get("checks", [])]
        self.stopped_at = state_dict.get("stopped_at")

    @functools.cached_property
    def held_out(self) -> examples.Examples:
        data = self.config.data
        return examples.generate(
            data,
            self.config.seed,
            "eval",
            self.config.train.stop_examples,
            tuple(data.train_lengths),
            stream=STOP_STREAM,
        )

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if self.stopped_at is not None:  # resumed from the checkpoint of the step it stopped at
            trainer.should_stop = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # with gradient accumulation every micro-batch ends here: check once per step, and never at
        # the cap
        if (
            step % self.every
            or step >= trainer.max_steps
            or (self.checks and self.checks[-1][0] == step)
        ):
            return
        exact = self.exact_match(trainer, pl_module)
        self.checks.append([step, exact])
        log.info(
            "step %d: held-out in-distribution exact match %.4f (stop at %g)",
            step,
            exact,
            self.threshold,
        )
        if exact >= self.threshold:
            self.stopped_at = step
            trainer.should_stop = True
            # ModelCheckpoint saves its own steps (it runs after us)
            if step % self.config.train.checkpoint_every:
                trainer.save_checkpoint(self.checkpoint)

    def exact_match(self, trainer: L.Trainer, pl_module) -> float:
        """This step's exact match on the held-out set, the same on every process."""
        model = pl_module.model
        rank, world = trainer.global_rank, trainer.world_size
        share = examples.Examples(
            *(
                t[rank::world]
                for t in (
                    self.held_out.inputs,
                    self.held_out.targets,
                    self.held_out.mask,
                    self.held_out.lengths,
                    self.held_out.depths,
                )
            )
        )
        model.eval()
        totals = example_totals(model, share, self.config, trainer.precision_plugin.forward_context)
        model.train()
        exact, count = trainer.strategy.reduce(totals[3:], reduce_op="sum").tolist()
        return exact / count

    def record(self, step: int) -> dict:
        """eval.json's `stopped`: why training ended at `step`, the threshold and every check."""
        reason = "exact_match" if self.stopped_at is not None else "max_steps"
        return {"reason": reason, "step": step, "threshold": self.threshold, "checks": self.checks}
