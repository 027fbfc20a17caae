"""The GPU check for the minutes a GPU is lent (`make gpu-check`; well over 10 min on the GPU of
docs/performance.md, split below).

    python benchmarks/gpu_check.py      # CUDA: parity, DDP, timing; JSON + Markdown table
    # a dry run of the parity:
    python benchmarks/gpu_check.py --device cpu --skip-timing --skip-ddp --schemes t5,fox

1. Parity (exit 1 on any failure): every scheme's fast paths (FlexAttention compiled, SDPA per
   block, the block kernel) against the explicit path in float64, forward and backward (the output,
   and the gradients of the input and every parameter), in fp32 (TF32 off) and under bf16 autocast,
   with memory, on small shapes. Failure: relative error of the norm above 1e-4 (fp32) or 2.5e-2
   (bf16, as tests/model/test_attention_precision.py). CPU FlexAttention has no backward: there its
   forward only.
2. DDP: one short training run (`relpos-ablate train`, Lightning DDP, NCCL) on every visible GPU.
3. Timing: each scheme of benchmarks/attention.py (backend auto: FlexAttention) against
   FlashAttention without positions (`sdpa_nope`), forward + backward in bf16 at L = 1024, 4096,
   16384, time ratio (median of alternating pairs) and peak memory (in the process,
   torch.cuda.max_memory_allocated above the inputs). Compilation happens in each cell's warm-up;
   the cells run in order of length, and those that would start after --deadline seconds from the
   start are recorded as skipped, so the check ends in time (every cell compiles FlexAttention
   again: about 9 s each with torch 2.11; docs/performance.md).

Cost and splitting: parity compiles FlexAttention once per scheme and dtype (about 46 times), timing
once per scheme and length (about 60): well over one 10-minute call. --backends, --dtypes,
--schemes, --skip-parity, --skip-ddp, --timed and --lengths take a part at a time; the JSON and
Markdown are written after each phase and each timed cell, so a check stopped early keeps what it
measured. What it showed so far: benchmarks/results/gpu_check/README.md.

Without CUDA (and without --device cpu) it prints one line saying so and exits 0. Writes
OUT/gpu_check.json and OUT/gpu_check.md (default benchmarks/results/gpu_check/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attention as bench  # benchmarks/attention.py: the timed schemes and their step
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.io import atomic_write_text

PARITY = {  # name -> AttentionConfig fields, small enough for float64 on any device
    **{f"xl_{terms}": dict(terms=terms) for terms in ("abcd", "b", "d", "ac")},
    **{f"bias_{bias}": dict(terms="ab", bias=bias) for bias in BIAS_TYPES if bias != "none"},
    "rope": dict(terms="a", absolute="rope"),
    "rope_xpos": dict(terms="a", absolute="rope", xpos_scale_base=64.0),
    "fox": dict(terms="a", forget_gate=True),
    "cope": dict(terms="a", cope_positions=16),
    "window_sinks_fox": dict(terms="abcd", window=48, sinks=2, forget_gate=True, bias="alibi"),
    "log_n_temperature": dict(
        terms="a", score_scale="log_n", log_n_length=64, learned_temperature=True, bias="t5"
    ),
}
BACKENDS = ("flex", "sdpa", "blocks")
TOLERANCE = {"fp32": 1e-4, "bf16": 2.5e-2}
D_MODEL, HEADS, D_HEAD, LQ, MEM = 64, 4, 16, 96, 32
TIMED = [
    "xl_abcd",
    "terms_b",
    "terms_d",
    "xl_table",
    "t5",
    "alibi",
    "alibi_learned",
    "kerple_log",
    "kerple_power",
    "fire",
    "dynamic",
    "sandwich",
    "rope",
    "rope_xpos",
    "rope_yarn",
    "fox",
    "cope",
    "window_256",
    "sinks_4",
    "log_n",
    "temperature",
]


def runs_on(fields: dict, backend: str) -> bool:
    return not (fields.get("cope_positions") and backend == "flex")


def attention(fields: dict, backend: str, device) -> RelPosAttention:
    torch.manual_seed(0)
    attn = RelPosAttention(
        D_MODEL, HEADS, D_HEAD, AttentionConfig(backend=backend, query_chunk=32, **fields)
    )
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3)
            if name.endswith(("threshold",)):
                p.fill_(60.0)  # FIRE: queries on both sides of its threshold
            elif name.endswith((".c", ".a", ".p")):
                p.abs_().add_(0.05)
    return attn.to(device)


def forward_backward(
    attn: RelPosAttention, x: torch.Tensor, mems: torch.Tensor, autocast: bool, backward: bool
):
    """The output and the gradients of (x, every parameter) of a fixed weighting of it, as one flat
    vector."""
    x = x.clone().requires_grad_(backward)
    with (
        torch.autocast(x.device.type, torch.bfloat16, enabled=autocast),
        torch.set_grad_enabled(backward),
    ):
        out, _ = attn(x, mems)
    if not backward:
        return out.detach().double().flatten(), None
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    params = [x, *attn.parameters()]
    grads = torch.autograd.grad((out.float() * weights).sum(), params, allow_unused=True)
    flat = torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).double().flatten()
            for p, g in zip(params, grads)
        ]
    )
    return out.detach().double().flatten(), flat


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def parity(
    names: list[str], device: torch.device, backends=BACKENDS, dtypes=tuple(TOLERANCE)
) -> list[dict]:
    """One row per (scheme, backend, dtype): errors of the output and of the gradients, and whether
    they pass."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(1)
    x, mems = (
        torch.randn(2, n, D_MODEL, generator=gen, dtype=torch.float64).to(device) for n in (LQ, MEM)
    )
    rows = []
    for name in names:
        fields = PARITY[name]
        want = forward_backward(
            attention(fields, "explicit", device).double(), x, mems, False, True
        )
        for backend in backends:
            if not runs_on(fields, backend):
                continue
            # CPU FlexAttention has no backward
            backward = device.type == "cuda" or backend != "flex"
            for dtype in dtypes:
                row = dict(scheme=name, backend=backend, dtype=dtype, backward=backward)
                try:
                    got = forward_backward(
                        attention(fields, backend, device),
                        x.float(),
                        mems.float(),
                        dtype == "bf16",
                        backward,
                    )
                    row["out_error"] = relative_error(got[0], want[0])
                    row["grad_error"] = relative_error(got[1], want[1]) if backward else None
                    row["ok"] = max(row["out_error"], row["grad_error"] or 0.0) < TOLERANCE[dtype]
                # a kernel that cannot run this case fails the check, with the reason
                except Exception as err:
                    row.update(
                        ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    )
                rows.append(row)
                errors = {
                    k: row[k]
                    for k in ("out_error", "grad_error", "error")
                    if row.get(k) is not None
                }
                print(
                    f"parity {name} {backend} {dtype}: {'ok' if row['ok'] else 'FAILED'} {errors}",
                    flush=True,
                )
    return rows


