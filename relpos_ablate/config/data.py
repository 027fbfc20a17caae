"""Data config: synthetic tasks generated on the fly, or real text through `datasets`."""

from __future__ import annotations

from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, check_range

SOURCES = ("synthetic", "text")
TASKS = ("offset_copy", "recall", "repeat")
TOKENIZERS = ("char", "byte", "word")
#: Named corpora: one shipped inside the package (offline), the others downloaded by `datasets` (hub ids and the
#: shipped files in relpos_ablate/train/data/text.py).
CORPORA = ("tinyshakespeare", "wikitext-2", "wikitext-103", "enwik8", "text8")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from."""

    source: str = "synthetic"
    """'synthetic' (a task generated from the seed, no download) or 'text' (a corpus via datasets)."""
    task: str = "offset_copy"
    """synthetic: offset_copy (emit the input token `offset` positions back: needs relative position) |
    recall (answer a query with the pair stored under its key: needs content only) | repeat (a random
    block of `period` tokens is repeated right after itself: needs memory + relative position)."""
    num_symbols: int = 16
    """synthetic: size of the random symbol alphabet (recall: number of values per key)."""
    offset: int = 8
    """offset_copy: how many tokens back the target is (must be below train.segment_len)."""
    period: int = 96
    """repeat: block length = distance between a token and its repetition (above train.segment_len,
    the task needs memory)."""
    num_keys: int = 8
    """recall: number of distinct keys."""
    rebind_every: int = 256
    """recall: every stream draws a new key -> value map every this many tokens."""
    train_tokens: int = 65536
    """synthetic: tokens per training stream (batch row); the streams restart after that."""
    eval_tokens: int = 4096
    """synthetic: tokens per evaluation stream (text evaluates the whole split)."""
    corpus: str = ""
    """text: a named corpus: tinyshakespeare (ships with the package, ~1 MB of characters, fixed train/valid/test
    split, works offline) or one downloaded by `datasets`: wikitext-2, wikitext-103 (raw), enwik8, text8."""
    train_file: str = ""
    """text: a local training file (instead of `corpus`)."""
    valid_file: str = ""
    """text: a local validation file (default: the last 5% of train_file's lines)."""
    test_file: str = ""
    """text: a local test file (needed for eval.split='test' with local files)."""
    tokenizer: str = "char"
    """text: char (Unicode characters) | byte (UTF-8 bytes, 256 symbols) | word (whitespace split,
    <eos> per line); vocabulary from the training split, <unk> for anything else."""
    min_freq: int = 1
    """word: words seen fewer times in training become <unk>."""
    cache_dir: str = ""
    """Where tokenized arrays and downloads are cached (default: ~/.cache/relpos_ablate)."""

    def __post_init__(self):
        check_choice("source", self.source, SOURCES)
        check_choice("task", self.task, TASKS)
        check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        for name in ("offset", "period", "num_keys", "train_tokens", "eval_tokens", "min_freq"):
            check_range(name, getattr(self, name), low=1)
        check_range("num_symbols", self.num_symbols, low=2)
        check_range("rebind_every", self.rebind_every, low=2)
        if self.corpus:
            check_choice("corpus", self.corpus, CORPORA)
        if self.source != "text":
            for name in ("corpus", "train_file", "valid_file", "test_file"):
                if getattr(self, name):
                    raise ConfigError(name, f"is read only with source='text' (source is {self.source!r})")
            return
        if self.corpus and self.train_file:
            raise ConfigError("corpus", "set either a corpus name or a train_file, not both")
        if not (self.corpus or self.train_file):
            raise ConfigError("corpus", "source='text' needs a corpus name or a train_file")
        for name in ("valid_file", "test_file"):
            if getattr(self, name) and not self.train_file:
                raise ConfigError(name, "local valid/test files go with a local train_file")

    @property
    def character_level(self) -> bool:
        """Tokens are characters or bytes, so bits per character is meaningful."""
        return self.source == "text" and self.tokenizer in ("char", "byte")
