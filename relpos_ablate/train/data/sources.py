"""Where a text corpus's documents come from, read in batches so that memory does not grow with the
corpus.

A local source (data.train_file, valid_file, test_file) is a file, a folder or a glob of shards of
one kind: plain text (documents end at data.document_delimiter; a file's end ends one too) or
records with a `text` column (JSON lines, Parquet, Arrow: a record is a document), the records
streamed by `datasets`. A `Documents` reads one split afresh each time it is iterated, so the BPE
trainer and the token writer can each take their own pass.
"""

from __future__ import annotations

import bz2
import functools
import glob
import gzip
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relpos_ablate.config import ConfigError, DataConfig

#: Suffix of a record shard -> the `datasets` builder that streams it.
RECORD_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
#: Plain text: a shard in a folder is taken when one of its suffixes is .txt (train.txt.xz).
TEXT_SUFFIX = ".txt"
_OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
#: Share of a plain-text train_file held out for validation when no valid_file is given: its last
#: 5% of characters.
HOLDOUT_FRACTION = 0.05
#: Record shards without valid_file: every HOLDOUT_EVERY-th record (the 20th, 40th, ...: 5%) is
#: validation, the others train.
HOLDOUT_EVERY = 20
#: A batch of documents ends at this many documents or characters, whichever comes first.
BATCH_DOCUMENTS, BATCH_CHARS = 1024, 1 << 22
#: Plain text is read this many characters at a time.
CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class Shards:
    """The files of one source, sorted, all of one kind: 'text', 'json', 'parquet' or 'arrow'."""

    field: str
    """The config key they come from, for errors: data.train_file."""
    kind: str
    paths: tuple[Path, ...]

    def identity(self) -> list:
        """Each file's resolved path, size and modification time: a changed file changes it."""
        return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in self.paths]

    def identity_key(self) -> tuple:
        """`identity` as a hashable tuple."""
        return tuple(tuple(entry) for entry in self.identity())


def resolve(field: str, name: str) -> Shards:
    """The shards `name` (a file, a folder or a glob) stands for; one-line ConfigErrors for nothing
    matched, kinds mixed, or a record shard without a `text` column."""
    path = Path(name).expanduser()
    if path.is_dir():
        # a folder keeps its shards only: a README beside them is not a document
        paths = sorted(p for p in path.iterdir() if p.is_file() and _kind(p, strict=True))
    elif path.is_file():
        paths = [path]
    elif any(c in name for c in "*?["):  # a glob
        paths = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    else:
        raise ConfigError(f"data.{field}", f"file not found: {name}")
    if not paths:
        raise ConfigError(
            f"data.{field}",
            f"{name} matches no shards (.txt, .jsonl, .json, .parquet, .arrow); give a file, a "
            "folder or a glob of them",
        )
    kinds = {p: _kind(p, strict=False) for p in paths}
    if len(set(kinds.values())) > 1:
        found = ", ".join(sorted({f"{p.name} ({k})" for p, k in kinds.items()})[:4])
        raise ConfigError(
            f"data.{field}", f"{name} mixes kinds of shards ({found}); give shards of one kind"
        )
    shards = Shards(f"data.{field}", kinds[paths[0]], tuple(paths))
    if shards.kind != "text":
        for p in paths:
            _check_text_column(shards, p)
    return shards


