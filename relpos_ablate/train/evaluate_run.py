"""New evaluation settings on a finished run, from its checkpoint: what `relpos-ablate evaluate`
does.

A paper evaluates one trained model many ways (ALiBi's App. B: one checkpoint at strides 1 ... L;
context-extension work: one model under PI / NTK / YaRN). Here the run's config.yaml, checkpoints,
metrics.csv and status.json stay as they are, so its run id does not change and a rerun of its grid
still sees it done; only eval.json (and token_losses.npz) gain the new settings' records.

- `plan_evaluation(run_dir, overrides, replace)` checks everything before anything is computed: the
  run is done, the overrides touch only evaluation fields (EVALUATION_KEYS), the run's config with
  them is valid, and which settings are new. A setting already in eval.json with the same fields is
  skipped unless `replace` (then its record is replaced in place), and one whose record lacks what
  is now asked (diagnostics, per-target losses) is evaluated again.
- `run_evaluation(plan)` evaluates the new settings with the evaluation layer (train/evaluation.py),
  exactly as training's final evaluation would, and merges the records: token_losses.npz first, then
  eval.json, each written atomically. A kill at any moment leaves eval.json as it was or complete
  (an array token_losses.npz gained before the kill is referenced by nothing until a rerun).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np

from relpos_ablate import rundir
from relpos_ablate.config import (
    ConfigError,
    EvalSetting,
    RunConfig,
    apply_overrides,
    from_dict,
    to_plain,
)
from relpos_ablate.config.base import ConfigErrors
from relpos_ablate.config.evaluation import ROPE_EXTENSION_FIELDS
from relpos_ablate.config.run import unsupported
from relpos_ablate.io import atomic_write_json
from relpos_ablate.train.checkpoints import load_weights
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.data.example_module import test_set_fields
from relpos_ablate.train.evaluation import (
    evaluate_examples,
    evaluate_settings,
    example_record,
    setting_record,
    write_token_losses,
)
from relpos_ablate.train.module import LitLM
from relpos_ablate.train.records import close_log, open_log
from relpos_ablate.train.trainer import quiet_known_warnings

log = logging.getLogger("relpos_ablate.train")

EVALUATION_KEYS = ("eval.",)
"""What `evaluate --set` may change: the evaluation (every eval.* field but FIXED_KEYS)."""
EXAMPLE_KEYS = ("data.test_lengths", "data.eval_examples", "data.passkey_depths")
"""Also allowed for example tasks, whose evaluation is their test sets."""
SETTINGS_KEYS = ("eval.settings", "eval.recl_contexts", "data.test_lengths", "data.passkey_depths")
"""Keys that give the settings to evaluate; without any of them, every setting eval.json holds
is."""
FIXED_KEYS = ("eval.batch_size", "eval.split")
"""The evaluation streams of one eval.json (its `layout`, and the split of every setting that names
none): fixed by training. A setting's own `split` scores another split."""
RESULT_KEYS = ("metrics", "position_loss", "token_losses", "diagnostics", "error")
"""Record keys that hold what an evaluation found, not which setting it was."""


@dataclass
class EvaluationPlan:
    """What `run_evaluation` will do for one run (planned without computing anything)."""

    run_dir: Path
    config: RunConfig
    """The run's config with the evaluation overrides."""
    todo: list[Any] = field(default_factory=list)
    """EvalSettings (text and synthetic streams) or test-set fields (example tasks) to evaluate."""
    names: list[str] = field(default_factory=list)
    """Per todo item: the config field it comes from (eval.settings[i], eval.recl_contexts,
    data.test_lengths[k])."""
    targets: list[int | None] = field(default_factory=list)
    """Per todo item: the eval.json record it replaces, or None (appended)."""
    skipped: int = 0
    """Settings already evaluated with the same fields (not asked to --replace)."""
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    """(key, reason) of each setting this model cannot take (key: its name and the field at fault,
    e.g. eval.settings[0].rope_scaling): recorded with its reason, as training does."""
    diagnostics: bool = False
    """Collect attention diagnostics (asked now, or kept by a record being replaced)."""


