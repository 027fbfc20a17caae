"""A memory-mapped corpus is read by window: the training streams of every process, their row groups
and the evaluation layout are views of the mapped token file (no copy of the corpus is made), and a
segment converts only its own window to long."""

import numpy as np
import torch

from relpos_ablate.config import DataConfig
from relpos_ablate.train.data.protocols import target_counts, unigram_loss, unigram_loss_of_counts
from relpos_ablate.train.data.streams import SegmentStreams, TrainingSegments, batchify
from relpos_ablate.train.data.text import load_corpus


def _corpus(tmp_path):
    text = "\n\n".join(
        f"Speech {k}: now is the winter of our discontent, {k * 7}." for k in range(400)
    )
    path = tmp_path / "train.txt"
    path.write_text(text)
    data = DataConfig(
        source="text",
        train_file=str(path),
        tokenizer="bpe",
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )
    return load_corpus(data)


def test_every_process_reads_views_of_the_mapped_file(tmp_path):
    tokens = _corpus(tmp_path).splits["train"]
    assert isinstance(tokens.numpy(), np.memmap) or tokens.numpy().base is not None
    storage = tokens.untyped_storage().data_ptr()
    inputs, targets = batchify(tokens, 4)
    streams = SegmentStreams(
        inputs, targets, torch.ones(1, 1, dtype=torch.bool).expand_as(inputs), 8
    )
    for rank in (0, 1):
        segments = TrainingSegments(
            streams, steps=3, loss_on="full", rank=rank, world=2, accumulate=2
        )
        for group in segments.groups:
            assert group.inputs.untyped_storage().data_ptr() == storage
        batch = segments[1]
        assert batch.inputs.dtype == torch.long and batch.inputs.shape == (1, 8)
        row = 2 * rank + 1  # this process's second row group: its one stream
        per_row = tokens.numel() // 4
        expected = tokens[row * per_row : row * per_row + 8].long()
        assert torch.equal(batch.inputs[0], expected)


def test_the_unigram_reference_of_a_mapped_split_comes_from_counts_read_off_its_file(
    tmp_path, monkeypatch
):
    """The split's counts are read from its file a chunk at a time (not through the map) and kept
    beside it; the targets' counts (the split less each stream's first token and the tail) give the
    reference numpy gives over the targets themselves."""
    from relpos_ablate.train.data import shards

    corpus = _corpus(tmp_path)
    tokens = corpus.splits["train"]
    monkeypatch.setattr(shards, "COUNT_CHUNK", 97)
    whole = corpus.unigram_counts("train")
    every = np.bincount(tokens.numpy().astype(np.int64), minlength=300)
    assert np.array_equal(whole.numpy(), every)
    assert (corpus.folder / "train.counts.npy").exists()
    _, targets = batchify(tokens, 3)
    held = tokens[-200:]
    got = unigram_loss_of_counts(
        target_counts(tokens, 3, whole), torch.bincount(held.long(), minlength=300)
    )
    counts = np.bincount(targets.numpy().astype(np.int64).ravel(), minlength=300) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    assert np.isclose(got, -log_p[held.numpy().astype(np.int64)].mean(), rtol=1e-12)
    assert np.isclose(got, unigram_loss(targets, held[None], 300), rtol=1e-12)
