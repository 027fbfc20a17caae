"""Each bias scheme against known values from the papers and its closed form
(docs/schemes/index.md), plus the rel-shift / Toeplitz layouts. Run: pytest
tests/model/test_position_schemes.py -q"""

import math
import re
from pathlib import Path

import pytest
import torch

from fixtures.reference import alibi_slopes_reference, sinusoid_row
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model.core.shift import rel_shift, toeplitz
from relpos_ablate.model.schemes import alibi_slopes, build_bias, sinusoid, t5_bucket

# docs/schemes/distance-biases.md#t5: the check vector, rp = j - i (HF T5's relative_position)
RP = [
    -200,
    -128,
    -127,
    -100,
    -64,
    -63,
    -32,
    -31,
    -16,
    -15,
    -12,
    -11,
    -9,
    -8,
    -7,
    -1,
    0,
    1,
    2,
    7,
    8,
    9,
    11,
    12,
    15,
    16,
    31,
    32,
    63,
    64,
    100,
    127,
    128,
    200,
]
BIDIRECTIONAL = [
    15,
    15,
    15,
    15,
    14,
    13,
    12,
    11,
    10,
    9,
    9,
    8,
    8,
    8,
    7,
    1,
    0,
    17,
    18,
    23,
    24,
    24,
    24,
    25,
    25,
    26,
    27,
    28,
    29,
    30,
    31,
    31,
    31,
    31,
]
UNIDIRECTIONAL = [31, 31, 31, 30, 26, 26, 21, 21, 16, 15, 12, 11, 9, 8, 7, 1, 0] + [0] * 17


@pytest.mark.parametrize("causal, expected", [(False, BIDIRECTIONAL), (True, UNIDIRECTIONAL)])
def test_t5_buckets_match_the_reference_vector(causal, expected):
    """docs/schemes/distance-biases.md#t5: HF T5's buckets for the check vector, both directions."""
    distances = -torch.tensor(RP)  # our distance i - j = -(j - i)
    assert t5_bucket(distances, causal, 32, 128).tolist() == expected


def test_t5_bias_reads_its_table_at_the_bucket():
    scheme = build_bias(AttentionConfig(bias="t5", causal=False), 3)
    curve = scheme.curve(-torch.tensor(RP))
    torch.testing.assert_close(curve, scheme.table[torch.tensor(BIDIRECTIONAL)].T)


def test_the_documented_check_vector_is_the_tested_one():
    text = (
        Path(__file__).resolve().parents[2] / "docs" / "schemes" / "distance-biases.md"
    ).read_text()
    rows = re.search(r"^ +rp( .*)\n +bidirectional( .*)\n +causal( .*)$", text, flags=re.M)
    assert [[int(v) for v in row.split()] for row in rows.groups()] == [
        RP,
        BIDIRECTIONAL,
        UNIDIRECTIONAL,
    ]


@pytest.mark.parametrize(
    "heads, exponents",
    [
        (8, [1, 2, 3, 4, 5, 6, 7, 8]),
        (12, [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]),
        (6, [2, 4, 6, 8, 1, 3]),
    ],
)
def test_alibi_slopes_match_the_paper(heads, exponents):
    """docs/schemes/distance-biases.md#alibi: the paper's slopes for 8 and 12 heads, and 6 (not a
    power of two)."""
    expected = [2.0**-e for e in exponents]
    assert alibi_slopes(heads) == pytest.approx(expected, rel=1e-12)
    assert alibi_slopes_reference(heads) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_curve_is_minus_slope_times_distance(causal):
    scheme = build_bias(AttentionConfig(bias="alibi", causal=causal), 8)
    d = torch.tensor([0, 1, 5, 100, -3])
    expected = torch.tensor([[-(2.0**-h) * abs(x) for x in d.tolist()] for h in range(1, 9)])
    torch.testing.assert_close(scheme.curve(d), expected)


def test_alibi_learned_starts_at_the_fixed_slopes():
    fixed = build_bias(AttentionConfig(bias="alibi"), 6)
    learned = build_bias(AttentionConfig(bias="alibi_learned"), 6)
    d = torch.arange(0, 50)
    torch.testing.assert_close(learned.curve(d), fixed.curve(d))
    assert sum(p.numel() for p in learned.parameters()) == 6 and not list(fixed.parameters())


def test_kerple_closed_forms():
    """docs/schemes/distance-biases.md#kerple_log and #kerple_power, with the 0.01 floor and the cap
    p <= 2."""
    log_k = build_bias(AttentionConfig(bias="kerple_log"), 2)
    power = build_bias(AttentionConfig(bias="kerple_power"), 2)
    with torch.no_grad():
        for scheme in (log_k, power):
            scheme.a.copy_(torch.tensor([0.5, 0.001]))  # 0.001 is clamped to 0.01
            scheme.p.copy_(torch.tensor([1.5, 3.0]))  # 3.0 is clamped to 2 (power only)
    d = torch.tensor([0, 1, 4, 9])
    expected_log = [
        [-1.5 * math.log(1 + 0.5 * r) for r in d.tolist()],
        [-3.0 * math.log(1 + 0.01 * r) for r in d.tolist()],
    ]
    expected_pow = [[-0.5 * r**1.5 for r in d.tolist()], [-0.01 * r**2.0 for r in d.tolist()]]
    torch.testing.assert_close(log_k.curve(d), torch.tensor(expected_log))
    torch.testing.assert_close(power.curve(d), torch.tensor(expected_pow))


