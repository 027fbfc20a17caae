"""The tasks of the example-based data (examples.py): the token layout, each task's generator
(`TASK_GENERATORS[task](data, rng, n, count, depths)` -> (sequences, answer marks), one vectorised
draw per task length) and the vocabulary size.

Answers inline: mqar answers each query right after it (`<sep> q1 a1 q2 a2 ...`); flip_flop's
answers are the bits after its read instructions (no <sep>).

Long-context tasks (RULER, Hsieh et al. 2024, at token level; mqar has no filler, these do): n
filler symbols with needles inside, each needle after a number of filler tokens (`_hide`), the one
that a depth places (data.DEPTH_TASKS) after round(depth·n) of them, the others uniform over [0, n].
Needles are `<key> name value` (a name of data.num_keys, a value of passkey_digits digits); the
question follows the haystack, starting with <key>:

- niah_multikey: niah_keys needles, distinct keys; `<key> k <sep>` asks one, the answer its value;
- niah_multivalue: niah_values needles of the asked key (distinct values, the first at the depth,
  the others after it) among one needle of each of niah_keys - 1 other keys; `<key> k <sep>`: its
  values in order of appearance;
- niah_multiquery: niah_keys needles, distinct keys; `<key> k1 .. kQ <sep>` asks niah_queries of
  them (the first at the depth): their values in the asked order;
- variable_tracking: variable_chains chains `<key> X1 v`, then `<key> X2 X1`, `<key> X3 X2`, ...
  (X_i+1 = X_i, variable_hops of them, in chain order; distinct names, a distinct value per chain);
  `<key> v <sep>` asks the first chain's value (its first assignment at the depth): the names X1 ..
  X_hops+1 that hold it;
- contextual_counting (Golkar et al. 2024, arXiv 2406.02585): n bits (0 and 1 equally likely) with
  counting_regions non-overlapping regions `[ ... ]` among them (the 2·regions delimiters at sorted
  uniform places, so a region may be empty and bits lie outside the regions too, as in the paper's
  `[ 0 ] [ 1 0 1 ] 0 [ 1 ] 1 [ ] 0` -> 0 2 1 0); `<sep>`, then the number of ones in each region, in
  order, each in counting_digits digits (the paper's decoder is prompted with the region labels
  instead).

Every answer follows from the prompt's tokens alone: solvers.py computes it there, token class by
token class (digits, <key>, the rest).
"""

from __future__ import annotations

import numpy as np

from relpos_ablate.config import DataConfig

PAD, BOS, SEP = 0, 1, 2
FIRST = 3  # the first task token
# digits 0-9; addition's '+' and passkey's <key> follow them
DIGIT, PLUS, KEY = (FIRST, FIRST + 10, FIRST + 10)
# passkey, niah_*, variable_tracking: num_symbols filler symbols, then (not passkey) num_keys names
FILLER = KEY + 1
# contextual_counting: bits 0, 1 after the digits; '[', ']'
COUNTED, OPEN, CLOSE = (FIRST + 10, FIRST + 12, FIRST + 13)
# flip_flop's instructions, then bits 0 and 1
WRITE, READ, IGNORE, BIT = (FIRST, FIRST + 1, FIRST + 2, FIRST + 3)


def vocab_size(data: DataConfig) -> int:
    """<pad>, <bos>, <sep>, then the task's tokens."""
    return (
        FIRST
        + {
            "copy": data.num_symbols,
            "reverse": data.num_symbols,
            "sort": data.num_symbols,
            "addition": 11,  # ten digits and '+'
            "parity": 2,
            "mqar": data.num_keys + data.num_symbols,  # keys, then values
            "flip_flop": 5,  # write, read, ignore, 0, 1
            "passkey": 11 + data.num_symbols,  # ten digits, <key>, filler symbols
            # ten digits, <key>, filler symbols, names
            **dict.fromkeys(
                ("niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking"),
                11 + data.num_symbols + data.num_keys,
            ),
            "contextual_counting": 14,  # ten digits (the counts), 0, 1, '[', ']'
        }[data.task]
    )


