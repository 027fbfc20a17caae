"""Real text through `datasets`: named corpora and local files take the same path, then a tokenizer.

Named corpora are mapped to their Hugging Face hub ids, except the one shipped inside the package
(relpos_ablate/corpora/, xz-compressed train/valid/test files), which goes through the `text`
builder like local files do.
Tokenized splits are cached under `<cache_dir>/tokens/<hash>.pt`, keyed by the source (corpus name,
or each file's path, size and modification time), the tokenizer and min_freq.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from relpos_ablate.config import ConfigError, DataConfig
from relpos_ablate.io import atomic_write_bytes

UNK, EOS = "<unk>", "<eos>"
CACHE_VERSION = 1
#: Fraction of a local train file held out for validation when no valid_file is given.
HOLDOUT_FRACTION = 0.05


@dataclass(frozen=True)
class HubCorpus:
    """Where `datasets` finds a named corpus and how its records join into one text per split."""

    path: str
    name: str | None = None
    revision: str | None = None
    joiner: str = ""
    """Records that lost their line breaks are joined with "\\n"; records that kept them with ""."""
    holdout: int = 0
    """Corpora published as one split: the last 2 * holdout characters become valid and test."""


CORPORA = {
    "wikitext-2": HubCorpus("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1"),
    # Transformer-XL's split of the 10^8-byte dump: 90M train, 5M valid, 5M test.
    "enwik8": HubCorpus(
        "LTCB/enwik8", "enwik8", revision="refs/convert/parquet", joiner="\n", holdout=5_000_000
    ),
    "text8": HubCorpus("afmck/text8"),
}


#: Corpora shipped with the package: name -> directory holding {train,valid,test}.txt.xz (source,
#: license and split in its README.md). Read offline through the same `text` builder as local files.
PACKAGED = {"tinyshakespeare": Path(__file__).resolve().parents[2] / "corpora" / "tinyshakespeare"}
PACKAGED_SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Corpus:
    """Token ids of each split (1-D int32) and the vocabulary they index."""

    vocab: list[str]
    splits: dict[str, Tensor]


def cache_root(data: DataConfig) -> Path:
    return Path(data.cache_dir or Path.home() / ".cache" / "relpos_ablate").expanduser()


def load_corpus(data: DataConfig) -> Corpus:
    """Tokenized train/valid/test splits, from the cache when the same source was tokenized
    before."""
    path = cache_root(data) / "tokens" / f"{cache_key(data)}.pt"
    if path.exists():
        blob = torch.load(path, weights_only=True)
        return Corpus(blob["vocab"], blob["splits"])
    corpus = tokenize(read_splits(data), data.tokenizer, data.min_freq)
    buffer = io.BytesIO()
    torch.save({"vocab": corpus.vocab, "splits": corpus.splits}, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return corpus


def cache_key(data: DataConfig) -> str:
    """Hash of what determines the token arrays; a changed local file (size or mtime) gets a new
    key."""
    if data.corpus:
        source = {"corpus": data.corpus}
    else:
        source = {
            field: _file_identity(field, getattr(data, field))
            for field in ("train_file", "valid_file", "test_file")
            if getattr(data, field)
        }
    key = {
        "source": source,
        "tokenizer": data.tokenizer,
        "min_freq": data.min_freq,
        "version": CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _file_identity(field: str, name: str) -> list:
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"data.{field}", f"file not found: {name}")
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def read_splits(data: DataConfig) -> dict[str, str]:
    """The raw text of each split: {"train", "valid"[, "test"]}."""
    if data.corpus in PACKAGED:
        return _read_files(
            {split: str(PACKAGED[data.corpus] / f"{split}.txt.xz") for split in PACKAGED_SPLITS},
            data,
        )
    if data.corpus:
        return _read_hub(data)
    files = {"train": data.train_file, "valid": data.valid_file, "test": data.test_file}
    return _read_files({split: name for split, name in files.items() if name}, data)


def _read_files(files: dict[str, str], data: DataConfig) -> dict[str, str]:
    """Text files (plain or compressed: `datasets` extracts .xz/.gz/.bz2) through the `text`
    builder."""
    from datasets import load_dataset

    try:
        loaded = load_dataset(
            "text",
            data_files={split: str(Path(name).expanduser()) for split, name in files.items()},
            keep_linebreaks=True,
            cache_dir=str(cache_root(data) / "hf"),
        )
    # datasets wraps a decoding error into DatasetGenerationError; name the file
    except Exception as err:
        _raise_if_not_text(files, err)
        raise
    texts = {split: "".join(loaded[split]["text"]) for split in files}
    if "valid" not in texts:
        cut = int(len(texts["train"]) * (1 - HOLDOUT_FRACTION))
        texts["train"], texts["valid"] = texts["train"][:cut], texts["train"][cut:]
    return texts


def _raise_if_not_text(files: dict[str, str], err: Exception) -> None:
    """A ConfigError naming the first file that is not UTF-8 text, when that is what `err` came
    from."""
    cause = err
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return
    for split, name in files.items():
        try:
            Path(name).expanduser().read_bytes().decode("utf-8")
        except UnicodeDecodeError as bad:
            raise ConfigError(
                f"data.{split}_file",
                f"{name} is not UTF-8 text (byte {bad.start}); give a text file",
            ) from None


def _read_hub(data: DataConfig) -> dict[str, str]:
    from datasets import load_dataset

    spec = CORPORA[data.corpus]
    try:
        loaded = load_dataset(
            spec.path, spec.name, revision=spec.revision, cache_dir=str(cache_root(data) / "hf")
        )
    except Exception as err:  # offline, hub changed, no access: all end the same way for the user
        raise ConfigError(
            "data.corpus",
            f"cannot load {data.corpus!r} ({spec.path}) from the Hugging Face hub "
            f"({type(err).__name__}); offline? set data.train_file/valid_file to local text files",
        ) from None
    names = {"train": "train", "valid": "validation", "test": "test"}
    texts = {
        split: spec.joiner.join(loaded[hub]["text"])
        for split, hub in names.items()
        if hub in loaded
    }
    if spec.holdout and "valid" not in texts:
        train, h = texts["train"], spec.holdout
        texts = {"train": train[: -2 * h], "valid": train[-2 * h : -h], "test": train[-h:]}
    return texts


def tokenize(texts: dict[str, str], tokenizer: str, min_freq: int = 1) -> Corpus:
    """Token ids per split, the vocabulary built from the train split only."""
    return _TOKENIZERS[tokenizer](texts, min_freq)


def _bytes(texts: dict[str, str], _min_freq: int) -> Corpus:
    vocab = [bytes([i]).decode("latin-1") for i in range(256)]
    return Corpus(
        vocab,
        {split: _int32(np.frombuffer(t.encode("utf-8"), np.uint8)) for split, t in texts.items()},
    )


def _chars(texts: dict[str, str], _min_freq: int) -> Corpus:
    """Id 0 is <unk> (characters absent from train), then the train characters in code point
    order."""
    points = {split: np.frombuffer(t.encode("utf-32-le"), np.uint32) for split, t in texts.items()}
    alphabet = np.unique(points["train"])
    splits = {}
    for split, cp in points.items():
        index = np.searchsorted(alphabet, cp).clip(max=len(alphabet) - 1)
        splits[split] = _int32(np.where(alphabet[index] == cp, index + 1, 0))
    return Corpus([UNK] + [chr(c) for c in alphabet], splits)


def _words(texts: dict[str, str], min_freq: int) -> Corpus:
    """Whitespace words with <eos> closing every line (as Transformer-XL does for WikiText)."""
    lines = {split: [line.split() + [EOS] for line in t.splitlines()] for split, t in texts.items()}
    counts = collections.Counter(word for line in lines["train"] for word in line)
    kept = sorted(
        (w for w, c in counts.items() if c >= min_freq and w not in (UNK, EOS)),
        key=lambda w: (-counts[w], w),
    )
    vocab = [UNK, EOS] + kept
    ids = {word: i for i, word in enumerate(vocab)}
    splits = {
        split: _int32(np.fromiter((ids.get(w, 0) for line in ls for w in line), np.int64))
        for split, ls in lines.items()
    }
    return Corpus(vocab, splits)


def _int32(array: np.ndarray) -> Tensor:
    return torch.from_numpy(array.astype(np.int32))


_TOKENIZERS = {"byte": _bytes, "char": _chars, "word": _words}
