"""Every encoding preset's training step at a researcher's size against the same model without
positions: `python benchmarks/train_step.py --presets` (docs/performance.md, "A train step's MFU").

    python benchmarks/train_step.py --presets --device cuda      # every preset, compile off and on
    python benchmarks/train_step.py --presets rope,alibi,fox --device cuda --compile off
    python benchmarks/train_step.py --presets --layers 1 --d-model 16 --heads 2 --d-head 8 \
        --d-inner 32 --length 16 --batch 2 --vocab 64 --steps 1 --warmup 1 --repeats 1   # CPU smoke

The model: TransformerLM at --layers, --d-model, --heads × --d-head, --d-inner, --vocab, dropout 0,
trained on one batch of random tokens (--batch × --length; the data pipeline is not what is
measured) with the project's optimizer (relpos_ablate/train/optimizer.py: AdamW, fused on CUDA) and
gradient clipping, under bf16 autocast on CUDA (fp32 on CPU); with compile on its forward goes
through torch.compile as train.compile's does (relpos_ablate/train/module.py). Every `encoding:`
word (relpos_ablate/config/presets.py, the layer schedules included) is one model. Per compile
setting the NoPE twin (the `nope` preset) is built once and kept; each preset's model is built,
warmed up (--warmup steps; compilation happens there), then it and NoPE train alternating blocks of
--steps steps, --repeats pairs: step time is the median of the blocks' per-step times, the ratio to
NoPE the median over pairs, so machine load hits both sides.

Peak memory on CUDA: torch.cuda.max_memory_allocated during the model's blocks, less what the other
model keeps resident (weights, gradients, optimizer state: both stay so that they alternate). On
CPU: the process's peak RSS from resource.getrusage, reset before each block through
/proc/self/clear_refs (both models in it), or its lifetime peak where that reset is refused; the
JSON's `memory` says which. MFU and its FLOP count: benchmarks/mfu.py (on CPU null unless
--peak-tflops). The paper-scale specs' device-hours (--cost-specs): each run's encoding's measured
step time (the faster compile setting), scaled to the run's own size by the ratio of model FLOPs per
step (the same MFU assumed), summed through `grid --dry-run`'s estimate on one slot
(relpos_ablate/runner/estimate.py). The issue's goals are reported, not asserted: every bias of
distance and RoPE within 1.1× of NoPE's step time, FoX within 1.2×.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo

from grid_cost import COST_SPECS, WT103_VOCAB, cost_lines, costs
from mfu import environment, environment_line, mfu, required_peak_tflops, step_flops
from relpos_ablate.config import RunConfig
from relpos_ablate.config.presets import bias_preset, encoding_words, presets
from relpos_ablate.config.run import resolve_log_n_length
from relpos_ablate.io import atomic_write_text
from relpos_ablate.model import TransformerLM
from relpos_ablate.runner.grid import resolve_variant
from relpos_ablate.train.metrics import token_stats
from relpos_ablate.train.optimizer import after_optimizer_step, build_optimizer

CLEAR_REFS = Path("/proc/self/clear_refs")
SIZE_FLAGS = ("layers", "d_model", "heads", "d_head", "d_inner", "length", "batch", "vocab")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --presets mode's flags (train_step.py's parser takes them)."""
    group = parser.add_argument_group("--presets: every encoding preset at a researcher's size")
    group.add_argument(
        "--presets",
        nargs="?",
        const="all",
        default=None,
        help="time every encoding preset (or these, comma-separated) against NoPE",
    )
    for flag, default, what in (
        ("--layers", 12, "layers"),
        ("--d-model", 768, "width of the residual stream"),
        ("--heads", 12, "attention heads"),
        ("--d-head", 64, "width of a head"),
        ("--d-inner", 3072, "hidden width of the feed-forward block"),
        ("--length", 2048, "tokens per segment (L)"),
        ("--batch", 8, "segments per step"),
        ("--vocab", 50304, "vocabulary (GPT-2's, padded to a multiple of 64, as nanoGPT)"),
    ):
        group.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    group.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak for MFU (default: benchmarks/mfu.py's table on CUDA, "
        "required for a device not in it; on CPU no MFU without it)",
    )
    group.add_argument(
        "--cost-specs",
        default=COST_SPECS,
        help="grid specs whose device-hours to estimate from the measured step times ('' none)",
    )
    group.add_argument(
        "--cost-vocab",
        type=int,
        default=WT103_VOCAB,
        help="vocabulary of a cost spec whose data sets it (its vocab_size 0; default WT103's)",
    )