def _framed(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """<bos> prompt <sep> answer, with the answer marked: ([count, T], [count, T])."""
    count = prompt.shape[0]
    seq = np.concatenate(
        [np.full((count, 1), BOS), prompt, np.full((count, 1), SEP), answer], axis=1
    )
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, seq.shape[1] - answer.shape[1] :] = True
    return seq, marked


def _copy(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, x)


def _reverse(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, x[:, ::-1])


def _sort(data, rng, n, count, depths):
    x = rng.integers(0, data.num_symbols, size=(count, n)) + FIRST
    return _framed(x, np.sort(x, axis=1))


def _addition(data, rng, n, count, depths):
    """Two n-digit numbers (leading zeros allowed), most significant digit first; their n+1-digit
    sum."""
    a, b = rng.integers(0, 10, size=(2, count, n))
    total, carry = np.zeros((count, n + 1), dtype=np.int64), np.zeros(count, dtype=np.int64)
    for k in range(n - 1, -1, -1):  # schoolbook addition from the least significant digit
        digit = a[:, k] + b[:, k] + carry
        total[:, k + 1], carry = digit % 10, digit // 10
    total[:, 0] = carry
    answer = total[:, ::-1] if data.addition_reversed else total
    return _framed(
        np.concatenate([a, np.full((count, 1), PLUS - DIGIT), b], axis=1) + DIGIT, answer + DIGIT
    )


def _parity(data, rng, n, count, depths):
    bits = rng.integers(0, 2, size=(count, n))
    return _framed(bits + FIRST, bits.sum(1, keepdims=True) % 2 + FIRST)


def _mqar(data, rng, n, count, depths):
    """n pairs with distinct keys, then min(mqar_queries, n) distinct keys each followed by its
    value."""
    # distinct keys per example
    keys = np.argsort(rng.random((count, data.num_keys)), axis=1)[:, :n]
    values = rng.integers(0, data.num_symbols, size=(count, n))
    # which pairs
    asked = np.argsort(rng.random((count, n)), axis=1)[:, : min(data.mqar_queries, n)]
    value_token = FIRST + data.num_keys
    pairs = np.stack([keys + FIRST, values + value_token], axis=2).reshape(count, 2 * n)
    queries = np.stack(
        [
            np.take_along_axis(keys, asked, 1) + FIRST,
            np.take_along_axis(values, asked, 1) + value_token,
        ],
        axis=2,
    ).reshape(count, -1)
    seq, _ = _framed(pairs, queries)
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, 2 * n + 3 :: 2] = True  # the value after each query
    return seq, marked


def _flip_flop(data, rng, n, count, depths):
    """An opening write, then n instructions with a bit each, the last a read; reads repeat the last
    write.

    The opening write makes every n >= 1 answerable (n = 1: write b, read -> b)."""
    p_write = (1.0 - data.flip_flop_ignore) / 2
    ops = rng.choice(
        [WRITE, READ, IGNORE], size=(count, n + 1), p=[p_write, p_write, data.flip_flop_ignore]
    )
    ops[:, 0], ops[:, -1] = WRITE, READ
    bits = rng.integers(0, 2, size=(count, n + 1))
    last_write = np.maximum.accumulate(np.where(ops == WRITE, np.arange(n + 1), 0), axis=1)
    bits = np.where(ops == READ, np.take_along_axis(bits, last_write, 1), bits)
    pairs = np.stack([ops, bits + BIT], axis=2).reshape(count, 2 * (n + 1))
    seq = np.concatenate([np.full((count, 1), BOS), pairs], 1)
    marked = np.zeros(seq.shape, dtype=bool)
    marked[:, 2::2] = ops == READ
    return seq, marked


