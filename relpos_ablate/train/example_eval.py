"""Evaluation of an example task: every test-length bin (and passkey depth) on its own, with per-token
accuracy and exact match on the answers, and the attention diagnostics from the same forward.

One record per test set in eval.json: the fields of an evaluation setting (segment_len = the input
length of the bin's longest n, as RunConfig.eval_settings), the set's `length_min`, `length_max` (and `depth`), its metrics — `exact_match`
(the share of examples with every answer token right), `acc` (answer tokens right), `loss` (nats per
answer token), `tokens`, `examples` — and, with eval.diagnostics, `diagnostics`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from relpos_ablate.config import EvalSetting, RunConfig
from relpos_ablate.model import TransformerLM
from relpos_ablate.train.data.example_module import ExampleDataModule, TestSet
from relpos_ablate.train.data.examples import PAD
from relpos_ablate.train.diagnostics import AttentionDiagnostics, max_seen_distance
from relpos_ablate.train.module import token_stats

MAIN_METRIC = "exact_match"


@torch.no_grad()
def evaluate_examples(model: TransformerLM, datamodule: ExampleDataModule, config: RunConfig, step: int = 0,
                      forward_context: Callable = contextlib.nullcontext) -> dict:
    """eval.json of an example task (module docstring). forward_context: e.g. the trainer's precision."""
    was_training = model.training
    model.eval()
    records = [_evaluate_set(model, test_set, config, forward_context) for test_set in datamodule.test_sets()]
    model.train(was_training)
    return {"main_metric": MAIN_METRIC, "step": step, "settings": records}


def _evaluate_set(model: TransformerLM, test_set: TestSet, config: RunConfig, forward_context: Callable) -> dict:
    from relpos_ablate.train.run import unsupported_reason  # run.py calls this module

    examples, device = test_set.examples, next(model.parameters()).device
    length = config.data.input_length(test_set.fields["length_max"])  # the bin's longest input
    record = {"segment_len": length, "mem_len": 0, "clamp_len": config.model.attention.clamp_len,
              "same_length": False, "attn_len": length, **test_set.fields, "metrics": {}}
    reason = unsupported_reason(config, EvalSetting(segment_len=length))
    if reason:
        return {**record, "error": reason}
    diagnostics = AttentionDiagnostics(model.config.n_layers, model.config.n_heads, max_seen_distance(config)).to(device) \
        if config.eval.diagnostics else None
    totals = torch.zeros(5, dtype=torch.float64, device=device)  # nll, right tokens, tokens, exact examples, examples
    for start in range(0, len(examples), config.eval.batch_size):
        rows = slice(start, start + config.eval.batch_size)
        inputs, targets, mask = (t[rows].to(device) for t in (examples.inputs, examples.targets, examples.mask))
        width = int((inputs != PAD).sum(1).max())  # right-padded: the batch's longest example
        inputs, targets, mask = inputs[:, :width], targets[:, :width], mask[:, :width]
        with forward_context():
            logits, _ = model(inputs, statistics=None if diagnostics is None else diagnostics.for_batch(mask))
        nll, correct = token_stats(logits, targets)
        totals += torch.stack([(nll * mask).sum(), (correct * mask).sum(), mask.sum(),
                               ((correct.bool() | ~mask).all(1) & mask.any(1)).sum(), mask.any(1).sum()]).double()
    nll, right, tokens, exact, count = totals.tolist()
    record["metrics"] = {MAIN_METRIC: exact / count, "acc": right / tokens, "loss": nll / tokens, "tokens": int(tokens),
                         "examples": int(count)}
    if diagnostics is not None:
        record["diagnostics"] = diagnostics.compute()
    return record