def test_kerple_power_gradient_is_finite_at_distance_zero():
    power = build_bias(AttentionConfig(bias="kerple_power"), 2)
    power.curve(torch.arange(0, 5)).sum().backward()
    assert torch.isfinite(power.p.grad).all() and torch.isfinite(power.a.grad).all()


def test_fire_closed_form_and_query_dependence():
    """docs/schemes/distance-biases.md#fire: MLP(psi(i - j) / psi(max(i, L))), a function of i - j
    only below L."""
    fire = build_bias(AttentionConfig(bias="fire"), 2)
    with torch.no_grad():
        fire.c.fill_(0.1)
        fire.threshold.fill_(4.0)
    w1, b1 = fire.mlp[0].weight[:, 0].detach(), fire.mlp[0].bias.detach()
    w2, b2 = fire.mlp[2].weight.detach(), fire.mlp[2].bias.detach()

    def expected(i, j):
        x = math.log(0.1 * (i - j) + 1) / math.log(0.1 * max(i, 4.0) + 1)
        return w2 @ torch.relu(w1 * x + b1) + b2

    got = fire.bias(torch.tensor([2, 9]), torch.tensor([0, 1, 2]))  # (H, 2, 3)
    for r, i in enumerate([2, 9]):
        for j in range(3):
            torch.testing.assert_close(got[:, r, j], expected(i, j))
    # below the threshold FIRE is a function of i - j: the same distance gives the same bias
    torch.testing.assert_close(
        fire.bias(torch.tensor([3]), torch.tensor([1]))[:, 0, 0], got[:, 0, 0]
    )
    # above it, it is not: distance 2 at query 9 differs from distance 2 at query 2
    assert not torch.allclose(
        fire.bias(torch.tensor([9]), torch.tensor([7]))[:, 0, 0], got[:, 0, 0]
    )


@pytest.mark.parametrize("causal", [True, False])
def test_xl_table_clamps_beyond_its_range(causal):
    """docs/schemes/distance-biases.md#xl_table: distances beyond max_distance share the last
    row."""
    scheme = build_bias(AttentionConfig(bias="xl_table", max_distance=4, causal=causal), 3)
    d = torch.tensor([0, 3, 4, 5, 1000])
    curve = scheme.curve(d)
    torch.testing.assert_close(curve[:, 3], curve[:, 2])
    torch.testing.assert_close(curve[:, 4], curve[:, 2])
    assert scheme.table.shape[0] == (5 if causal else 9)
    if not causal:
        torch.testing.assert_close(scheme.curve(torch.tensor([-1000]))[:, 0], scheme.table[0])
        assert not torch.allclose(
            scheme.curve(torch.tensor([-2]))[:, 0], scheme.curve(torch.tensor([2]))[:, 0]
        )


def test_sinusoid_matches_the_xl_layout():
    pos = torch.tensor([0, 1, 7, 400])
    expected = torch.tensor([sinusoid_row(p, 10) for p in pos.tolist()], dtype=torch.float64)
    torch.testing.assert_close(sinusoid(pos, 10), expected)


@pytest.mark.parametrize("lq, n_keys, q_offset", [(4, 4, 0), (3, 7, 4), (1, 5, 4), (5, 9, 2)])
def test_rel_shift_and_toeplitz_index_by_distance(lq, n_keys, q_offset):
    """out[r, j] must be the value at distance (q_offset + r) - j, for every entry (bidirectional
    layout)."""
    dmax = q_offset + lq - 1
    distances = torch.arange(dmax, dmax - (lq + n_keys - 1), -1)  # descending
    per_distance = distances.double() * 10 + 0.5
    out = toeplitz(per_distance, lq, n_keys)
    # row-dependent values
    rows = per_distance[None].repeat(lq, 1) + torch.arange(lq)[:, None] * 1000.0
    shifted = rel_shift(rows, n_keys)
    for r in range(lq):
        for j in range(n_keys):
            d = q_offset + r - j
            assert out[r, j] == d * 10 + 0.5
            assert shifted[r, j] == d * 10 + 0.5 + r * 1000.0


def test_bias_curve_api():
    attn = RelPosAttention(16, 2, 8, AttentionConfig(terms="abcd", bias="alibi"))
    d = torch.arange(0, 6)
    torch.testing.assert_close(attn.bias_curve(d), attn.bias_scheme.curve(d))
    v, r = attn.position_bias_v, attn.projected_relative(d)
    torch.testing.assert_close(
        attn.bias_curve(d, source="d"), torch.einsum("hd,hnd->hn", v, r) / math.sqrt(8)
    )
    with pytest.raises(ValueError, match="no bias"):
        RelPosAttention(16, 2, 8, AttentionConfig()).bias_curve(d)
    with pytest.raises(ValueError, match="term d is off"):
        RelPosAttention(16, 2, 8, AttentionConfig(terms="a")).bias_curve(d, source="d")