def plan_all(
    run_dirs: list[Path], overrides: list[str], replace: bool = False
) -> tuple[list[EvaluationPlan], list[ConfigError]]:
    """The plans of several runs and every problem found (one line each). A setting that none of the
    runs can take is a problem; one that only some cannot take is recorded in theirs with its
    reason, as training does with a setting its model cannot take."""
    plans, errors = [], []
    for run_dir in run_dirs:
        try:
            plans.append(plan_evaluation(run_dir, overrides, replace))
        except ConfigError as err:
            errors.extend(err.errors)
    for key in dict.fromkeys(key for plan in plans for key, _ in plan.unsupported):
        setting = key.rsplit(".", 1)[0]
        if not any(setting in plan.names and key not in dict(plan.unsupported) for plan in plans):
            plan = next(plan for plan in plans if key in dict(plan.unsupported))
            what = (
                "this run cannot take it"
                if len(plans) == 1
                else f"none of the {len(plans)} runs can take it"
            )
            errors.append(
                ConfigError(f"{plan.run_dir}: {key}", f"{what}: {dict(plan.unsupported)[key]}")
            )
    return plans, errors


def plan_evaluation(
    run_dir: str | Path, overrides: list[str], replace: bool = False
) -> EvaluationPlan:
    """The plan for one run, or a ConfigError whose lines each name the run (module docstring)."""
    run_dir = Path(run_dir)
    try:
        return _plan(run_dir, overrides, replace)
    except ConfigError as err:
        raise ConfigErrors(
            [
                ConfigError(f"{run_dir}: {e.field}" if e.field else str(run_dir), e.message)
                for e in err.errors
            ]
        ) from None


def _plan(run_dir: Path, overrides: list[str], replace: bool) -> EvaluationPlan:
    if not rundir.is_run_dir(run_dir):
        raise ConfigError("", f"not a run directory (none of {', '.join(rundir.MARKERS)})")
    if not rundir.is_done(run_dir):
        state = (rundir.read_status(run_dir) or {}).get("state", "unknown")
        detail = (
            f"{rundir.EVAL} is missing or unreadable"
            if state == "done"
            else f"its state is {state}"
        )
        raise ConfigError(
            "", f"not done ({detail}); evaluate takes finished runs (finish it with grid or train)"
        )
    if not rundir.last_checkpoint(run_dir).exists():
        raise ConfigError(
            "", f"no {rundir.CHECKPOINTS}/{rundir.LAST_CHECKPOINT} to load the trained weights from"
        )
    stored = rundir.stored_config(run_dir)
    check_keys(overrides, stored.data.example_task)
    config = from_dict(RunConfig, apply_overrides(to_plain(stored), overrides))
    document = rundir.read_eval(run_dir)
    records = document["settings"]
    plan = EvaluationPlan(run_dir, config, diagnostics=config.eval.diagnostics)
    given = any(item.split("=", 1)[0].strip().startswith(SETTINGS_KEYS) for item in overrides)
    if given and config.data.source == "text":  # every setting fits the evaluation split
        datamodule = build_datamodule(config)
        datamodule.prepare_data()
        datamodule.check_evaluation()
    for name, item, setting, record in (
        _candidates(config) if given else _recorded(config, document)
    ):
        problem = unsupported(config, setting)
        found = next(
            (k for k, old in enumerate(records) if same_setting(old, record, document)), None
        )
        if (
            found is not None
            and not replace
            and (problem or _complete(records[found], setting, config.eval.diagnostics))
        ):
            plan.skipped += 1
            continue
        if problem:
            plan.unsupported.append((f"{name}.{problem[0]}", problem[1]))
        # evaluated again: keep what the record had (per-target losses, diagnostics)
        if found is not None:
            if records[found].get("token_losses") and isinstance(item, EvalSetting):
                item = dataclasses.replace(item, token_losses=True)
            plan.diagnostics |= "diagnostics" in records[found]
        plan.todo.append(item)
        plan.names.append(name)
        plan.targets.append(found)
    return plan


