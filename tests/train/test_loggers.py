"""TensorBoard and W&B (train.loggers), read back from what they wrote; metrics.csv stays the
record.

Covers: TensorBoard's events file holds every logged training scalar at its step with the values
of metrics.csv, the run id and variant as hyperparameters, and a resumed run continues the same log
dir without the steps of the interrupted attempt past its checkpoint; TensorBoard's HParams, read by
TensorBoard's own plugin, shows one session group per variant (its axes but the seed as the
hyperparameters, the seed a metric, each metric the mean over the variant's seeds); W&B in offline
mode writes its run under the run dir, named and identified by the run id, tagged with the variant,
grouped by it (every field but the seed), with every step's metrics in its transaction log, and a
resumed run appends to the same W&B run; a missing extra is a one-line failure naming
`pip install relpos-ablate[...]`.
Run: pytest tests/train/test_loggers.py -q   (about 25 s)
"""

import csv
import importlib.util
import json
import time
from pathlib import Path

import pytest
import yaml

from fixtures.training import At, crash, sigterm
from relpos_ablate.config import load_run_config
from relpos_ablate.rundir import read_status
from relpos_ablate.train.run import train_run

RUN = {
    "model": {
        "d_model": 16,
        "n_layers": 1,
        "n_heads": 2,
        "d_head": 8,
        "d_inner": 32,
        "dropout": 0.0,
    },
    "data": {
        "source": "synthetic",
        "task": "offset_copy",
        "num_symbols": 8,
        "offset": 4,
        "train_tokens": 512,
        "eval_tokens": 128,
    },
    "train": {
        "segment_len": 16,
        "batch_size": 4,
        "max_steps": 10,
        "warmup_steps": 2,
        "log_every": 1,
        "checkpoint_every": 4,
        "accelerator": "cpu",
    },
    "eval": {"settings": [{"segment_len": 16}], "batch_size": 2},
}
VARIANT = {"encoding": "xl", "seed": 0}


def run_dir_with_info(tmp_path: Path) -> Path:
    run_dir = tmp_path / "g" / "abc123"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(
        json.dumps({"run_id": "abc123", "experiment": "g", "variant": VARIANT})
    )
    return run_dir


def config(*loggers: str):
    return load_run_config(
        None, [f"{k}={json.dumps(v)}" for k, v in RUN.items()] + [f"train.loggers={list(loggers)}"]
    )


def csv_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f)}


def tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_tensorboard_holds_the_logged_scalars_and_a_resume_continues_it(tmp_path):
    run_dir = run_dir_with_info(tmp_path)
    assert train_run(config("csv", "tensorboard"), run_dir, callbacks=(At(6, crash),)) == "failed"
    # steps 4 and 5 again, from the step-4 checkpoint
    assert train_run(config("csv", "tensorboard"), run_dir) == "done"
    log_dir = run_dir / "tensorboard"
    scalars = tensorboard_scalars(log_dir, "train_loss")
    expected = csv_losses(run_dir)
    # each step once: the retrained 4, 5 win
    assert sorted(scalars) == sorted(expected) == list(range(10))
    assert scalars == pytest.approx(expected, rel=1e-6)
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert (
        hparams["run"] == {"id": "abc123", "variant": VARIANT}
        and hparams["config"]["train"]["max_steps"] == 10
    )


