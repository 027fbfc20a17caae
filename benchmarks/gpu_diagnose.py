"""Two diagnoses of gradient differences between compiled FlexAttention and the block kernel, as
rows in one JSON file written when the run ends (a temporary file renamed):

    python benchmarks/gpu_diagnose.py --write OUT.json [--device cuda|cpu] [--small] [--only NAME]

fire_gradient: on CUDA (torch 2.11) compiled FlexAttention's gradient of FIRE's first MLP bias
differed from the block kernel's by up to 0.083, the forward matching; so training FIRE through it
is refused (QueryPositionBias.point_gradient_trusted: True here, in this process only). A row's
`hypothesis`: c: FIRE in fp32, flex and blocks against the explicit path in float64 (does flex
still differ?); a: the same in float64 (flex matching here, differing in c: the fp32 difference is
precision; differing here too: a lowering bug; an error row: no float64 FlexAttention); b: a bare
compiled flex_attention adding a captured table alpha (requires grad) read at an index, against
dense scores with autograd in float64: `data_dependent` (alpha[h, below], below = #breakpoints < x,
x = psi[t] * inverse[q_idx], as FIRE's), `two_tables` (FIRE's alpha + beta * x), controls
`distance_index` (alpha[h, t], t the column of q_idx - kv_idx) and `head_only` (alpha[h]). Only the
data-dependent kinds differing: the gradient of a captured tensor at a data-dependent index.

terms_abcd: Transformer-XL's terms abcd in fp32 with TF32 off (on CUDA again with it on: `tf32`),
flex, blocks and the explicit path against the explicit path in float64; `entrywise_failures`:
entries failing rtol = atol = 5e-3 against `entrywise_vs` (flex: blocks, where 2 of q_net.weight's
512 once failed; blocks: the fp32 explicit path), the first 8 listed with the float64 `reference`
and, for q_net.weight, the largest summand |dq·x| and the summands' sizes summed: an entry far below
them is cancelled, its fp32 error large relative to it whatever the kernel.

A row: `error` the largest |got - reference| of one tensor (the output `out`, the input `x`, each
parameter), `scale` the largest |reference|, `yardstick` the fp32 explicit path's (b: the fp32 dense
scores') largest error, times 2^-29 in float64 rows; verdict "matches" when error <= 16 * yardstick
+ 2e-5 * scale, else "differs". x [2, 256, 16], memory [2, 64, 16], 2 heads of 16 (--small: 24 and
8 tokens). --device cpu: FlexAttention has no backward there, its rows say skipped; the dense
references and the block kernel run. A compiled case due after --deadline s is skipped ("time
budget"); one that raises is recorded with its error.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.io import atomic_write_text
from relpos_ablate.model.core.bias import QueryPositionBias
from relpos_ablate.model.kernels import flex

RULE = "matches when error <= 16 * yardstick + 2e-5 * scale, else differs"
NO_BACKWARD = "no FlexAttention backward on cpu"
FLOAT64_YARDSTICK = 2.0**-29  # float64's epsilon over fp32's
DTYPES = {"fp32": torch.float32, "float64": torch.float64}
BREAKPOINTS = 8  # hypothesis b: 9 pieces
CAPTURED = ("data_dependent", "two_tables", "distance_index", "head_only")


def verdict(error: float, yardstick: float, scale: float) -> str:
    return "matches" if error <= 16 * yardstick + 2e-5 * scale else "differs"


def attention(fields: dict) -> RelPosAttention:
    """Float64, parameters drawn as randomize(attn, 5) of tests/fixtures/attention.py (FIRE's
    threshold small: queries on both sides of it)."""
    attn = RelPosAttention(16, 2, 16, AttentionConfig(**fields)).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            values = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
            if name.endswith("threshold"):
                values = 2.0 + values.abs() * 2
            elif name.endswith((".c", ".a", ".p")):
                values = 0.05 + values.abs()
            p.copy_(values)
    return attn


def gradients(attn64, backend: str, dtype, device, x, mems, hook_q=False) -> dict:
    """{name: float64 CPU tensor}: the output and the gradients of x and every parameter of
    out.square().sum() through `backend` in `dtype` on `device`; hook_q: also `dq`, q_net's
    output's."""
    attn = copy.deepcopy(attn64).to(device=device, dtype=dtype)
    attn.config = dataclasses.replace(attn.config, backend=backend)
    seen = []
    if hook_q:
        attn.q_net.register_forward_hook(lambda module, args, out: seen.append(out))
    xx = x.to(device, dtype).requires_grad_(True)
    out, _ = attn(xx, mems.to(device, dtype))
    names = ["x", *(n for n, _ in attn.named_parameters()), *(["dq"] if hook_q else [])]
    grads = torch.autograd.grad(
        out.square().sum(), [xx, *attn.parameters(), *seen], allow_unused=True
    )
    found = {"out": out, **{n: g for n, g in zip(names, grads) if g is not None}}
    return {n: t.detach().cpu().double() for n, t in found.items()}