def _passkey(data, rng, n, count, depths):
    """n filler symbols with <key> d_1 .. d_k inserted after round(depth·n) of them; then <sep> d_1
    .. d_k."""
    filler = _filler(data, rng, n, count)
    digits = rng.integers(0, 10, size=(count, data.passkey_digits)) + DIGIT
    hidden = np.concatenate([np.full((count, 1), KEY), digits], axis=1)
    return _framed(_hide(filler, [hidden], _depth_slot(depths, n)), digits)


def _niah_multikey(data, rng, n, count, depths):
    return _niah_asking(data, rng, n, count, depths, asked=1)


def _niah_multiquery(data, rng, n, count, depths):
    return _niah_asking(data, rng, n, count, depths, asked=data.niah_queries)


def _niah_asking(data, rng, n, count, depths, asked):
    """niah_keys needles under distinct keys, the first at the depth, the others anywhere; the first
    `asked` keys are asked, answered by their values in that order."""
    filler, keys = _filler(data, rng, n, count), _names(data, rng, count, data.niah_keys)
    values = _digits(
        rng.integers(0, 10**data.passkey_digits, size=(count, data.niah_keys)), data.passkey_digits
    )
    slots = np.concatenate(
        [_depth_slot(depths, n), rng.integers(0, n + 1, size=(count, data.niah_keys - 1))], 1
    )
    prompt = _hide(filler, _needles(keys, values), slots)
    return _framed(_asking(prompt, keys[:, :asked]), values[:, :asked].reshape(count, -1))


def _niah_multivalue(data, rng, n, count, depths):
    """niah_values distinct values under the asked key (the first at the depth, the others after it,
    in order) among one needle of each other key (anywhere); the answer is the asked key's
    values."""
    filler, keys = _filler(data, rng, n, count), _names(data, rng, count, data.niah_keys)
    width, others = data.passkey_digits, data.niah_keys - 1
    # [count, values, width]
    values = _digits(_distinct(rng, count, data.niah_values, width), width)
    distractors = _digits(rng.integers(0, 10**width, size=(count, others)), width)
    at = _depth_slot(depths, n)
    slots = np.concatenate(
        [
            at,
            np.sort(rng.integers(at, n + 1, size=(count, data.niah_values - 1)), axis=1),
            rng.integers(0, n + 1, size=(count, others)),
        ],
        axis=1,
    )
    owners = np.concatenate([np.repeat(keys[:, :1], data.niah_values, axis=1), keys[:, 1:]], axis=1)
    prompt = _hide(filler, _needles(owners, np.concatenate([values, distractors], axis=1)), slots)
    return _framed(_asking(prompt, keys[:, :1]), values.reshape(count, -1))


def _variable_tracking(data, rng, n, count, depths):
    """variable_chains chains X1 = v, X2 = X1, .. in order (the first chain's X1 = v at the depth,
    its copies after it; the other chains anywhere), distinct names and values; the first chain's
    value is asked."""
    chains, hops, width = data.variable_chains, data.variable_hops, data.passkey_digits
    filler = _filler(data, rng, n, count)
    names = _names(data, rng, count, chains * (hops + 1)).reshape(count, chains, hops + 1)
    values = _digits(_distinct(rng, count, chains, width), width)  # [count, chains, width]
    at = _depth_slot(depths, n)
    others = np.sort(rng.integers(0, n + 1, size=(count, chains - 1, hops + 1)), axis=2).reshape(
        count, -1
    )
    slots = np.concatenate(
        [at, np.sort(rng.integers(at, n + 1, size=(count, hops)), axis=1), others], axis=1
    )
    key = np.full((count, 1), KEY)
    needles = [
        block
        for c in range(chains)
        for block in (
            np.concatenate([key, names[:, c, :1], values[:, c]], axis=1),  # <key> X1 v
            *(
                np.concatenate([key, names[:, c, i : i + 1], names[:, c, i - 1 : i]], axis=1)
                for i in range(1, hops + 1)
            ),
        )
    ]
    prompt = _hide(filler, needles, slots)
    return _framed(np.concatenate([prompt, key, values[:, 0]], axis=1), names[:, 0])


