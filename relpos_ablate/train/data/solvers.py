"""Brute-force solvers of the long-context example tasks: the answer tokens computed from an
example's prompt alone, by reading it token by token as its definition says (example_tasks.py's
module docstring), with none of the generator's bookkeeping (where the needles were put, which were
asked). The tests check every generated answer against them.

`solve(data, prompt)`: `prompt` is the example's tokens up to its <sep> (a leading <bos> and the
<sep> itself may be there); `data` names the task and, for contextual_counting, the answer's format
(the digits of a count), which the prompt does not show.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from relpos_ablate.config import DataConfig
from relpos_ablate.train.data.example_tasks import BOS, CLOSE, COUNTED, DIGIT, KEY, OPEN, SEP


def solve(data: DataConfig, prompt: Sequence[int]) -> list[int]:
    """The answer tokens of `prompt` for `data.task`, a long-context task."""
    solvers = {
        "niah_multikey": niah_multikey,
        "niah_multivalue": niah_multivalue,
        "niah_multiquery": niah_multiquery,
        "variable_tracking": variable_tracking,
        "contextual_counting": functools.partial(contextual_counting, digits=data.counting_digits),
    }
    if data.task not in solvers:
        raise ValueError(f"no solver for {data.task!r}; these have one: {', '.join(solvers)}")
    body = list(prompt)
    body = body[1:] if body[:1] == [BOS] else body
    return solvers[data.task](body[: body.index(SEP)] if SEP in body else body)


def niah_multikey(body: list[int]) -> list[int]:
    """The value of the one needle under the asked key."""
    needles, asked = _needles(body)
    (value,) = [value for name, value in needles if name == asked[0]]
    return value


def niah_multivalue(body: list[int]) -> list[int]:
    """Every value under the asked key, in order of appearance."""
    needles, asked = _needles(body)
    return [token for name, value in needles if name == asked[0] for token in value]


def niah_multiquery(body: list[int]) -> list[int]:
    """The value of each asked key, in the asked order."""
    needles, asked = _needles(body)
    store = dict(needles)
    return [token for name in asked for token in store[name]]


def variable_tracking(body: list[int]) -> list[int]:
    """Runs the assignments in order (`X v`: X = v, `X Y`: X = Y) and names every variable that ends
    up holding the asked value, in order of assignment."""
    needles, asked = _needles(body)
    held = {}
    for name, right in needles:
        # a copy of what Y holds
        held[name] = tuple(right) if _is_digit(right[0]) else held.get(right[0])
    return [name for name, _ in needles if held[name] == tuple(asked)]


def contextual_counting(body: list[int], digits: int) -> list[int]:
    """The number of 1 bits between each '[' and the next ']', in order, each in `digits` digits."""
    counts, inside = [], None
    for token in body:
        if token == OPEN:
            inside = 0
        elif token == CLOSE:
            counts.append(inside)
            inside = None
        elif token == COUNTED + 1 and inside is not None:
            inside += 1
    return [DIGIT + int(c) for count in counts for c in str(count).zfill(digits)]


def _is_digit(token: int) -> bool:
    return DIGIT <= token < DIGIT + 10


def _needles(body: list[int]) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """The needles `<key> name right` of the haystack as (name, right) in order (right: a run of
    digits, or one name), and the question: the tokens after the last <key>."""
    last = len(body) - 1 - body[::-1].index(KEY)
    needles, i = [], 0
    while i < last:
        if body[i] != KEY:  # filler
            i += 1
            continue
        end = i + 2
        while _is_digit(body[end]):
            end += 1
        end = max(end, i + 3)  # no digits: the right side is one name
        needles.append((body[i + 1], body[i + 2 : end]))
        i = end
    return needles, body[last + 1 :]
