"""Memory of a corpus larger than memory: a synthetic English-like corpus of each size is tokenized
(a byte-level BPE of 2,048 tokens trained on its first 50 MB, then every document streamed into the
memory-mapped token files: `load_corpus`) and trained on (`relpos-ablate train`, a tiny model, 50
steps, evaluation capped at max_targets), each in a fresh process whose peak resident memory is
measured, so that the sizes can be compared: memory that does not grow with the corpus is the point.

The corpus: words of a fixed synthetic vocabulary (letters drawn with English frequencies, shorter
words more frequent) drawn from a Zipf-Mandelbrot law, sentences and paragraphs, documents of
log-normal length (median ~250 words), written as JSON-lines (or Parquet) shards of ~64 MB under
--work (kept for the next call; delete it when done). Validation is the train shards' every 20th
document (sources.py).

    python benchmarks/corpus_memory.py --sizes 100MB 2GB --out /tmp/corpus_memory/results

Peak RSS: the measured process's maximum resident set (wait4's ru_maxrss). It counts the pages of
the memory-mapped token files the process touched (training's unigram reference reads the whole
train split once), which are clean file pages the kernel drops under pressure; peak anon: the
largest of its anonymous memory (/proc/<pid>/status RssAnon, sampled every 0.5 s), its own heap:
the number that must not grow with the corpus. The JSON also holds the file-backed peak and USS
(psutil).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHARD_BYTES = 64_000_000
VOCAB_SIZE, TRAIN_BYTES = 2048, 50_000_000
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
#: English letter frequencies (%), in LETTERS' order.
LETTER_P = np.array(
    "12.7 9.1 8.2 7.5 7 6.7 6.3 6.1 6 4.3 4 2.8 2.8 2.4 2.4 2.2 2 2 1.9 1.5 1 0.8 "
    ".2 .2 .1 .1".split(),
    float,
)
TRAIN_CONFIG = """\
model: {{d_model: 64, n_layers: 2, n_heads: 4, d_head: 16, d_inner: 256, dropout: 0.0}}
data:
  source: text
  train_file: {corpus}
  tokenizer: bpe
  vocab_size: {vocab_size}
  tokenizer_train_bytes: {train_bytes}
  cache_dir: {cache}
train: {{segment_len: 128, batch_size: 8, max_steps: 50, log_every: 10, checkpoint_every: 1000,
  accelerator: cpu}}
eval:
  batch_size: 8
  settings: [{{segment_len: 128, max_targets: 8192}}]