def base_config(args: argparse.Namespace) -> dict:
    """The run config every preset is laid over (resolve_variant's base)."""
    model = dict(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        d_head=args.d_head,
        d_inner=args.d_inner,
        vocab_size=args.vocab,
        dropout=0.0,
    )
    train = dict(segment_len=args.length, batch_size=args.batch, max_steps=10**6)
    return {"model": model, "train": train}


def preset_config(base: dict, word: str) -> RunConfig:
    """The run config of encoding `word` on `base`, as a grid resolves it."""
    return resolve_log_n_length(resolve_variant(base, {"encoding": word}))


def goal(word: str) -> float | None:
    """The issue's step-time goal against NoPE: 1.1× for a bias of distance and the RoPE presets,
    1.2× for FoX (a forget gate); None for the rest."""
    fields = presets().get(word, {})
    if fields.get("forget_gate"):
        return 1.2
    if fields == bias_preset(word) or fields.get("absolute") == "rope":
        return 1.1
    return None


class Trainee:
    """A model with its optimizer and schedule, trained one step at a time on a fixed batch."""

    def __init__(self, config: RunConfig, device: torch.device, compiled: bool):
        torch.manual_seed(config.seed)
        self.model = TransformerLM(config.model).to(device).train()
        self.optimizer, self.scheduler = build_optimizer(self.model, config.train, device)
        self.forward = torch.compile(self.model.forward) if compiled else self.model
        self.autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
        self.grad_clip = config.train.grad_clip

    def step(self, tokens: torch.Tensor) -> None:
        with self.autocast:
            logits, _ = self.forward(tokens[:, :-1], None)
        nll, _ = token_stats(logits, tokens[:, 1:])
        self.optimizer.zero_grad(set_to_none=True)
        nll.mean().backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        after_optimizer_step(self.model)
        self.scheduler.step()

    def resident_bytes(self) -> int:
        """Bytes its weights, gradients and optimizer state hold between steps."""
        tensors = {id(t): t for p in self.model.parameters() for t in (p, p.grad) if t is not None}
        for state in self.optimizer.state.values():
            tensors.update({id(v): v for v in state.values() if torch.is_tensor(v)})
        return sum(t.numel() * t.element_size() for t in tensors.values())


def memory_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated less the other model's weights, grads, optimizer"
    if _can_reset_rss():
        return "peak RSS of the process (getrusage, reset per block; both models in it)"
    return "peak RSS of the process over its life (getrusage, not reset)"


