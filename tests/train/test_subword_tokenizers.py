"""Subword tokenizers of text corpora (train/data/tokenizers.py), on tiny corpora the tests write.

Covers: the byte-level BPE (its vocabulary, lossless round trip, <|endoftext|> as id 0 opening every
document, the cached BPE reused instead of retrained), tokenizer_file with a Hugging Face
tokenizer.json and a SentencePiece .model (their own ids, checked against the libraries), and every
new one-line error of the data config and of a tokenizer file.
Run: pytest tests/train/test_subword_tokenizers.py
"""

import json
import shutil

import pytest
import sentencepiece
import torch
from tokenizers import Tokenizer

import relpos_ablate.train.data.text as text
import relpos_ablate.train.data.tokenizers as subword
from fixtures.tokenizers import write_reference_bpe
from relpos_ablate.config import ConfigError, DataConfig, load_run_config

WORDS = "the cat sat on a mat while seven quick foxes jumped over lazy dogs near rivers".split()
DOCUMENTS = [
    " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12 + i % 9)) + f" number {i}."
    for i in range(60)
]
DOCUMENTS[3] = "Grüße aus Köln: naïve café, 東京 and emoji 🙂 — dashes."
DOCUMENTS[5] = "a document quoting <|endoftext|> as plain text"
VALID = ["the dog sat on the café mat", "rivers near Köln"]
TRAIN = "\n\n".join(DOCUMENTS) + "\n"  # the last document keeps the file's final line break


@pytest.fixture
def corpus_dir(tmp_path):
    (tmp_path / "train.txt").write_text(TRAIN)
    (tmp_path / "valid.txt").write_text("\n\n".join(VALID))
    return tmp_path


def config(tmp_path, *sets):
    return load_run_config(
        None,
        [
            "data.source=text",
            f"data.train_file={tmp_path / 'train.txt'}",
            f"data.valid_file={tmp_path / 'valid.txt'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            *sets,
        ],
    ).data


def bpe_config(tmp_path, vocab_size=300, *sets):
    return config(tmp_path, "data.tokenizer=bpe", f"data.vocab_size={vocab_size}", *sets)


def trained_file(tmp_path):
    (path,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    return path


def documents_of(tokens, separator):
    """The id lists between separators, each document's separator removed."""
    cuts = (tokens == separator).nonzero().flatten().tolist() + [len(tokens)]
    assert cuts[0] == 0, "the first token must be a separator"
    return [tokens[a + 1 : b].tolist() for a, b in zip(cuts, cuts[1:])]


def test_bpe_vocabulary_round_trip_and_separator(corpus_dir):
    corpus = text.load_corpus(bpe_config(corpus_dir))
    # the corpus has enough merges to fill the vocabulary: exactly vocab_size tokens
    assert len(corpus.vocab) == 300 and corpus.vocab[0] == "<|endoftext|>"
    assert corpus.separator == 0 and corpus.splits["train"].dtype == torch.uint16
    bpe = Tokenizer.from_file(str(trained_file(corpus_dir)))
    assert bpe.get_vocab_size() == 300
    for sample in ("plain ascii, with punctuation!\n", "Grüße 東京 🙂 naïve\n\n\tend"):
        assert bpe.decode(bpe.encode(sample).ids) == sample
    # every document opens with id 0, and decodes back to itself (the quoted <|endoftext|> too)
    train = documents_of(corpus.splits["train"], 0)
    assert [bpe.decode(ids) for ids in train] == TRAIN.split("\n\n")
    assert [bpe.decode(ids) for ids in documents_of(corpus.splits["valid"], 0)] == VALID
    assert corpus.split_bytes["valid"] == sum(len(d.encode()) for d in VALID)
    assert corpus.tokenizer_hash == subword.file_hash(trained_file(corpus_dir))


def test_bits_per_byte_counts_every_token_over_the_documents_bytes(corpus_dir):
    corpus = text.load_corpus(bpe_config(corpus_dir))
    tokens, size = corpus.splits["valid"].numel(), sum(len(d.encode()) for d in VALID)
    assert corpus.bits_per_byte(1.5, "valid") == pytest.approx(
        1.5 / 0.6931471805599453 * tokens / size
    )


def test_trained_bpe_is_reused_and_retrained_for_another_vocabulary(corpus_dir, monkeypatch):
    text.load_corpus(bpe_config(corpus_dir))
    path = trained_file(corpus_dir)
    stamp = path.stat().st_mtime_ns
    shutil.rmtree(corpus_dir / "cache" / "tokens")  # the tokens go, the BPE stays

    def no_training(*args, **kwargs):
        raise AssertionError("the cached BPE should have been used")

    monkeypatch.setattr(subword, "train_bpe", no_training)
    again = text.load_corpus(bpe_config(corpus_dir))
    assert path.stat().st_mtime_ns == stamp and len(again.vocab) == 300
    monkeypatch.undo()
    text.load_corpus(bpe_config(corpus_dir, 280))
    assert len(list((corpus_dir / "cache" / "tokenizers").glob("*.json"))) == 2


def test_train_bytes_caps_what_the_bpe_learns_from(corpus_dir):
    text.load_corpus(bpe_config(corpus_dir, 400, "data.tokenizer_train_bytes=30"))
    bpe = Tokenizer.from_file(str(trained_file(corpus_dir)))
    # 30 bytes of the first document hold few pairs: far fewer merges than 400 - 257
    assert 257 < bpe.get_vocab_size() < 300


def test_tokenizer_file_json_gives_the_trained_bpes_ids(corpus_dir):
    trained = text.load_corpus(bpe_config(corpus_dir))
    shutil.copy(trained_file(corpus_dir), corpus_dir / "tokenizer.json")
    data = config(
        corpus_dir, "data.tokenizer=file", f"data.tokenizer_file={corpus_dir}/tokenizer.json"
    )
    loaded = text.load_corpus(data)
    assert loaded.vocab == trained.vocab and loaded.separator == 0
    for split in ("train", "valid"):
        assert torch.equal(loaded.splits[split], trained.splits[split])


def test_tokenizer_file_sentencepiece_gives_its_own_ids(corpus_dir):
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus_dir / "train.txt"),
        model_prefix=str(corpus_dir / "sp"),
        vocab_size=60,  # the most pieces this text gives differs between sentencepiece releases
        hard_vocab_limit=False,
        minloglevel=2,
    )
    model = sentencepiece.SentencePieceProcessor(model_file=str(corpus_dir / "sp.model"))
    data = config(corpus_dir, "data.tokenizer=file", f"data.tokenizer_file={corpus_dir}/sp.model")
    corpus = text.load_corpus(data)
    eos = model.eos_id()
    assert corpus.separator == eos and len(corpus.vocab) == model.get_piece_size()
    expected = [t for doc in VALID for t in [eos, *model.encode(doc)]]
    assert corpus.splits["valid"].tolist() == expected


