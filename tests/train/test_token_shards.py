"""Local shards and the memory-mapped token cache (train/data/sources.py, shards.py), on tiny
corpora the tests write.

Covers: JSON-lines, Parquet and Arrow shards given as a folder, a glob or a file, read back as the
documents re-encoded by the `tokenizers` library itself ([separator] + ids per document); the
held-out validation share of record shards and of plain text; the one-line errors for a shard
without `text`, mixed kinds, a glob matching nothing and a document too long; uint16 / uint32 files;
a failed write leaving nothing a later load reads; memory-mapped splits cut into streams; char,
byte and word with and without the <doc> separator.
Run: pytest tests/train/test_token_shards.py
"""

import dataclasses
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

import relpos_ablate.train.data.shards as shards
import relpos_ablate.train.data.text as text
from fixtures.tokenizers import write_reference_bpe
from relpos_ablate.config import ConfigError, load_run_config
from relpos_ablate.train.data.streams import SegmentStreams, batchify

WORDS = "alpha beta gamma delta épsilon zeta eta théta iota kappa lambda mu".split()
DOCS = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(3 + i % 7)) for i in range(45)]


@pytest.fixture
def tokenizer_file(tmp_path):
    """A byte-level BPE trained here with the `tokenizers` library: the independent encoder."""
    return write_reference_bpe(tmp_path / "tokenizer.json", DOCS, 290, "</s>")


def expected_ids(path, docs):
    """[</s>] + ids of each document, concatenated: what the cache must hold."""
    bpe = Tokenizer.from_file(str(path))
    eos = bpe.token_to_id("</s>")
    return [t for doc in docs for t in [eos, *bpe.encode(doc, add_special_tokens=False).ids]]


def config(tmp_path, train, *sets, tokenizer=None):
    chosen = ["data.tokenizer=file", f"data.tokenizer_file={tokenizer}"] if tokenizer else []
    return load_run_config(
        None,
        [
            "data.source=text",
            f"data.train_file={train}",
            f"data.cache_dir={tmp_path / 'cache'}",
            *chosen,
            *sets,
        ],
    ).data


def write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def test_jsonl_folder_holds_out_every_20th_record(tmp_path, tokenizer_file):
    (tmp_path / "shards").mkdir()
    for k in range(3):  # 15 records each, read in file order
        write_jsonl(tmp_path / "shards" / f"part-{k}.jsonl", DOCS[15 * k : 15 * (k + 1)])
    (tmp_path / "shards" / "README.md").write_text("not a shard: a folder keeps its shards only")
    corpus = text.load_corpus(config(tmp_path, tmp_path / "shards", tokenizer=tokenizer_file))
    valid = [d for i, d in enumerate(DOCS) if (i + 1) % 20 == 0]
    train = [d for i, d in enumerate(DOCS) if (i + 1) % 20]
    assert corpus.splits["train"].tolist() == expected_ids(tokenizer_file, train)
    assert corpus.splits["valid"].tolist() == expected_ids(tokenizer_file, valid)
    assert corpus.split_bytes["valid"] == sum(len(d.encode()) for d in valid)


def test_parquet_glob_with_a_valid_shard(tmp_path, tokenizer_file):
    for k in range(2):
        pq.write_table(pa.table({"text": DOCS[20 * k : 20 * (k + 1)]}), tmp_path / f"tr{k}.parquet")
    pq.write_table(pa.table({"text": DOCS[40:], "n": list(range(5))}), tmp_path / "va.parquet")
    data = config(
        tmp_path,
        tmp_path / "tr*.parquet",
        f"data.valid_file={tmp_path / 'va.parquet'}",
        tokenizer=tokenizer_file,
    )
    corpus = text.load_corpus(data)
    assert corpus.splits["train"].tolist() == expected_ids(tokenizer_file, DOCS[:40])
    assert corpus.splits["valid"].tolist() == expected_ids(tokenizer_file, DOCS[40:])


def test_arrow_shard_written_by_datasets(tmp_path, tokenizer_file):
    from datasets import Dataset

    Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    write_jsonl(tmp_path / "valid.jsonl", DOCS[:2])
    data = config(
        tmp_path, arrow, f"data.valid_file={tmp_path / 'valid.jsonl'}", tokenizer=tokenizer_file
    )
    assert text.load_corpus(data).splits["train"].tolist() == expected_ids(tokenizer_file, DOCS)


