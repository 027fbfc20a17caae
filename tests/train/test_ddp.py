"""One run over several processes (Lightning DDP, gloo on CPU) computes what one process computes.

Covers: two real processes (`train --set train.devices=2`, launched by Lightning itself, as a user
would) train the same loss curve and final weights as one process with the same global batch, with
memory on, and evaluate to the same numbers over uneven shares of the evaluation streams (every
protocol; the per-target losses of a sliding setting gathered from both processes); the step's loss
over any split of the streams (processes x accumulate groups) is the global token mean, not a mean
of means (float64 reference); gradient accumulation trains the same steps; which fields are "how to
run" (not in the run id); sharding errors; the cluster environment chosen under SLURM.
Run: pytest tests/train/test_ddp.py -q   (about 30 s; one real 2-process run). The SIGKILL/SIGTERM
tests of a 2-process run are in tests/train/test_ddp_faults.py, whose runs of terms d alone (no
query, no key projection) are also the check that such a run trains on 2 processes.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fixtures.runner import REPO
from fixtures.training import RECALL
from relpos_ablate.config import ConfigError, check_world_size, load_run_config, run_id
from relpos_ablate.rundir import same_run
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.data.streams import TrainingSegments, loss_mask
from relpos_ablate.train.module import LitLM, token_stats
from relpos_ablate.train.run import cluster_environment, resolve_vocab, train_run


def assert_same_weights(a: dict, b: dict) -> None:
    """Equal to fp32 tolerance after 12 AdamW steps at lr 3e-3 (each step moves a weight by up to
    ~3e-3). Summation order differs (2 x 2 rows vs 4 rows, an all-reduce), and Adam's division by
    sqrt(v) turns that rounding into up to ~1e-5 on the few coordinates whose gradients nearly
    cancel (observed: 1e-5 on ~1% of XL's r_net weights, <1e-7 elsewhere). A wrong split of the
    streams or of the loss moves every weight by orders of magnitude more."""
    assert a.keys() == b.keys()
    diff = torch.cat([(a[name] - b[name]).abs().flatten() for name in a])
    assert diff.max().item() <= 5e-5 and diff.mean().item() <= 1e-6, (
        diff.max().item(),
        diff.mean().item(),
    )


def config(*overrides):
    data = yaml.safe_load(yaml.safe_dump(RECALL))
    return load_run_config(
        None, [f"{key}={json.dumps(value)}" for key, value in data.items()] + list(overrides)
    )


def train_processes(
    run_dir: Path, processes: int, *overrides: str, timeout: float = 180
) -> subprocess.CompletedProcess:
    """`relpos-ablate train` as a user runs it; Lightning launches the other processes."""
    config_path = run_dir.parent / f"{run_dir.name}.yaml"
    config_path.write_text(yaml.safe_dump(RECALL))
    argv = [
        sys.executable,
        "-m",
        "relpos_ablate",
        "train",
        "--config",
        str(config_path),
        "--run-dir",
        str(run_dir),
        "--threads",
        str(processes),
        "--set",
        f"train.devices={processes}",
        *[a for o in overrides for a in ("--set", o)],
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def metric_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.process_group
def test_two_processes_train_and_evaluate_the_same_run_as_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_run(config(), one) == "done"
    done = train_processes(two, 2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Starting with 2 processes" in done.stdout + done.stderr

    rows_one, rows_two = metric_rows(one), metric_rows(two)
    # rank 0 alone wrote each step once
    assert [r["step"] for r in rows_two] == [str(s) for s in range(12)]
    for column in ("train_loss", "train_acc"):
        torch.testing.assert_close(
            torch.tensor([float(r[column]) for r in rows_two]),
            torch.tensor([float(r[column]) for r in rows_one]),
            rtol=1e-5,
            atol=1e-6,
        )
    assert_same_weights(weights(one), weights(two))

    eval_one, eval_two = (json.loads((d / "eval.json").read_text())["settings"] for d in (one, two))
    for a, b in zip(eval_one, eval_two):
        # 3 streams over 2 processes: none lost or doubled
        assert b["metrics"]["tokens"] == a["metrics"]["tokens"]
        for name in ("loss", "acc"):
            assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-5)
    # every process's targets
    with np.load(one / "token_losses.npz") as a, np.load(two / "token_losses.npz") as b:
        assert a.files == b.files and len(a.files) == 1
        assert np.isnan(a[a.files[0]]).tolist() == np.isnan(b[b.files[0]]).tolist()
        np.testing.assert_allclose(b[b.files[0]], a[a.files[0]], rtol=1e-4, atol=1e-5)
    status = json.loads((two / "status.json").read_text())
    assert status["state"] == "done" and status["device"] == "cpu x 2 per node"
    # how this attempt ran
    assert yaml.safe_load((two / "config.yaml").read_text())["train"]["devices"] == 2


def test_step_loss_over_any_split_of_the_streams_is_the_global_token_mean():
    """Σ over the row groups of (Σ nll over counted targets) / counted_in_step equals the float64
    token mean of the whole batch for 1, 2 and 4 groups; the mean of per-group means does not (that
    is the bug this guards against)."""
    cfg = config("train.batch_size=8", "train.loss_on=half")
    datamodule = build_datamodule(cfg)
    cfg = resolve_vocab(cfg, datamodule.vocab_size)
    torch.manual_seed(0)
    module = LitLM(cfg).eval()
    streams = datamodule.streams("train", cfg.train.segment_len)
    inputs, targets, mask = streams[1]
    logits, _ = module.model(inputs)
    nll, _correct = token_stats(logits, targets)
    counted = loss_mask(mask, "half")
    reference = (nll.double() * counted).sum() / counted.sum()
    for world, accumulate in ((1, 1), (2, 1), (2, 2), (1, 4)):
        shares, means = [], []
        for rank in range(world):
            segments = TrainingSegments(
                streams, steps=4, loss_on="half", rank=rank, world=world, accumulate=accumulate
            )
            for group in range(accumulate):
                batch = segments[1 * accumulate + group]
                loss, _acc = module.segment_loss(
                    batch.inputs,
                    batch.targets,
                    batch.mask,
                    restart=True,
                    group=group,
                    counted_in_step=batch.counted_in_step,
                )
                shares.append(loss.double())
                means.append(
                    module.segment_loss(batch.inputs, batch.targets, batch.mask, restart=True)[
                        0
                    ].double()
                )
        assert sum(shares).item() == pytest.approx(reference.item(), rel=1e-6)
        if len(means) > 1:
            assert abs(sum(means).item() / len(means) - reference.item()) > 1e-3


def test_gradient_accumulation_trains_the_same_steps(tmp_path):
    assert train_run(config(), tmp_path / "one") == "done"
    assert train_run(config("train.accumulate=2"), tmp_path / "acc") == "done"
    rows_one, rows_acc = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "acc")
    torch.testing.assert_close(
        torch.tensor([float(r["train_loss"]) for r in rows_acc]),
        torch.tensor([float(r["train_loss"]) for r in rows_one]),
        rtol=1e-5,
        atol=1e-6,
    )
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "acc"))


def test_devices_nodes_strategy_and_accumulate_are_how_to_run_not_what():
    base = config("train.batch_size=8")
    how = config(
        "train.batch_size=8",
        "train.devices=2",
        "train.num_nodes=2",
        "train.strategy=ddp",
        "train.accumulate=2",
        "train.accelerator=gpu",
        "train.loggers=[csv, tensorboard]",
        "train.deterministic=true",
    )
    assert run_id(how) == run_id(base) and same_run(how, base)
    for what in (
        "train.batch_size=16",
        "train.precision=bf16-mixed",
        "train.log_every=2",
        "model.mem_len=8",
    ):
        assert run_id(config("train.batch_size=8", what)) != run_id(base), what
    assert run_id(load_run_config(None, [])) == run_id(load_run_config(None, ["train.devices=4"]))


def test_uneven_sharding_is_a_one_line_error_naming_the_field():
    with pytest.raises(
        ConfigError,
        match=r"^train.batch_size: 4 streams do not split evenly over 3 processes; "
        r"use a multiple of 3$",
    ):
        config("train.devices=3")
    with pytest.raises(
        ConfigError,
        match=r"over 2 processes x 4 micro-batches \(train.accumulate\); use a multiple of 8$",
    ):
        config("train.devices=2", "train.accumulate=4")
    # devices: auto learns the world size only at run time, where train checks it before launching
    # the others
    with pytest.raises(
        ConfigError, match=r"^train.batch_size: 4 streams do not split evenly over 3 processes"
    ):
        check_world_size(config(), 3)
    with pytest.raises(
        ConfigError,
        match=r"^eval.batch_size: 3 streams cannot give each of 4 processes one; use at least 4$",
    ):
        check_world_size(config("train.batch_size=8"), 4)
    check_world_size(config(), 2)


SLURM_TASK = {
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NAME": "relpos-g",
    "SLURM_PROCID": "0",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_ID": "4242",
}


def test_slurm_started_processes_use_slurm_environment_without_its_requeue(monkeypatch):
    from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    # SLURMEnvironment writes them into os.environ: undo after the test
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    assert cluster_environment(config().train) == []  # outside SLURM: Lightning's own detection
    for key, value in SLURM_TASK.items():
        monkeypatch.setenv(key, value)
    (env,) = cluster_environment(config("train.devices=2", "train.num_nodes=2").train)
    # submitit requeues, not Lightning
    assert isinstance(env, SLURMEnvironment) and not env.auto_requeue
    assert env.world_size() == 4 and env.main_address == "node1"
    # a local slot inside an allocation
    (env,) = cluster_environment(config("train.devices=2").train)
    assert type(env) is LightningEnvironment
