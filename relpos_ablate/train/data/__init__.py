"""Data for one run: a LightningDataModule over contiguous streams (synthetic task or text corpus:
datamodule.py), or over whole examples (example tasks: example_module.py).

`build_datamodule(config)` is the entry point; `sample_inputs` gives the analysis layer a fixed
input.
"""

from __future__ import annotations

from torch import Tensor

from relpos_ablate.config import RunConfig
from relpos_ablate.train.data.datamodule import SegmentDataModule
from relpos_ablate.train.data.example_module import ExampleDataModule
from relpos_ablate.train.data.streams import Batch, SegmentStreams, TrainBatch


def build_datamodule(config: RunConfig) -> SegmentDataModule:
    """The data of a run: contiguous streams, or whole examples for example tasks
    (example_module.py)."""
    if config.data.example_task:
        return ExampleDataModule(config)
    return SegmentDataModule(config)


def sample_inputs(config: RunConfig, segment_len: int, batch_size: int = 1) -> Tensor:
    """The first evaluation segment of the first `batch_size` streams, [batch_size, segment_len]
    long."""
    if batch_size > config.eval.batch_size:
        raise ValueError(
            f"batch_size {batch_size} > eval.batch_size {config.eval.batch_size} (the eval streams)"
        )
    inputs, _targets, _mask = build_datamodule(config).streams("eval", segment_len)[0]
    return inputs[:batch_size]


__all__ = [
    "Batch",
    "SegmentDataModule",
    "SegmentStreams",
    "TrainBatch",
    "build_datamodule",
    "sample_inputs",
]
