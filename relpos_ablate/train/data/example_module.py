"""The data of an example task (examples.py) for training and evaluation.

Training reuses the segment layout of streams.py: each of the train.batch_size rows holds whole
examples one after another, each padded to train.segment_len, so one training segment is a batch of
examples (the model has no memory: mem_len is 0 for example tasks). The training examples are
grouped into batches of about one length (batch order shuffled) and each batch is cut after its
longest example: padding then costs little, without packing several examples into a row (which
would need per-row positions and a block-diagonal mask). Evaluation goes bin by bin of
data.test_lengths (and depth by depth for the depth tasks: data.DEPTH_TASKS): `test_sets`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from relpos_ablate.config import ConfigError
from relpos_ablate.train.data import examples
from relpos_ablate.train.data.datamodule import SegmentDataModule
from relpos_ablate.train.data.streams import SegmentStreams


@dataclass(frozen=True)
class TestSet:
    """The examples of one evaluation: a test-length bin (and a depth of a depth task)."""

    fields: dict[str, Any]
    """What identifies it in eval.json: length_min, length_max (and depth)."""
    examples: examples.Examples


class ExampleDataModule(SegmentDataModule):
    """Example tasks: training segments are batches of whole examples; evaluation by `test_sets`."""

    @property
    def vocab_size(self) -> int:
        return examples.vocab_size(self.config.data)

    @functools.cached_property
    def _train_examples(self) -> examples.Examples:
        data = self.config.data
        found = examples.generate(
            data, self.config.seed, "train", data.train_examples, data.train_lengths
        )
        return examples.by_length(found, self._rows("train"), self.config.seed)

    def streams(self, split: str, segment_len: int) -> SegmentStreams:
        """Training examples (batches of about one length), or (any other split) evaluation examples
        at the longest task length whose input fits `segment_len`, as rows of segments of
        `segment_len` tokens, each segment cut after its longest example."""
        rows = self._rows(split)
        found = self._train_examples if split == "train" else self._fitting(segment_len, count=rows)
        return examples.TrimmedSegments(*examples.as_streams(found, rows, segment_len), segment_len)

    def _fitting(self, segment_len: int, count: int) -> examples.Examples:
        data = self.config.data
        fits = [
            n for n in range(1, data.train_lengths[1] + 1) if data.input_length(n) <= segment_len
        ]
        if not fits:
            raise ConfigError(
                "eval.settings",
                f"segment_len {segment_len} is shorter than the shortest {data.task} "
                f"example ({data.input_length(1)} tokens)",
            )
        # test sets use (lo, hi[, depth])
        return examples.generate(
            data,
            self.config.seed,
            "eval",
            max(count, data.eval_examples),
            (fits[-1], fits[-1]),
            stream=(0,),
        )

    def test_sets(self, wanted: list[dict[str, Any]] | None = None) -> list[TestSet]:
        """One set per test-length bin (per bin and depth for depth tasks), data.eval_examples each;
        `wanted`: only these (test_set_fields entries). A set's examples depend on its bin and depth
        alone, not on the other bins listed, so a bin evaluated later (`relpos-ablate evaluate`)
        gets the same examples."""
        data = self.config.data
        sets = []
        for fields in test_set_fields(data) if wanted is None else wanted:
            depth = fields.get("depth")
            stream = (
                fields["length_min"],
                fields["length_max"],
                *(() if depth is None else (round(depth * 1e6),)),
            )
            found = examples.generate(
                data,
                self.config.seed,
                "eval",
                data.eval_examples,
                (fields["length_min"], fields["length_max"]),
                depth,
                stream=stream,
            )
            sets.append(TestSet(fields, found))
        return sets


def test_set_fields(data) -> list[dict[str, Any]]:
    """What identifies each test set in eval.json, in evaluation order: length_min, length_max (and
    depth for depth tasks), one per bin of data.test_lengths (and depth of data.passkey_depths)."""
    depths = data.passkey_depths if data.depth_task else (None,)
    return [
        {"length_min": lo, "length_max": hi, **({} if depth is None else {"depth": depth})}
        for lo, hi in data.test_lengths
        for depth in depths
    ]