def errors(got: dict, want: dict) -> dict:
    return {n: (got[n] - w).abs().max().item() for n, w in want.items() if n in got}


def tensor_rows(base: dict, want: dict, got: dict, yardstick: dict | None) -> list[dict]:
    """One row per tensor of want (dq aside): error, scale, yardstick and verdict."""
    rows, found = [], errors(got, want)
    for name, w in want.items():
        if name == "dq":
            continue
        row = {**base, "tensor": name, "scale": w.abs().max().item()}
        if name not in found:
            rows.append({**row, "error": "no gradient"})
        elif yardstick is None:  # the yardstick itself
            rows.append({**row, "error": found[name]})
        else:
            row.update(error=found[name], yardstick=yardstick[name])
            rows.append({**row, "verdict": verdict(found[name], yardstick[name], row["scale"])})
    return rows


def flex_backward(device: torch.device) -> bool:
    """Whether FlexAttention differentiates on `device` (torch refuses on the CPU)."""
    return device.type != "cpu"


class Runner:
    """The device, and the deadline of the cases that need FlexAttention's backward."""

    def __init__(self, device: torch.device, deadline: float):
        self.device, self.deadline = device, time.perf_counter() + deadline

    def flex(self, base: dict, run) -> list[dict]:
        """run()'s rows, or one row saying why not (CPU, the time budget, an error)."""
        if not flex_backward(self.device):
            return [{**base, "skipped": NO_BACKWARD}]
        if time.perf_counter() > self.deadline:
            return [{**base, "skipped": "time budget"}]
        try:
            return run()
        except Exception as err:  # recorded: e.g. no float64 lowering
            return [{**base, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}]


def fire_gradient(runner: Runner, x, mems) -> list[dict]:
    """Hypotheses c (fp32) and a (float64): FIRE through flex and the block kernel."""
    attn, device, rows = attention(dict(terms="a", bias="fire")), runner.device, []
    want = gradients(attn, "explicit", torch.float64, device, x, mems)
    fp32 = errors(gradients(attn, "explicit", torch.float32, device, x, mems), want)
    for dtype, hypothesis, yard in (("fp32", "c", 1.0), ("float64", "a", FLOAT64_YARDSTICK)):
        yard = {n: e * yard for n, e in fp32.items()}
        blocks = gradients(attn, "blocks", DTYPES[dtype], device, x, mems)
        base = dict(hypothesis=hypothesis, dtype=dtype)
        named = {**base, "name": f"fire_blocks_{dtype}", "backend": "blocks"}
        rows += tensor_rows(named, want, blocks, yard)
        base = {**base, "name": f"fire_flex_{dtype}", "backend": "flex"}

        def run(dtype=dtype, base=base, yard=yard, blocks=blocks):
            # flex.untrusted_gradient bypassed for FIRE, restored after
            with mock.patch.object(QueryPositionBias, "point_gradient_trusted", True):
                got = gradients(attn, "flex", DTYPES[dtype], device, x, mems)
            vs_blocks = errors(got, blocks)
            found = tensor_rows(base, want, got, yard)
            return [{**row, "vs_blocks": vs_blocks.get(row["tensor"])} for row in found]

        rows += runner.flex(base, run)
    return rows


