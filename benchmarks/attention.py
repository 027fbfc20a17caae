"""Speed and memory of every attention scheme, as ratios to SDPA without positions (same
projections).

    python benchmarks/attention.py                       # all schemes, L = 512..4096, CPU fp32
    python benchmarks/attention.py --lengths 1024 --schemes xl_abcd,t5,alibi --pairs 7
    python benchmarks/attention.py --device cuda --dtype bf16 --lengths 1024,2048,4096,8192

Time: forward + backward of one attention layer (B=2, H=8, d_head=64, causal), the scheme and the
baseline run alternately, ratio = median over pairs of (scheme time / baseline time), so machine
load hits both sides. Memory: peak bytes above the inputs during forward + backward, measured in a
fresh child process per (scheme, L) on CPU (RSS with a fixed malloc mmap threshold, so freed blocks
are returned, and the peak counter reset first), with torch.cuda.max_memory_allocated on CUDA.
Writes a JSON file and prints a table.

Backend 'auto' picks each call's kernel by timing the candidates at first use
(kernels/calibration.py): that happens in the warm-up step, and the JSON lists the choices
(kernel_choices) next to the processor, its flags, the cores, the date and whether denormals were
flushed (relpos_ablate/model/denormals.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# the package of this tree, or of another revision's (benchmarks/compare_revisions.py --time): only
# what every revision has is imported here, the rest where a scheme needs it
sys.path.insert(
    0, os.environ.get("RELPOS_PACKAGE_ROOT", str(Path(__file__).resolve().parent.parent))
)
from relpos_ablate import AttentionConfig, RelPosAttention

try:  # (compare_revisions.py runs this file against revisions from before model/schemes/)
    from relpos_ablate.model.schemes import RopeScaling, sinusoid
except ImportError:
    from relpos_ablate.model.position import RopeScaling, sinusoid

B, H, D_HEAD, D_MODEL = 2, 8, 64, 512
TERM_SUBSETS = [
    "".join(c) for n in (1, 2, 3, 4) for c in __import__("itertools").combinations("abcd", n)
]
SCHEMES: dict[str, dict | None] = {
    "sdpa_nope": None,  # the baseline: projections + SDPA(is_causal), no position information
    "xl_abcd": dict(terms="abcd"),
    **{f"terms_{t}": dict(terms=t) for t in TERM_SUBSETS if t != "abcd"},
    **{
        b: dict(terms="a", bias=b)
        for b in (
            "xl_table",
            "t5",
            "alibi",
            "alibi_learned",
            "kerple_log",
            "kerple_power",
            "fire",
            "dynamic",
            "sandwich",
        )
    },
    "rope": dict(terms="a", absolute="rope"),
    "rope_partial": dict(terms="a", absolute="rope", rope_fraction=0.25),  # Pythia's rotary_pct
    "p_rope": dict(terms="a", absolute="rope", rope_p=0.75),
    "rope_xpos": dict(terms="a", absolute="rope", xpos_scale_base=512.0),
    "rope_yarn": "yarn",  # RoPE evaluated with YaRN at s = 4 (an evaluation setting's rope_scaling)
    "rope_dynamic": "dynamic",  # ... with dynamic NTK at s = 4
    "rope_longrope": "longrope",  # ... with LongRoPE, factors 4 past L = 512
    "fox": dict(terms="a", forget_gate=True),
    "cope": dict(terms="a", cope_positions=64),
    "window_256": dict(terms="a", window=256),
    "sinks_4": dict(terms="a", sinks=4),
    "log_n": dict(terms="a", score_scale="log_n", log_n_length=512),
    "ssmax": dict(terms="a", score_scale="ssmax", log_n_length=512),
    "temperature": dict(terms="a", learned_temperature=True),
    # the schemes that read the scores themselves: the materialised path per query block (their
    # floor on CPU), next to that path with a plain softmax and no position (explicit_nope: what no
    # fused kernel costs)
    "explicit_nope": dict(terms="a", backend="explicit"),
    "stick_breaking": dict(terms="a", normaliser="stick_breaking"),
    "path": dict(terms="a", path=True),
    "dape": dict(terms="a", bias="kerple_log", dape="v1"),
    "dape_v2": dict(terms="a", bias="kerple_log", dape="v2"),
    "shaw": dict(terms="ab", rel="learned", clamp_len=20),
    # the attention plumbing of 2025-26 (docs/schemes/attention-plumbing.md), each on RoPE or NoPE
    "qk_norm_rms": dict(terms="a", absolute="rope", qk_norm="rms"),
    "qk_norm_l2": dict(terms="a", absolute="rope", qk_norm="l2", qk_norm_order="after_rope"),
    "output_gate": dict(terms="a", absolute="rope", output_gate="elementwise"),
    "output_gate_headwise": dict(terms="a", absolute="rope", output_gate="headwise"),
    "sink_logit": dict(terms="a", absolute="rope", sink_logit="learned"),
    "sink_off_by_one": dict(terms="a", absolute="rope", sink_logit="off_by_one"),
    "canon_4": dict(terms="a", absolute="rope", canon_width=4),
    "rope_heads_half": dict(terms="a", absolute="rope", rope_heads=0.5),
    "mla_rope": dict(terms="a", qk_rope_dim=32),
    "pope": dict(terms="a", pope=True),
    "grape_a": dict(terms="a", grape="a", qk_norm="rms"),
    "grape_ap": dict(terms="a", grape="ap", qk_norm="rms"),
    "seed000_abcd": "seed000",  # materialises R for every (i, j): [L, K, d_model]
}


class PlainSDPA(torch.nn.Module):
    """The baseline: the same q/kv/out projections as RelPosAttention around causal SDPA."""

    def __init__(self):
        super().__init__()
        self.q_net = torch.nn.Linear(D_MODEL, H * D_HEAD, bias=False)
        self.kv_net = torch.nn.Linear(D_MODEL, 2 * H * D_HEAD, bias=False)
        self.out_net = torch.nn.Linear(H * D_HEAD, D_MODEL, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_net(x).view(b, n, H, D_HEAD).transpose(1, 2)
        k, v = self.kv_net(x).view(b, n, 2, H, D_HEAD).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_net(out.transpose(1, 2).reshape(b, n, H * D_HEAD))


class Seed000(RelPosAttention):
    """Transformer-XL terms computed the naive way: R_{i-j} materialised per (i, j) pair."""

    def __init__(self):
        super().__init__(D_MODEL, H, D_HEAD, AttentionConfig(terms="abcd"))

    def forward(self, x, mems=None, **_):
        b, n, _ = x.shape
        q = self.q_net(x).view(b, n, H, D_HEAD)
        k, v = self.kv_net(x).view(b, n, 2, H, D_HEAD).unbind(2)
        dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        r = self.r_net(sinusoid(dist.flatten(), D_MODEL).to(x.dtype).to(x.device)).view(
            n, n, H, D_HEAD
        )
        scores = torch.einsum("bihd,bjhd->bhij", q + self.content_bias_u, k)
        scores = scores + torch.einsum("bihd,ijhd->bhij", q + self.position_bias_v, r)
        scores = scores * self.scale
        scores = scores.masked_fill(dist[None, None].to(x.device) < 0, float("-inf"))
        out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
        return self.out_net(out.reshape(b, n, H * D_HEAD)), None


class ScaledRoPE(RelPosAttention):
    """RoPE called as an evaluation setting with a context extension at s = 4 calls it (yarn:
    frequencies and temperature; dynamic: the base grown by the call's length; longrope: per-pair
    factors, the long ones past 512)."""

    def __init__(self, kind: str = "yarn"):
        super().__init__(D_MODEL, H, D_HEAD, AttentionConfig(terms="a", absolute="rope"))
        self.kind = kind

    def forward(self, x, mems=None, **_):
        from relpos_ablate.model import AttentionOptions

        factors = (
            {"long_factor": (4.0,) * (D_HEAD // 2), "short_factor": (1.0,) * (D_HEAD // 2)}
            if self.kind == "longrope"
            else {}
        )
        scaling = RopeScaling(self.kind, 4.0, 512, **factors)
        return super().forward(x, mems, AttentionOptions(rope_scaling=scaling))


def build(name: str, device, dtype) -> torch.nn.Module:
    spec = SCHEMES[name]
    special = {None: PlainSDPA, "seed000": Seed000}
    module = (
        ScaledRoPE(spec)
        if spec in ("yarn", "dynamic", "longrope")
        else special[spec]()
        if not isinstance(spec, dict)
        else RelPosAttention(D_MODEL, H, D_HEAD, AttentionConfig(**spec))
    )
    return module.to(device=device, dtype=dtype)


def step(module, x) -> None:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()


def seed000_fits(length: int, device) -> bool:
    """R per pair is [L, L, d_model] several times over (R, W_R R, grads): skip when it cannot
    fit."""
    need = 4 * length * length * D_MODEL * 4
    limit = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else 12 * 2**30
    )
    return need < limit


def timed(module, x, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(module, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_ratio(name: str, length: int, pairs: int, device, dtype) -> dict:
    torch.manual_seed(0)
    base, module = build("sdpa_nope", device, dtype), build(name, device, dtype)
    x = torch.randn(B, length, D_MODEL, device=device, dtype=dtype, requires_grad=True)
    for m in (base, module):
        step(m, x)  # warm-up (and compilation on CUDA)
    ratios, base_times, times = [], [], []
    for _ in range(pairs):
        tb, ts = timed(base, x, device), timed(module, x, device)
        base_times.append(tb)
        times.append(ts)
        ratios.append(ts / tb)
    return {
        "ratio": statistics.median(ratios),
        "ms": 1000 * statistics.median(times),
        "baseline_ms": 1000 * statistics.median(base_times),
    }


def peak_memory_child(name: str, length: int, device, dtype) -> float:
    """Run in a fresh process: MB of peak memory above the inputs for one forward + backward."""
    torch.manual_seed(0)
    module = build(name, device, dtype)
    x = torch.randn(B, length, D_MODEL, device=device, dtype=dtype, requires_grad=True)
    # warm-up at the measured shape: a kernel choice timed at first use is not in the peak
    step(module, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(module, x)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    # reset the kernel's peak-RSS counter (VmHWM), else the peak of importing torch hides small
    # steps
    Path("/proc/self/clear_refs").write_text("5")
    before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step(module, x)
    status = Path("/proc/self/status").read_text()
    peak_kb = int(
        next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]
    )
    return (peak_kb * 1024 - before) / 2**20


def peak_memory(name: str, length: int, args) -> float | None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [
        sys.executable,
        __file__,
        "--child-memory",
        name,
        "--lengths",
        str(length),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # reported, not hidden: the cell shows — and the reason goes to stderr
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        print(f"memory of {name} at L={length} not measured: {reason}", file=sys.stderr, flush=True)
        return None
    return float(done.stdout.strip().splitlines()[-1])


def fmt(value, suffix="x") -> str:
    return (
        "—"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.2f}{suffix}"
    )


def kernel_choices() -> dict:
    """The kernels calibration chose in this run (kernels/calibration.py: key -> {"choice",
    "seconds" of each candidate as timed at first use on this machine, from the cache where it was
    timed before}); {} for a revision without calibration (compare_revisions.py)."""
    try:
        from relpos_ablate.model.kernels.calibration import CALIBRATION
    except ImportError:
        return {}
    return dict(CALIBRATION.entries)


def denormals() -> str:
    """Whether denormal floats are flushed to zero (relpos_ablate.model.denormals, from 2026-12-03
    on)."""
    try:
        from relpos_ablate.model import denormals as setting
    except ImportError:
        return "kept (a revision without the setting)"
    return "flushed" if setting.FLUSHED else "kept"


def machine() -> dict:
    """What the timings belong to: the processor's model name, the instruction sets that pick the
    kernels (AVX2, AVX-512, AMX), the cores this process may use and the UTC date (Linux:
    /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(key: str) -> str:
        lines = (
            line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(key)
        )
        return next(lines, "")

    flags = set(field("flags").split())
    return {
        "processor": field("model name") or "unknown",
        "cpu_flags": [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags
        ],
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", default="512,1024,2048,4096", help="comma-separated sequence lengths"
    )
    parser.add_argument(
        "--schemes",
        default="all",
        help="comma-separated scheme names, or 'all': " + ", ".join(SCHEMES),
    )
    parser.add_argument(
        "--pairs", type=int, default=5, help="alternating (baseline, scheme) timing pairs (median)"
    )
    parser.add_argument(
        "--memory",
        default="all",
        help="'all', 'none', or comma-separated lengths to measure memory at",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype", default="fp32", choices=("fp32", "bf16"), help="parameter and input dtype"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)"
    )
    parser.add_argument(
        "--out", default="benchmarks/attention.json", help="where to write the JSON results"
    )
    parser.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = (
        torch.device(args.device),
        {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
    )
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.child_memory:
        print(peak_memory_child(args.child_memory, lengths[0], device, dtype))
        return
    names = (
        [n for n in SCHEMES if n != "sdpa_nope"]
        if args.schemes == "all"
        else args.schemes.split(",")
    )
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; allowed: {', '.join(SCHEMES)}")
    mem_lengths = set(
        lengths
        if args.memory == "all"
        else []
        if args.memory == "none"
        else map(int, args.memory.split(","))
    )
    results = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "batch": B,
        "heads": H,
        "d_head": D_HEAD,
        "d_model": D_MODEL,
        "torch": torch.__version__,
        **machine(),
        "denormals": denormals(),
        "rows": [],
    }
    baseline_mem = {n: peak_memory("sdpa_nope", n, args) for n in lengths if n in mem_lengths}
    for name in names:
        row = {"scheme": name}
        for n in lengths:
            if SCHEMES[name] == "seed000" and not seed000_fits(n, device):
                continue
            row[str(n)] = time_ratio(name, n, args.pairs, device, dtype)
            if n in mem_lengths:
                mem = peak_memory(name, n, args)
                row[str(n)]["peak_mb"] = mem
                row[str(n)]["mem_ratio"] = (
                    None if mem is None or not baseline_mem[n] else mem / baseline_mem[n]
                )
        results["rows"].append(row)
        cells = " | ".join(
            f"{fmt(row.get(str(n), {}).get('ratio'))} "
            f"({fmt(row.get(str(n), {}).get('mem_ratio'))} mem)"
            for n in lengths
        )
        print(f"| {name} | {cells} |", flush=True)
    results["baseline_peak_mb"] = baseline_mem
    results["kernel_choices"] = kernel_choices()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out)
    print("\n| scheme | " + " | ".join(f"L={n}: time (mem)" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for row in results["rows"]:
        print(
            f"| {row['scheme']} | "
            + " | ".join(
                f"{fmt(row.get(str(n), {}).get('ratio'))} "
                f"({fmt(row.get(str(n), {}).get('mem_ratio'))})"
                for n in lengths
            )
            + " |"
        )
    print(
        "baseline sdpa_nope ms: "
        + ", ".join(
            f"L={n}: {results['rows'][0].get(str(n), {}).get('baseline_ms', float('nan')):.1f}"
            for n in lengths
        )
    )
    print(f"baseline sdpa_nope peak MB: {baseline_mem}")


if __name__ == "__main__":
    main()
