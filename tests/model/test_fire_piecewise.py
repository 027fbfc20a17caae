"""FIRE's MLP evaluated as a piecewise-linear function (model/schemes/piecewise.py) against the MLP
written out in float64: values, and the gradients of W1, b1, W2, b2, c, L and the MLP's input, at a
block's size and on the edge cases (units without a breakpoint, breakpoints outside the data or
exactly on it). Run:
pytest tests/model/test_fire_piecewise.py -q"""

import functools

import pytest
import torch

from relpos_ablate import AttentionConfig
from relpos_ablate.model.schemes import build_bias
from relpos_ablate.model.schemes.piecewise import relu_mlp

# largest error / largest float64 value, per tensor. Measured at the block's size: <= 9e-7; the
# MLP's layers in fp32 reach 1.2e-5 (W1), one running fp32 sum per piece over the block's pairs 7e-6
RTOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def mlp_float64(params: dict, x):
    """relu(W1·x + b1)·W2ᵀ + b2 with the hidden layer materialised, [H, *x.shape]."""
    # (..., U)
    hidden = torch.relu(params["mlp.0.weight"][:, 0] * x[..., None] + params["mlp.0.bias"])
    return (hidden @ params["mlp.2.weight"].T + params["mlp.2.bias"]).movedim(-1, 0)


def fire_float64(params: dict, distances, query):
    """B [H, *distances.shape] from docs/schemes/distance-biases.md#fire: MLP(ψ(i - j) / ψ(query)),
    query = max(i, L) (broadcast against the distances), ψ(x) = sign(x)·log(1 + |c|·|x|)."""
    c, d = params["c"].abs(), distances.double()
    return mlp_float64(params, d.sign() * torch.log(1 + c * d.abs()) / torch.log(1 + c * query))


def assert_close_to(got: dict, want: dict, dtype, spread: dict | None = None) -> None:
    """Each entry within RTOL of the largest wanted one; an entry named in `spread` (Σ|term| of a
    gradient summed over every pair) may add one ulp of that sum, which is all a sum that cancels to
    a small value can promise."""
    for name, w in want.items():
        err = (got[name].double() - w).abs().max()
        limit = RTOL[dtype] * w.abs().max() + torch.finfo(dtype).eps * (spread or {}).get(name, 0.0)
        assert err <= limit, (dtype, name, float(err / w.abs().max()), float(limit / w.abs().max()))


def spread_of_sum(f, leaves: dict, name: str, grad) -> float:
    """Σ |grad · ∂f/∂leaf| over every output entry for the scalar leaf `name` (forward mode,
    float64)."""
    constants = {key: value.detach() for key, value in leaves.items()}

    def with_leaf(value):
        return f({**constants, name: value})

    leaf = constants[name]
    _, tangent = torch.func.jvp(with_leaf, (leaf,), (torch.ones_like(leaf),))
    return float((grad * tangent).abs().sum())


def float64_leaves(module, prefix: str = "") -> dict:
    return {
        name: p.detach().double().requires_grad_()
        for name, p in module.named_parameters(prefix=prefix)
    }


def values_and_gradients(f, leaves: dict, grad) -> dict:
    """{'out': f(), and the gradient of each leaf under the output gradient `grad`}."""
    out = f()
    grads = torch.autograd.grad(out, list(leaves.values()), grad.to(out.dtype))
    return {"out": out.detach(), **dict(zip(leaves, grads))}


def fire(dtype, threshold: float, seed: int = 0):
    torch.manual_seed(seed)
    scheme = build_bias(AttentionConfig(bias="fire"), 8).to(dtype)
    with torch.no_grad():
        scheme.threshold.fill_(threshold)
    return scheme


DTYPES = (torch.float32, torch.float64)
BLOCKS = [(range(4032, 4096), 4064), (range(2016, 2080), 2048)]


def _keys(keys: str):
    if keys == "in_order":
        return torch.arange(4096)
    return torch.randperm(4096, generator=torch.Generator().manual_seed(2))


def _on_pairs(queries: range, keys: str):
    """The float64 map of a block of queries x 4096 keys as a function of the leaves."""
    q_pos, k_pos = torch.tensor(queries), _keys(keys)

    def on_pairs(leaves):
        query = torch.maximum(q_pos.double(), leaves["threshold"].abs())[:, None]  # (Lq, 1)
        return fire_float64(leaves, q_pos[:, None] - k_pos, query)

    return on_pairs


def _grad(n_queries: int):
    return torch.randn(
        8, n_queries, 4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )


def _float64_params(threshold: float) -> dict:
    """The parameters of `fire(dtype, threshold)` for either dtype (drawn in fp32, so equal in
    float64): the float64 reference is computed once for both."""
    params = float64_leaves(fire(torch.float32, threshold))
    same = float64_leaves(fire(torch.float64, threshold))
    assert all(torch.equal(params[name], same[name]) for name in params)
    return params


