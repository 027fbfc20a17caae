"""Token arrays on disk: a corpus tokenized once, streamed into raw files that runs memory-map.

`<cache_dir>/tokens/<key>/` holds, per split, `<split>.bin` (the token ids, little-endian uint16
when the vocabulary has at most 65,536 ids, else uint32) and `<split>.docs.bin` (each document's
length in tokens, its separator included, uint32), and `meta.json` (dtype, per split the tokens,
documents and UTF-8 bytes, the separator id, the tokenizer's file and hash, the cache version).
Each document is written as [separator] + its tokens. The folder is written under a temporary name
and renamed when complete, so a reader never sees half of one; a crash leaves only a `.tmp` folder
that nothing reads.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_bytes

META = "meta.json"
#: Vocabularies of at most this many ids are stored as uint16, larger ones as uint32.
UINT16_VOCAB = 1 << 16
#: The most tokens (separator included) one document may have: `<split>.docs.bin` is uint32.
MAX_DOCUMENT_TOKENS = (1 << 32) - 1
#: Changes when the layout changes, so that no folder of another layout is read.
CACHE_VERSION = 1
Encode = Callable[[list[str]], list[list[int]]]


def write_tokens(
    directory: Path,
    splits: dict[str, Iterable[list[str]]],
    encode: Encode,
    separator: int,
    vocab_size: int,
    fields: dict[str, str],
    about: dict,
) -> None:
    """Tokenize each split's batches of documents into `directory`, one batch in memory at a time.
    `fields` names each split's config key for errors; `about` joins meta.json (the tokenizer)."""
    dtype = np.dtype("<u2" if vocab_size <= UINT16_VOCAB else "<u4")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(
        tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp")
    )
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp makes 0700; caches are shared on clusters
    try:
        counts = {
            split: _write_split(partial, split, batches, encode, separator, dtype, fields[split])
            for split, batches in splits.items()
        }
        meta = {
            "version": CACHE_VERSION,
            "dtype": dtype.name,
            "separator": separator,
            "vocab_size": vocab_size,
            "splits": counts,
            **about,
        }
        (partial / META).write_text(json.dumps(meta, indent=2) + "\n")
        _sync(partial)
        os.rename(partial, directory)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not (directory / META).exists():  # else another process wrote the same folder first
            raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_split(
    folder: Path,
    split: str,
    batches: Iterable[list[str]],
    encode: Encode,
    separator: int,
    dtype: np.dtype,
    field: str,
) -> dict[str, int]:
    """Appends [separator] + ids of each document to `<split>.bin`; the counts meta.json keeps."""
    tokens = documents = size = 0
    with (
        open(folder / f"{split}.bin", "wb") as out,
        open(folder / f"{split}.docs.bin", "wb") as lengths,
    ):
        for batch in batches:
            ids = encode(batch)
            lengths_ = np.fromiter((len(x) + 1 for x in ids), np.int64, count=len(ids))
            over = np.flatnonzero(lengths_ > MAX_DOCUMENT_TOKENS)
            if over.size:
                raise ConfigError(
                    field,
                    f"document {documents + int(over[0])} has {int(lengths_[over[0]]):,} tokens; "
                    f"the cache indexes at most {MAX_DOCUMENT_TOKENS:,} per document",
                )
            flat = itertools.chain.from_iterable(itertools.chain((separator,), x) for x in ids)
            out.write(np.fromiter(flat, dtype, count=int(lengths_.sum())).tobytes())
            lengths.write(lengths_.astype("<u4").tobytes())
            tokens += int(lengths_.sum())
            documents += len(batch)
            size += sum(len(doc.encode("utf-8")) for doc in batch)
        for f in (out, lengths):
            f.flush()
            os.fsync(f.fileno())
    return {"tokens": tokens, "documents": documents, "bytes": size}


def _sync(folder: Path) -> None:
    if sys.platform != "win32":
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_meta(directory: Path) -> dict | None:
    """The folder's meta.json, or None when it was never completed or has another layout."""
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if meta.get("version") == CACHE_VERSION else None


def token_array(directory: Path, split: str, meta: dict) -> Tensor:
    """A split's tokens as a 1-D tensor over a copy-on-write memory map: nothing is read until a
    window of it is touched."""
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    if not meta["splits"][split]["tokens"]:  # an empty file cannot be mapped
        return torch.from_numpy(np.zeros(0, dtype))
    return torch.from_numpy(np.memmap(directory / f"{split}.bin", dtype, mode="c"))


def document_lengths(directory: Path, split: str) -> np.ndarray:
    """Each document's tokens, its separator included (uint32), memory-mapped; their cumulative sum
    gives where each document starts in the split."""
    path = directory / f"{split}.docs.bin"
    if not path.stat().st_size:
        return np.zeros(0, np.uint32)
    return np.memmap(path, np.dtype("<u4"), mode="r")


#: tokens one read of a split's file holds while its unigram counts are taken
COUNT_CHUNK = 1 << 20


def unigram_counts(directory: Path, split: str, meta: dict, vocab_size: int) -> np.ndarray:
    """How often each id occurs in the split (int64 [vocab_size]), kept as `<split>.counts.npy`
    after the first time. Counted from plain reads of the file a chunk at a time, not through the
    memory map: the pages read stay out of the process's resident memory."""
    path = directory / f"{split}.counts.npy"
    if path.exists():
        return np.load(path)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    counts = np.zeros(vocab_size, np.int64)
    with open(directory / f"{split}.bin", "rb") as f:
        while (chunk := np.fromfile(f, dtype, COUNT_CHUNK)).size:
            counts += np.bincount(chunk, minlength=vocab_size)
    buffer = io.BytesIO()
    np.save(buffer, counts)
    atomic_write_bytes(path, buffer.getvalue())
    return counts