def test_plain_text_without_valid_file_holds_out_its_last_5_percent(tmp_path):
    body = "\n\n".join(DOCS)
    (tmp_path / "train.txt").write_text(body)
    corpus = text.load_corpus(
        config(tmp_path, tmp_path / "train.txt", "data.tokenizer=bpe", "data.vocab_size=300")
    )
    (bpe_path,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    bpe = Tokenizer.from_file(str(bpe_path))
    cut = int(len(body) * 0.95)
    for split, part in (("train", body[:cut]), ("valid", body[cut:])):
        ids = [t for doc in part.split("\n\n") if doc for t in [0, *bpe.encode(doc).ids]]
        assert corpus.splits[split].tolist() == ids


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: write_jsonl(d / "a.jsonl", DOCS, column="content"),
            r"a\.jsonl has no 'text' column \(its columns: content, id\)",
        ),
        (
            lambda d: pq.write_table(pa.table({"body": DOCS}), d / "a.parquet"),
            r"a\.parquet has no 'text' column \(its columns: body\)",
        ),
        (
            lambda d: (write_jsonl(d / "a.jsonl", DOCS), (d / "b.txt").write_text("x")),
            r"mixes kinds of shards \(a\.jsonl \(json\), b\.txt \(text\)\); give shards of one",
        ),
        (lambda d: (d / "notes.md").write_text("x"), r"matches no shards"),
    ],
    ids=["jsonl_without_text", "parquet_without_text", "mixed", "nothing"],
)
def test_bad_shards_are_one_line(tmp_path, tokenizer_file, make, message):
    (tmp_path / "in").mkdir()
    make(tmp_path / "in")
    with pytest.raises(ConfigError, match=r"^data\.train_file: .*" + message) as err:
        text.load_corpus(config(tmp_path, tmp_path / "in", tokenizer=tokenizer_file))
    assert "\n" not in str(err.value)


def test_glob_matching_nothing_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.train_file: .*\*\.parquet matches no shards"):
        text.load_corpus(config(tmp_path, tmp_path / "*.parquet", "data.tokenizer=byte"))


def cache_folders(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir())