def hparams_session_groups(log_dir: Path) -> dict[str, dict]:
    """TensorBoard's HParams table of a log dir as its plugin computes it (one row per session
    group, metrics averaged over the group's sessions): {group: {hparams, sessions, metrics}}."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(log_dir))
    backend = backend_context.Context(
        base_plugin.TBContext(logdir=str(log_dir), multiplexer=mux, data_provider=provider)
    )
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0,
        slice_size=100,
        aggregation_type=api_pb2.AGGREGATION_AVG,
        allowed_statuses=list(api_pb2.Status.values()),  # the page's default: every status
    )
    response = list_session_groups.Handler(context.RequestContext(), backend, "", request).run()
    return {
        group.name: {
            "hparams": {
                k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                for k, v in group.hparams.items()
            },
            "sessions": [session.name for session in group.sessions],
            "metrics": {m.name.tag: m.value for m in group.metric_values},
        }
        for group in response.session_groups
    }


def test_tensorboard_hparams_show_one_entry_per_variant_with_the_seed_as_a_metric(tmp_path):
    pytest.importorskip("tensorboard")
    runs = {"xl0": ("xl", 0), "xl1": ("xl", 1), "alibi0": ("alibi", 0)}
    for rid, (encoding, seed) in runs.items():
        run_dir = tmp_path / "g" / rid
        run_dir.mkdir(parents=True)
        variant = {"encoding": encoding, "train.lr": 0.001, "seed": seed}
        (run_dir / "run.json").write_text(
            json.dumps({"run_id": rid, "experiment": "g", "variant": variant})
        )
        short = load_run_config(
            None,
            [f"{k}={json.dumps(v)}" for k, v in RUN.items()]
            + ["train.loggers=[csv, tensorboard]", f"seed={seed}", "train.max_steps=3"],
        )
        assert train_run(short, run_dir) == "done"
    groups = hparams_session_groups(tmp_path / "g")
    # the variant's seeds in one row; its hyperparameters the axes but the seed
    assert {name: group["sessions"] for name, group in groups.items()} == {
        "g: encoding=xl train.lr=0.001": ["xl0/tensorboard", "xl1/tensorboard"],
        "g: encoding=alibi train.lr=0.001": ["alibi0/tensorboard"],
    }
    assert groups["g: encoding=xl train.lr=0.001"]["hparams"] == {
        "encoding": "xl",
        "train.lr": 0.001,
    }
    # the row's metrics: the mean over its seeds of each run's last value (metrics.csv)
    last_loss = {rid: csv_losses(tmp_path / "g" / rid)[2] for rid in runs}
    xl = groups["g: encoding=xl train.lr=0.001"]["metrics"]
    assert xl["seed"] == 0.5
    assert xl["train_loss"] == pytest.approx((last_loss["xl0"] + last_loss["xl1"]) / 2, rel=1e-6)
    alibi = groups["g: encoding=alibi train.lr=0.001"]["metrics"]
    assert alibi["train_loss"] == pytest.approx(last_loss["alibi0"], rel=1e-6)


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log
    records in 32 KiB blocks (crc: 4 bytes, length: 2, type: 1 full / 2 first / 3 middle / 4
    last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunk = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def test_wandb_offline_run_is_named_by_the_run_id_and_holds_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = run_dir_with_info(tmp_path)
    assert train_run(config("csv", "wandb"), run_dir, callbacks=(At(6, sigterm),)) == "interrupted"
    time.sleep(1.1)  # W&B names an offline attempt's directory by the second it starts in
    assert train_run(config("csv", "wandb"), run_dir) == "done"
    logs = sorted(run_dir.glob("wandb/offline-run-*-abc123/run-abc123.wandb"))
    # one per attempt, both of W&B run abc123 (resume="allow" joins them on sync)
    assert len(logs) == 2
    history: dict[int, float] = {}
    for log in logs:
        records = list(wandb_records(log))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.display_name, run.project, list(run.tags)) == (
            "abc123",
            "abc123",
            "g",
            ["encoding=xl", "seed=0"],
        )
        assert run.run_group == "encoding=xl"  # the variant but its seed: seeds grouped
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                if "train_loss" in items:
                    history[items["trainer/global_step"]] = items["train_loss"]
        config_keys = {
            item.key or item.nested_key[0]
            for r in records
            if r.WhichOneof("record_type") == "config"
            for item in r.config.update
        }
        assert {"config", "run"} <= config_keys
    assert history == pytest.approx(csv_losses(run_dir), rel=1e-6)


@pytest.mark.parametrize("extra", ["tensorboard", "wandb"])
def test_a_missing_extra_fails_the_run_with_one_line_naming_it(tmp_path, monkeypatch, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a)
    )
    assert train_run(config("csv", extra), tmp_path) == "failed"
    assert (
        read_status(tmp_path)["reason"]
        == f"train.loggers: {extra} is not installed; pip install relpos-ablate[{extra}]"
    )