def _recorded(config: RunConfig, document: dict) -> list[tuple[str, Any, EvalSetting, dict]]:
    """The candidates (as _candidates) of every setting eval.json (`document`) holds: what a run is
    evaluated at when --set gives no settings (e.g. --set eval.diagnostics=true, or --replace
    alone)."""
    candidates = []
    for k, old in enumerate(document["settings"]):
        name = f"{rundir.EVAL} settings[{k}]"
        if config.data.example_task:
            fields = {key: old[key] for key in ("length_min", "length_max", "depth") if key in old}
            record = example_record(config, fields)
            candidates.append(
                (name, fields, EvalSetting(segment_len=record["segment_len"]), record)
            )
            continue
        scaling = rundir.record_value(old, "rope_scaling")
        split = rundir.record_value(old, "split", document)
        # eval.split's: as written (synthetic: no split)
        setting = EvalSetting(
            segment_len=old["segment_len"],
            protocol=rundir.record_value(old, "protocol"),
            stride=old.get("stride"),
            mem_len=old.get("mem_len"),
            clamp_len=old.get("clamp_len"),
            max_targets=rundir.record_value(old, "max_targets"),
            token_losses=bool(old.get("token_losses")),
            rope_scaling=scaling,
            rope_scale=old.get("rope_scale") if scaling else "auto",
            split=None if split == config.eval.split else split,
            **{
                key: tuple(old[key]) if isinstance(old[key], list) else old[key]
                for key in ROPE_EXTENSION_FIELDS
                if key in old
            },
        )
        candidates.append((name, setting, setting, setting_record(config, setting)))
    return candidates


def _candidates(config: RunConfig) -> list[tuple[str, Any, EvalSetting, dict]]:
    """(config field, what to evaluate, its EvalSetting, its record before results) of every setting
    the config asks for: eval settings, or the test sets of an example task."""
    if not config.data.example_task:
        return [
            (config.eval_setting_field(i, "").rstrip("."), s, s, setting_record(config, s))
            for i, s in enumerate(config.eval_settings())
        ]
    candidates = []
    for fields in test_set_fields(config.data):
        record = example_record(config, fields)
        k = list(config.data.test_lengths).index((fields["length_min"], fields["length_max"]))
        candidates.append(
            (
                f"data.test_lengths[{k}]",
                fields,
                EvalSetting(segment_len=record["segment_len"]),
                record,
            )
        )
    return candidates


def check_keys(overrides: list[str], example_task: bool) -> None:
    """Only evaluation fields may change (EVALUATION_KEYS; EXAMPLE_KEYS for example tasks), and not
    FIXED_KEYS."""
    allowed = EVALUATION_KEYS + (EXAMPLE_KEYS if example_task else ())
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in FIXED_KEYS:
            raise ConfigError(
                key,
                f"is fixed by training (the evaluation streams of a run's {rundir.EVAL}); "
                "evaluate changes the settings: score another split with a setting's own split "
                "(eval.settings=[{segment_len: 64, split: test}])",
            )
        if not key.startswith(allowed) or key in ("eval", "eval."):
            what = "eval.* keys" + (f" and {', '.join(EXAMPLE_KEYS)}" if example_task else "")
            raise ConfigError(
                key or "--set",
                f"evaluate takes only {what} (the trained model stays as it is); "
                "to change anything else, train a new run",
            )


def same_setting(old: dict, new: dict, document: dict | None = None) -> bool:
    """Whether eval.json record `old` is the setting of record `new`: equal in every field of a
    setting, its split included (not in what was found; a field an older eval.json lacks reads as
    its default, rundir.record_value, the split as the run's eval.split kept in `document`, the
    eval.json of `old`)."""
    return all(
        rundir.record_value(old, k, document) == v for k, v in new.items() if k not in RESULT_KEYS
    )


