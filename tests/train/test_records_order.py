"""last.ckpt and metrics.csv stay consistent at every moment a run could be SIGKILLed: whenever a
checkpoint at global step G is on disk, metrics.csv already holds the row of every step below G
(with the validation metrics of the steps that validated), so a rerun from it loses no step and
repeats none. Lightning saves a step's checkpoint before it logs that step's metrics and runs its
validation; the run must not let the checkpoint reach the disk before them, nor at all when an error
comes in between.
Run: pytest tests/train/test_records_order.py -q   (about 15 s on 2 loaded cores, 7 s of it the
tests)
"""

import csv
import os
import shutil
from pathlib import Path

import lightning as L
import pytest

from fixtures.runner import checkpoint_step
from fixtures.training import At, short, sigterm
from relpos_ablate.train.run import train_run

MAX_STEPS, CHECKPOINT_EVERY, VAL_EVERY = 12, 2, 4


def config(*overrides: str):
    return short(
        f"train.max_steps={MAX_STEPS}",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",
        f"train.val_every={VAL_EVERY}",
        *overrides,
    )


def rows_on_disk(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in rows]
    assert len(steps) == len(set(steps)), f"a step recorded twice: {steps}"
    return dict(zip(steps, rows))


def uncovered_steps(run_dir: Path) -> tuple[int | None, list[str]]:
    """What a SIGKILL now would leave: the checkpoint's step and the steps below it that metrics.csv
    lacks, or has without their validation (steps whose global step after them is a multiple of
    VAL_EVERY)."""
    step, rows = checkpoint_step(run_dir), rows_on_disk(run_dir)
    if step is None:
        return None, []
    return step, (
        [f"{s}" for s in range(step) if s not in rows]
        + [
            f"{s} (validation)"
            for s in range(step)
            if s in rows and (s + 1) % VAL_EVERY == 0 and not rows[s].get("val_loss")
        ]
    )


def test_every_write_leaves_metrics_covering_the_checkpoint(tmp_path, monkeypatch):
    """Checked right after each rename of last.ckpt or metrics.csv: the only moments the files on
    disk change, so the only states a kill can leave behind. Through a SIGTERM stop and the
    rerun."""
    watched = {tmp_path / "metrics.csv", tmp_path / "checkpoints" / "last.ckpt"}
    real_replace = os.replace
    seen_checkpoints, gaps = [], []

    def replace_and_check(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        if Path(dst) in watched:
            step, missing = uncovered_steps(tmp_path)
            gaps.extend(
                f"after writing {Path(dst).name}: last.ckpt at step {step}, metrics.csv lacks {m}"
                for m in missing
            )
            if Path(dst).name == "last.ckpt":
                seen_checkpoints.append(step)

    monkeypatch.setattr(os, "replace", replace_and_check)
    assert train_run(config(), tmp_path, callbacks=(At(7, sigterm),)) == "interrupted"
    assert train_run(config(), tmp_path) == "done"
    assert gaps == []
    assert seen_checkpoints == [2, 4, 6, 7, 8, 10, 12]  # the SIGTERM one included
    assert sorted(rows_on_disk(tmp_path)) == list(range(MAX_STEPS))


class CopyAt(L.Callback):
    """Copies the run dir to `to` when `hook` is called at global step `step` during training: what
    a SIGKILL at that moment leaves on disk. Runs after RunRecorder's hooks, as every extra callback
    does."""

    def __init__(self, hook: str, step: int, run_dir: Path, to: Path):
        self.hook, self.step, self.run_dir, self.to = hook, step, run_dir, to

    def on_train_batch_start(self, trainer, *args):
        self._copy_at(trainer, "on_train_batch_start")

    def on_validation_start(self, trainer, *args):
        self._copy_at(trainer, "on_validation_start")

    def _copy_at(self, trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_step == self.step:
            shutil.copytree(self.run_dir, self.to)


@pytest.mark.parametrize(
    "hook, resumed_from", [("on_train_batch_start", 4), ("on_validation_start", 2)]
)
def test_killed_after_a_checkpoint_the_rerun_records_every_step_once(tmp_path, hook, resumed_from):
    """The reported failure: killed as step 4 starts (its checkpoint on disk, and the validation of
    step 3 done), the rerun resumed from that checkpoint and metrics.csv never got a row for step 3.
    Killed during the validation of step 3, the checkpoint of step 4 is held back (not committed):
    the rerun resumes from step 2 and clears the held file and the temp files of its writes."""
    run_dir, killed = tmp_path / "run", tmp_path / "killed"
    assert train_run(config(), run_dir, callbacks=(CopyAt(hook, 4, run_dir, killed),)) == "done"
    shutil.rmtree(run_dir)
    killed.rename(run_dir)  # the rerun finds what the kill left
    assert (run_dir / "checkpoints" / ".last.ckpt.staged.tmp").exists() == (resumed_from == 2)
    # a kill mid-write
    (run_dir / "checkpoints" / "..last.ckpt.staged.tmp.cut_short.tmp").write_bytes(b"PK")
    assert uncovered_steps(run_dir) == (resumed_from, [])
    assert train_run(config(), run_dir) == "done"
    assert "Restored all states from the checkpoint" in (run_dir / "log.txt").read_text()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    rows = rows_on_disk(run_dir)
    assert sorted(rows) == list(range(MAX_STEPS))
    assert [s for s, row in rows.items() if row.get("val_loss")] == [3, 7, 11]


class PeerDiesAtSaveBarrier(L.Callback):
    """The barrier that ends Trainer.save_checkpoint fails at global step `step`, as it does in a
    multi-process run whose other process was killed: after the checkpoint is saved, before
    Lightning logs the step."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, *args):
        barrier = trainer.strategy.barrier

        def failing_barrier(name=None, *rest, **kwargs):
            if name == "Trainer.save_checkpoint" and trainer.global_step == self.step:
                raise RuntimeError("Connection reset by peer")
            return barrier(name, *rest, **kwargs)

        trainer.strategy.barrier = failing_barrier


def test_an_error_between_the_save_and_the_log_of_a_step_drops_that_checkpoint(tmp_path):
    """The 2-process fault test's failure (last.ckpt at step 18, no row for step 17): a rank killed
    while rank 0 waits in the barrier after writing a checkpoint. The run resumes from the one
    before."""
    assert train_run(config(), tmp_path, callbacks=(PeerDiesAtSaveBarrier(4),)) == "failed"
    assert uncovered_steps(tmp_path) == (2, [])
    assert train_run(config(), tmp_path) == "done"
    assert sorted(rows_on_disk(tmp_path)) == list(range(MAX_STEPS))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]