def write_bpe_without_eos(path):
    write_reference_bpe(path, DOCUMENTS, 270, "<pad>")


def write_sentencepiece_without_eos(path):
    source = path.parent / "sp_source.txt"
    source.write_text("\n".join(DOCUMENTS))
    prefix = str(path).removesuffix(".model")
    sentencepiece.SentencePieceTrainer.train(
        input=str(source),
        model_prefix=prefix,
        vocab_size=60,
        hard_vocab_limit=False,
        eos_id=-1,
        minloglevel=2,
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (None, r"^data\.tokenizer_file: file not found: "),
        (lambda p: p.write_text("neither json nor a model"), r"is neither a Hugging Face tok"),
        (lambda p: p.write_text(json.dumps({"version": "1.0"})), r"is neither a Hugging Face tok"),
        (write_bpe_without_eos, r"has no end-of-text token \(looked for <\|endoftext\|>, </s>, "),
        (write_sentencepiece_without_eos, r"has no end-of-text token \(looked for the model's eos"),
    ],
    ids=["missing", "text", "json", "json_without_eos", "sentencepiece_without_eos"],
)
def test_bad_tokenizer_file_is_one_line(corpus_dir, make, message):
    path = corpus_dir / "tok.model"
    if make is not None:
        make(path)
    data = config(corpus_dir, "data.tokenizer=file", f"data.tokenizer_file={path}")
    with pytest.raises(ConfigError, match=message) as err:
        text.load_corpus(data)
    assert str(err.value).startswith("data.tokenizer_file: ") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["data.tokenizer=bpe", "data.vocab_size=200"],
            "data.vocab_size: 200 is too small for "
            "the byte alphabet: 256 bytes + 1 end-of-text token; use >= 257",
        ),
        (["data.tokenizer=bpe"], "data.vocab_size: 0 is too small for the byte alphabet"),
        (["data.vocab_size=300"], "data.vocab_size: is read only with tokenizer='bpe'"),
        (
            ["data.tokenizer_train_bytes=100"],
            "data.tokenizer_train_bytes: is read only with tokenizer='bpe'",
        ),
        (
            ["data.tokenizer=bpe", "data.vocab_size=300", "data.tokenizer_train_bytes=-1"],
            "data.tokenizer_train_bytes: -1 is out of range",
        ),
        (
            ["data.tokenizer=file"],
            "data.tokenizer_file: tokenizer 'file' needs a local "
            "tokenizer.json or SentencePiece .model",
        ),
        (
            ["data.tokenizer_file=tok.json"],
            "data.tokenizer_file: is read only with tokenizer='file' (tokenizer is 'char')",
        ),
        (
            ["data.documents=stacked"],
            "data.documents: 'stacked' is not allowed; choose one of "
            "concatenate, packed, packed_reset",
        ),
        (
            ["data.source=synthetic", "data.train_file=''", "data.documents=packed"],
            "data.documents: 'packed' packs the documents of a text corpus: needs source='text'",
        ),
        (
            ["data.tokenizer=sentencepiece"],
            "data.tokenizer: 'sentencepiece' is not allowed; "
            "choose one of char, byte, word, bpe, file",
        ),
    ],
)
def test_config_errors_are_one_line(tmp_path, sets, message):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["data.source=text", "data.train_file=x.txt", *sets])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_empty_document_delimiter_is_one_line():
    with pytest.raises(ConfigError) as err:
        DataConfig(source="text", train_file="x.txt", document_delimiter="")
    assert str(err.value) == ("document_delimiter: is empty; give the string between two documents")
