"""Text data through `datasets` with local files the tests write (no network).

Covers: char / byte / word tokenizers against hand computations, the valid holdout, the token cache
(hit, and invalidated by a changed file), named-corpus handling with a stubbed hub (split mapping,
enwik8-style holdout, the one-line offline error), and contiguous text streams.
Run: pytest tests/train/test_data_text.py
"""

import os

import pytest
import torch

import relpos_ablate.train.data.text as text
from relpos_ablate.config import ConfigError, load_run_config
from relpos_ablate.train.data import build_datamodule

TRAIN = "the cat sat\non the mat\nthe end\n"
VALID = "the dog sat\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "train.txt").write_text(TRAIN)
    (tmp_path / "valid.txt").write_text(VALID)
    return tmp_path


def text_config(tmp_path, *overrides, valid=True):
    sets = [
        "data.source=text",
        f"data.train_file={tmp_path / 'train.txt'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    if valid:
        sets.append(f"data.valid_file={tmp_path / 'valid.txt'}")
    return load_run_config(None, sets + list(overrides)).data


def decode(corpus, split):
    return "".join(corpus.vocab[i] for i in corpus.splits[split].tolist())


def test_char_tokens_round_trip_and_unknown_characters_map_to_unk(files):
    corpus = text.load_corpus(text_config(files, "data.tokenizer=char"))
    assert corpus.vocab == ["<unk>"] + sorted(set(TRAIN))
    assert decode(corpus, "train") == TRAIN
    # 'g' never occurs in train -> <unk> (id 0); the rest decodes back
    expected = [0 if c == "g" else corpus.vocab.index(c) for c in VALID]
    assert corpus.splits["valid"].tolist() == expected


def test_byte_tokens_are_utf8_bytes(files):
    (files / "train.txt").write_text("héllo\n")
    corpus = text.load_corpus(text_config(files, "data.tokenizer=byte"))
    assert corpus.splits["train"].tolist() == list("héllo\n".encode())
    assert len(corpus.vocab) == 256


def test_word_tokens_close_lines_with_eos_and_drop_rare_words(files):
    corpus = text.load_corpus(text_config(files, "data.tokenizer=word", "data.min_freq=2"))
    # counts in train: the 3, sat 1, cat 1, on 1, mat 1, end 1; <eos> 3 -> only "the" is kept
    assert corpus.vocab == ["<unk>", "<eos>", "the"]
    words = [corpus.vocab[i] for i in corpus.splits["train"].tolist()]
    assert words == [
        "the",
        "<unk>",
        "<unk>",
        "<eos>",
        "<unk>",
        "the",
        "<unk>",
        "<eos>",
        "the",
        "<unk>",
        "<eos>",
    ]
    assert [corpus.vocab[i] for i in corpus.splits["valid"].tolist()] == [
        "the",
        "<unk>",
        "<unk>",
        "<eos>",
    ]


def test_without_valid_file_the_last_5_percent_is_held_out(files):
    body = "".join(f"line {i}\n" for i in range(200))
    (files / "train.txt").write_text(body)
    corpus = text.load_corpus(text_config(files, "data.tokenizer=byte", valid=False))
    cut = int(len(body) * 0.95)
    assert bytes(corpus.splits["train"].tolist()).decode() == body[:cut]
    assert bytes(corpus.splits["valid"].tolist()).decode() == body[cut:]


def test_tokens_are_cached_and_a_changed_file_is_retokenized(files, monkeypatch):
    data = text_config(files, "data.tokenizer=char")
    first = text.load_corpus(data)
    assert len(list((files / "cache" / "tokens").glob("*.pt"))) == 1

    def no_reading(_data):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(text, "read_splits", no_reading)
    cached = text.load_corpus(data)
    assert cached.vocab == first.vocab and torch.equal(
        cached.splits["train"], first.splits["train"]
    )
    monkeypatch.undo()

    (files / "train.txt").write_text(TRAIN + "zebra\n")
    os.utime(files / "train.txt", ns=(1, 1))
    assert text.cache_key(data) != text.cache_key(text_config(files, "data.tokenizer=byte"))
    assert "z" in text.load_corpus(data).vocab


class FakeHub:
    """Stands in for datasets.load_dataset: records the call, returns {split: {"text": records}}."""

    def __init__(self, splits):
        self.splits, self.calls = splits, []

    def __call__(self, path, name=None, **kwargs):
        self.calls.append((path, name))
        return {split: {"text": records} for split, records in self.splits.items()}


def test_named_corpus_maps_to_its_hub_id_and_splits(tmp_path, monkeypatch):
    hub = FakeHub({"train": ["a b\n", "c\n"], "validation": ["a\n"], "test": ["b\n"]})
    monkeypatch.setattr("datasets.load_dataset", hub)
    data = load_run_config(
        None,
        [
            "data.source=text",
            "data.corpus=wikitext-2",
            "data.tokenizer=word",
            f"data.cache_dir={tmp_path}",
        ],
    ).data
    corpus = text.load_corpus(data)
    assert hub.calls == [("Salesforce/wikitext", "wikitext-2-raw-v1")]
    assert sorted(corpus.splits) == ["test", "train", "valid"]
    assert [corpus.vocab[i] for i in corpus.splits["test"].tolist()] == ["b", "<eos>"]


def test_single_split_corpus_holds_out_valid_and_test(tmp_path, monkeypatch):
    monkeypatch.setattr("datasets.load_dataset", FakeHub({"train": ["abcdefghij", "klmnopqrst"]}))
    monkeypatch.setitem(text.CORPORA, "enwik8", text.HubCorpus("x/enwik8", joiner="\n", holdout=3))
    data = load_run_config(
        None,
        [
            "data.source=text",
            "data.corpus=enwik8",
            "data.tokenizer=byte",
            f"data.cache_dir={tmp_path}",
        ],
    ).data
    splits = {k: bytes(v.tolist()).decode() for k, v in text.load_corpus(data).splits.items()}
    assert splits == {"train": "abcdefghij\nklmn", "valid": "opq", "test": "rst"}


def test_offline_corpus_is_a_one_line_error_pointing_at_local_files(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub\n(long details)")

    monkeypatch.setattr("datasets.load_dataset", offline)
    data = load_run_config(
        None, ["data.source=text", "data.corpus=wikitext-103", f"data.cache_dir={tmp_path}"]
    ).data
    with pytest.raises(ConfigError) as err:
        text.load_corpus(data)
    message = str(err.value)
    assert (
        message.startswith("data.corpus:") and "\n" not in message and "data.train_file" in message
    )


def test_missing_local_file_names_the_field(tmp_path):
    data = load_run_config(
        None,
        [
            "data.source=text",
            f"data.train_file={tmp_path / 'nope.txt'}",
            f"data.cache_dir={tmp_path}",
        ],
    ).data
    with pytest.raises(ConfigError, match=r"^data\.train_file: file not found"):
        text.load_corpus(data)


def test_text_datamodule_rows_are_contiguous_slices_of_the_split(files):
    (files / "train.txt").write_text("".join(f"{i:03d}\n" for i in range(300)))
    cfg = load_run_config(
        None,
        [
            "data.source=text",
            f"data.train_file={files / 'train.txt'}",
            f"data.cache_dir={files / 'cache'}",
            "data.tokenizer=byte",
            "train.batch_size=4",
            "train.segment_len=10",
        ],
    )
    dm = build_datamodule(cfg)
    tokens = dm._corpus.splits["train"]
    per_row = tokens.numel() // 4
    streams = dm.streams("train", 10)
    assert len(streams) == (per_row - 1) // 10
    inputs, targets, mask = streams[2]
    assert torch.equal(inputs[3], tokens[3 * per_row + 20 : 3 * per_row + 30].long())
    assert torch.equal(targets[3], tokens[3 * per_row + 21 : 3 * per_row + 31].long())
    assert mask.all() and dm.vocab_size == 256


def test_too_short_split_names_the_batch_size(files):
    cfg = load_run_config(
        None,
        [
            "data.source=text",
            f"data.train_file={files / 'train.txt'}",
            f"data.valid_file={files / 'valid.txt'}",
            f"data.cache_dir={files / 'cache'}",
            "eval.batch_size=8",
            "train.segment_len=4",
        ],
    )
    with pytest.raises(ConfigError, match=r"^eval\.batch_size: the valid split has 12 tokens"):
        build_datamodule(cfg).streams("eval", 4)


def test_shipped_tinyshakespeare_loads_offline_with_its_fixed_split(tmp_path):
    """The corpus inside the package: three xz files that concatenate back to char-rnn's input.txt
    (its published sha256), read through the `datasets` text builder with no network."""
    import hashlib

    data = load_run_config(
        None,
        ["data.source=text", "data.corpus=tinyshakespeare", f"data.cache_dir={tmp_path / 'cache'}"],
    ).data
    splits = text.read_splits(data)
    assert {k: len(v) for k, v in splits.items()} == {
        "train": 1_003_857,
        "valid": 55_825,
        "test": 55_712,
    }
    whole = "".join(splits[k] for k in ("train", "valid", "test"))
    assert (
        hashlib.sha256(whole.encode()).hexdigest()
        == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    assert splits["valid"].startswith("GREMIO:\n") and splits["test"].startswith("BAPTISTA:\n")
    corpus = text.load_corpus(data)
    assert len(corpus.vocab) == 66  # <unk> + the 65 characters of the train split
    assert decode(corpus, "test") == splits["test"]