def ddp(steps: int) -> dict:
    """A short training run with Lightning DDP on every visible GPU."""
    config = {
        "model": {
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "d_head": 16,
            "d_inner": 128,
            "mem_len": 32,
        },
        "data": {"train_tokens": 65536, "eval_tokens": 2048},
        "train": {
            "max_steps": steps,
            "batch_size": 8 * torch.cuda.device_count(),
            "accelerator": "gpu",
            "devices": "auto",
            "strategy": "ddp",
            "log_every": 5,
            "checkpoint_every": steps,
        },
        "eval": {"settings": [{"segment_len": 64}], "batch_size": torch.cuda.device_count()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"  # JSON is YAML
        path.write_text(json.dumps(config))
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "relpos_ablate",
                "train",
                "--config",
                str(path),
                "--run-dir",
                str(Path(tmp) / "run"),
            ],
            capture_output=True,
            text=True,
        )
        status = (
            json.loads((Path(tmp) / "run" / "status.json").read_text())
            if (Path(tmp) / "run" / "status.json").exists()
            else {}
        )
    ok = done.returncode == 0 and status.get("state") == "done"
    return {
        "gpus": torch.cuda.device_count(),
        "steps": steps,
        "ok": ok,
        "seconds": time.perf_counter() - start,
        "state": status.get("state"),
        "tail": "" if ok else (done.stdout + done.stderr)[-2000:],
    }


def timing(
    names: list[str],
    lengths: list[int],
    pairs: int,
    budget: float,
    device: torch.device,
    progress=lambda rows: None,
) -> list[dict]:
    """Per (scheme, L): time ratio to FlashAttention without positions and peak memory, bf16; cells
    that would start after `budget` seconds are skipped. `progress(rows)` is called after each
    measured cell."""
    start, rows = time.perf_counter(), []
    for length in lengths:
        for name in names:
            row = {"scheme": name, "L": length}
            if time.perf_counter() - start > budget:
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                row.update(bench.time_ratio(name, length, pairs, device, torch.bfloat16))
                row["peak_mb"], row["baseline_peak_mb"] = (
                    peak_memory(n, length, device) for n in (name, "sdpa_nope")
                )
            except Exception as err:  # e.g. out of memory at 16k: recorded, the check goes on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
            rows.append(row)
            progress(rows)
            print(f"timing {name} L={length}: {row}", flush=True)
    return rows


