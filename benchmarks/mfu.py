"""The arithmetic of the GPU reports: a training step's model FLOPs and MFU, an attention call's
FLOPs and TFLOP/s, the devices' dense bf16 peaks, and what a measurement belongs to.

A training step (benchmarks/train_step.py --presets), per token, as nanoGPT's `estimate_mfu` and
PaLM's appendix B count it:

    6·N + 12·n_layers·(H·d_head)·K

- N: the parameters that take part in a matrix product, of the model without positions (the `nope`
  twin): every parameter but the embedding tables (tokens, learned positions), the output head
  counted whether or not it is tied (its product runs either way; nanoGPT's tied `wte` is counted
  the same way). 6 = 2 (multiply and add) × 3 (the forward, and the backward's products for the
  inputs and for the weights). A scheme's own work (rotations, biases, XL's W_R) is not counted:
  the same useful FLOPs for a scheme and its NoPE twin, so their MFU ratio is their speed ratio.
- Attention: QKᵀ and AV, 2·2·(H·d_head)·K per token and layer forward, ×3 with the backward.
  K = the keys a query sees (L + mem_len). Not halved for the causal mask, as nanoGPT and PaLM, so
  the MFU compares with theirs (at 12 layers, d_model 768, L = 2048 the term is ~23% of the count;
  halving it would lower MFU by ~12%).

An attention call (gpu_check's attention phase), FlashAttention's count (its
benchmarks/benchmark_flash_attention.py): forward 4·B·H·L²·d (two products of 2·L²·d), halved when
causal; backward 2.5× forward, so forward + backward 3.5× forward. The two counts differ on purpose:
each is the one its anchor reports, so the numbers compare with FlashAttention's TFLOP/s and with
nanoGPT's MFU.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM

#: Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets, keyed by a
#: substring of torch.cuda.get_device_name (the first match wins: specific names first).
DENSE_BF16_PEAK_TFLOPS = {
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,  # the SXM part's name as the driver reports it
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def device_peak_tflops(name: str, override: float | None = None) -> float | None:
    """The dense bf16 peak of device `name` (None where the table has no entry), or `override`."""
    if override is not None:
        return override
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in name), None)


def required_peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The peak MFU is measured against: on CUDA the table's or `override` (one-line error where
    neither), on CPU `override` alone (else None: no MFU)."""
    if device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    peak = device_peak_tflops(name, override)
    if peak is None:
        raise SystemExit(
            f"--peak-tflops: no dense bf16 peak known for {name!r} (known: "
            f"{', '.join(DENSE_BF16_PEAK_TFLOPS)}); pass the device's dense bf16 TFLOP/s"
        )
    return peak


def matmul_params(model: nn.Module) -> int:
    """N of the module docstring: parameters outside nn.Embedding tables, plus the output head's
    weight where it is tied to the token embedding."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    count = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    head = getattr(model, "head", None)
    tied = head is not None and id(head.weight) in tables
    return count + (head.weight.numel() if tied else 0)


def nope_twin(config: ModelConfig) -> ModelConfig:
    """The same model without positions: terms a, no bias, no absolute positions, every layer
    alike."""
    attention = AttentionConfig(terms="a", causal=config.attention.causal)
    return dataclasses.replace(config, attention=attention, layer_kinds=(), layer_pattern=())


def lm_flops_per_token(n_params: int, n_layers: int, attention_width: int, keys: int) -> int:
    """6·N + 12·n_layers·(H·d_head)·K (module docstring)."""
    return 6 * n_params + 12 * n_layers * attention_width * keys


def step_flops(config: ModelConfig, length: int, batch: int) -> int:
    """Model FLOPs of one training step of `batch` segments of `length` tokens: the count per token
    of config's NoPE twin (built on the meta device: no memory) times the tokens."""
    twin = nope_twin(config)
    with torch.device("meta"):
        n_params = matmul_params(TransformerLM(twin))
    per_token = lm_flops_per_token(
        n_params, twin.n_layers, twin.n_heads * twin.d_head, length + twin.mem_len
    )
    return per_token * length * batch


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Achieved FLOP/s as a fraction of the peak (None without a peak)."""
    return None if peak_tflops is None else flops / seconds / (peak_tflops * 1e12)


def attention_flops(
    batch: int, heads: int, length: int, d_head: int, causal: bool = True, backward: bool = True
) -> float:
    """FlashAttention's count (module docstring): 4·B·H·L²·d forward, halved when causal; × 3.5
    with the backward."""
    forward = 4 * batch * heads * length**2 * d_head / (2 if causal else 1)
    return 3.5 * forward if backward else forward


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def environment(device: torch.device) -> dict:
    """What the numbers belong to: device, driver (CUDA runtime of torch, and the NVIDIA driver
    where nvidia-smi is present), torch, processor, UTC date and time, the git commit (-dirty where
    the tree differs from it; None outside a git checkout)."""
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "cuda": torch.version.cuda,
        "nvidia_driver": _nvidia_driver() if cuda else None,
        "torch": torch.__version__,
        "processor": _processor(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _git("describe", "--always", "--dirty"),
    }


def environment_line(env: dict) -> str:
    """environment() in one sentence, for a report's header."""
    return (
        f"{env['date']}, commit {env['commit']}: {env['device']}, CUDA {env['cuda']}, NVIDIA "
        f"driver {env['nvidia_driver']}, torch {env['torch']}, processor {env['processor']}."
    )


def _nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def _processor() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, platform.processor() or "unknown")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None
