"""Packed documents (model/documents.py): a row packing documents gives, for each document's tokens,
the outputs and gradients of that document alone — for every scheme of the parity matrix
(tests/fixtures/matrix.py) on every kernel that takes it, in float64.

Two layouts, each with two rows of different cuts:
- `row`: no memory; row 0 holds documents of 3 and 7 tokens, row 1 of 6 and 4. Each document
  alone is the same layer on its tokens.
- `memory`: 4 memory keys; row 0's memory ends with the first two tokens of the segment's first
  document (its first two are another document's: dropped), the segment then holds 5 and 5 tokens;
  row 1's memory is all another document (dropped), its segment one document. Alone: the document's
  own memory tokens, then its tokens.

The weighted sum of the packed outputs is the sum of the documents' weighted sums, so every gradient
(input and parameters) is the sum of the documents' own. FlexAttention runs forward only on CPU
(eager, no_grad); the low-rank and band kernels take plain causal calls only and leave a packed call
to the others (asserted once).
"""

import zlib

import pytest
import torch

from fixtures.attention import randomize
from fixtures.matrix import D_MODEL, KERNELS, MEM, PINNED, SCHEMES, allowed, layer
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.scheme_checks import document_refusal
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.kernels import dispatch

#: per layout and row: the memory's document ids (or None) and the segment's
LAYOUTS = {
    "row": [(None, [0] * 3 + [1] * 7), (None, [5] * 6 + [9] * 4)],
    "memory": [([0, 0, 1, 1], [1] * 5 + [2] * 5), ([3] * 4, [4] * 10)],
}
#: what the parity matrix's schemes leave out and reads a place or a count of keys: the scales that
#: count the keys a query sees, Llama 4's temperature tuning (floor scale 2: positions 0-9 reach
#: its steps), the readers of the scores, Shaw's values, xPos, p-RoPE, a window, sinks under RoPE
EXTRA = {
    "log_n": dict(terms="a", bias="alibi", score_scale="log_n", log_n_length=4),
    "ssmax": dict(terms="a", absolute="rope", score_scale="ssmax", log_n_length=4),
    "learned_temperature": dict(terms="a", bias="t5", learned_temperature=True),
    "temperature_tuning": dict(
        terms="a", absolute="rope", temperature_tuning=True, temperature_floor_scale=2.0
    ),
    "stick_breaking": dict(terms="a", bias="alibi", normaliser="stick_breaking"),
    "path": dict(terms="a", path=True),
    "dape_v1": dict(terms="a", bias="alibi", dape="v1", dape_width=4),
    "dape_v2": dict(terms="a", bias="kerple_log", dape="v2", dape_width=4),
    "shaw": dict(terms="ab", rel="learned", clamp_len=3, shaw_values=True),
    "xpos": dict(terms="a", absolute="rope", xpos_scale_base=8.0),
    "p_rope": dict(terms="a", absolute="rope", rope_p=0.5),
    "window": dict(terms="a", bias="alibi", window=3),
    "rope_sinks": dict(terms="a", absolute="rope", sinks=2),
}
SCHEMES = {**SCHEMES, **EXTRA}
CASES = [
    (scheme, kernel, layout)
    for scheme, fields in SCHEMES.items()
    if document_refusal(AttentionConfig(**fields)) is None
    for kernel in KERNELS
    if kernel not in PINNED and allowed(fields, kernel)
    for layout in LAYOUTS
]


def _layer(scheme: str, kernel: str) -> RelPosAttention:
    if scheme not in EXTRA:
        return layer(scheme, kernel)
    fields = {"query_chunk": 4, **EXTRA[scheme], "backend": kernel}
    attn = RelPosAttention(D_MODEL, 2, 8, AttentionConfig(**fields)).double()
    randomize(attn, zlib.crc32(scheme.encode()) % 1000)
    return attn


def _data(layout: str):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 10, D_MODEL, generator=gen, dtype=torch.float64)
    rows = LAYOUTS[layout]
    mems = None
    if rows[0][0] is not None:
        mems = torch.randn(2, MEM, D_MODEL, generator=gen, dtype=torch.float64)
    ids = torch.tensor([(m or []) + s for m, s in rows])
    return x, mems, ids


