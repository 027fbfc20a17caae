"""Explicit positions (AttentionOptions.positions): every scheme reads them, on every kernel.

With positions p (one per key, shared by the batch), every encoding is the float64 reference
(tests/fixtures/reference.py) evaluated at p: RoPE rotates by p, every bias type and terms b/d take
the distance p_query - p_key, Shaw's values too; the mask stays by index. Checked for term subsets
that take every path x bias type x causal/bidirectional x memory on the explicit, SDPA-per-block,
rebuild-in-backward and FlexAttention (CPU eager, forward) kernels, forward and backward. Explicit
distances (AttentionOptions.distances, Ruoss et al.'s randomized relative encodings): every
distance-only scheme and terms b/d read d_(i'-j), against the same reference one pair at a time.
That consecutive positions leave the fast path bit for bit unchanged was checked against the
previous revision with benchmarks/compare_revisions.py (the suite cannot hold the old code).
Run: pytest tests/model/test_attention_positions.py -q"""

import dataclasses

import pytest
import torch

from fixtures.attention import (
    D_HEAD,
    D_MODEL,
    HEADS,
    LQ,
    MEM,
    SPREAD,
    drawn,
    fast_and_explicit_gradients,
    inputs,
    randomize,
)
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.model import AttentionOptions

# every way a term reads positions: none (a; c reads none either), term b gathered per pair, term d
# as a gathered curve (alone and added to the bias curve: d; beside b on the position query: abcd).
# (the parity matrix, tests/model/test_parity_matrix.py, runs every scheme at explicit positions)
TERM_SUBSETS = ("a", "b", "d", "abcd")
BACKENDS = ("explicit", "sdpa", "blocks", "flex")


def make(seed=0, **fields):
    fields.setdefault("query_chunk", 2)  # several blocks even at L=5
    if fields.get("bias") == "t5":
        fields.update(num_buckets=8, max_distance=12)
    elif fields.get("bias") == "xl_table":
        fields.setdefault("max_distance", 9)  # below the spread distances: the clamp is exercised
    attn = RelPosAttention(D_MODEL, HEADS, D_HEAD, AttentionConfig(**fields)).double()
    randomize(attn, seed)
    if fields.get("bias") == "fire":
        with torch.no_grad():
            attn.bias_scheme.threshold.fill_(12.0)  # some drawn query positions lie beyond it
    return attn


def on_backend(attn, backend):
    attn.config = dataclasses.replace(attn.config, backend=backend)
    return attn


