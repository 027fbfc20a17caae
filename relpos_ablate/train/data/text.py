"""Real text through `datasets`: named corpora and local files take the same path, then a tokenizer.

Named corpora are mapped to their Hugging Face hub ids, except the one shipped inside the package
(relpos_ablate/corpora/, xz-compressed train/valid/test files), which is read like local files are.
Local files are shards (sources.py): plain text, or records with a `text` column.

Two ways to tokens, both cached under `<cache_dir>/tokens/`:
- char, byte, word tokenize the corpus in memory (small corpora) into `<hash>.pt`, keyed by the
  source (corpus name, or each file's path, size and modification time), the tokenizer, min_freq and
  whether documents are marked;
- bpe and file stream the documents through the tokenizer (tokenizers.py) into memory-mapped arrays
  (shards.py), `<hash>/`, keyed by the source, the tokenizer file's hash and the delimiter.

Documents: every document is written as [separator] + its tokens, the separator opening it as a BOS
would. bpe and file always mark documents (their end-of-text token); char, byte and word only for
data.documents packed or packed_reset (the token <doc>, last in the vocabulary), so that their
concatenated stream stays the plain text it always was.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from relpos_ablate.config import ConfigError, DataConfig
from relpos_ablate.io import atomic_write_bytes
from relpos_ablate.train.data.shards import read_meta, token_array, unigram_counts, write_tokens
from relpos_ablate.train.data.sources import (
    HOLDOUT_FRACTION,
    Documents,
    Shards,
    local_documents,
    resolve,
)
from relpos_ablate.train.data.tokenizers import subword_tokenizer

UNK, EOS, DOC = "<unk>", "<eos>", "<doc>"
#: 2: the cached corpus also holds its separator, bytes and tokenizer hash.
CACHE_VERSION = 2
#: Tokenizers whose corpora stream into memory-mapped arrays.
SUBWORD = ("bpe", "file")
#: A vocabulary's encoder: text -> token ids.
Encoder = Callable[[str], np.ndarray]


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
    """Token ids of each split and what they mean."""

    vocab: list[str]
    """The token string of each id."""
    splits: dict[str, Tensor]
    """1-D token ids per split: int32 in memory (char, byte, word), or uint16 / uint32 over a
    copy-on-write memory map (bpe, file): slice a window, then `.long()` it."""
    separator: int | None = None
    """The id that opens each document; None when the corpus has no document boundaries (char,
    byte, word with documents=concatenate)."""
    split_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """UTF-8 bytes of the text each split's tokens encode: its documents, without the delimiters
    between them (the separator stands for those)."""
    tokenizer_hash: str = ""
    """sha256 (first 16 hex digits) of the tokenizer's file (bpe, file) or of the vocabulary (char,
    byte, word)."""
    folder: Path | None = None
    """The memory-mapped splits' cache folder (bpe, file), or None (in memory)."""

    def unigram_counts(self, split: str) -> Tensor:
        """How often each id occurs in the split (int64 [vocab]), without reading a memory-mapped
        split through its map (shards.unigram_counts)."""
        if self.folder is None:
            return torch.bincount(self.splits[split].long(), minlength=len(self.vocab))
        meta = read_meta(self.folder)
        return torch.from_numpy(unigram_counts(self.folder, split, meta, len(self.vocab)))

    def bits_per_byte(self, loss_nats_per_token: float, split: str) -> float:
        """The loss in bits per UTF-8 byte of `split`'s text: loss / ln 2 x tokens / bytes, where
        every token of the split counts, separators included (the model predicts them too), and the
        bytes are those of its documents. Comparable across tokenizers of the same corpus."""
        tokens = self.splits[split].numel()
        return loss_nats_per_token / math.log(2) * tokens / self.split_bytes[split]


def cache_root(data: DataConfig) -> Path:
    return Path(data.cache_dir or Path.home() / ".cache" / "relpos_ablate").expanduser()


