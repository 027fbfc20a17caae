"""Data config: synthetic tasks generated on the fly, or real text through `datasets`."""

from __future__ import annotations

from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, check_range

SOURCES = ("synthetic", "text")
TASKS = ("offset_copy", "recall", "repeat")
TOKENIZERS = ("char", "byte", "word")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from."""

    source: str = "synthetic"
    """'synthetic' (a task generated from the seed, no download) or 'text' (a corpus via datasets)."""
    task: str = "offset_copy"
    """synthetic: offset_copy (emit the token `offset` back) | recall (key-value lookup by content) |
    repeat (a block repeated `period` tokens later, beyond the segment: needs memory)."""
    num_symbols: int = 16
    """synthetic: size of the random symbol alphabet."""
    offset: int = 8
    """offset_copy: how many tokens back the target is."""
    period: int = 96
    """repeat: distance between a block and its repetition."""
    train_tokens: int = 65536
    """synthetic: tokens per batch row in the training stream (one epoch)."""
    eval_tokens: int = 4096
    """Tokens per batch row evaluated at every evaluation setting."""
    corpus: str = ""
    """text: a named corpus (wikitext-2, wikitext-103, enwik8, text8) downloaded by `datasets`."""
    train_file: str = ""
    """text: a local training file (used instead of `corpus`)."""
    valid_file: str = ""
    """text: a local validation file (default: the last 5% of train_file)."""
    test_file: str = ""
    """text: a local test file (optional)."""
    tokenizer: str = "char"
    """text: char | byte | word (vocabulary from the training split)."""
    min_freq: int = 1
    """word: words seen fewer times in training become <unk>."""
    cache_dir: str = ""
    """Where tokenized arrays and downloads are cached (default: ~/.cache/relpos_ablate)."""

    def __post_init__(self):
        check_choice("source", self.source, SOURCES)
        check_choice("task", self.task, TASKS)
        check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        for name in ("num_symbols", "offset", "period", "train_tokens", "eval_tokens", "min_freq"):
            check_range(name, getattr(self, name), low=1)
        check_range("num_symbols", self.num_symbols, low=2)
        if self.source == "text" and not (self.corpus or self.train_file):
            raise ConfigError("corpus", "source='text' needs a corpus name or a train_file")