def check_every_backend(attn, x, mems, positions, **kw):
    ref_out, ref_probs = reference_attention(attn, x, mems, positions=positions, **kw)
    options = AttentionOptions(
        positions=positions,
        window=kw.get("window"),
        key_padding_mask=kw.get("padding"),
        clamp_len=kw.get("clamp_len"),
        distances=kw.get("distances"),
    )
    for backend in BACKENDS:
        if backend == "flex" and attn.value_table is not None:
            continue  # Shaw values need the probabilities: the explicit path serves every backend
        on_backend(attn, backend)
        with torch.no_grad():
            out, _ = attn(x, mems, options)
        torch.testing.assert_close(
            out, ref_out, rtol=1e-6, atol=1e-9, msg=lambda m, backend=backend: f"{backend}: {m}"
        )
    _, probs = attn(x, mems, options, need_weights=True)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("bias", BIAS_TYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("n_mem", [0, MEM], ids=["nomem", "mem"])
def test_every_scheme_reads_explicit_positions_on_every_kernel(bias, causal, n_mem):
    for i, terms in enumerate(TERM_SUBSETS):
        attn = make(seed=i, terms=terms, bias=bias, causal=causal)
        x, mems = inputs(i, n_mem)
        check_every_backend(attn, x, mems, drawn(n_mem + LQ, seed=i))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "fields",
    [
        dict(terms="a", absolute="rope"),
        dict(terms="a", absolute="rope", bias="alibi"),
        dict(terms="ab", rel="learned", clamp_len=6, shaw_values=True),
        dict(terms="abcd", clamp_len=7),
    ],
    ids=["rope", "rope+alibi", "shaw_values", "xl_clamp"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_rope_shaw_and_clamped_r_at_explicit_positions(fields, causal):
    attn = make(causal=causal, **fields)
    x, mems = inputs(3, MEM)
    check_every_backend(attn, x, mems, drawn(MEM + LQ, seed=3))


def drawn_distances(n_keys, seed, spread=SPREAD):
    """0, then sorted distinct distances from [1, spread), as randomized relative encodings draw
    them."""
    return torch.cat([torch.zeros(1, dtype=torch.long), drawn(n_keys - 1, seed, spread - 1) + 1])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
# FIRE reads the query position too
@pytest.mark.parametrize("bias", [b for b in BIAS_TYPES if b != "fire"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_every_distance_scheme_reads_drawn_distances_on_every_kernel(bias, causal):
    """Ruoss et al.'s randomized relative encodings: offset r = i' - j reads d_r (mirrored for r <
    0), in the reference one pair at a time, in the kernels through the strided layout (term b per
    distance, term d alone and beside a bias as curves)."""
    for i, terms in enumerate(("b", "d", "ad", "abcd")):
        attn = make(seed=i, terms=terms, bias=bias, causal=causal)
        x, mems = inputs(i, MEM)
        check_every_backend(attn, x, mems, None, distances=drawn_distances(MEM + LQ, seed=i))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "fields",
    [
        dict(terms="a", absolute="rope", bias="alibi"),
        dict(terms="ab", rel="learned", clamp_len=6, shaw_values=True),
    ],
    ids=["rope+alibi", "shaw_values"],
)
def test_rope_reads_positions_while_the_relative_encodings_read_drawn_distances(fields):
    attn = make(**fields)
    x, mems = inputs(3, MEM)
    check_every_backend(
        attn, x, mems, drawn(MEM + LQ, seed=3), distances=drawn_distances(MEM + LQ, seed=4)
    )


def test_drawn_distances_0_to_k_minus_1_are_the_default():
    attn = make(terms="abcd", bias="t5")
    x, mems = inputs(6, MEM)
    default, _ = attn(x, mems)
    drawn_as_offsets, _ = attn(x, mems, AttentionOptions(distances=torch.arange(MEM + LQ)))
    torch.testing.assert_close(drawn_as_offsets, default, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"distances: expected \[M \+ L\] = \[8\] distances"):
        attn(x, mems, AttentionOptions(distances=torch.arange(LQ)))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_window_padding_and_evaluation_clamp_stay_by_index():
    attn = make(terms="abcd", bias="t5")
    x, mems = inputs(4, MEM)
    padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
    padding[0, :2] = True
    positions = drawn(MEM + LQ, seed=4)
    check_every_backend(attn, x, mems, positions, window=3, clamp_len=5)
    check_every_backend(attn, x, mems, positions, padding=padding)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("bias", ["none", "kerple_power", "xl_table", "t5", "fire"])
def test_unsorted_positions_give_visible_pairs_negative_distances(bias):
    """Causal by index, but a later token at an earlier position: the distance range covers every
    visible pair's distance, negative ones included."""
    attn = make(terms="abcd", bias=bias)
    x, mems = inputs(5, 0)
    check_every_backend(attn, x, mems, torch.tensor([7, 3, 12, 0, 5]))


@pytest.mark.parametrize(
    "terms, bias", [("abcd", "t5"), ("bd", "fire"), ("ab", "alibi_learned"), ("ac", "dynamic")]
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("backend", ["blocks", "sdpa"])
def test_fast_backward_at_explicit_positions_equals_autograd_of_explicit_scores(
    terms, bias, causal, backend
):
    attn = make(seed=11, terms=terms, bias=bias, causal=causal, backend=backend)
    x, mems = inputs(12, MEM)
    grads = fast_and_explicit_gradients(
        attn, x, mems, AttentionOptions(positions=drawn(MEM + LQ, seed=12))
    )
    for fast, slow in zip(*grads):
        if slow is None:
            assert fast is None or fast.abs().max() == 0
            continue
        torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("terms, bias", [("abcd", "t5"), ("ab", "alibi_learned")])
@pytest.mark.parametrize("backend", ["blocks", "sdpa"])
def test_fast_backward_at_drawn_distances_equals_autograd_of_explicit_scores(terms, bias, backend):
    attn = make(seed=13, terms=terms, bias=bias, backend=backend)
    x, mems = inputs(14, MEM)
    grads = fast_and_explicit_gradients(
        attn, x, mems, AttentionOptions(distances=drawn_distances(MEM + LQ, seed=14))
    )
    for fast, slow in zip(*grads):
        if slow is not None:
            torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(
    "fields",
    [
        dict(terms="abcd", bias="alibi"),
        dict(terms="a", absolute="rope"),
        dict(terms="bd", bias="fire"),
    ],
)
def test_consecutive_positions_given_explicitly_equal_the_default(fields):
    """The gather path at 0 .. K - 1 agrees with the strided fast path (to rounding: other sums)."""
    attn = make(**fields)
    x, mems = inputs(6, MEM)
    default, _ = attn(x, mems)
    explicit, _ = attn(x, mems, AttentionOptions(positions=torch.arange(MEM + LQ)))
    torch.testing.assert_close(explicit, default, rtol=1e-12, atol=1e-12)


def test_shifting_every_position_leaves_relative_schemes_unchanged():
    """Translation invariance at explicit positions: XL terms, T5, ALiBi and RoPE see only
    differences."""
    for fields in (
        dict(terms="abcd", bias="t5"),
        dict(terms="a", bias="alibi"),
        dict(terms="a", absolute="rope"),
    ):
        attn = make(**fields)
        x, mems = inputs(7, MEM)
        positions = drawn(MEM + LQ, seed=7)
        a, _ = attn(x, mems, AttentionOptions(positions=positions))
        b, _ = attn(x, mems, AttentionOptions(positions=positions + 1000))
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_small_query_blocks_with_term_b_at_explicit_positions():
    """Term b gathers a d_head-wide key per pair, so its blocks hold d_head times fewer pairs; the
    result does not depend on the block size."""
    attn = make(terms="abcd", query_chunk=1)
    x, mems = inputs(8, MEM)
    check_every_backend(attn, x, mems, drawn(MEM + LQ, seed=8))


def test_positions_of_the_wrong_shape_are_one_line_errors():
    attn = make(terms="abcd")
    x, mems = inputs(9, MEM)
    with pytest.raises(
        ValueError,
        match=r"positions: expected \[M \+ L\] = \[8\] key positions shared by the batch",
    ):
        attn(x, mems, AttentionOptions(positions=torch.arange(LQ)))
    with pytest.raises(ValueError, match=r"got \[2, 8\]"):
        attn(x, mems, AttentionOptions(positions=torch.arange(MEM + LQ).expand(2, -1)))