def _pieces(layout: str):
    """(row, the document's columns in the segment, its memory columns) of every document."""
    for r, (mem_ids, ids) in enumerate(LAYOUTS[layout]):
        for doc in dict.fromkeys(ids):
            cols = [c for c, d in enumerate(ids) if d == doc]
            own_mem = [c for c, d in enumerate(mem_ids or []) if d == doc]
            yield r, slice(cols[0], cols[-1] + 1), own_mem


def _run(attn, x, mems, ids, grad: bool):
    xx = x.clone().requires_grad_(grad)
    out, _ = attn(xx, mems, document_ids=ids)
    return xx, out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("scheme, kernel, layout", CASES, ids=["-".join(c) for c in CASES])
def test_a_packed_document_is_the_document_alone(scheme, kernel, layout):
    attn = _layer(scheme, kernel)
    x, mems, ids = _data(layout)
    grad = kernel != "flex"
    weights = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)
    with torch.set_grad_enabled(grad):
        xx, out = _run(attn, x, mems, ids, grad)
        alone_x_grad = torch.zeros_like(x)
        alone_params = [torch.zeros_like(p) for p in attn.parameters()]
        for r, cols, own_mem in _pieces(layout):
            piece = x[r : r + 1, cols].clone().requires_grad_(grad)
            piece_mem = mems[r : r + 1, own_mem] if own_mem else None
            alone, _ = attn(piece, piece_mem)
            torch.testing.assert_close(out[r : r + 1, cols], alone, rtol=1e-7, atol=1e-10)
            if grad:
                got = torch.autograd.grad(
                    (alone * weights[r : r + 1, cols]).sum(),
                    [piece, *attn.parameters()],
                    allow_unused=True,
                )
                alone_x_grad[r : r + 1, cols] = got[0]
                for acc, g in zip(alone_params, got[1:]):
                    if g is not None:
                        acc += g
    if not grad:
        return
    packed = torch.autograd.grad((out * weights).sum(), [xx, *attn.parameters()], allow_unused=True)
    names = ["x", *(name for name, _ in attn.named_parameters())]
    for name, p, a in zip(names, packed, [alone_x_grad, *alone_params]):
        p = torch.zeros_like(a) if p is None else p
        torch.testing.assert_close(p, a, rtol=1e-7, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_the_refused_schemes_are_named():
    """What reads a query's place in the stream besides distances is refused in one line; the
    matrix covers every other scheme."""
    refused = {
        scheme: document_refusal(AttentionConfig(**fields))
        for scheme, fields in SCHEMES.items()
        if document_refusal(AttentionConfig(**fields)) is not None
    }
    assert set(refused) == {"fire", "dape_v2"}, refused
    assert "query's position" in refused["fire"]
    chunked = AttentionConfig(chunk=4)
    assert "chunk" in document_refusal(chunked)
    attn = RelPosAttention(D_MODEL, 2, 8, chunked)
    with pytest.raises(ValueError, match=r"^document_ids: chunked attention"):
        attn(torch.randn(1, 6, D_MODEL), document_ids=torch.zeros(1, 6, dtype=torch.long))
    plain = RelPosAttention(D_MODEL, 2, 8, AttentionConfig(bias="alibi"))
    with pytest.raises(ValueError, match=r"^document_ids: explicit positions"):
        plain(
            torch.randn(1, 6, D_MODEL),
            None,
            AttentionOptions(positions=torch.arange(6)),
            document_ids=torch.zeros(1, 6, dtype=torch.long),
        )
    with pytest.raises(ValueError, match=r"^document_ids: expected integer ids \[B, M \+ L\]"):
        x, mem = torch.randn(1, 6, D_MODEL), torch.randn(1, 2, D_MODEL)
        plain(x, mem, document_ids=torch.zeros(1, 6))
    # one row's ids for a batch of two would be broadcast: refused
    with pytest.raises(ValueError, match=r"= \[2, 6\], got torch.int64 \[1, 6\]$"):
        plain(torch.randn(2, 6, D_MODEL), document_ids=torch.zeros(1, 6, dtype=torch.long))


def test_the_plain_causal_kernels_leave_packed_calls_to_the_others():
    attn = layer("alibi", "auto")
    x, _, ids = _data("row")
    call, q_content, _ = attn.kernel_call(x, None, AttentionOptions(document_ids=ids))
    assert not call.plain_causal
    assert not set(dispatch.candidates(call, q_content, attn.config, 0.0)) & set(PINNED)