seed: 0
"""


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B)", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 100MB or 2GB")
    return int(float(match[1]) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[match[2]])


def vocabulary(rng: np.random.Generator, n: int = 30_000) -> tuple[list[str], np.ndarray]:
    """n distinct words, most frequent first, and the cumulative Zipf-Mandelbrot law over them."""
    lengths = np.clip(rng.poisson(5.5, 4 * n), 1, 14)
    letters = rng.choice(list(LETTERS), size=int(lengths.sum()), p=LETTER_P / LETTER_P.sum())
    cuts = np.cumsum(lengths)[:-1]
    words = sorted(set(map("".join, np.split(letters, cuts))))
    # frequent words tend to be short, not strictly: the rank follows the length plus noise
    noisy = np.array([len(w) for w in words]) + rng.normal(0, 2.5, len(words))
    words = [words[i] for i in np.argsort(noisy, kind="stable")[:n]]
    weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.07
    return words, np.cumsum(weights / weights.sum())


def documents(size: int, seed: int = 0):
    """Documents of about `size` UTF-8 bytes in all."""
    rng = np.random.default_rng(seed)
    words, cdf = vocabulary(rng)
    words = np.array(words, dtype=object)
    written = 0
    while written < size:
        lengths = np.clip(rng.lognormal(5.5, 0.9, 4096), 20, 20_000).astype(int)
        drawn = words[np.searchsorted(cdf, rng.random(int(lengths.sum())))].tolist()
        # after each word: a space, the end of a sentence, or of a paragraph
        ends = rng.choice(
            np.array([" ", ". ", ".\n"], dtype=object), len(drawn), p=[0.92, 0.07, 0.01]
        )
        start = 0
        for n in lengths:
            doc = "".join(
                itertools.chain.from_iterable(
                    zip(drawn[start : start + n], ends[start : start + n])
                )
            )
            start += n
            yield doc.capitalize().rstrip() + "."
            written += len(doc) + 1
            if written >= size:
                return


def write_corpus(folder: Path, size: int, kind: str) -> None:
    """JSON-lines or Parquet shards of ~SHARD_BYTES; a `complete` file marks a finished corpus."""
    if (folder / "complete").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shard, batch, batch_bytes = 0, [], 0
    for doc in documents(size):
        batch.append(doc)
        batch_bytes += len(doc)
        if batch_bytes >= SHARD_BYTES:
            _write_shard(folder / f"train-{shard:05d}.{kind}", batch)
            shard, batch, batch_bytes = shard + 1, [], 0
    if batch:
        _write_shard(folder / f"train-{shard:05d}.{kind}", batch)
    (folder / "complete").write_text(f"{size}\n")


def _write_shard(path: Path, docs: list[str]) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path)
        return
    with path.open("w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)


def unique_mb() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_full_info().uss / 2**20


def child_tokenize(corpus: str, cache: str) -> None:
    """In the measured process: load_corpus, timed, then its memory, as one JSON line."""
    import relpos_ablate.train.data.tokenizers as subword
    from relpos_ablate.config import DataConfig
    from relpos_ablate.train.data.text import load_corpus

    trained = {}
    train_bpe = subword.train_bpe

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = train_bpe(*args, **kwargs)
        trained["bpe_s"] = time.perf_counter() - start
        return result

    subword.train_bpe = timed
    data = DataConfig(
        source="text",
        train_file=corpus,
        tokenizer="bpe",
        vocab_size=VOCAB_SIZE,
        tokenizer_train_bytes=TRAIN_BYTES,
        cache_dir=cache,
    )
    start = time.perf_counter()
    loaded = load_corpus(data)
    result = {
        "wall_s": time.perf_counter() - start,
        **trained,
        "tokens": {split: t.numel() for split, t in loaded.splits.items()},
        "bytes": loaded.split_bytes,
        "uss_mb": unique_mb(),
    }
    print(json.dumps(result))


def _sample(pid: int) -> dict[str, float]:
    """The process's resident memory now (MB): anonymous (its own heap: what must not grow with
    the corpus), file-backed (pages of mapped files it touched: the kernel may drop them), USS."""
    sample = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                sample[name] = int(value.split()[0]) / 1024
        import psutil

        sample["USS"] = psutil.Process(pid).memory_full_info().uss / 2**20
    except Exception:  # OSError, psutil.Error: it ended between two looks; no psutil
        pass
    return sample


def measured(command: list[str], log: Path) -> dict:
    """Runs `command` (stdout and stderr to `log`): its wall time, peak RSS (wait4: this child's
    own) and the peaks of its anonymous, file-backed and unique memory sampled every 0.5 s."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    peaks: dict[str, float] = {}
    while not (reaped := os.wait4(proc.pid, os.WNOHANG))[0]:
        for name, value in _sample(proc.pid).items():
            peaks[name] = max(peaks.get(name, 0.0), value)
        time.sleep(0.5)
    _pid, status, usage = reaped
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}); see {log}")
    return {
        "wall_s": time.perf_counter() - start,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux reports KiB
        "peak_anon_mb": peaks.get("RssAnon"),
        "peak_file_mb": peaks.get("RssFile"),
        "peak_uss_mb": peaks.get("USS"),
    }