def _kind(path: Path, strict: bool) -> str | None:
    """A shard's kind from its suffixes; any other file is plain text unless `strict` (folders)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in RECORD_KINDS:
        return RECORD_KINDS[suffixes[-1]]
    return "text" if TEXT_SUFFIX in suffixes or not strict else None


def _check_text_column(shards: Shards, path: Path) -> None:
    columns = _columns(shards, path)
    if "text" not in columns:
        raise ConfigError(
            shards.field,
            f"{path} has no 'text' column (its columns: {', '.join(columns) or 'none'}); each "
            "record's document must be under 'text'",
        )


def _columns(shards: Shards, path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if shards.kind == "parquet":
            return pq.read_schema(path).names
        if shards.kind == "arrow":
            try:  # `datasets` writes the streaming format; a file in the random-access one too
                return pa.ipc.open_stream(path).schema.names
            except pa.ArrowInvalid:
                return pa.ipc.open_file(path).schema.names
        with path.open(encoding="utf-8") as lines:
            first = next((line for line in lines if line.strip()), "{}")
        record = json.loads(first)
        return list(record) if isinstance(record, dict) else []
    except (OSError, ValueError) as err:  # ArrowInvalid and JSONDecodeError are ValueErrors
        raise ConfigError(
            shards.field, f"{path} is not a {shards.kind} shard ({type(err).__name__})"
        ) from None


@dataclass(frozen=True, eq=False)
class Documents:
    """One split's documents: iterating reads them afresh, in batches (lists of strings)."""

    field: str
    """The config key they come from, for errors."""
    shards: Shards | None = None
    text: str | None = None
    """A corpus split already in memory (downloaded corpora), instead of shards."""
    delimiter: str = "\n\n"
    share: str = ""
    """'train' or 'valid': this split's share of a train_file given without valid_file."""

    def __iter__(self) -> Iterator[list[str]]:
        return _batched(d for d in self._documents() if d)

    def _documents(self) -> Iterator[str]:
        if self.text is not None:
            return iter(self.text.split(self.delimiter))
        if self.shards.kind != "text":
            return self._records()
        if not self.share:
            return _text_documents(self.shards, self.delimiter)
        cut = int(_characters(self.shards.identity_key()) * (1 - HOLDOUT_FRACTION))
        window = (0, cut) if self.share == "train" else (cut, None)
        return _text_documents(self.shards, self.delimiter, window)

    def _records(self) -> Iterator[str]:
        from datasets import load_dataset

        files = [str(p) for p in self.shards.paths]
        columns = {"columns": ["text"]} if self.shards.kind == "parquet" else {}
        stream = load_dataset(
            self.shards.kind, data_files=files, split="train", streaming=True, **columns
        ).select_columns(["text"])
        texts = (
            t or "" for batch in stream.iter(batch_size=BATCH_DOCUMENTS) for t in batch["text"]
        )
        if not self.share:
            return texts
        valid = self.share == "valid"
        return (t for i, t in enumerate(texts) if ((i + 1) % HOLDOUT_EVERY == 0) == valid)


def _batched(documents: Iterator[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) == BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _open_text(path: Path):
    return _OPENERS.get(path.suffix.lower(), open)(path, "rt", encoding="utf-8")


def _chunks(shards: Shards, path: Path) -> Iterator[str]:
    try:
        with _open_text(path) as f:
            yield from iter(functools.partial(f.read, CHUNK_CHARS), "")
    except UnicodeDecodeError:
        raise ConfigError(shards.field, f"{path} is not UTF-8 text; give a text file") from None


def _text_documents(
    shards: Shards, delimiter: str, window: tuple[int, int | None] = (0, None)
) -> Iterator[str]:
    """The documents of characters [start, stop) of the shards read one after the other; the ends
    of a file and of the window end a document too."""
    start, stop = window
    offset = 0
    for path in shards.paths:
        carry = ""
        for chunk in _chunks(shards, path):
            lo, offset = offset, offset + len(chunk)
            piece = chunk[max(start - lo, 0) : None if stop is None else max(stop - lo, 0)]
            # search only the new text (and the delimiter's width before it): a document spanning
            # many chunks is not scanned again for each
            search, carry = max(len(carry) - len(delimiter) + 1, 0), carry + piece
            first = 0
            while (end := carry.find(delimiter, search)) >= 0:
                yield carry[first:end]
                first = search = end + len(delimiter)
            carry = carry[first:]
            if stop is not None and offset >= stop:
                break
        yield carry
        if stop is not None and offset >= stop:
            return


@functools.cache
def _characters(identity: tuple) -> int:
    """Characters of the plain-text shards `identity` names (their paths, sizes and times)."""
    shards = Shards("", "text", tuple(Path(path) for path, _size, _time in identity))
    return sum(len(chunk) for path in shards.paths for chunk in _chunks(shards, path))


def local_documents(data: DataConfig) -> dict[str, Documents]:
    """Each split's documents from data.train_file / valid_file / test_file; without valid_file,
    validation is train_file's held-out share (HOLDOUT_FRACTION, HOLDOUT_EVERY)."""

    def documents(field: str, share: str = "") -> Documents:
        shards = resolve(field, getattr(data, field))
        return Documents(shards.field, shards, delimiter=data.document_delimiter, share=share)

    if data.valid_file:
        splits = {"train": documents("train_file"), "valid": documents("valid_file")}
    else:
        splits = {
            "train": documents("train_file", "train"),
            "valid": documents("train_file", "valid"),
        }
    if data.test_file:
        splits["test"] = documents("test_file")
    return splits
