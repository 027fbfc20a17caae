"""Subword tokenizers of text corpora: a byte-level BPE trained on the training split
(data.tokenizer 'bpe'), or a local tokenizer file (data.tokenizer 'file': a Hugging Face
tokenizer.json or a SentencePiece .model).

Either encodes batches of documents and names its end-of-text token, the separator that opens every
document in the token arrays (train/data/shards.py). A trained BPE is kept as
`<cache_dir>/tokenizers/<hash>.json`, keyed by what it was trained on, and reused by every run with
the same source, vocabulary size, training bytes and delimiter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from relpos_ablate.config import ConfigError, DataConfig
from relpos_ablate.io import atomic_write_text

#: The trained BPE's end-of-text token: the trainer's first special token, so its id is 0.
END_OF_TEXT = "<|endoftext|>"
#: End-of-text tokens looked for in a tokenizer.json, in this order (SentencePiece: its eos).
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
#: Changes when the BPE's recipe changes, so that no cached BPE of another recipe is reused.
BPE_VERSION = 1


@dataclass(frozen=True)
class SubwordTokenizer:
    """A tokenizer as the token writer uses it."""

    path: Path
    """Its file: tokenizer.json or .model."""
    encode: Callable[[list[str]], list[list[int]]]
    """Documents -> their token ids, no special tokens added."""
    vocab: list[str]
    """Token string of each id."""
    separator: int
    """The end-of-text token's id: it opens every document."""

    @property
    def hash(self) -> str:
        """sha256 of the file's bytes, its first 16 hex digits."""
        return file_hash(self.path)


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def subword_tokenizer(
    data: DataConfig, train: Callable[[], Iterable[list[str]]], identity: object, cache: Path
) -> SubwordTokenizer:
    """data.tokenizer_file's tokenizer, or the BPE trained on `train()` (batches of the training
    split's documents, asked for only when no BPE is cached; their source `identity` keys it)."""
    if data.tokenizer == "file":
        return load_file(data.tokenizer_file)
    key = {
        "source": identity,
        "vocab_size": data.vocab_size,
        "train_bytes": data.tokenizer_train_bytes,
        "delimiter": data.document_delimiter,
        "version": BPE_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"{digest}.json"
    if not path.exists():
        bpe = train_bpe(capped(train(), data.tokenizer_train_bytes), data.vocab_size)
        atomic_write_text(path, bpe.to_str())
    return load_file(str(path))


def train_bpe(documents: Iterable[list[str]], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer, no prefix space) of at most `vocab_size` tokens:
    <|endoftext|> (id 0), the 256 byte symbols, then merges in the order learnt. The trainer holds
    each distinct pre-token once, not the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(documents, trainer)
    return bpe


def capped(batches: Iterable[list[str]], limit: int) -> Iterator[list[str]]:
    """The first documents of `batches` up to `limit` UTF-8 bytes in all, the last one cut there
    (0: all of them)."""
    left = limit
    for batch in batches:
        if not limit:
            yield batch
            continue
        kept = []
        for doc in batch:
            size = len(doc.encode("utf-8"))
            if size >= left:
                # errors="ignore" drops a character cut in two at the limit
                kept.append(doc.encode("utf-8")[:left].decode("utf-8", errors="ignore"))
                yield kept
                return
            kept.append(doc)
            left -= size
        yield kept


def load_file(name: str) -> SubwordTokenizer:
    """A tokenizer.json or SentencePiece .model; one-line ConfigErrors for a missing file, a file
    that is neither, or a tokenizer without an end-of-text token."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError("data.tokenizer_file", f"file not found: {name}")
    with path.open("rb") as f:
        json_like = f.read(64).lstrip().startswith(b"{")
    try:
        return _hugging_face(path) if json_like else _sentencepiece(path)
    except ConfigError:
        raise
    except Exception:  # each library has its own parse errors (Exception, RuntimeError, OSError)
        raise ConfigError(
            "data.tokenizer_file",
            f"{name} is neither a Hugging Face tokenizer.json nor a SentencePiece .model",
        ) from None


def _hugging_face(path: Path) -> SubwordTokenizer:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    # a document's own "<|endoftext|>" is text: only the separator may open a document
    tokenizer.encode_special_tokens = True
    found = [i for name in EOS_TOKENS if (i := tokenizer.token_to_id(name)) is not None]
    if not found:
        _no_eos(path, ", ".join(EOS_TOKENS))

    def encode(documents: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(documents, add_special_tokens=False)]

    size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = [tokenizer.id_to_token(i) or "" for i in range(size)]
    return SubwordTokenizer(path, encode, vocab, found[0])


def _sentencepiece(path: Path) -> SubwordTokenizer:
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    if model.eos_id() < 0:
        _no_eos(path, "the model's eos_id (it is -1)")

    def encode(documents: list[str]) -> list[list[int]]:
        return model.encode(documents)

    vocab = [model.id_to_piece(i) for i in range(model.get_piece_size())]
    return SubwordTokenizer(path, encode, vocab, model.eos_id())


def _no_eos(path: Path, looked_for: str) -> None:
    raise ConfigError(
        "data.tokenizer_file",
        f"{path} has no end-of-text token (looked for {looked_for}); each document opens with one",
    )
