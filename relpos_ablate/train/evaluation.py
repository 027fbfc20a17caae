"""Evaluation of a trained model, as a layer of its own: every setting's record in eval.json, the
per-target losses of token_losses.npz, and the reference a model must beat.

Two callers: `train/run.py` evaluates every setting once training ends, and `relpos-ablate evaluate`
(train/evaluate_run.py) evaluates new settings of a finished run from its checkpoint. Both go
through `evaluate_settings` (text and synthetic streams, by protocol: train/data/protocols.py) or
`evaluate_examples` (example tasks, test set by test set), so a setting gives the same record
whichever path computed it. Whether a model can take a setting at all:
config.run.unsupported_reason.

Example tasks: one record per test set, with the fields of an evaluation setting (segment_len = the
input length of the bin's longest n, as RunConfig.eval_settings), the set's `length_min`,
`length_max` (and `depth`), its metrics — `exact_match` (the share of examples with every answer
token right), `acc` (answer tokens right), `loss` (nats per answer token), `tokens`, `examples` —
and, with eval.diagnostics, `diagnostics`. Each set is evaluated under its own fixed random state
(seeded by the run's seed), so randomized positions at evaluation draw the same positions whichever
sets are evaluated with it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch

from relpos_ablate import rundir
from relpos_ablate.config import EvalSetting, RunConfig, unsupported_reason
from relpos_ablate.config.evaluation import ROPE_EXTENSION_FIELDS
from relpos_ablate.io import atomic_write_bytes
from relpos_ablate.model import TransformerLM
from relpos_ablate.train.data.datamodule import SegmentDataModule
from relpos_ablate.train.data.example_module import ExampleDataModule, TestSet
from relpos_ablate.train.data.examples import PAD, Examples
from relpos_ablate.train.data.protocols import unigram_loss_of_counts
from relpos_ablate.train.diagnostics import AttentionDiagnostics, max_seen_distance
from relpos_ablate.train.document_metrics import document_metrics, places
from relpos_ablate.train.metrics import main_metric, token_stats
from relpos_ablate.train.module import LitLM, rope_scale

log = logging.getLogger("relpos_ablate.train")

EXAMPLE_METRIC = "exact_match"
"""The main metric of example tasks."""


def evaluate(
    trainer: L.Trainer, module: LitLM, datamodule: SegmentDataModule, config: RunConfig
) -> tuple[dict, dict[str, np.ndarray]]:
    """(eval.json, token_losses.npz arrays) at the end of training. eval.json: one record per
    setting (protocol, lengths, attention length, split, metrics, loss by position, attention
    diagnostics with eval.diagnostics), the layout of eval.split's streams and the reference
    (unigram or chance) on them (a setting with a split of its own scores that split's streams); the
    arrays: each target's loss for the settings that ask for it. Example tasks: one record per test
    set."""
    if config.data.example_task:
        return evaluate_examples(
            module.model,
            datamodule,
            config,
            trainer.global_step,
            trainer.precision_plugin.forward_context,
        ), {}
    records, token_losses = evaluate_settings(trainer, module, datamodule, config)
    streams = datamodule.streams("eval", config.eval_settings()[0].segment_len)
    return {
        "main_metric": main_metric(config),
        "step": trainer.global_step,
        "layout": {
            "split": config.eval.split,
            "streams": streams.rows,
            "targets_per_stream": streams.inputs.shape[1],
        },
        "reference": reference(config, datamodule),
        "tokenizer": datamodule.tokenizer_record(),
        "settings": records,
    }, token_losses


def evaluate_settings(
    trainer: L.Trainer, module: LitLM, datamodule: SegmentDataModule, config: RunConfig
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """One record per setting of config.eval_settings() (a setting the model cannot take: its
    reason, no metrics), and the per-target loss arrays named as the records say
    (token_losses_key(i))."""
    settings = config.eval_settings()
    usable = [i for i, s in enumerate(settings) if unsupported_reason(config, s) is None]
    module.eval_indices = usable
    # a corpus of documents: every setting's per-target losses, for its document metrics
    separator = datamodule.separator
    module.every_token_loss = separator is not None
    loaders = {i: datamodule.eval_dataloader(settings[i]) for i in usable}
    if usable:
        # every setting draws its (randomized) positions from this seed
        module.eval_seed = config.seed
        with torch.random.fork_rng(devices=_cuda_devices(module.device)):
            trainer.validate(module, dataloaders=list(loaders.values()), verbose=False)
        module.eval_seed = None
    records, token_losses = [], {}
    for i, setting in enumerate(settings):
        result = module.eval_results.get(i, {})
        record = {**setting_record(config, setting), "metrics": result.get("metrics", {})}
        bpb = datamodule.bits_per_byte(record["metrics"].get("loss"), record["split"])
        if bpb is not None:
            record["metrics"]["bpb"] = bpb
        if "position_loss" in result:
            record["position_loss"] = result["position_loss"]
        if "token_losses" in result:
            layout = loaders[i].dataset.layout
            losses = layout_array(layout, *result["token_losses"])
            if setting.token_losses:
                record["token_losses"] = rundir.token_losses_key(i)
                token_losses[record["token_losses"]] = losses
            if separator is not None:
                documents = document_metrics(
                    *places(layout.inputs, separator), losses, config.train.segment_len
                )
                record["documents"] = documents
                beyond = documents.get("beyond_train_length", {})
                record["metrics"].update(
                    doc_loss=documents["loss"],
                    beyond_loss=beyond.get("loss"),
                    beyond_tokens=beyond.get("tokens", 0),
                )
        if i in module.diagnostics_results:
            record["diagnostics"] = module.diagnostics_results[i]
        reason = unsupported_reason(config, setting)
        if reason:
            record["error"] = reason
            log.warning("eval setting %d skipped: %s", i, reason)
        records.append(record)
    return records, token_losses


def _cuda_devices(device: torch.device) -> list:
    """The CUDA device whose random state fork_rng must keep (none on the CPU)."""
    return [device] if device.type == "cuda" else []


def setting_record(config: RunConfig, setting: EvalSetting) -> dict:
    """The resolved setting as eval.json writes it (attn_len: the keys a query sees,
    EvalSetting.attn_len; split: the setting's own, else eval.split, so a record says which split it
    scored)."""
    clamp_len = config.model.attention.clamp_len if setting.clamp_len is None else setting.clamp_len
    # a RoPE extension's own fields only where set (records written before them stay as they were)
    extension = {
        name: list(value) if isinstance(value, tuple) else value
        for name in ROPE_EXTENSION_FIELDS
        if (value := getattr(setting, name)) != EvalSetting.__dataclass_fields__[name].default
    }
    return {
        "protocol": setting.protocol,
        "segment_len": setting.segment_len,
        "stride": setting.stride,
        "mem_len": setting.memory(config.model.mem_len),
        "clamp_len": clamp_len,
        "same_length": setting.protocol == "xl",
        "max_targets": setting.max_targets,
        "token_losses": None,
        "attn_len": setting.attn_len(config.model.mem_len),
        "rope_scaling": setting.rope_scaling,
        "rope_scale": rope_scale(config, setting),
        "split": setting.split_of(config.eval.split),
        **extension,
    }


def example_record(config: RunConfig, fields: dict[str, Any]) -> dict:
    """A test set's record before its metrics: the setting fields of its bin's longest input, and
    `fields`."""
    length = config.data.input_length(fields["length_max"])
    return {
        "segment_len": length,
        "mem_len": 0,
        "clamp_len": config.model.attention.clamp_len,
        "same_length": False,
        "attn_len": length,
        **fields,
        "metrics": {},
    }


def layout_array(layout, index: torch.Tensor, losses: torch.Tensor) -> np.ndarray:
    """Per-target losses as a [B, T] float32 array of the evaluation layout (NaN: not scored)."""
    array = np.full(layout.streams * layout.length, np.nan, dtype=np.float32)
    array[index.numpy()] = losses.float().numpy()
    return array.reshape(layout.streams, layout.length)


def write_token_losses(path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())


def reference(config: RunConfig, datamodule: SegmentDataModule) -> dict:
    """What a model must beat: chance accuracy for synthetic tasks (every task's target is one of
    num_symbols), the add-one-smoothed unigram of the training targets for text."""
    if config.data.source == "synthetic":
        return {"name": "chance", "metrics": {"acc": 1.0 / config.data.num_symbols}}
    train = datamodule.target_counts("train", config.train.batch_size)
    evaluated = datamodule.target_counts(config.eval.split, config.eval.batch_size)
    loss = unigram_loss_of_counts(train, evaluated)
    metrics = {"loss": loss, "ppl": math.exp(loss)}
    if config.data.character_level:
        metrics["bpc"] = loss / math.log(2)
    return {"name": "unigram", "metrics": metrics}


@torch.no_grad()
def evaluate_examples(
    model: TransformerLM,
    datamodule: ExampleDataModule,
    config: RunConfig,
    step: int = 0,
    forward_context: Callable = contextlib.nullcontext,
    wanted: list[dict[str, Any]] | None = None,
) -> dict:
    """eval.json of an example task (module docstring); `wanted`: only these test sets (their
    fields). forward_context: e.g. the trainer's precision."""
    was_training = model.training
    model.eval()
    records = [
        _evaluate_set(model, test_set, config, forward_context)
        for test_set in datamodule.test_sets(wanted)
    ]
    model.train(was_training)
    return {"main_metric": EXAMPLE_METRIC, "step": step, "settings": records}


@torch.no_grad()
def example_totals(
    model: TransformerLM,
    examples: Examples,
    config: RunConfig,
    forward_context: Callable = contextlib.nullcontext,
    diagnostics: AttentionDiagnostics | None = None,
) -> torch.Tensor:
    """Sums over `examples` in batches of eval.batch_size, float64 [5]: answer-token loss, answer
    tokens right, answer tokens, examples exactly right, examples. The model's mode is the caller's
    (eval for evaluation). From a fixed random state (the run's seed), so randomized positions draw
    the same whatever ran before."""
    device = next(model.parameters()).device
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    with torch.random.fork_rng(devices=_cuda_devices(device)):
        torch.manual_seed(config.seed)
        for start in range(0, len(examples), config.eval.batch_size):
            rows = slice(start, start + config.eval.batch_size)
            inputs, targets, mask = (
                t[rows].to(device) for t in (examples.inputs, examples.targets, examples.mask)
            )
            width = int((inputs != PAD).sum(1).max())  # right-padded: the batch's longest example
            inputs, targets, mask = inputs[:, :width], targets[:, :width], mask[:, :width]
            with forward_context():
                logits, _ = model(
                    inputs, statistics=None if diagnostics is None else diagnostics.for_batch(mask)
                )
            nll, correct = token_stats(logits, targets)
            totals += torch.stack(
                [
                    (nll * mask).sum(),
                    (correct * mask).sum(),
                    mask.sum(),
                    ((correct.bool() | ~mask).all(1) & mask.any(1)).sum(),
                    mask.any(1).sum(),
                ]
            ).double()
    return totals


def _evaluate_set(
    model: TransformerLM, test_set: TestSet, config: RunConfig, forward_context: Callable
) -> dict:
    examples, device = test_set.examples, next(model.parameters()).device
    record = example_record(config, test_set.fields)
    reason = unsupported_reason(config, EvalSetting(segment_len=record["segment_len"]))
    if reason:
        return {**record, "error": reason}
    diagnostics = (
        AttentionDiagnostics(
            model.config.n_layers, model.config.n_heads, max_seen_distance(config)
        ).to(device)
        if config.eval.diagnostics
        else None
    )
    nll, right, tokens, exact, count = example_totals(
        model, examples, config, forward_context, diagnostics
    ).tolist()
    record["metrics"] = {
        EXAMPLE_METRIC: exact / count,
        "acc": right / tokens,
        "loss": nll / tokens,
        "tokens": int(tokens),
        "examples": int(count),
    }
    if diagnostics is not None:
        record["diagnostics"] = diagnostics.compute()
    return record
