"""Shared test setup: small thread count (the CI machine has 2 cores), repo root on sys.path."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Overwrite every parameter with random values (so a missing term or table cannot hide behind
    its init values); scalars that must stay positive (FIRE's c and threshold) stay positive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
            if name.endswith(("threshold",)):
                values = 2.0 + values.abs() * 2  # small, so queries cross it in tests (FIRE's i-dependence)
            elif name.endswith((".c", ".a", ".p")) or name in ("c", "a", "p"):
                values = 0.05 + values.abs()
            p.copy_(values.to(p.dtype))


@pytest.fixture
def rand():
    return randomize