@functools.cache
def _float64_block(queries: range, threshold: float, keys: str) -> dict:
    """The float64 map of a block of queries x 4096 keys and its gradients under `_grad`."""
    params = _float64_params(threshold)
    on_pairs = _on_pairs(queries, keys)
    return values_and_gradients(lambda: on_pairs(params), params, _grad(len(queries)))


@functools.cache
def _float64_spread(queries: range, threshold: float, keys: str) -> dict:
    """The spread (spread_of_sum) of the sums of c's and L's gradients over the block."""
    params, on_pairs = _float64_params(threshold), _on_pairs(queries, keys)
    grad = _grad(len(queries))
    return {name: spread_of_sum(on_pairs, params, name, grad) for name in ("c", "threshold")}


@pytest.mark.parametrize("queries, threshold", BLOCKS, ids=["causal_block", "keys_both_sides"])
def test_fire_block_matches_the_mlp_in_float64(queries, threshold):
    """A block of 64 queries × 4096 keys (the block kernel's), half the queries below L: the bias
    and the gradient of each parameter under a random output gradient, in fp32 and float64."""
    grad, want = _grad(len(queries)), _float64_block(queries, threshold, "in_order")
    for dtype in DTYPES:
        scheme = fire(dtype, threshold)
        got = values_and_gradients(
            lambda scheme=scheme: scheme.bias(torch.tensor(queries), torch.arange(4096)),
            dict(scheme.named_parameters()),
            grad,
        )
        assert_close_to(got, want, dtype)


@pytest.mark.parametrize("keys", ["in_order", "shuffled"])
@pytest.mark.parametrize("queries, threshold", BLOCKS, ids=["causal_block", "keys_both_sides"])
def test_fire_pairs_by_hand_match_the_mlp_in_float64(queries, threshold, keys):
    """The block kernel's FIRE (fire_pairs.FIREPairs) over tiles of 32 queries x 256 keys, in fp32
    and float64: the map, and the parameters' gradients summed by hand (runs of keys in order,
    scatter_add shuffled) then taken through the pieces once, against the MLP written out in
    float64. The threshold sits on a query position (torch.maximum gives L half of that query's
    gradient); with keys in order, tiles far from the diagonal lie inside one interval."""
    grad, want = _grad(len(queries)), _float64_block(queries, threshold, keys)
    spread = _float64_spread(queries, threshold, keys)
    q_pos, k_pos = torch.tensor(queries), _keys(keys)
    for dtype in DTYPES:
        scheme = fire(dtype, threshold)
        pairs = scheme.hand_gradient(q_pos, k_pos, grad=True)
        out, one_interval = (
            torch.empty(8, len(queries), 4096, dtype=dtype),
            torch.zeros(len(queries), 4096, dtype=torch.bool),
        )
        for r in range(0, len(queries), 32):
            for c in range(0, 4096, 256):
                rows, cols = slice(r, r + 32), slice(c, c + 256)
                out[:, rows, cols], tile = pairs.block(rows, cols)
                # forward's values are backward's
                assert torch.equal(out[:, rows, cols], pairs.values(rows, cols))
                one_interval[rows, cols] = tile.interval is not None
                # (add_gradient overwrites it)
                pairs.add_gradient(tile, grad[:, rows, cols].to(dtype, copy=True))
        names = [name for name, _ in scheme.named_parameters()]
        got = {
            "out": out,
            **dict(
                zip(names, pairs.parameter_gradients([p for _, p in scheme.named_parameters()]))
            ),
        }
        if keys == "in_order":  # both kinds of tile occur (shuffled keys span every distance)
            assert 0 < int(one_interval.sum()) // (32 * 256) < 2 * 16
        # c's sum cancels: shuffled, keys on both sides, it is Σ|term| / 4300 (the autograd of
        # FIREBias.bias is off by 1.0e-5 of it in fp32, these sums by 5.3e-6, 1.2e-9 of Σ|term|)
        assert_close_to(got, want, dtype, spread)
        # inside one interval the same values as FIREBias.bias, to the bit; elsewhere the same
        # function (hinges) rounded otherwise
        mlp = scheme.bias(q_pos, k_pos).detach()
        assert torch.equal(out[:, one_interval], mlp[:, one_interval])
        torch.testing.assert_close(
            out, mlp, rtol=0, atol=4 * torch.finfo(dtype).eps * float(mlp.abs().max())
        )


