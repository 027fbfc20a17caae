"""Data config: synthetic tasks generated on the fly, or real text through `datasets`."""

from __future__ import annotations

from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, check_range, reject

SOURCES = ("synthetic", "text")
STREAM_TASKS = ("offset_copy", "recall", "repeat")
#: Tasks made of independent examples `<bos> prompt <sep> answer` (train/data/examples.py). A new
#: task goes last: a task's index seeds its examples.
EXAMPLE_TASKS = (
    "copy",
    "reverse",
    "sort",
    "addition",
    "parity",
    "mqar",
    "flip_flop",
    "passkey",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "contextual_counting",
)
#: Example tasks with needles in n filler tokens, one of them at a depth (round(depth·n) filler
#: tokens before it), and the needle it is. Their test bins are evaluated depth by depth
#: (passkey_depths), drawn by `plot --kind passkey` as depth x length maps.
DEPTH_TASKS = {
    "passkey": "the key",
    "niah_multikey": "the asked needle",
    "niah_multivalue": "the first value",
    "niah_multiquery": "the first asked needle",
    "variable_tracking": "the chain's first assignment",
}
TASKS = STREAM_TASKS + EXAMPLE_TASKS
TOKENIZERS = ("char", "byte", "word", "bpe", "file")
#: How a text corpus's documents meet the model (train/data/text.py writes the boundaries).
DOCUMENTS = ("concatenate", "packed", "packed_reset")
#: A byte-level BPE's smallest vocabulary: the 256 byte symbols and the end-of-text token.
BPE_MIN_VOCAB = 257
#: Named corpora: one shipped inside the package (offline), the others downloaded by `datasets` (hub
#: ids and the shipped files in relpos_ablate/train/data/text.py).
CORPORA = ("tinyshakespeare", "wikitext-2", "wikitext-103", "enwik8", "text8")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from."""

    source: str = "synthetic"
    """'synthetic' (a task generated from the seed, no download) or 'text' (a corpus via
    datasets)."""
    task: str = "offset_copy"
    """synthetic streams: offset_copy (emit the input token `offset` positions back: needs relative
    position) | recall (answer a query with the pair stored under its key: needs content only) |
    repeat (a random block of `period` tokens is repeated right after itself: needs memory +
    relative position). Synthetic examples `<bos> prompt <sep> answer`, loss and accuracy on the
    answer only, of length n: copy, reverse, sort (n symbols) | addition (two n-digit numbers, their
    n+1-digit sum) | parity (n bits, answer their parity) | mqar (n key-value pairs, then
    mqar_queries keys to answer) | flip_flop (a write, then n instructions write/ignore/read with a
    bit, the last a read; a read repeats the last written bit) | passkey (n filler tokens with a
    passkey_digits-digit key hidden at a depth, asked for at the end). Long-context tasks in the
    style of RULER (Hsieh et al. 2024), n filler tokens with needles `<key> name value` (values of
    passkey_digits digits) at random places: niah_multikey (niah_keys needles, one key asked: its
    value) | niah_multivalue (one key with niah_values values among niah_keys - 1 other keys'
    needles: all its values, in order) | niah_multiquery (niah_keys needles, niah_queries keys
    asked: their values in the asked order) | variable_tracking (chains X1 = v, X2 = X1, ... of
    variable_hops hops, variable_chains of them, each its own value; a value asked: every name
    holding it, in chain order) | contextual_counting (Golkar et al. 2024: n bits with
    counting_regions regions marked by [ ]: the count of ones in each region)."""
    num_symbols: int = 16
    """synthetic: size of the random symbol alphabet (recall: number of values per key; passkey,
    niah_*, variable_tracking: the filler's)."""
    offset: int = 8
    """offset_copy: how many tokens back the target is (must be below train.segment_len)."""
    period: int = 96
    """repeat: block length = distance between a token and its repetition (above train.segment_len,
    the task needs memory)."""
    num_keys: int = 8
    """recall, mqar: number of distinct keys; niah_*: key names; variable_tracking: variable names
    (distinct names are drawn from them)."""
    rebind_every: int = 256
    """recall: every stream draws a new key -> value map every this many tokens."""
    train_tokens: int = 65536
    """synthetic: tokens per training stream (batch row); the streams restart after that."""
    eval_tokens: int = 4096
    """synthetic: tokens per evaluation stream (text evaluates the whole split)."""
    corpus: str = ""
    """text: a named corpus: tinyshakespeare (ships with the package, ~1 MB of characters, fixed
    train/valid/test split, works offline) or one downloaded by `datasets`: wikitext-2, wikitext-103
    (raw), enwik8, text8."""
    train_file: str = ""
    """text: local training data (instead of `corpus`): a file, a folder or a glob
    (`data/*.parquet`) of shards, all of one kind: plain text (.txt, also .xz/.gz compressed) or
    records with a `text` column (.jsonl/.json JSON lines, .parquet, .arrow), a document each."""
    valid_file: str = ""
    """text: local validation data, as train_file (default: plain text: the last 5% of train_file's
    characters; records: every 20th record of train_file)."""
    test_file: str = ""
    """text: local test data, as train_file (needed for eval.split='test' with local files)."""
    tokenizer: str = "char"
    """text: char (Unicode characters) | byte (UTF-8 bytes, 256 symbols) | word (whitespace split,
    <eos> per line), their vocabulary from the training split, <unk> for anything else, tokenized in
    memory (small corpora) | bpe (byte-level BPE of vocab_size tokens trained on the training split
    with Hugging Face `tokenizers`: lossless) | file (tokenizer_file's). bpe and file stream the
    corpus and write its tokens once to memory-mapped files: corpora larger than memory."""
    min_freq: int = 1
    """word: words seen fewer times in training become <unk>."""
    vocab_size: int = 0
    """bpe: tokens in the vocabulary, at least 257: 256 bytes and the end-of-text token."""
    tokenizer_file: str = ""
    """tokenizer 'file': a local Hugging Face tokenizer.json or SentencePiece .model; its
    end-of-text token (<|endoftext|>, </s>, <eos>, <|end_of_text|> or SentencePiece's eos) opens
    every document."""
    tokenizer_train_bytes: int = 0
    """bpe: train on at most this many bytes of the training split's first documents (0: all of it;
    training holds every distinct word: on 2 GB it takes tens of minutes, cap it)."""
    documents: str = "concatenate"
    """text: concatenate (the corpus as one stream, documents joined by an end-of-text token, the
    model not told where they start: Transformer-XL's stream, memory carries) | packed (the same
    rows, each segment an independent row: memory not carried from one segment to the next,
    attention may cross documents, positions run on) | packed_reset (attention masked at document
    boundaries, positions restarting at each document's first token, memory dropped at a
    boundary)."""
    document_delimiter: str = "\n\n"
    """text: plain-text sources: the string that ends one document and starts the next (default: a
    blank line: paragraphs, Tiny Shakespeare's speeches); record sources (JSONL/Parquet/Arrow
    shards): every record's `text` is one document."""
    cache_dir: str = ""
    """Where tokenized arrays and downloads are cached (default: ~/.cache/relpos_ablate)."""
    train_lengths: tuple[int, ...] = (1, 20)
    """example tasks: [min, max] of the task length n of training examples (drawn uniformly)."""
    test_lengths: tuple[tuple[int, ...], ...] = ((1, 20), (21, 25), (26, 30), (31, 35), (36, 40))
    """example tasks: bins [lo, hi] of n, each evaluated on its own (n uniform in the bin); bins
    above train_lengths' max are out of distribution (the tables' OOD mean)."""
    train_examples: int = 65536
    """example tasks: distinct training examples, generated once from the seed; batches cycle
    through them."""
    eval_examples: int = 256
    """example tasks: examples per test bin (per bin and depth for the depth tasks: passkey, niah_*,
    variable_tracking)."""
    addition_reversed: bool = False
    """addition: write the sum least significant digit first (each digit then follows from the
    digits already written and a carry)."""
    mqar_queries: int = 4
    """mqar: keys asked after the pairs (at most n), each answered by its value."""
    flip_flop_ignore: float = 0.8
    """flip_flop: probability of an ignore instruction (Liu et al. 2023's FFL(0.8)); writes and
    reads share the rest. An opening write comes before the n instructions; the last of them
    reads."""
    passkey_digits: int = 5
    """passkey: digits of the key (the answer); niah_*, variable_tracking: digits of each value (1
    to 18)."""
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """depth tasks (passkey, niah_*, variable_tracking): depths evaluated (filler tokens before the
    depth's needle / n: 0 = first, 1 = last; which needle: data.DEPTH_TASKS); training draws depths
    uniformly."""
    niah_keys: int = 4
    """niah_multikey, niah_multiquery: needles, each under its own key (RULER's num_needle_k);
    niah_multivalue: keys hidden, the asked one with niah_values values, each other one with one
    value (distractors)."""
    niah_values: int = 4
    """niah_multivalue: distinct values hidden under the asked key, the answer in order of
    appearance (RULER's num_needle_v)."""
    niah_queries: int = 4
    """niah_multiquery: keys asked at once (at most niah_keys), answered by their values in the
    asked order (RULER's num_needle_q)."""
    variable_hops: int = 4
    """variable_tracking: copies X2 = X1, X3 = X2, ... after a chain's X1 = v, so hops + 1 names
    hold v (RULER's num_hops)."""
    variable_chains: int = 1
    """variable_tracking: chains in the filler, each bound to its own value; the first is asked, the
    others are distractors (RULER's num_chains)."""
    counting_regions: int = 4
    """contextual_counting: regions marked by [ ] among the n bits, non-overlapping, maybe empty
    (Golkar et al. 2024 use 4); the answer is their counts of ones, in order."""
    counting_digits: int = 2
    """contextual_counting: digits of each count (most significant first, zero-padded); a region can
    hold all n bits, so 10**counting_digits must exceed the longest n."""

    def __post_init__(self):
        check_choice("source", self.source, SOURCES)
        check_choice("task", self.task, TASKS)
        self._check_example_fields()
        check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        self._check_tokenizer_fields()
        for name in ("offset", "period", "num_keys", "train_tokens", "eval_tokens", "min_freq"):
            check_range(name, getattr(self, name), low=1)
        check_range("num_symbols", self.num_symbols, low=2)
        check_range("rebind_every", self.rebind_every, low=2)
        if self.corpus:
            check_choice("corpus", self.corpus, CORPORA)
        if self.source != "text":
            for name in ("corpus", "train_file", "valid_file", "test_file"):
                if getattr(self, name):
                    raise ConfigError(
                        name, f"is read only with source='text' (source is {self.source!r})"
                    )
            return
        if self.corpus and self.train_file:
            raise ConfigError("corpus", "set either a corpus name or a train_file, not both")
        if not (self.corpus or self.train_file):
            raise ConfigError("corpus", "source='text' needs a corpus name or a train_file")
        for name in ("valid_file", "test_file"):
            if getattr(self, name) and not self.train_file:
                raise ConfigError(name, "local valid/test files go with a local train_file")

    def _check_tokenizer_fields(self) -> None:
        check_choice("documents", self.documents, DOCUMENTS)
        check_range("vocab_size", self.vocab_size, low=0)
        check_range("tokenizer_train_bytes", self.tokenizer_train_bytes, low=0)
        if not self.document_delimiter:
            reject("document_delimiter", "is empty; give the string between two documents")
        if self.documents != "concatenate" and self.source != "text":
            raise ConfigError(
                "documents",
                f"{self.documents!r} packs the documents of a text "
                f"corpus: needs source='text' (source is {self.source!r})",
            )
        if self.tokenizer == "file" and not self.tokenizer_file:
            raise ConfigError(
                "tokenizer_file",
                "tokenizer 'file' needs a local tokenizer.json or SentencePiece .model",
            )
        owners = {"tokenizer_file": "file", "vocab_size": "bpe", "tokenizer_train_bytes": "bpe"}
        for name, owner in owners.items():
            if getattr(self, name) and self.tokenizer != owner:
                raise ConfigError(
                    name, f"is read only with tokenizer={owner!r} (tokenizer is {self.tokenizer!r})"
                )
        if self.tokenizer == "bpe" and self.vocab_size < BPE_MIN_VOCAB:
            raise ConfigError(
                "vocab_size",
                f"{self.vocab_size} is too small for the byte "
                f"alphabet: 256 bytes + 1 end-of-text token; use >= {BPE_MIN_VOCAB}",
            )

    def _check_example_fields(self) -> None:
        if len(self.train_lengths) != 2 or not 1 <= self.train_lengths[0] <= self.train_lengths[1]:
            raise ConfigError(
                "train_lengths", f"{list(self.train_lengths)}: give [min, max] with 1 <= min <= max"
            )
        if not self.test_lengths:
            raise ConfigError("test_lengths", "give at least one bin [lo, hi]")
        for k, bin_ in enumerate(self.test_lengths):
            if len(bin_) != 2 or not 1 <= bin_[0] <= bin_[1]:
                raise ConfigError(
                    f"test_lengths[{k}]", f"{list(bin_)}: give [lo, hi] with 1 <= lo <= hi"
                )
        for name in (
            "train_examples",
            "eval_examples",
            "mqar_queries",
            "niah_keys",
            "niah_values",
            "niah_queries",
            "variable_chains",
            "counting_regions",
        ):
            check_range(name, getattr(self, name), low=1)
        check_range("variable_hops", self.variable_hops, low=0)
        for name in ("passkey_digits", "counting_digits"):  # 18 digits: every value fits an int64
            check_range(name, getattr(self, name), 1, 18)
        check_range("flip_flop_ignore", self.flip_flop_ignore, 0.0, 0.99)
        for k, depth in enumerate(self.passkey_depths):
            check_range(f"passkey_depths[{k}]", depth, 0.0, 1.0)
        if self.task in DEPTH_TASKS and not self.passkey_depths:
            raise ConfigError("passkey_depths", "give at least one depth in [0, 1] to evaluate")
        longest = max(self.train_lengths[1], *(hi for _, hi in self.test_lengths))
        if self.task == "mqar" and self.num_keys < longest:
            raise ConfigError(
                "num_keys",
                f"mqar draws n distinct keys, up to n = {longest} (train_lengths, "
                f"test_lengths); use num_keys >= {longest}",
            )
        self._check_needles(longest)

    def _check_needles(self, longest: int) -> None:
        """The long-context tasks: enough distinct names and values for their needles, counts that
        fit."""
        names = {
            "niah_multikey": self.niah_keys,
            "niah_multivalue": self.niah_keys,
            "niah_multiquery": self.niah_keys,
            "variable_tracking": self.variable_chains * (self.variable_hops + 1),
        }.get(self.task, 0)
        if self.num_keys < names:
            raise ConfigError(
                "num_keys",
                f"{self.task} hides {names} distinct names (niah_keys, or variable_chains x "
                f"(variable_hops + 1)); use num_keys >= {names}",
            )
        if self.task == "niah_multiquery":
            # asks keys that are hidden
            check_range("niah_queries", self.niah_queries, 1, self.niah_keys)
        distinct = {"niah_multivalue": "niah_values", "variable_tracking": "variable_chains"}.get(
            self.task
        )
        if distinct and getattr(self, distinct) > 10**self.passkey_digits:
            raise ConfigError(
                distinct,
                f"{getattr(self, distinct)} distinct values of passkey_digits = "
                f"{self.passkey_digits} digits do not exist; use at most {10**self.passkey_digits}",
            )
        if self.task == "contextual_counting" and 10**self.counting_digits <= longest:
            raise ConfigError(
                "counting_digits",
                f"{self.counting_digits} digits cannot write a count of n = {longest} "
                f"ones (train_lengths, test_lengths); use counting_digits >= {len(str(longest))}",
            )

    @property
    def example_task(self) -> bool:
        """Independent examples (train/data/examples.py) rather than contiguous streams."""
        return self.source == "synthetic" and self.task in EXAMPLE_TASKS

    @property
    def depth_task(self) -> bool:
        """An example task with a needle at a depth (DEPTH_TASKS): evaluated depth by depth."""
        return self.example_task and self.task in DEPTH_TASKS

    def sequence_length(self, n: int) -> int:
        """Tokens of one example of task length n, <bos> included (train/data/examples.py lays them
        out)."""
        queries, digits = min(self.mqar_queries, n), self.passkey_digits
        # <key> k v
        needle, keys, values, asked = (
            digits + 2,
            self.niah_keys,
            self.niah_values,
            self.niah_queries,
        )
        hops, regions = self.variable_hops, self.counting_regions
        chain = digits + 2 + 3 * hops  # <key> X1 v, then <key> X_i+1 X_i per hop
        return {
            "copy": 2 * n + 2,
            "reverse": 2 * n + 2,
            "sort": 2 * n + 2,  # <bos> x <sep> y
            "addition": 3 * n + 4,  # <bos> a + b <sep> (a + b), n + 1 digits
            "parity": n + 3,  # <bos> bits <sep> parity
            "mqar": 2 * n + 2 + 2 * queries,  # <bos> (k v)*n <sep> (q a)*queries
            "flip_flop": 2 * n + 3,  # <bos> (instruction bit)*(n + 1): the opening write, then n
            "passkey": n + 2 * digits + 3,  # <bos> filler with <key> digits inside <sep> digits
            # <bos> filler with the needles inside, the question (<key> and names or a value) <sep>
            # answer
            "niah_multikey": n + keys * needle + digits + 4,  # <key> k <sep> v
            "niah_multivalue": n
            + (values + keys - 1) * needle
            + values * digits
            + 4,  # <key> k <sep> v1 .. vV
            "niah_multiquery": n
            + keys * needle
            + asked * (digits + 1)
            + 3,  # <key> k1 .. kQ <sep> v1 .. vQ
            "variable_tracking": n
            + self.variable_chains * chain
            + digits
            + hops
            + 4,  # <key> v <sep> X1 .. X_hops+1
            "contextual_counting": n
            + regions * (self.counting_digits + 2)
            + 2,  # <bos> bits, [ ] <sep> counts
        }[self.task]

    def input_length(self, n: int) -> int:
        """Tokens a causal LM reads for an example of task length n: all but the last."""
        return self.sequence_length(n) - 1

    @property
    def character_level(self) -> bool:
        """Tokens are characters or bytes, so bits per character is meaningful."""
        return self.source == "text" and self.tokenizer in ("char", "byte")


def check_example_run(data: DataConfig, model, segment_len: int, eval_settings: tuple) -> None:
    """The run-level rules of an example task (RunConfig calls this): no memory, the test bins are
    the evaluation, training examples fit train.segment_len."""
    if not data.example_task:
        return
    if model.mem_len:
        raise ConfigError(
            "model.mem_len",
            f"example tasks are independent examples; memory would carry one into the "
            f"next: use 0 (got {model.mem_len})",
        )
    if eval_settings:
        raise ConfigError(
            "eval.settings",
            "example tasks are evaluated at data.test_lengths; leave eval.settings empty",
        )
    longest = data.input_length(data.train_lengths[1])
    if segment_len < longest:
        raise ConfigError(
            "train.segment_len",
            f"{segment_len} is shorter than the longest training example "
            f"({longest} tokens: {data.task} at n = {data.train_lengths[1]}); use {longest}",
        )