def _complete(record: dict, setting: EvalSetting, diagnostics: bool) -> bool:
    """Whether an existing record already holds what is asked now: metrics (no error), per-target
    losses when the setting saves them, diagnostics when eval.diagnostics."""
    return (
        "error" not in record
        and (not setting.token_losses or bool(record.get("token_losses")))
        and (not diagnostics or "diagnostics" in record)
    )


def run_evaluation(plan: EvaluationPlan) -> int:
    """Evaluate the plan's settings and merge their records into the run's eval.json; returns how
    many records were added or replaced."""
    if not plan.todo:
        return 0
    handler = open_log(plan.run_dir)
    try:
        log.info("evaluate: %d new setting(s), %d already evaluated", len(plan.todo), plan.skipped)
        with warnings.catch_warnings():
            quiet_known_warnings()
            records, arrays = _evaluate(plan)
        merge_records(plan.run_dir, plan.targets, records, arrays)
        log.info(
            "evaluate: %s now holds %d settings",
            rundir.EVAL,
            len(rundir.read_eval(plan.run_dir)["settings"]),
        )
    finally:
        close_log(handler)
    return len(records)


def _evaluate(plan: EvaluationPlan) -> tuple[list[dict], dict[str, np.ndarray]]:
    eval_config = dataclasses.replace(plan.config.eval, diagnostics=plan.diagnostics)
    if not plan.config.data.example_task:  # exactly the settings to do, the RECL ones among them
        eval_config = dataclasses.replace(eval_config, settings=tuple(plan.todo), recl_contexts=())
    config = dataclasses.replace(plan.config, eval=eval_config)
    datamodule = build_datamodule(config)
    datamodule.prepare_data()
    trainer = evaluation_trainer(config)
    module = LitLM(config)
    module.separator = datamodule.separator
    load_weights(plan.run_dir, module.model)
    if config.data.example_task:
        model = module.model.to(trainer.strategy.root_device)
        document = evaluate_examples(
            model,
            datamodule,
            config,
            forward_context=trainer.precision_plugin.forward_context,
            wanted=plan.todo,
        )
        return document["settings"], {}
    return evaluate_settings(trainer, module, datamodule, config)


def evaluation_trainer(config: RunConfig) -> L.Trainer:
    """A Trainer that only evaluates: one device of the run's accelerator, the run's precision, no
    logger and no checkpoint (nothing of the run but eval.json changes)."""
    t = config.train
    # "GPU available: ..." on every run
    announcer = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = announcer.level
    announcer.setLevel(logging.WARNING)
    try:
        return L.Trainer(
            accelerator=t.accelerator,
            devices=1,
            precision=t.precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=sys.stdout.isatty(),
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
    finally:
        announcer.setLevel(level)


def merge_records(
    run_dir: Path, targets: list[int | None], records: list[dict], arrays: dict[str, np.ndarray]
) -> None:
    """Put `records` into the run's eval.json (each at its target, or appended) and their per-target
    losses into token_losses.npz under names no record used before, npz first: whenever a kill
    comes, eval.json names only arrays that are there."""
    document = rundir.read_eval(run_dir)
    settings = list(document["settings"])
    kept = rundir.read_token_losses(run_dir) or {}
    kept = {name: kept[name] for name in (s.get("token_losses") for s in settings) if name in kept}
    taken = set(kept) | {s.get("token_losses") for s in settings}
    added = {}
    for target, record in zip(targets, records):
        record = dict(record)
        if record.get("token_losses"):
            name = next(
                rundir.token_losses_key(k)
                for k in range(len(taken) + len(records) + 1)
                if rundir.token_losses_key(k) not in taken
            )
            taken.add(name)
            added[name] = arrays[record["token_losses"]]
            record["token_losses"] = name
        if target is None:
            settings.append(record)
        else:
            settings[target] = record
    if added:
        write_token_losses(run_dir / rundir.TOKEN_LOSSES, {**kept, **added})
    atomic_write_json(run_dir / rundir.EVAL, {**document, "settings": settings})
