"""Which kernel is fastest for a call, measured on this machine at first use and remembered (cuDNN's
benchmark mode and Triton's autotune are the models).

The fastest path depends on the processor: SDPA with a float mask has cost 2.6x its causal call on
one processor, 1.4x on another (docs/performance.md names the processors measured); the CPU flash
kernel's speed relative to tensor products differs as much. So
where more than one kernel can compute a call (dispatch.candidates: the low-rank form, the block
kernel, SDPA per query block), `Calibration.choose` times them on the call's own shapes (forward,
and backward where autograd is on: after one warm-up run each, three rounds in which the candidates
take turns, each candidate's fastest run kept, so that a machine whose speed drifts while it
measures moves every candidate alike) and keeps the fastest for that key: the scheme class (which
score terms, which options), a shape bucket (batch, heads, head width, the powers of two at or above
the queries and memory keys), device, dtype and train/eval. The choices live in memory and in a JSON
file under the user's cache directory ($RELPOS_ABLATE_CACHE or $XDG_CACHE_HOME/relpos_ablate or
~/.cache/relpos_ablate), one section per processor and torch version, written atomically. A second
call with the same key measures nothing.

Every candidate computes the same attention (the parity tests hold them to the float64 reference),
so the choice changes results by rounding only. Pin a kernel with `model.attention.backend` (no
timing then), or set RELPOS_ABLATE_CALIBRATE=0 for the fixed order (`candidates`' first: what the
test suite runs, so that its numbers never depend on the machine's load).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

ENV_CACHE, ENV_SWITCH = "RELPOS_ABLATE_CACHE", "RELPOS_ABLATE_CALIBRATE"


def processor() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "relpos_ablate"


def enabled() -> bool:
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{ENV_SWITCH}: {value!r} is not allowed; use 1 (measure the kernels) or 0 (fixed "
            f"order)"
        )
    return value == "1"


def bucket(n: int) -> int:
    """The power of two at or above n (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


ROUNDS = 3


def time_alternating(runs: dict[str, Callable[[], None]], rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds of each run's fastest of `rounds`, after one warm-up run each, the runs taking turns
    round by round (timed one after the other, a drift of the machine's speed between them decided:
    a learned linear bias at L = 1024 got the block kernel at 0.054 against 0.058 s for the low-rank
    one, which takes 98 against 105 ms in seven alternating pairs)."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


class Calibration:
    """The measured choices of this process and machine (module docstring). `timer(path, run) ->
    seconds`, where given, measures one candidate (tests force timings through it; default:
    time_alternating over the candidates); `path` of the cache file (None: cache_dir())."""

    def __init__(
        self,
        path: Path | None = None,
        timer: Callable[[str, Callable[[], None]], float] | None = None,
    ):
        self._path = path
        self.timer = timer
        self.choices: dict[str, str] = {}
        self.entries: dict[
            str, dict
        ] = {}  # key -> {"choice", "seconds"} of the choices made here (benchmarks)
        self.measured = 0  # candidates timed by this object (tests read it)

    @property
    def path(self) -> Path:
        return self._path or cache_dir() / "kernels.json"

    @staticmethod
    def section() -> str:
        return f"{processor()} | torch {torch.__version__}"

    def choose(self, key: str, candidates: list[str], run: Callable[[str], None]) -> str:
        """The fastest of `candidates` for `key`: remembered, else read from the cache file, else
        measured by `run(name)` (one forward, and backward where autograd is on) and written
        there."""
        if len(candidates) == 1:
            return candidates[0]
        stored = (
            self._stored().get(key, {}) if key not in self.choices else self.entries.get(key, {})
        )
        choice = self.choices.get(key) or stored.get("choice")
        if choice in candidates:
            self.choices[key], self.entries[key] = choice, stored
            return choice
        runs = {name: (lambda name=name: run(name)) for name in candidates}
        if self.timer is None:
            times = time_alternating(runs)
        else:
            times = {name: self.timer(name, go) for name, go in runs.items()}
        self.measured += len(candidates)
        choice = min(times, key=times.get)
        self.choices[key] = choice
        self.entries[key] = {
            "choice": choice,
            "seconds": {name: round(t, 6) for name, t in times.items()},
        }
        self._store(key, self.entries[key])
        return choice

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # no file yet, or one another version wrote: measured anew

    def _stored(self) -> dict:
        return self._read().get(self.section(), {})

    def _store(self, key: str, entry: dict) -> None:
        """Merges the entry into the file (re-read first: other processes may have written) and
        replaces it atomically; a cache that cannot be written only costs a measurement next
        time."""
        try:
            data = self._read()
            data.setdefault(self.section(), {})[key] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass


CALIBRATION = Calibration()
