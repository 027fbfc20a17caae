"""The LightningDataModule of a run over contiguous streams (synthetic task or text corpus); example
tasks extend it (example_module.py). `relpos_ablate.train.data.build_datamodule` picks one."""

from __future__ import annotations

import functools

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from relpos_ablate.config import ConfigError, EvalSetting, RunConfig
from relpos_ablate.config.base import raise_all
from relpos_ablate.train.data import synthetic, text
from relpos_ablate.train.data.protocols import eval_loader, target_counts
from relpos_ablate.train.data.streams import (
    ResumeSampler,
    SegmentStreams,
    TrainingSegments,
    batchify,
    shard_rows,
)


class SegmentDataModule(L.LightningDataModule):
    """Training streams (train.batch_size rows) and one evaluation loader per eval setting
    (eval.batch_size rows).

    Training is one pass of train.max_steps steps; step i trains segment i mod train_segments of the
    streams, so the streams restart (and memory is reset) every train_segments steps. Resuming
    starts at the restored global step. Under data parallelism each process loads its own share of
    the streams (streams.py), for training and evaluation alike.
    """

    def __init__(self, config: RunConfig):
        super().__init__()
        self.config = config
        self._tasks: dict[str, synthetic.TaskStreams] = {}

    def prepare_data(self) -> None:
        if self.config.data.source == "text":
            self._corpus  # noqa: B018 - downloads and tokenizes once; later runs hit the cache

    @functools.cached_property
    def _corpus(self) -> text.Corpus:
        return text.load_corpus(self.config.data)

    def _task(self, split: str) -> synthetic.TaskStreams:
        if split not in self._tasks:
            data = self.config.data
            length = data.train_tokens if split == "train" else data.eval_tokens
            self._tasks[split] = synthetic.generate(
                data, self.config.seed, split, self._rows(split), length
            )
        return self._tasks[split]

    def _rows(self, split: str) -> int:
        return self.config.train.batch_size if split == "train" else self.config.eval.batch_size

    @property
    def vocab_size(self) -> int:
        if self.config.data.source == "synthetic":
            return synthetic.vocab_size(self.config.data)
        return len(self._corpus.vocab)

    @property
    def separator(self) -> int | None:
        """The token that opens every document of a text corpus (None: no document boundaries, or
        a synthetic task)."""
        return self._corpus.separator if self.config.data.source == "text" else None

    def bits_per_byte(self, loss: float | None, split: str) -> float | None:
        """A text split's loss (nats per token) in bits per UTF-8 byte of its text (comparable
        across tokenizers: text.Corpus.bits_per_byte); None for synthetic data or no loss."""
        corpus = self._corpus if self.config.data.source == "text" else None
        if corpus is None or loss is None or not corpus.split_bytes.get(split):
            return None
        return corpus.bits_per_byte(loss, split)

    def target_counts(self, split: str, rows: int) -> Tensor:
        """How often each id occurs among the targets of a text split cut into `rows` streams, from
        the corpus's counts (a memory-mapped split is not read through its map)."""
        tokens = self._corpus.splits[split]
        return target_counts(tokens, rows, self._corpus.unigram_counts(split))

    def tokenizer_record(self) -> dict | None:
        """What eval.json records of a text run's tokens: the tokenizer, its vocabulary size and
        hash, how documents meet and the separator id (None for synthetic data)."""
        if self.config.data.source != "text":
            return None
        data, corpus = self.config.data, self._corpus
        return {
            "tokenizer": data.tokenizer,
            "file": data.tokenizer_file or None,
            "vocab_size": len(corpus.vocab),
            "hash": corpus.tokenizer_hash,
            "documents": data.documents,
            "separator": corpus.separator,
            "tokens": {split: int(t.numel()) for split, t in corpus.splits.items()},
            "bytes": dict(corpus.split_bytes),
        }

    @property
    def vocab(self) -> list[str] | None:
        """Token strings for text corpora (None for synthetic tasks, whose tokens are plain
        symbols)."""
        return self._corpus.vocab if self.config.data.source == "text" else None

    def streams(self, split: str, segment_len: int) -> SegmentStreams:
        """The 'train' or 'eval' streams cut into segments of `segment_len`. For text, 'eval' is
        eval.split's streams, and 'valid' or 'test' names a split (a setting's own: eval_split); a
        synthetic task has one evaluation stream, 'eval'."""
        if self.config.data.source == "synthetic":
            return self._task(split).segments(segment_len)
        name = self.config.eval.split if split == "eval" else split
        field = "train.batch_size" if split == "train" else "eval.batch_size"
        tokens = self._corpus.splits.get(name)
        if tokens is None or tokens.numel() < self._rows(split) * (segment_len + 1):
            size = 0 if tokens is None else tokens.numel()
            raise ConfigError(
                field,
                f"the {name} split has {size} tokens, too few for {self._rows(split)} "
                f"streams of segment length {segment_len}",
            )
        inputs, targets = batchify(tokens, self._rows(split))
        return SegmentStreams(
            inputs, targets, torch.ones(1, 1, dtype=torch.bool).expand_as(inputs), segment_len
        )

    def eval_split(self, setting: EvalSetting) -> str:
        """The streams `setting` scores (a name for `streams`): its text split, else eval.split's;
        'eval' for a synthetic task's one evaluation stream."""
        if self.config.data.source != "text":
            return "eval"
        return setting.split_of(self.config.eval.split)

    def check_evaluation(self) -> None:
        """Every evaluation setting fits its text split, checked once the data is prepared: a split
        missing or too short would otherwise fail the run after all its training steps. One line per
        setting that does not fit. (Synthetic streams: RunConfig checks data.eval_tokens.)"""
        if self.config.data.source != "text":
            return
        rows, problems = self._rows("eval"), []
        settings = self.config.eval_settings()
        for name in dict.fromkeys(
            [self.config.eval.split, *(self.eval_split(s) for s in settings)]
        ):
            tokens = self._corpus.splits.get(name)
            if tokens is None:  # e.g. a hub corpus published without a test split
                missing = (
                    f"{name!r}: this corpus has no {name} split (it has "
                    f"{', '.join(self._corpus.splits)})"
                )
                fields = (
                    [
                        self.config.eval_setting_field(i, "split")
                        for i, s in enumerate(settings)
                        if s.split == name
                    ]
                    if name != self.config.eval.split
                    else ["eval.split"]
                )
                problems += [ConfigError(field, missing) for field in fields]
                continue
            size = tokens.numel()
            # per stream: batchify's rows, each stream's first token not a target
            targets = size // rows - 1
            if targets < 1:
                raise ConfigError(
                    "eval.batch_size",
                    f"the {name} split has {size} tokens, too few for {rows} "
                    f"streams of at least one target; use at most {max(1, size // 2)} streams",
                )
            problems += [
                ConfigError(
                    self.config.eval_setting_field(i),
                    f"{s.segment_len} does not fit the {name} split: its {size} tokens cut into "
                    f"eval.batch_size={rows} streams leave {targets} targets per stream; use "
                    f"segment_len <= {targets} (or fewer streams)",
                )
                for i, s in enumerate(settings)
                if self.eval_split(s) == name and s.segment_len > targets
            ]
        raise_all(problems)

    @property
    def train_segments(self) -> int:
        """Segments per training stream: the memory is reset every this many steps."""
        return len(self.streams("train", self.config.train.segment_len))

    def _process(self) -> tuple[int, int]:
        """(rank, world size) of this process in the run; (0, 1) outside a Trainer."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        t = self.config.train
        rank, world = self._process()
        segments = TrainingSegments(
            self.streams("train", t.segment_len), t.max_steps, t.loss_on, rank, world, t.accumulate
        )
        sampler = ResumeSampler(len(segments), start=self._resume_position)
        return DataLoader(segments, sampler=sampler, batch_size=None)

    def _resume_position(self) -> int:
        """The first micro-batch to train: the restored global step's first."""
        step = self.trainer.global_step if self.trainer is not None else 0
        return step * self.config.train.accumulate

    def val_dataloader(self) -> list[DataLoader]:
        """Validation during training (train.val_every > 0): the first evaluation setting; else
        none."""
        if not self.config.train.val_every:
            return []
        return [self.eval_dataloader(self.config.eval_settings()[0])]

    def eval_dataloader(self, setting: EvalSetting) -> DataLoader:
        """`setting`'s protocol (train/data/protocols.py) over this process's share of its split's
        streams; shares may differ by one stream (the metrics add token sums across processes, so
        the result is exact)."""
        rank, world = self._process()
        streams = self.streams(self.eval_split(setting), setting.segment_len)
        return eval_loader(
            streams,
            setting,
            self.config.eval.sliding_batch_tokens,
            shard_rows(streams.rows, rank, world),
        )
