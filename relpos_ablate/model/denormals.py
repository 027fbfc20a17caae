"""Denormal floats flushed to zero on the CPU, set when the model package is imported.

A softmax whose scores fall far below the row's maximum (ALiBi's and FoX's far keys, any long row)
produces probabilities below fp32's smallest normal number, 1.2e-38. Some processors (Intel's among
them) compute with such denormal numbers in microcode, many times slower: on one (torch 2.13) SDPA
with an ALiBi mask took 1.7x as long, and the low-rank kernel twice as long, as with them flushed;
they change no result beyond 1e-38. The setting is per thread, and torch's intra-op threads copy it
when they start: it must be made before torch runs its first parallel operation, so it is made here,
at import. RELPOS_ABLATE_DENORMALS=keep leaves the processor's default.
"""

from __future__ import annotations

import os

import torch

ENV = "RELPOS_ABLATE_DENORMALS"


def flush_denormals() -> bool:
    """Flush denormals to zero in this thread and in the intra-op threads started after it (True if
    set)."""
    value = os.environ.get(ENV, "flush")
    if value not in ("flush", "keep"):
        raise ValueError(f"{ENV}: {value!r} is not allowed; use flush (the default) or keep")
    return value == "flush" and torch.set_flush_denormal(True)


FLUSHED = flush_denormals()