def measure(size: int, args: argparse.Namespace) -> dict:
    label = f"{size / 1e6:g}MB"
    corpus = args.work / f"corpus-{label}-{args.format}"
    start = time.perf_counter()
    write_corpus(corpus, size, args.format)
    generated = time.perf_counter() - start
    cache, run = args.work / f"cache-{label}", args.work / f"run-{label}"
    for folder in (cache, run):
        shutil.rmtree(folder, ignore_errors=True)
    run.mkdir(parents=True)
    command = [sys.executable, __file__, "--child-tokenize", str(corpus), str(cache)]
    tokenize = measured(command, run / "tokenize.log")
    child = json.loads((run / "tokenize.log").read_text().strip().splitlines()[-1])
    (run / "config.yaml").write_text(
        TRAIN_CONFIG.format(
            corpus=corpus, vocab_size=VOCAB_SIZE, train_bytes=TRAIN_BYTES, cache=cache
        ).replace("max_steps: 50", f"max_steps: {args.steps}")
    )
    cli = str(Path(sys.executable).with_name("relpos-ablate"))
    command = [
        cli,
        "train",
        "--config",
        str(run / "config.yaml"),
        "--run-dir",
        str(run / "run"),
        "--threads",
        str(os.cpu_count()),
    ]
    train = measured(command, run / "train.log")
    on_disk = sum(p.stat().st_size for p in corpus.glob("train-*"))
    return {
        "size": label,
        "corpus_bytes": on_disk,
        "generate_s": generated,
        "tokenize": tokenize
        | {k: child[k] for k in ("bpe_s", "tokens", "bytes", "uss_mb") if k in child},
        "train": train,
    }


def table(rows: list[dict]) -> str:
    """Markdown: a line per size, and the largest size over the smallest."""
    columns = {
        "tokens": lambda r: sum(r["tokenize"]["tokens"].values()),
        "tokenize wall": lambda r: r["tokenize"]["wall_s"],
        "of it BPE training": lambda r: r["tokenize"].get("bpe_s", 0.0),
        "tokenize peak RSS": lambda r: r["tokenize"]["peak_rss_mb"],
        "tokenize peak anon": lambda r: r["tokenize"]["peak_anon_mb"] or 0.0,
        "train wall": lambda r: r["train"]["wall_s"],
        "train peak RSS": lambda r: r["train"]["peak_rss_mb"],
        "train peak anon": lambda r: r["train"]["peak_anon_mb"] or 0.0,
    }
    units = {"tokens": "{:,.0f}", "wall": "{:.0f} s", "BPE": "{:.0f} s"}

    def cell(name: str, value: float) -> str:
        unit = next((f for key, f in units.items() if key in name), "{:.0f} MB")
        return unit.format(value)

    lines = ["| corpus | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in rows:
        cells = [cell(name, get(r)) for name, get in columns.items()]
        lines.append(f"| {r['size']} | " + " | ".join(cells) + " |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        ratios = [f"{get(b) / get(a):.2f}x" if get(a) else "" for get in columns.values()]
        lines.append(f"| {b['size']} / {a['size']} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[parse_size("100MB"), parse_size("2GB")],
        help="corpus sizes in UTF-8 bytes of text, e.g. 100MB 2GB",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("/tmp/corpus_memory/results"),
        help="folder for corpus_memory.json",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/corpus_memory"),
        help="corpora, token caches and runs (not in the repository)",
    )
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--steps", type=int, default=50, help="training steps")
    parser.add_argument(
        "--child-tokenize", nargs=2, metavar=("CORPUS", "CACHE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child_tokenize:
        child_tokenize(*args.child_tokenize)
        return
    from relpos_ablate.model.kernels.calibration import processor

    rows = []
    for size in args.sizes:
        rows.append(measure(size, args))
        print(table(rows[-1:]), flush=True)
    result = {
        "processor": processor(),
        "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "vocab_size": VOCAB_SIZE,
        "tokenizer_train_bytes": TRAIN_BYTES,
        "steps": args.steps,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "corpus_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['processor']}, {result['cores']} cores, {result['date']}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