def captured_bias(kind: str, n: int):
    """bias(tables, h, q_idx, kv_idx) for 0-dim indices (score_mod) or broadcast ones (dense)."""

    def bias(tables, h, q_idx, kv_idx):
        t = n - 1 - q_idx + kv_idx  # the column of distance q_idx - kv_idx
        if kind in ("head_only", "distance_index"):
            return tables["alpha"][h] if kind == "head_only" else tables["alpha"][h, t]
        x = tables["psi"][t] * tables["inverse"][q_idx]
        below = sum((x > tables["breakpoints"][u]).to(torch.int64) for u in range(BREAKPOINTS))
        out = tables["alpha"][h, below]
        return out + tables["beta"][h, below] * x if kind == "two_tables" else out

    return bias


def captured_tables(kind: str, n: int) -> dict:
    """Float64 tables of 2 heads: FIRE-like psi, inverse and breakpoints, alpha (and beta)."""
    gen, f64 = torch.Generator().manual_seed(3), torch.float64
    d = torch.arange(n - 1, -n, -1, dtype=f64)  # the distance of column t
    tables = {
        "psi": d.sign() * torch.log1p(0.3 * d.abs()),
        "inverse": 1 / torch.log1p(0.3 * torch.arange(n, dtype=f64).clamp(min=4)),
        "breakpoints": (torch.rand(BREAKPOINTS, generator=gen, dtype=f64) * 1.2).sort().values,
    }
    width = {"head_only": (), "distance_index": (2 * n - 1,)}.get(kind, (BREAKPOINTS + 1,))
    tables["alpha"] = torch.randn(2, *width, generator=gen, dtype=f64)
    if kind == "two_tables":
        tables["beta"] = torch.randn(2, BREAKPOINTS + 1, generator=gen, dtype=f64)
    return tables


def captured_gradients(kind, qkv, tables64, dtype, device, kernel=None) -> dict:
    """{name: float64 CPU tensor}: the output and the gradients of q and the trained tables of
    out.square().sum(), causal, dense with autograd or through flex_attention `kernel`."""
    q, k, v = (t.to(device, dtype).requires_grad_(name == "q") for name, t in zip("qkv", qkv))
    tables = {name: t.to(device, dtype) for name, t in tables64.items()}
    trained = [name for name in ("alpha", "beta") if name in tables]
    for name in trained:
        tables[name].requires_grad_(True)
    n, bias = q.shape[2], captured_bias(kind, q.shape[2])
    if kernel is None:
        h, i, j = (torch.arange(m, device=device) for m in (2, n, n))
        h, i, j = h[:, None, None], i[:, None], j[None, :]
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias(tables, h, i, j)
        out = scores.masked_fill(j > i, float("-inf")).softmax(-1) @ v
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device=str(device))
        out = kernel(
            q, k, v, block_mask=mask, score_mod=lambda s, b, h, i, j: s + bias(tables, h, i, j)
        )
    grads = torch.autograd.grad(out.square().sum(), [q, *(tables[t] for t in trained)])
    found = {"out": out, **dict(zip(["q", *trained], grads))}
    return {name: t.detach().cpu().double() for name, t in found.items()}


def captured_index(runner: Runner, n: int) -> list[dict]:
    """Hypothesis b: a bare compiled flex_attention's gradient of a captured table, in fp32."""
    gen, rows, device = torch.Generator().manual_seed(4), [], runner.device
    qkv = [torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64) * 0.5 for _ in range(3)]
    for kind in CAPTURED:
        tables = captured_tables(kind, n)
        want = captured_gradients(kind, qkv, tables, torch.float64, device)
        yard = errors(captured_gradients(kind, qkv, tables, torch.float32, device), want)
        base = dict(name=f"captured_{kind}", hypothesis="b", dtype="fp32", backend="flex")

        def run(kind=kind, tables=tables, want=want, yard=yard, base=base):
            kernel = flex._kernel(True)  # torch.compile(flex_attention, dynamic=False)
            got = captured_gradients(kind, qkv, tables, torch.float32, device, kernel)
            return tensor_rows(base, want, got, yard)

        rows += runner.flex({**base, "dense_yardstick": yard["alpha"]}, run)
    return rows