def test_token_files_are_uint16_then_uint32_above_65536_ids(tmp_path, tokenizer_file, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", DOCS)
    data = config(tmp_path, tmp_path / "train.jsonl", tokenizer=tokenizer_file)
    small = text.load_corpus(data)
    (folder,) = cache_folders(tmp_path)
    tokens = small.splits["train"].numel()
    assert small.splits["train"].dtype == torch.uint16
    assert (tmp_path / "cache" / "tokens" / folder / "train.bin").stat().st_size == 2 * tokens
    meta = json.loads((tmp_path / "cache" / "tokens" / folder / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == tokens and meta["dtype"] == "uint16"
    monkeypatch.setattr(shards, "UINT16_VOCAB", 100)
    data = dataclasses.replace(data, cache_dir=str(tmp_path / "cache32"))
    large = text.load_corpus(data)
    assert large.splits["train"].dtype == torch.uint32
    (folder,) = (tmp_path / "cache32" / "tokens").iterdir()
    assert (folder / "train.bin").stat().st_size == 4 * tokens
    assert torch.equal(large.splits["train"].long(), small.splits["train"].long())
    # each document's length, separator included, adds up to the separators' places
    starts = np.cumsum(shards.document_lengths(folder, "train")) - shards.document_lengths(
        folder, "train"
    )
    assert (
        starts.tolist() == (large.splits["train"] == large.separator).nonzero().flatten().tolist()
    )


def test_a_failed_write_leaves_nothing_a_later_load_reads(tmp_path, tokenizer_file, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", DOCS)
    data = config(tmp_path, tmp_path / "train.jsonl", tokenizer=tokenizer_file)
    write_split = shards._write_split

    def fails_on_valid(folder, split, *args):
        if split == "valid":
            raise KeyboardInterrupt  # a crash after train.bin was written
        return write_split(folder, split, *args)

    monkeypatch.setattr(shards, "_write_split", fails_on_valid)
    with pytest.raises(KeyboardInterrupt):
        text.load_corpus(data)
    assert cache_folders(tmp_path) == []
    monkeypatch.undo()
    corpus = text.load_corpus(data)
    assert corpus.splits["valid"].numel() > 0 and len(cache_folders(tmp_path)) == 1


def test_a_document_longer_than_the_cache_indexes_is_one_line(
    tmp_path, tokenizer_file, monkeypatch
):
    write_jsonl(tmp_path / "train.jsonl", ["alpha", *DOCS])
    monkeypatch.setattr(shards, "MAX_DOCUMENT_TOKENS", 4)
    with pytest.raises(ConfigError) as err:
        text.load_corpus(config(tmp_path, tmp_path / "train.jsonl", tokenizer=tokenizer_file))
    bpe = Tokenizer.from_file(str(tokenizer_file))
    sizes = [1 + len(bpe.encode(d, add_special_tokens=False).ids) for d in ["alpha", *DOCS]]
    first = next(i for i, n in enumerate(sizes) if n > 4)
    assert first > 0 and str(err.value) == (
        f"data.train_file: document {first} has {sizes[first]} tokens; the cache indexes at most "
        "4 per document"
    )


def mapped_from(tensor, name):
    """Whether the tensor's memory lies in a mapping of the file `name` (Linux: /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) >= 6 and fields[5].endswith(name) and start <= address < end:
            return True
    return False


def test_memory_mapped_split_cuts_into_streams(tmp_path, tokenizer_file):
    write_jsonl(tmp_path / "train.jsonl", DOCS * 4)
    tokens = text.load_corpus(
        config(tmp_path, tmp_path / "train.jsonl", tokenizer=tokenizer_file)
    ).splits["train"]
    if sys.platform == "linux":
        assert mapped_from(tokens, "train.bin")
    expected = torch.tensor(
        expected_ids(tokenizer_file, [d for i, d in enumerate(DOCS * 4) if (i + 1) % 20])
    )
    assert tokens.numel() == expected.numel()
    inputs, targets = batchify(tokens, 4)
    per_row = expected.numel() // 4
    streams = SegmentStreams(
        inputs, targets, torch.ones(1, 1, dtype=torch.bool).expand_as(inputs), 8
    )
    x, y, _mask = streams[3]
    assert x.dtype == torch.long
    assert torch.equal(x[2], expected[2 * per_row + 24 : 2 * per_row + 32])
    assert torch.equal(y[2], expected[2 * per_row + 25 : 2 * per_row + 33])


BODY = "ab c\nd\n\nb a\n\nc c a\n"


@pytest.mark.parametrize("tokenizer", ["char", "byte", "word"])
def test_in_memory_tokenizers_mark_documents_only_when_packed(tmp_path, tokenizer):
    (tmp_path / "train.txt").write_text(BODY)
    (tmp_path / "valid.txt").write_text("a b")
    sets = [f"data.tokenizer={tokenizer}", f"data.valid_file={tmp_path / 'valid.txt'}"]
    plain = text.load_corpus(config(tmp_path, tmp_path / "train.txt", *sets))
    packed = text.load_corpus(
        config(tmp_path, tmp_path / "train.txt", *sets, "data.documents=packed")
    )
    encode = {
        "char": lambda s: [plain.vocab.index(c) for c in s],
        "byte": lambda s: list(s.encode()),
        "word": lambda s: [
            plain.vocab.index(w) for line in s.splitlines() for w in [*line.split(), "<eos>"]
        ],
    }[tokenizer]
    assert plain.separator is None and plain.splits["train"].tolist() == encode(BODY)
    assert plain.split_bytes["train"] == len(BODY.encode())
    assert packed.vocab == [*plain.vocab, "<doc>"] and packed.separator == len(plain.vocab)
    documents = ["ab c\nd", "b a", "c c a\n"]
    sep = packed.separator
    assert packed.splits["train"].tolist() == [t for d in documents for t in [sep, *encode(d)]]
    assert packed.split_bytes["train"] == sum(len(d.encode()) for d in documents)
    # packed and packed_reset share the arrays: only the model reads them differently
    reset = text.load_corpus(
        config(tmp_path, tmp_path / "train.txt", *sets, "data.documents=packed_reset")
    )
    assert torch.equal(reset.splits["train"], packed.splits["train"])


def test_records_with_an_in_memory_tokenizer_join_on_the_delimiter(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", DOCS)
    corpus = text.load_corpus(config(tmp_path, tmp_path / "train.jsonl", "data.tokenizer=byte"))
    train = "\n\n".join(d for i, d in enumerate(DOCS) if (i + 1) % 20)
    valid = "\n\n".join(d for i, d in enumerate(DOCS) if (i + 1) % 20 == 0)
    assert corpus.separator is None
    assert bytes(corpus.splits["train"].tolist()).decode() == train
    assert bytes(corpus.splits["valid"].tolist()).decode() == valid
