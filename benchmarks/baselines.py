"""Fair baselines: every encoding preset trained briefly on one text file, perplexity at the training length.

    python benchmarks/baselines.py FILE                       # e.g. Tiny Shakespeare, char level
    python benchmarks/baselines.py FILE --steps 1000 --presets vaswani,rope,alibi
    python benchmarks/baselines.py FILE --set model.embed_scale=none     # any run-config override

Each preset (relpos_ablate/runner/presets.py) trains the same small model (3 layers, d_model 128,
segments of 64 characters, the other fields at their defaults, as a new user would) through the real
training path (`train_run`: LitLM, the text DataModule with data.train_file, whose last 5% of lines
are the validation split) and is evaluated on that split at the training length. The table gives
each preset's perplexity, its ratio to the best preset's and its wall time. A preset that encodes
position and ends more than `--tolerance` above the best is marked: the goal is that none is
handicapped by an implementation detail (NoPE, which encodes no position, is reported, not judged).
Writes the results as JSON next to the run directories (`--results`, default a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from relpos_ablate.config import load_run_config  # noqa: E402
from relpos_ablate.io import atomic_write_json, read_json  # noqa: E402
from relpos_ablate import rundir  # noqa: E402
from relpos_ablate.runner.presets import preset_fields, presets  # noqa: E402
from relpos_ablate.train.run import train_run  # noqa: E402

#: The new user's run: char-level text, 3 layers of width 128, trained and evaluated at 64 tokens.
BASE = ["model.n_layers=3", "model.d_model=128", "data.source=text", "data.tokenizer=char",
        "train.segment_len=64", "train.accelerator=cpu", "train.log_every=50", "eval.settings=[{segment_len: 64}]"]
#: Encodes no position: reported, not held to the tolerance.
UNJUDGED = ("nope",)


def run_preset(name: str, text_file: Path, steps: int, overrides: list[str], run_dir: Path) -> dict:
    """Train and evaluate one preset; {'preset', 'ppl', 'wall_s'}."""
    encoding = [f"model.attention.{key}={value}" for key, value in preset_fields(name).items()]
    config = load_run_config(None, [*BASE, f"data.train_file={text_file}", f"train.max_steps={steps}",
                                    f"train.checkpoint_every={steps}", *encoding, *overrides])
    start = time.perf_counter()
    state = train_run(config, run_dir)
    wall = time.perf_counter() - start
    if state != "done":
        raise RuntimeError(f"preset {name}: the run ended {state}; see {run_dir / 'log.txt'}")
    metrics = read_json(run_dir / rundir.EVAL)["settings"][0]["metrics"]
    return {"preset": name, "ppl": metrics["ppl"], "wall_s": wall}


def table(results: list[dict], tolerance: float) -> str:
    """Markdown: preset, perplexity, ratio to the best, wall time; presets beyond the tolerance marked."""
    best = min(r["ppl"] for r in results)
    rows = ["| preset | ppl at train length | / best | wall time |", "|:---|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: r["ppl"]):
        ratio = r["ppl"] / best
        flag = " (no position)" if r["preset"] in UNJUDGED else " **over**" if ratio > 1 + tolerance else ""
        rows.append(f"| {r['preset']} | {r['ppl']:.3f} | {ratio:.3f}{flag} | {r['wall_s']:.0f} s |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="a UTF-8 text file (the last 5%% of its lines are validation)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per preset")
    parser.add_argument("--presets", default=",".join(presets()), help="comma-separated preset names (default: all)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed ppl ratio to the best, minus 1")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--results", type=Path, help="where run dirs and baselines.json go (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="a run-config override applied to every preset, e.g. model.embed_scale=none")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    for name in names:
        preset_fields(name)  # an unknown name fails before anything trains
    with tempfile.TemporaryDirectory() as scratch:
        results_dir = args.results or Path(scratch)
        start = time.perf_counter()
        results = [run_preset(name, args.file.resolve(), args.steps, args.overrides, results_dir / name)
                   for name in names]
        total = time.perf_counter() - start
        atomic_write_json(results_dir / "baselines.json", {"steps": args.steps, "overrides": args.overrides,
                                                           "total_wall_s": total, "results": results})
    print(table(results, args.tolerance))
    print(f"{len(results)} presets, {args.steps} steps each, {total / 60:.1f} min in all, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return results


if __name__ == "__main__":
    main()