def test_fire_curve_matches_the_mlp_in_float64():
    """The curve over distances on both sides at the default query position, L."""
    scheme = fire(torch.float32, 512)
    distances = torch.arange(-300, 4096)
    params = float64_leaves(scheme)
    grad = torch.randn(
        8, len(distances), generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    want = values_and_gradients(
        lambda: fire_float64(params, distances, params["threshold"].abs()), params, grad
    )
    got = values_and_gradients(
        lambda: scheme.curve(distances), dict(scheme.named_parameters()), grad
    )
    assert_close_to(got, want, torch.float32)


def _constant_units(w1, b1):
    w1[:6] = 0.0
    # on everywhere where b1 > 0, else off (relu'(0) = 0)
    b1[:6] = torch.tensor([0.5, -0.5, 0.0, 1.0, -1.0, -0.0])


def _breakpoints_outside(w1, b1):
    """Breakpoints at ±1.5 .. ±40: all of x in one piece."""
    b1.copy_(
        -w1 * torch.linspace(1.5, 40.0, len(w1)) * torch.tensor([1.0, -1.0]).repeat(len(w1) // 2)
    )


def _no_breakpoint(w1, b1):
    w1.zero_()


def _on_breakpoints(w1, b1):
    """Breakpoints x = 0 (b1 = 0, both slopes, also -0.0), 0.5 and 1 hit exactly by data points,
    some of them shared by units of opposite and equal slopes."""
    w1[:8] = torch.tensor([0.75, -1.5, 0.5, -0.25, 1.0, 2.0, -2.0, 0.25])
    b1[:8] = torch.tensor([0.0, -0.0, -0.25, 0.125, -0.5, -2.0, 2.0, -0.25])


EDGES = {
    "constant_units": _constant_units,
    "breakpoints_outside": _breakpoints_outside,
    "no_breakpoint": _no_breakpoint,
    "on_breakpoints": _on_breakpoints,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("edge", EDGES)
def test_edge_cases_match_the_mlp_in_float64(edge, dtype):
    """x in [-1, 1] (bidirectional FIRE) with its ends, 0, -0.0 and 0.5 among the data: the value,
    and the gradients of x, W1, b1, W2, b2."""
    scheme = fire(dtype, 512, seed=3)
    first, second = scheme.mlp[0], scheme.mlp[2]
    with torch.no_grad():
        EDGES[edge](first.weight[:, 0], first.bias)
    gen = torch.Generator().manual_seed(2)
    x = (
        torch.cat(
            [
                torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1,
                torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0], dtype=torch.float64),
            ]
        )
        .view(5, 801)
        .to(dtype)
    )
    grad = torch.randn(8, *x.shape, generator=gen, dtype=torch.float64)
    params = float64_leaves(scheme.mlp, "mlp")
    x64, x_in = x.double().requires_grad_(), x.clone().requires_grad_()
    want = values_and_gradients(lambda: mlp_float64(params, x64), {"x": x64, **params}, grad)
    got = values_and_gradients(
        lambda: relu_mlp(first, second, x_in),
        {"x": x_in, **dict(scheme.mlp.named_parameters(prefix="mlp"))},
        grad,
    )
    assert_close_to(got, want, dtype)


def test_on_a_shared_breakpoint_every_unit_is_off_as_torch_relu_has_it():
    """|x| as relu(x) + relu(-x): at x = 0 torch's ReLU gives both units derivative 0, where the
    interval on either side would give the slope -1 or +1 and the gradient of one unit."""
    linear = torch.nn.Linear(1, 2), torch.nn.Linear(2, 1)
    with torch.no_grad():
        linear[0].weight.copy_(torch.tensor([[1.0], [-1.0]]))
        linear[0].bias.zero_()
        linear[1].weight.fill_(1.0)
        linear[1].bias.zero_()
    x = torch.tensor([-0.5, 0.0, 0.5], requires_grad=True)
    out = relu_mlp(*linear, x)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, 0.5]]))
    out.sum().backward()
    assert x.grad.tolist() == [-1.0, 0.0, 1.0]
    assert linear[0].weight.grad[:, 0].tolist() == [0.5, -0.5] and linear[0].bias.grad.tolist() == [
        1.0,
        1.0,
    ]


def test_no_grad_gives_the_same_values_without_a_graph():
    """Bit for bit: the block kernel's forward (no_grad) and its rebuild in backward compute the
    same map."""
    scheme = fire(torch.float32, 100)
    q_pos, k_pos = torch.arange(50, 150), torch.arange(150)
    with torch.no_grad():
        plain = scheme.bias(q_pos, k_pos)
    assert not plain.requires_grad
    assert torch.equal(plain, scheme.bias(q_pos, k_pos))


def test_autocast_leaves_the_bias_in_float32():
    """The MLP's layers ran in bf16 under autocast; the pieces are elementwise work and stay in
    fp32."""
    scheme = fire(torch.float32, 100)
    q_pos, k_pos = torch.arange(50, 150), torch.arange(150)
    with torch.autocast("cpu", torch.bfloat16):
        cast = scheme.bias(q_pos, k_pos)
    assert cast.dtype == torch.float32 and torch.equal(cast, scheme.bias(q_pos, k_pos))
