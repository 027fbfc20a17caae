"""Shared test setup: small thread count (the CI machine has 2 cores), repo root on sys.path, and
--process-groups (make test runs the tests marked process_group alone, after the rest)."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
# the kernels' fixed order, not a measured choice (kernels/calibration.py): a test's numbers never
# depend on the machine's load; the calibration tests switch it on with their own cache.
# Subprocesses inherit both.
os.environ["RELPOS_ABLATE_CALIBRATE"] = "0"
os.environ["RELPOS_ABLATE_CACHE"] = tempfile.mkdtemp(prefix="relpos_ablate_cache_")


def pytest_addoption(parser):
    parser.addoption(
        "--process-groups",
        choices=("with", "skip", "only"),
        default="with",
        help="tests marked process_group: run them with the rest (default), skip them, or run only "
        "them. make test runs the rest on pytest-xdist workers, then these alone",
    )


def pytest_collection_modifyitems(config, items):
    """The torch.compile tests first, then deselect by --process-groups.

    The first compilation in a process costs ~13 s before its own graphs (Inductor's imports, its
    probe of the vector ISA, the precompiled header; ~20 s with an empty compile cache): run first,
    all of them land on one pytest-xdist worker (worksteal hands the first half of the list to one
    worker and takes tests from the end of a queue) and pay it once, not once a worker.

    A process group's ranks wait on each other at every step, so a rank that shares the cores with
    other tests stalls the rest: test_ddp_parameters' check takes ~9 s alone and took 120 s beside
    other work on 2 cores. (Its runs past the 240 s deadline were a deadlock on exit, not this: see
    that test.)"""
    # stable: order kept otherwise
    items.sort(key=lambda item: not item.path.name.startswith("test_compiled_"))
    mode = config.getoption("--process-groups")
    if mode == "with":
        return
    keep, dropped = [], []
    for item in items:
        (
            keep
            if (item.get_closest_marker("process_group") is not None) == (mode == "only")
            else dropped
        ).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Overwrite every parameter with random values (so a missing term or table cannot hide behind
    its init values); scalars that must stay positive (FIRE's c and threshold) stay positive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
            if name.endswith(("threshold",)):
                # small, so queries cross it in tests (FIRE's i-dependence)
                values = 2.0 + values.abs() * 2
            elif name.endswith((".c", ".a", ".p")) or name in ("c", "a", "p"):
                values = 0.05 + values.abs()
            p.copy_(values.to(p.dtype))


@pytest.fixture
def rand():
    return randomize


def assert_memory_and_causality_exact(model) -> None:
    """A TransformerLM (float64, eval, mem_len 6): segment 2 with memory equals the tail of one long
    pass, and later tokens never change earlier outputs."""
    tokens = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(5))
    full, _ = model(tokens)
    _, mems = model(tokens[:, :6])
    torch.testing.assert_close(model(tokens[:, 6:], mems)[0], full[:, 6:], rtol=1e-9, atol=1e-9)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 11
    torch.testing.assert_close(model(changed)[0][:, :7], full[:, :7], rtol=1e-9, atol=1e-9)


def fast_and_explicit_gradients(attn, x, mems, options):
    """Gradients of a fixed weighting of the output w.r.t. x and every parameter, once through the
    attention's fast kernels and once through its explicit scores: (fast, explicit) tuples."""
    grads = []
    for explicit in (False, True):
        xx = x.clone().requires_grad_(True)
        out, _ = attn(xx, mems, options, need_weights=explicit)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        grads.append(
            torch.autograd.grad((out * weights).sum(), [xx, *attn.parameters()], allow_unused=True)
        )
    return grads