def _contextual_counting(data, rng, n, count, depths):
    bits = rng.integers(0, 2, size=(count, n))
    # region r: 2r, 2r+1
    bounds = np.sort(rng.integers(0, n + 1, size=(count, 2 * data.counting_regions)), axis=1)
    # before a slot
    ones = np.concatenate([np.zeros((count, 1), dtype=np.int64), np.cumsum(bits, axis=1)], axis=1)
    counts = np.take_along_axis(ones, bounds[:, 1::2], 1) - np.take_along_axis(
        ones, bounds[:, 0::2], 1
    )
    marks = [
        np.full((count, 1), CLOSE if k % 2 else OPEN) for k in range(2 * data.counting_regions)
    ]
    return _framed(
        _hide(bits + COUNTED, marks, bounds),
        _digits(counts, data.counting_digits).reshape(count, -1),
    )


def _filler(data, rng, n, count):
    return rng.integers(0, data.num_symbols, size=(count, n)) + FILLER


def _names(data, rng, count, k):
    """[count, k] distinct names per example (tokens after the filler symbols)."""
    return np.argsort(rng.random((count, data.num_keys)), axis=1)[:, :k] + FILLER + data.num_symbols


def _distinct(rng, count, k, width):
    """[count, k] distinct numbers below 10**width per example, uniform: drawn one at a time from
    those left."""
    chosen = np.empty((count, k), dtype=np.int64)
    for j in range(k):
        value = rng.integers(0, 10**width - j, size=count)
        for taken in np.sort(chosen[:, :j], axis=1).T:  # skip the numbers taken, smallest first
            value += value >= taken
        chosen[:, j] = value
    return chosen


def _digits(numbers, width):
    """Numbers [...] as `width` digit tokens each, most significant first: [..., width]."""
    return numbers[..., None] // 10 ** np.arange(width - 1, -1, -1) % 10 + DIGIT


def _needles(keys, values):
    """`<key> k v_1 .. v_w` per key: keys [count, m], values [count, m, w] -> m blocks [count, w +
    2]."""
    return [
        np.concatenate([np.full((len(keys), 1), KEY), keys[:, j : j + 1], values[:, j]], axis=1)
        for j in range(keys.shape[1])
    ]


def _asking(prompt, keys):
    """The haystack, then the question `<key> k_1 .. k_q`."""
    return np.concatenate([prompt, np.full((len(prompt), 1), KEY), keys], axis=1)


def _depth_slot(depths, n):
    """[count, 1] filler tokens before the needle at each depth."""
    return np.rint(depths * n).astype(np.int64)[:, None]


def _hide(filler, needles, slots):
    """The filler [count, n] with needle j (a block [count, w_j]) inserted after slots[:, j] of its
    tokens; needles after the same number keep their order: [count, n + Σ w_j]."""
    count, n = filler.shape
    widths = np.array([block.shape[1] for block in needles])
    # the needles in prompt order: by slot, then index
    order = np.argsort(slots, axis=1, kind="stable")
    # needle tokens before each, in prompt order
    ahead = np.cumsum(widths[order], axis=1) - widths[order]
    start = np.empty_like(slots)
    np.put_along_axis(start, order, np.take_along_axis(slots, order, 1) + ahead, axis=1)
    prompt = np.full((count, n + int(widths.sum())), -1, dtype=np.int64)
    rows = np.arange(count)[:, None]
    for j, block in enumerate(needles):
        prompt[rows, start[:, j : j + 1] + np.arange(widths[j])] = block
    prompt[prompt < 0] = filler.reshape(-1)  # row by row, each row's n free places in order
    return prompt


TASK_GENERATORS = {
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
    "addition": _addition,
    "parity": _parity,
    "mqar": _mqar,
    "flip_flop": _flip_flop,
    "passkey": _passkey,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "niah_multiquery": _niah_multiquery,
    "variable_tracking": _variable_tracking,
    "contextual_counting": _contextual_counting,
}
