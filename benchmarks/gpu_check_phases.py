"""The phases of the GPU check, one process each (benchmarks/gpu_check.py runs them in turn, each
with its own timeout; a phase is written only when it completes: a temporary file renamed over
--write).

    python benchmarks/gpu_check_phases.py parity --backends blocks --dtypes fp32 --schemes t5,fox \
        --device cpu --write /tmp/parity.json
    python benchmarks/gpu_check_phases.py ddp --write /tmp/ddp.json
    python benchmarks/gpu_check_phases.py attention --lengths 4096 --write /tmp/attention.json

parity (correctness): every scheme's fast paths (FlexAttention compiled, SDPA per block, the block
kernel) against the explicit path in float64, forward and backward (the output, and the gradients of
the input and every parameter), in fp32 (TF32 off) and under bf16 autocast, with memory, on small
shapes. Failure: relative error of the norm above 1e-4 (fp32) or 2.5e-2 (bf16, as
tests/model/test_attention_precision.py); a failing row is a result, not a failed phase. CPU
FlexAttention has no backward: there its forward only.

ddp: one short training run (`relpos-ablate train`, Lightning DDP, NCCL) on every visible GPU.

attention: each scheme of benchmarks/attention.py (backend auto: FlexAttention) against
FlashAttention without positions (`sdpa_nope`), forward + backward in bf16, time ratio (median of
alternating pairs), TFLOP/s by FlashAttention's count and its fraction of the device's dense bf16
peak (benchmarks/mfu.py; the projections' time is in the measured time, not in the count), and peak
memory (torch.cuda.max_memory_allocated above the inputs). Compilation happens in each cell's
warm-up; cells that would start after --deadline seconds are recorded as skipped, so the phase ends
within its timeout.
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
from mfu import attention_flops, required_peak_tflops, tflops
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
    deadline: float,
    device: torch.device,
    peak_tflops: float | None,
) -> list[dict]:
    """Per (scheme, L): time ratio to FlashAttention without positions, TFLOP/s of both and their
    fraction of `peak_tflops`, peak memory, bf16; cells that would start after `deadline` seconds
    are skipped."""
    start, rows = time.perf_counter(), []
    for length in lengths:
        for name in names:
            row = {"scheme": name, "L": length}
            if time.perf_counter() - start > deadline:
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                row.update(bench.time_ratio(name, length, pairs, device, torch.bfloat16))
                row.update(attention_rates(row, length, peak_tflops))
                row["peak_mb"], row["baseline_peak_mb"] = (
                    peak_memory(n, length, device) for n in (name, "sdpa_nope")
                )
            except Exception as err:  # e.g. out of memory at 16k: recorded, the check goes on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"timing {name} L={length}: {row}", flush=True)
    return rows


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8x8x64' -> (B, H, d_head)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--shape: {text!r} is not BxHxD (e.g. 8x8x64)")
    return int(parts[0]), int(parts[1]), int(parts[2])


def set_shape(batch: int, heads: int, d_head: int) -> None:
    """benchmarks/attention.py's layer shape for this process (d_model = heads·d_head)."""
    bench.B, bench.H, bench.D_HEAD, bench.D_MODEL = batch, heads, d_head, heads * d_head


def attention_rates(row: dict, length: int, peak_tflops: float | None) -> dict:
    """TFLOP/s of the scheme and of the baseline from their milliseconds (FlashAttention's causal
    forward + backward count at benchmarks/attention.py's B, H, d_head), and each as a fraction of
    the peak (None without one)."""
    flops = attention_flops(bench.B, bench.H, length, bench.D_HEAD, causal=True, backward=True)
    rates = {
        "tflops": tflops(flops, row["ms"] / 1000),
        "baseline_tflops": tflops(flops, row["baseline_ms"] / 1000),
    }
    for key in ("tflops", "baseline_tflops"):
        fraction = None if peak_tflops is None else rates[key] / peak_tflops
        rates[key.replace("tflops", "peak_fraction")] = fraction
    return rates


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=("parity", "ddp", "attention"))
    parser.add_argument("--write", required=True, help="the phase's JSON (written when it ends)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (parity only)")
    parser.add_argument(
        "--schemes", default="all", help="parity schemes, comma-separated: " + ", ".join(PARITY)
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="parity backends, comma-separated"
    )
    parser.add_argument("--dtypes", default="fp32,bf16", help="parity dtypes: fp32, bf16")
    parser.add_argument("--ddp-steps", type=int, default=20, help="ddp: training steps")
    parser.add_argument(
        "--timed", default=",".join(TIMED), help="attention: benchmarks/attention.py's schemes"
    )
    parser.add_argument("--lengths", default="4096", help="attention: lengths, comma-separated")
    parser.add_argument(
        "--shape", default=None, help="attention: BxHxD (batch, heads, d_head; d_model = H·D)"
    )
    parser.add_argument("--pairs", type=int, default=3, help="attention: timing pairs per cell")
    parser.add_argument(
        "--deadline", type=float, default=330.0, help="attention: no cell starts after this (s)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="attention: dense bf16 peak (mfu.py)"
    )
    args = parser.parse_args(argv)
    start, device = time.perf_counter(), torch.device(args.device)
    if args.phase == "parity":
        names = list(PARITY) if args.schemes == "all" else args.schemes.split(",")
        unknown = [n for n in names if n not in PARITY]
        if unknown:
            parser.error(f"--schemes: unknown {unknown}; allowed: {', '.join(PARITY)}")
        result = {"rows": parity(names, device, args.backends.split(","), args.dtypes.split(","))}
    elif args.phase == "ddp":
        result = ddp(args.ddp_steps)
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        if args.shape:
            set_shape(*parse_shape(args.shape))
        peak = required_peak_tflops(device, args.peak_tflops)
        rows = timing(args.timed.split(","), lengths, args.pairs, args.deadline, device, peak)
        result = {"rows": rows, "peak_tflops": peak, "B": bench.B, "H": bench.H}
        result["d_head"] = bench.D_HEAD
    result.update(phase=args.phase, seconds=time.perf_counter() - start)
    atomic_write_text(args.write, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