def _can_reset_rss() -> bool:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def timed_block(
    trainee: Trainee, tokens: torch.Tensor, steps: int, other: Trainee, device: torch.device
) -> tuple[float, float]:
    """(seconds per step, peak MB) of `steps` steps (module docstring: the peak on each device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _can_reset_rss()
    start = time.perf_counter()
    for _ in range(steps):
        trainee.step(tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - other.resident_bytes()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return seconds, peak / 2**20


def time_preset(
    trainee: Trainee, nope: Trainee, tokens: torch.Tensor, args, device: torch.device
) -> dict:
    """Step time, peak memory and ratio of `trainee` against `nope` (module docstring)."""
    for _ in range(args.warmup):  # NoPE too: a compilation can make the other recompile once
        trainee.step(tokens)
        nope.step(tokens)
    times, nope_times, ratios, peaks, nope_peaks = [], [], [], [], []
    for _ in range(args.repeats):
        nope_s, nope_mb = timed_block(nope, tokens, args.steps, trainee, device)
        seconds, mb = timed_block(trainee, tokens, args.steps, nope, device)
        times.append(seconds)
        nope_times.append(nope_s)
        ratios.append(seconds / nope_s)
        peaks.append(mb)
        nope_peaks.append(nope_mb)
    return {
        "step_s": statistics.median(times),
        "nope_step_s": statistics.median(nope_times),
        "ratio_to_nope": statistics.median(ratios),
        "peak_mb": max(peaks),
        "nope_peak_mb": max(nope_peaks),
    }


def run(args: argparse.Namespace) -> dict:
    """Every preset × compile setting against NoPE; writes the JSON (--out) and Markdown beside."""
    device = torch.device(args.device)
    words = encoding_words() if args.presets == "all" else args.presets.split(",")
    unknown = [w for w in words if w not in encoding_words()]
    if unknown:
        raise SystemExit(f"--presets: unknown {unknown}; allowed: {', '.join(encoding_words())}")
    peak_tflops = required_peak_tflops(device, args.peak_tflops)
    if args.compile != "off":
        # each preset's model is one more compilation of TransformerLM.forward (and of the frames
        # after a graph break): past dynamo's limit (8) it would run eagerly without a word
        # (benchmarks/results/gpu_check/README.md, run 1)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(words) + 8)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4096)
    base = base_config(args)
    nope_config = preset_config(base, "nope")
    flops = step_flops(nope_config.model, args.length, args.batch)
    tokens_per_step = args.length * args.batch
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (args.batch, args.length + 1), generator=generator)
    tokens = tokens.to(device)
    result = {
        **environment(device),
        "size": {k: v for k, v in vars(args).items() if k in SIZE_FLAGS},
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "flops_per_step": flops,
        "flop_count": "6·N + 12·n_layers·(H·d_head)·L per token; N: the NoPE twin's parameters "
        "in matrix products, output head included; causal not halved (nanoGPT, PaLM; mfu.py)",
        "peak_tflops": peak_tflops,
        "memory": memory_kind(device),
        "rows": [],
    }
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        nope = Trainee(nope_config, device, compiled)
        for _ in range(args.warmup):
            nope.step(tokens)
        for word in words:
            row = {"scheme": word, "compile": compiled, "goal": goal(word)}
            try:
                trainee = Trainee(preset_config(base, word), device, compiled)
                row.update(time_preset(trainee, nope, tokens, args, device))
                row["tokens_per_s"] = tokens_per_step / row["step_s"]
                row["mfu"] = mfu(flops, row["step_s"], peak_tflops)
                row["nope_mfu"] = mfu(flops, row["nope_step_s"], peak_tflops)
            except Exception as err:  # e.g. out of memory at this size: recorded, the rest goes on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            trainee = None  # freed before the next preset's model is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result["rows"].append(row)
            print(f"train_step {word} compile {'on' if compiled else 'off'}: {row}", flush=True)
    specs = [path for path in args.cost_specs.split(",") if path]
    result["costs"] = costs(result["rows"], specs, args.cost_vocab, flops)
    out = Path(args.out or "benchmarks/results/train_step_presets.json")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def markdown(result: dict) -> str:
    size = result["size"]
    lines = [
        f"# Train step per encoding preset: {result['device']}, torch {result['torch']}",
        "",
        f"{environment_line(result)} {size['layers']} layers, "
        f"d_model {size['d_model']}, {size['heads']} heads × {size['d_head']}, d_inner "
        f"{size['d_inner']}, L = {size['length']}, batch {size['batch']}, vocabulary "
        f"{size['vocab']}, {result['precision']}; median of {result['repeats']} pair(s) of "
        f"{result['steps']} steps. FLOPs per step {result['flops_per_step']:.3e} "
        f"({result['flop_count']}); peak {result['peak_tflops'] or '—'} TFLOP/s. Memory: "
        f"{result['memory']}.",
        "",
        *rows_table(result["rows"]),
        "",
        *cost_lines(result.get("costs", [])),
    ]
    return "\n".join(lines) + "\n"


def rows_table(rows: list[dict]) -> list[str]:
    """The Markdown table of the rows: step time, ratio to NoPE against the goal, tokens/s, peak
    memory, MFU."""
    lines = [
        "| scheme | compile | step ms | × NoPE | goal | tokens/s | peak MB (NoPE) | MFU (NoPE) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"| {r['scheme']} | {'on' if r['compile'] else 'off'} |"
        if "error" in r:
            lines.append(f"{where} {r['error']} | | | | | |")
            continue
        met = "—" if r["goal"] is None else f"≤{r['goal']}× {_met(r)}"
        mfu_cell = "—" if r["mfu"] is None else f"{r['mfu']:.1%} ({r['nope_mfu']:.1%})"
        lines.append(
            f"{where} {1000 * r['step_s']:.1f} | {r['ratio_to_nope']:.2f}× | {met} | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_mb']:,.0f} ({r['nope_peak_mb']:,.0f}) | "
            f"{mfu_cell} |"
        )
    return lines


def _met(row: dict) -> str:
    return "met" if row["ratio_to_nope"] <= row["goal"] else "missed"
