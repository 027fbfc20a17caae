"""data.documents through training and evaluation: the ids the LM gets (a new document at every
separator, the memory's last one going on), a run on a subword corpus with packed_reset that records
bits per byte and the tokenizer in eval.json, and the one-line refusals."""

import json
import math

import pytest
import torch

from relpos_ablate.config import ConfigError, RunConfig
from relpos_ablate.config.base import from_dict
from relpos_ablate.train.module import LitLM, remembered
from relpos_ablate.train.run import resolve_vocab, train_run

TEXT = "".join(
    f"First Citizen:\nWe are accounted poor citizens, number {k}.\n\n"
    f"Second Citizen:\nWould you proceed especially against Caius Marcius {k}?\n\n"
    for k in range(120)
)


def _config(tmp_path, documents="packed_reset", attention=None, mem_len=8) -> RunConfig:
    train = tmp_path / "train.txt"
    train.write_text(TEXT)
    return from_dict(
        RunConfig,
        {
            "model": {
                "n_layers": 1, "d_model": 16, "n_heads": 2, "d_head": 8, "d_inner": 32,
                "mem_len": mem_len, "attention": attention or {"terms": "a", "absolute": "rope"},
            },
            "data": {
                "source": "text", "train_file": str(train), "tokenizer": "bpe", "vocab_size": 300,
                "documents": documents, "cache_dir": str(tmp_path / "cache"),
            },
            "train": {"segment_len": 16, "batch_size": 2, "max_steps": 3, "log_every": 1,
                      "checkpoint_every": 3},
            "eval": {"batch_size": 2, "settings": [{"segment_len": 16},
                     {"segment_len": 32, "protocol": "sliding", "stride": 16}]},
        }
    )  # fmt: skip


def test_document_ids_open_at_every_separator_and_carry_the_memory(tmp_path):
    module = LitLM(resolve_vocab(_config(tmp_path), 300))
    module.separator = 0
    first = module.documents(torch.tensor([[5, 0, 6, 7], [0, 8, 0, 9]]), None)
    assert first.tolist() == [[0, 1, 1, 1], [1, 1, 2, 2]]
    memory = remembered(first, [torch.zeros(2, 3, 16)])
    assert memory.tolist() == [[1, 1, 1], [1, 2, 2]]
    second = module.documents(torch.tensor([[4, 4, 0, 4], [4, 0, 4, 4]]), memory)
    assert second.tolist() == [[1, 1, 1, 1, 1, 2, 2], [1, 2, 2, 2, 3, 3, 3]]


@pytest.mark.slow
def test_a_packed_reset_run_records_bits_per_byte_and_its_tokenizer(tmp_path):
    config = _config(tmp_path)
    assert train_run(config, tmp_path / "run") == "done"
    record = json.loads((tmp_path / "run" / "eval.json").read_text())
    tokenizer = record["tokenizer"]
    assert tokenizer["tokenizer"] == "bpe" and tokenizer["documents"] == "packed_reset"
    assert tokenizer["separator"] == 0 and len(tokenizer["hash"]) == 16
    for setting in record["settings"]:
        metrics = setting["metrics"]
        split = setting["split"]
        expected = (
            metrics["loss"] / math.log(2) * tokenizer["tokens"][split] / tokenizer["bytes"][split]
        )
        assert metrics["bpb"] == pytest.approx(expected, rel=1e-12)


def test_packed_reset_refuses_what_cannot_honour_it_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, attention={"terms": "a", "bias": "fire"})
    assert err.value.field == "data.documents" and "\n" not in str(err.value)
    assert "fire" in str(err.value)
    with pytest.raises(ConfigError, match="chunked attention"):
        _config(tmp_path, attention={"terms": "a", "chunk": 8})
    _config(tmp_path, documents="packed", attention={"terms": "a", "bias": "fire"})  # fine


def test_packed_rows_keep_no_memory_from_one_segment_to_the_next(tmp_path):
    """data.documents packed: each training segment an independent row, so a segment repeated
    gives the same loss; concatenate carries memory into the repeat, which changes it."""
    for documents, same in (("packed", True), ("concatenate", False)):
        module = LitLM(resolve_vocab(_config(tmp_path, documents=documents), 300)).eval()
        inputs = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(inputs, dtype=torch.bool)
        first, _ = module.segment_loss(inputs, inputs, mask, restart=False)
        again, _ = module.segment_loss(inputs, inputs, mask, restart=False)
        assert torch.equal(first, again) == same, documents