def entrywise(got: dict, other: dict, want: dict, tensor: str, x) -> dict:
    """The entries of `tensor` failing rtol = atol = 5e-3 between got and other: their count and
    the first 8 (the float64 value; q_net.weight: its summands dq[b, i, o]·x[b, i, c])."""
    bad, listed = ~torch.isclose(got[tensor], other[tensor], rtol=5e-3, atol=5e-3), []
    for index in bad.nonzero()[:8].tolist():
        at = tuple(index)
        entry = dict(index=index, got=got[tensor][at].item(), other=other[tensor][at].item())
        entry["reference"] = want[tensor][at].item()
        if tensor == "q_net.weight":
            terms = (want["dq"][..., at[0]] * x[..., at[1]]).abs()
            entry.update(largest_summand=terms.max().item(), summands_abs=terms.sum().item())
        listed.append(entry)
    return {"entrywise_failures": int(bad.sum()), "entries": bad.numel(), "failing": listed}


def terms_abcd(runner: Runner, x, mems, tf32: bool) -> list[dict]:
    """Terms abcd in fp32, TF32 on or off, against the explicit path in float64."""
    attn, device, matmul = attention(dict(terms="abcd")), runner.device, torch.backends.cuda.matmul
    saved, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        want = gradients(attn, "explicit", torch.float64, device, x, mems, hook_q=True)
        matmul.allow_tf32 = tf32
        explicit = gradients(attn, "explicit", torch.float32, device, x, mems)
        blocks = gradients(attn, "blocks", torch.float32, device, x, mems)
        base, yard = dict(name="abcd", dtype="fp32", tf32=tf32), errors(explicit, want)
        rows = tensor_rows({**base, "backend": "explicit"}, want, explicit, None)
        for row in tensor_rows({**base, "backend": "blocks"}, want, blocks, yard):
            found = entrywise(blocks, explicit, want, row["tensor"], x)
            rows.append({**row, **found, "entrywise_vs": "explicit"})

        def run():
            got = gradients(attn, "flex", torch.float32, device, x, mems)
            found = tensor_rows({**base, "backend": "flex"}, want, got, yard)
            return [
                {**row, **entrywise(got, blocks, want, row["tensor"], x), "entrywise_vs": "blocks"}
                if row["tensor"] in got
                else row
                for row in found
            ]

        return rows + runner.flex({**base, "backend": "flex"}, run)
    finally:
        matmul.allow_tf32 = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", required=True, help="the JSON file (written when the run ends)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (flex rows skipped)")
    parser.add_argument("--small", action="store_true", help="24 queries, 8 in memory (CPU test)")
    parser.add_argument("--only", choices=("fire_gradient", "terms_abcd"), help="one diagnosis")
    parser.add_argument(
        "--deadline", type=float, default=150.0, help="no compiled case starts after this (s)"
    )
    args = parser.parse_args(argv)
    start, runner = time.perf_counter(), Runner(torch.device(args.device), args.deadline)
    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_tf32 = matmul.allow_tf32, False  # IEEE fp32 (terms_abcd: also TF32)
    try:
        lq, n_mem = (24, 8) if args.small else (256, 64)
        gen = torch.Generator().manual_seed(2)
        x, mems = (torch.randn(2, n, 16, generator=gen, dtype=torch.float64) for n in (lq, n_mem))
        result = {"rule": RULE, "device": str(runner.device), "torch": torch.__version__}
        result["shapes"] = {"x": [2, lq, 16], "mems": [2, n_mem, 16], "heads": 2, "d_head": 16}
        if args.only in (None, "fire_gradient"):
            rows = fire_gradient(runner, x, mems) + captured_index(runner, lq)
            result["fire_gradient"] = {"rows": rows}
        if args.only in (None, "terms_abcd"):
            rows = terms_abcd(runner, x, mems, tf32=False)
            on = dict(name="abcd", dtype="fp32", tf32=True, skipped="TF32 is CUDA only")
            rows += terms_abcd(runner, x, mems, tf32=True) if runner.device.type == "cuda" else [on]
            result["terms_abcd"] = {"rows": rows}
    finally:
        matmul.allow_tf32 = saved
    result["seconds"] = time.perf_counter() - start
    atomic_write_text(args.write, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