def load_corpus(data: DataConfig) -> Corpus:
    """Tokenized train/valid/test splits, from the cache when the same source was tokenized
    before."""
    if data.tokenizer in SUBWORD:
        return _load_subword(data)
    path = cache_root(data) / "tokens" / f"{cache_key(data)}.pt"
    if path.exists():
        return Corpus(**torch.load(path, weights_only=True))
    if data.documents == "concatenate":
        corpus = tokenize(read_splits(data), data.tokenizer, data.min_freq)
    else:
        documents = {
            split: [doc for batch in docs for doc in batch]
            for split, docs in document_splits(data).items()
        }
        corpus = tokenize_documents(documents, data.tokenizer, data.min_freq)
    buffer = io.BytesIO()
    torch.save({f.name: getattr(corpus, f.name) for f in dataclasses.fields(corpus)}, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return corpus


def _load_subword(data: DataConfig) -> Corpus:
    """bpe / file: the tokenizer (a cached BPE, or the file), then the token arrays written once."""
    splits = functools.cache(lambda: document_splits(data))  # a downloaded corpus only on a miss
    identity = source_identity(data)
    tokenizer = subword_tokenizer(
        data, lambda: splits()["train"], identity, cache_root(data) / "tokenizers"
    )
    key = {
        "source": identity,
        "tokenizer": tokenizer.hash,
        "delimiter": data.document_delimiter,
        "version": CACHE_VERSION,
    }
    directory = cache_root(data) / "tokens" / _digest(key)
    meta = read_meta(directory)
    if meta is None:
        write_tokens(
            directory,
            splits(),
            tokenizer.encode,
            tokenizer.separator,
            len(tokenizer.vocab),
            fields={split: docs.field for split, docs in splits().items()},
            about={"tokenizer": str(tokenizer.path.resolve()), "tokenizer_hash": tokenizer.hash},
        )
        meta = read_meta(directory)
    counts = meta["splits"]
    return Corpus(
        tokenizer.vocab,
        {split: token_array(directory, split, meta) for split in counts},
        tokenizer.separator,
        {split: count["bytes"] for split, count in counts.items()},
        tokenizer.hash,
        directory,
    )


def cache_key(data: DataConfig) -> str:
    """Hash of what determines the in-memory token arrays (char, byte, word); a changed local file
    (size or mtime) gets a new key."""
    key = {
        "source": source_identity(data),
        "tokenizer": data.tokenizer,
        "min_freq": data.min_freq,
        "documents": data.documents != "concatenate",
        "delimiter": data.document_delimiter,
        "version": CACHE_VERSION,
    }
    return _digest(key)


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def source_identity(data: DataConfig) -> dict:
    """The corpus name, or each local source's shards (resolved path, size, modification time)."""
    if data.corpus:
        return {"corpus": data.corpus}
    return {
        field: resolve(field, getattr(data, field)).identity()
        for field in ("train_file", "valid_file", "test_file")
        if getattr(data, field)
    }


def document_splits(data: DataConfig) -> dict[str, Documents]:
    """Each split's documents, read in batches (sources.py); a downloaded corpus is held in
    memory."""
    if data.corpus in PACKAGED:
        return {
            split: Documents(
                "data.corpus",
                Shards("data.corpus", "text", (PACKAGED[data.corpus] / f"{split}.txt.xz",)),
                delimiter=data.document_delimiter,
            )
            for split in PACKAGED_SPLITS
        }
    if data.corpus:
        return {
            split: Documents("data.corpus", text=text, delimiter=data.document_delimiter)
            for split, text in _read_hub(data).items()
        }
    return local_documents(data)


def read_splits(data: DataConfig) -> dict[str, str]:
    """The raw text of each split: {"train", "valid"[, "test"]}; record shards' documents joined by
    data.document_delimiter."""
    if data.corpus in PACKAGED:
        return _read_files(
            {split: [PACKAGED[data.corpus] / f"{split}.txt.xz"] for split in PACKAGED_SPLITS}, data
        )
    if data.corpus:
        return _read_hub(data)
    texts, files = {}, {}
    for split, docs in local_documents(data).items():
        if docs.shards.kind != "text":
            texts[split] = data.document_delimiter.join(d for batch in docs for d in batch)
        elif docs.share != "valid":  # a plain-text train_file's holdout: _read_files cuts it
            files[split] = list(docs.shards.paths)
    holdout = "train" in files and not data.valid_file
    texts |= _read_files(files, data, holdout) if files else {}
    return {split: texts[split] for split in ("train", "valid", "test") if split in texts}


def _read_files(
    files: dict[str, list[Path]], data: DataConfig, holdout: bool = False
) -> dict[str, str]:
    """Text files (plain or compressed: `datasets` extracts .xz/.gz/.bz2) through the `text`
    builder; `holdout`: the last HOLDOUT_FRACTION of train's characters become valid."""
    from datasets import load_dataset

    try:
        loaded = load_dataset(
            "text",
            data_files={split: [str(p) for p in paths] for split, paths in files.items()},
            keep_linebreaks=True,
            cache_dir=str(cache_root(data) / "hf"),
        )
    # datasets wraps a decoding error into DatasetGenerationError; name the file
    except Exception as err:
        _raise_if_not_text(files, err)
        raise
    texts = {split: "".join(loaded[split]["text"]) for split in files}
    if holdout:
        cut = int(len(texts["train"]) * (1 - HOLDOUT_FRACTION))
        texts["train"], texts["valid"] = texts["train"][:cut], texts["train"][cut:]
    return texts


def _raise_if_not_text(files: dict[str, list[Path]], err: Exception) -> None:
    """A ConfigError naming the first file that is not UTF-8 text, when that is what `err` came
    from."""
    cause = err
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return
    for split, paths in files.items():
        for path in paths:
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as bad:
                raise ConfigError(
                    f"data.{split}_file",
                    f"{path} is not UTF-8 text (byte {bad.start}); give a text file",
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
    vocab, encode = _FIT[tokenizer]([texts["train"]], min_freq)
    return Corpus(
        vocab,
        {split: _int32(encode(text)) for split, text in texts.items()},
        None,
        {split: len(text.encode("utf-8")) for split, text in texts.items()},
        _digest({"vocab": vocab}),
    )


def tokenize_documents(
    documents: dict[str, list[str]], tokenizer: str, min_freq: int = 1
) -> Corpus:
    """As `tokenize`, each document opened by <doc>, the vocabulary's last token (built from the
    train documents)."""
    vocab, encode = _FIT[tokenizer](documents["train"], min_freq)
    vocab, separator = [*vocab, DOC], len(vocab)
    opening = np.array([separator])

    def stream(docs: list[str]) -> Tensor:
        parts = [part for doc in docs for part in (opening, encode(doc))]
        return _int32(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int32)

    splits = {split: stream(docs) for split, docs in documents.items()}
    sizes = {split: sum(len(d.encode("utf-8")) for d in docs) for split, docs in documents.items()}
    return Corpus(vocab, splits, separator, sizes, _digest({"vocab": vocab}))


def _fit_bytes(_texts: list[str], _min_freq: int) -> tuple[list[str], Encoder]:
    vocab = [bytes([i]).decode("latin-1") for i in range(256)]
    return vocab, lambda text: np.frombuffer(text.encode("utf-8"), np.uint8)


def _fit_chars(texts: list[str], _min_freq: int) -> tuple[list[str], Encoder]:
    """Id 0 is <unk> (characters absent from train), then the train characters in code point
    order."""
    alphabet = np.unique(np.concatenate([_code_points(t) for t in texts] or [_code_points("")]))

    def encode(text: str) -> np.ndarray:
        points = _code_points(text)
        index = np.searchsorted(alphabet, points).clip(max=len(alphabet) - 1)
        return np.where(alphabet[index] == points, index + 1, 0)

    return [UNK] + [chr(c) for c in alphabet], encode


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def _fit_words(texts: list[str], min_freq: int) -> tuple[list[str], Encoder]:
    """Whitespace words with <eos> closing every line (as Transformer-XL does for WikiText)."""
    counts = collections.Counter(w for t in texts for line in t.splitlines() for w in line.split())
    kept = sorted(
        (w for w, c in counts.items() if c >= min_freq and w not in (UNK, EOS)),
        key=lambda w: (-counts[w], w),
    )
    vocab = [UNK, EOS] + kept
    ids = {word: i for i, word in enumerate(vocab)}

    def encode(text: str) -> np.ndarray:
        words = (w for line in text.splitlines() for w in (*line.split(), EOS))
        return np.fromiter((ids.get(w, 0) for w in words), np.int64)

    return vocab, encode


def _int32(array: np.ndarray) -> Tensor:
    return torch.from_numpy(array.astype(np.int32))


_FIT = {"byte": _fit_bytes, "char": _fit_chars, "word": _fit_words}