def peak_memory(name: str, length: int, device: torch.device) -> float:
    """MB allocated above the inputs during one forward + backward (in this process)."""
    module = bench.build(name, device, torch.bfloat16)
    x = torch.randn(
        bench.B, length, bench.D_MODEL, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    bench.step(module, x)  # compiled and warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    bench.step(module, x)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def save(result: dict, out: Path) -> None:
    """gpu_check.json and gpu_check.md, each written to a temporary file and renamed over the old
    one."""
    atomic_write_text(out / "gpu_check.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "gpu_check.md", markdown(result))


def markdown(result: dict) -> str:
    lines = [
        f"# GPU check: {result['device']}, torch {result['torch']}",
        "",
        f"Parity: {sum(r['ok'] for r in result['parity'])}/{len(result['parity'])} ok",
        "",
        "| scheme | backend | dtype | output error | gradient error | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["parity"]:
        grad = "—" if r.get("grad_error") is None else f"{r['grad_error']:.1e}"
        out = "—" if r.get("out_error") is None else f"{r['out_error']:.1e}"
        lines.append(
            f"| {r['scheme']} | {r['backend']} | {r['dtype']} | {out} | {grad} | "
            f"{'ok' if r['ok'] else 'FAILED ' + r.get('error', '')} |"
        )
    if result.get("ddp"):
        d = result["ddp"]
        lines += [
            "",
            f"DDP on {d['gpus']} GPU(s), {d['steps']} steps: {d['state']} in {d['seconds']:.0f} s",
        ]
    if result.get("timing"):
        lines += [
            "",
            "| scheme | L | time / FlashAttention | peak MB (FlashAttention) |",
            "|---|---|---|---|",
        ]
        for r in result["timing"]:
            cell = r.get("skipped") or r.get("error") or f"{r['ratio']:.2f}x"
            memory = f"{r['peak_mb']:.0f} ({r['baseline_peak_mb']:.0f})" if "peak_mb" in r else "—"
            lines.append(f"| {r['scheme']} | {r['L']} | {cell} | {memory} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default=None, help="cuda (default when available) or cpu (parity only)"
    )
    parser.add_argument(
        "--schemes", default="all", help="parity schemes, comma-separated: " + ", ".join(PARITY)
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="parity backends, comma-separated"
    )
    parser.add_argument("--dtypes", default="fp32,bf16", help="parity dtypes: fp32, bf16")
    parser.add_argument(
        "--timed", default=",".join(TIMED), help="timed schemes (benchmarks/attention.py's names)"
    )
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--lengths", default="1024,4096,16384", help="timed lengths")
    parser.add_argument("--pairs", type=int, default=3, help="alternating timing pairs per cell")
    parser.add_argument(
        "--deadline",
        type=float,
        default=420.0,
        help="seconds from the start after which no timing cell starts (parity and DDP always run)",
    )
    parser.add_argument("--ddp-steps", type=int, default=20)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument(
        "--out", default="benchmarks/results/gpu_check", help="folder for gpu_check.json and .md"
    )
    args = parser.parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print(
            "gpu_check: no GPU present (torch.cuda.is_available() is False); nothing checked "
            "(--device cpu runs the parity part on CPU)"
        )
        return 0
    start, device = time.perf_counter(), torch.device(args.device or "cuda")
    names = list(PARITY) if args.schemes == "all" else args.schemes.split(",")
    unknown = [n for n in names if n not in PARITY]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; allowed: {', '.join(PARITY)}")
    out = Path(args.out)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parity": []
        if args.skip_parity
        else parity(names, device, args.backends.split(","), args.dtypes.split(",")),
    }
    # each phase's results are on disk before the next starts: a killed check keeps them
    save(result, out)
    if device.type == "cuda" and not args.skip_ddp:
        result["ddp"] = ddp(args.ddp_steps)
        save(result, out)
    if device.type == "cuda" and not args.skip_timing:
        budget = args.deadline - (time.perf_counter() - start)
        lengths = [int(n) for n in args.lengths.split(",")]
        result["timing"] = timing(
            args.timed.split(","),
            lengths,
            args.pairs,
            budget,
            device,
            lambda rows: save({**result, "timing": rows}, out),
        )
        save(result, out)
    failed = [f"{r['scheme']} {r['backend']} {r['dtype']}" for r in result["parity"] if not r["ok"]]
    if result.get("ddp") and not result["ddp"]["ok"]:
        failed.append("ddp")
    print(
        f"gpu_check: {len(failed)} failure(s){': ' + ', '.join(failed) if failed else ''}; "
        f"wrote {out}/gpu_check.md"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
