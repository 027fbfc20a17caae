"""FIRE's bias at every (query, key) pair of one attention call, and its gradient by hand: the block
kernel's materialised maps (kernels/block_maps.py) use it for the queries past FIRE's threshold.

Autograd through each tile's map (FIREBias.bias) would compute the MLP's pieces again per tile, keep
a graph of the tile's pairs, and sum each piece's gradient by scatter_add (several passes over the
map). Here what depends on the call alone is computed once: the pieces (α, β [H, S], piecewise.py),
ψ(max(i, L)) per query and its derivatives in c and L. A tile's map gradient G [H, L_b, K_b] (summed
over the batch) is reduced to
- α's and β's: the sums of G and of G·x over each piece's pairs. Where a tile holds fewer than
  FEW_PIECES pieces, by matmul with their one-hot [pairs, pieces]. Elsewhere, with keys in order, x
  falls along each row (ψ rises with the distance), so each row's pieces are runs of keys: running
  sums along the row read at the runs' ends (scatter_add where keys are not in order);
- |c|'s and |L|'s: Σ g_x·∂x/∂c and Σ g_x·∂x/∂L over the pairs, g_x = Σ_h G_h·β_h(piece) (with few
  pieces, Σ_h G_h·β_h(s) for each piece s by one matmul, then a gather of each pair's own), the
  weight ∂x/∂c formed per pair (it is a difference of two terms of about the same size where i - j ≈
  i: summed apart, the two sums cancel to ~2e-6 of error in fp32).
`parameter_gradients` takes the sums to FIRE's parameters once per call, by autograd through the
pieces. Values: in a tile inside one interval, those of FIREBias.bias to the bit (the same
operations per pair); elsewhere on the CPU the line of the tile's lowest interval plus a hinge per
breakpoint inside its range (`_hinged`), the same function rounded differently (~2e-7), in forward
and in backward's rebuild alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.schemes.piecewise import _evaluate, _piece_sums, pieces


class Tile(NamedTuple):
    """What a tile's gradient reads again: the tile's query rows, distances d, inputs x and
    #breakpoints < x."""

    rows: slice
    distances: Tensor  # (L_b, K_b)
    x: Tensor  # (L_b, K_b)
    below: Tensor | None  # (L_b, K_b) int64; None where every x lies inside one interval
    interval: int | None  # that interval (#breakpoints below every x)
    x_range: Tensor | None  # [min(x), max(x)] (None off the CPU)


class FIREPairs:
    """FIRE (`scheme`, a FIREBias) at the pairs of `query_positions` [L] and `key_positions` [K]:
    `block` gives a tile's map, `add_gradient` takes a map gradient, `parameter_gradients` returns
    the parameters' gradients. `grad`: keep the graph from the parameters to the pieces
    (backward)."""

    def __init__(self, scheme, query_positions: Tensor, key_positions: Tensor, grad: bool = False):
        self.scheme = scheme
        dtype = scheme.c.dtype
        self.q, self.k = query_positions.to(dtype), key_positions.to(dtype)
        with torch.set_grad_enabled(grad):
            self.breakpoints, alpha, beta = pieces(scheme.mlp[0], scheme.mlp[2])
            c, threshold = scheme.c.abs(), scheme.threshold.abs()
        self._graph = [alpha, beta, c, threshold]
        self.alpha, self.beta = alpha.detach(), beta.detach()
        self.interval_alpha, self.interval_beta = self.alpha[:, ::2], self.beta[:, ::2]
        with torch.no_grad():
            c, threshold = c.detach(), threshold.detach()
            n = torch.maximum(self.q, threshold)  # (L,)
            self.norm = scheme.psi(n)  # ψ(max(i, L)): x = ψ(i - j) / norm
            self.c = c
            self.norm_dc = n / (1 + c * n)  # ∂ψ(n)/∂|c|
            # ∂ψ(n)/∂|L| where L is the larger (torch.maximum gives each side half at a tie)
            share = torch.where(
                threshold > self.q, 1.0, torch.where(threshold == self.q, 0.5, 0.0)
            ).to(dtype)
            self.norm_dl = c / (1 + c * n) * share
            self.in_order = bool((self.k[1:] >= self.k[:-1]).all())  # rows' pieces are runs of keys
        self.trained = any(t.requires_grad for t in self._graph)  # (else no gradient to sum)
        self.grad_alpha, self.grad_beta = torch.zeros_like(self.alpha), torch.zeros_like(self.beta)
        self.grad_c = torch.zeros((), dtype=torch.float64, device=c.device)
        self.grad_threshold = torch.zeros((), dtype=torch.float64, device=c.device)
        self._scratch = torch.empty(0, dtype=dtype, device=c.device)

    def block(self, rows: slice, keys: slice) -> tuple[Tensor, Tile]:
        """(the bias [H, L_b, K_b] of queries `rows` against keys `keys`, what its gradient
        reads)."""
        bias, tile = self._bias(rows, keys)
        if tile.interval is None and tile.below is None:
            tile = tile._replace(below=_count_below(tile.x, self.breakpoints, tile.x_range))
        return bias, tile

    def values(self, rows: slice, keys: slice) -> Tensor:
        """The bias [H, L_b, K_b] alone (forward)."""
        return self._bias(rows, keys)[0]

    def _bias(self, rows: slice, keys: slice) -> tuple[Tensor, Tile]:
        """The bias, and its tile without the pieces where it needs no lookup of them."""
        with torch.no_grad():
            q = self.q[rows]
            distances = q[:, None] - self.k[keys][None, :]
            x = self.scheme.psi(distances) / self.norm[rows, None]
            x_range = _range(x)
            interval = _one_interval(x_range, self.breakpoints)
            # one α and β per head, no lookups (a tile far from the diagonal, mostly)
            if interval is not None:
                bias = torch.addcmul(
                    self.interval_alpha[:, interval, None, None].expand(-1, *x.shape),
                    self.interval_beta[:, interval, None, None],
                    x,
                )
                return bias, Tile(rows, distances, x, None, interval, x_range)
            if x_range is not None:
                return self._hinged(x, x_range), Tile(rows, distances, x, None, None, x_range)
            below = torch.bucketize(x, self.breakpoints)  # (no range off the CPU: no host sync)
            return _evaluate(x, self.interval_alpha, self.interval_beta, below), Tile(
                rows, distances, x, below, None, None
            )

    def _hinged(self, x: Tensor, x_range: Tensor) -> Tensor:
        """α + β·x of each x's interval, [H, *x.shape], as the line of min(x)'s interval plus, for
        each breakpoint τ in [min(x), max(x)), the change of slope there times relu(x - τ): one
        product [H, 2 + n] @ [2 + n, pairs] in place of a lookup of each pair's interval and of α
        and β per pair and head (FIRE at L = 4096, B = 2, H = 8: its forward blocks 158 -> 66 ms,
        backward tiles 88 -> 73 ms). f is continuous, so this is the same function; it
        rounds differently (2.4e-7 against values up to 0.54 there)."""
        first, last = torch.searchsorted(
            self.breakpoints, x_range
        ).tolist()  # #breakpoints < min(x), < max(x)
        basis = x.new_empty(2 + last - first, x.numel())
        basis[0] = 1.0
        basis[1] = x.view(-1)
        for row, point in enumerate(self.breakpoints[first:last].tolist(), start=2):
            torch.sub(basis[1], point, out=basis[row]).clamp_(min=0.0)
        beta = self.interval_beta
        coefficients = torch.cat(
            [
                self.interval_alpha[:, first, None],
                beta[:, first, None],
                beta[:, first + 1 : last + 1] - beta[:, first:last],
            ],
            dim=1,
        )
        return (coefficients @ basis).view(len(beta), *x.shape)

    def add_gradient(self, tile: Tile, grad: Tensor) -> None:
        """Add the gradient [H, L_b, K_b] of the tile's map onto the sums of α, β, |c| and |L|. grad
        is this call's to overwrite."""
        with torch.no_grad():
            heads, n = grad.shape[0], grad.numel()
            if self._scratch.numel() < n:
                self._scratch = grad.new_empty(n)
            scratch = self._scratch[:n].view_as(grad)
            few = None  # the pieces present, [L_b·K_b, span] one-hot, where they are few
            if tile.interval is None:
                # (see piecewise.pieces)
                piece = tile.below.add_(
                    _count_below(tile.x, self.breakpoints, tile.x_range, right=True)
                )
                # (elsewhere: no read-back, every piece may be present)
                on_cpu = piece.device.type == "cpu"
                low, high = (
                    map(int, torch.aminmax(piece)) if on_cpu else (0, self.beta.shape[1] - 1)
                )
                # Σ_h G_h·β_h(s) for each piece s present, then each pair's own
                if high - low < FEW_PIECES:
                    offset = piece.view(-1, 1) - low
                    few = (offset == torch.arange(high - low + 1, device=piece.device)).to(
                        grad.dtype
                    )
                    # (span, L_b·K_b)
                    per_piece = self.beta[:, low : high + 1].T @ grad.reshape(heads, -1)
                    grad_x = per_piece.gather(0, offset.view(1, -1)).view_as(tile.x)
                else:
                    index = piece.view(1, -1).expand(heads, -1)
                    torch.gather(self.beta, 1, index, out=scratch.view(heads, -1))
                    grad_x = scratch.mul_(grad).sum(0)  # (L_b, K_b): Σ_h G_h·β_h(piece)
            else:
                piece = 2 * tile.interval  # (an open interval's piece)
                grad_x = (self.beta[:, piece] @ grad.reshape(heads, -1)).view_as(tile.x)
            rows, x, d = tile.rows, tile.x, tile.distances
            norm = self.norm[rows, None]
            # ∂x/∂|c| = (ψ'(d) - x·ψ'(n)) / ψ(n), ψ'(d) = d / (1 + |c|·|d|)
            weight = (
                d.abs()
                .mul_(self.c)
                .add_(1)
                .reciprocal_()
                .mul_(d)
                .sub_(x * self.norm_dc[rows, None])
                .div_(norm)
            )
            self.grad_c += (weight.mul_(grad_x)).sum(dtype=torch.float64)
            norm_dl = self.norm_dl[rows]
            if norm_dl.any():  # ∂x/∂|L| = -x·ψ'(n)·∂n/∂L / ψ(n): queries below the threshold
                self.grad_threshold -= (grad_x.mul_(x).sum(1) * (norm_dl / self.norm[rows])).sum(
                    dtype=torch.float64
                )
            torch.mul(grad, x, out=scratch)
            if tile.interval is not None:
                self.grad_alpha[:, piece] += grad.sum((1, 2))
                self.grad_beta[:, piece] += scratch.sum((1, 2))
            elif few is not None:
                self.grad_alpha[:, low : high + 1] += grad.view(heads, -1) @ few
                self.grad_beta[:, low : high + 1] += scratch.view(heads, -1) @ few
            elif self.in_order:
                self.grad_alpha[:, low : high + 1] += _run_sums(grad, piece, low, high)
                self.grad_beta[:, low : high + 1] += _run_sums(scratch, piece, low, high)
            else:
                self.grad_alpha += _piece_sums(grad, piece, self.alpha.shape[1])
                self.grad_beta += _piece_sums(scratch, piece, self.alpha.shape[1])

    def parameter_gradients(self, params: list[Tensor]) -> list[Tensor | None]:
        """The gradients of `params` (None for each not reached) from the sums added so far."""
        grads = [
            self.grad_alpha,
            self.grad_beta,
            self.grad_c.to(self.alpha.dtype),
            self.grad_threshold.to(self.alpha.dtype),
        ]
        outputs = [(t, g) for t, g in zip(self._graph, grads) if t.requires_grad]
        if not outputs:
            return [None] * len(params)
        return list(
            torch.autograd.grad(
                [t for t, _ in outputs], params, [g for _, g in outputs], allow_unused=True
            )
        )


def _range(x: Tensor) -> Tensor | None:
    """[min(x), max(x)] on the CPU; None on other devices (reading it back would wait for the
    device) or empty."""
    return torch.stack(torch.aminmax(x)) if x.device.type == "cpu" and x.numel() else None


def _one_interval(x_range: Tensor | None, breakpoints: Tensor) -> int | None:
    """The interval between breakpoints that holds every x of the range [min(x), max(x)], if one
    does (no x on a breakpoint either); None without a range."""
    if x_range is None:
        return None
    # #breakpoints < min(x) and <= max(x): equal where none lies in [min(x), max(x)]
    below = int(torch.searchsorted(breakpoints, x_range[0]))
    upto = int(torch.searchsorted(breakpoints, x_range[1], right=True))
    return below if below == upto else None


# a tile's x spans few of the breakpoints but near the diagonal: up to this many, compared one by
# one
FEW_BREAKPOINTS = 6


def _count_below(
    x: Tensor, breakpoints: Tensor, x_range: Tensor | None, right: bool = False
) -> Tensor:
    """torch.bucketize(x, breakpoints, right=right): #breakpoints < x (right: <= x), int64. Where
    x's range [min(x), max(x)] (`_range`) holds at most FEW_BREAKPOINTS of them, by comparing with
    those alone (~5x faster than its binary searches)."""
    if x_range is None:
        return torch.bucketize(x, breakpoints, right=right)
    low, high = torch.searchsorted(breakpoints, x_range, right=right).tolist()
    if high - low > FEW_BREAKPOINTS:
        return torch.bucketize(x, breakpoints, right=right)
    count = torch.full(x.shape, low, dtype=torch.int64, device=x.device)
    for point in breakpoints[low:high].tolist():  # (the breakpoints are float values of x's dtype)
        count += (x >= point) if right else (x > point)
    return count


# a tile's pieces, where at most this many: one-hot [pairs, pieces], the sums per piece by matmul
FEW_PIECES = 8


def _run_sums(values: Tensor, piece: Tensor, low: int, high: int) -> Tensor:
    """Σ of values [H, R, K] over the pairs of each piece low .. high (every piece of the tile): [H,
    high - low + 1], where each row's pieces do not rise along the row (runs). values is overwritten
    (its running sums along the rows)."""
    heads, n_rows, _ = values.shape
    span = high - low + 1
    rows = torch.arange(n_rows, device=piece.device)[:, None] * span - low
    counts = torch.bincount((piece + rows).view(-1), minlength=n_rows * span).view(n_rows, span)
    # (R, span): #keys of the row with piece >= s, piece s's run's end
    ends = counts.flip(1).cumsum_(1).flip(1)
    running = values.cumsum_(2)
    # Σ over the keys before each run's end, 0 above the row's pieces; piece s's run follows piece
    # s + 1's
    upto = running.gather(2, (ends - 1).clamp_(min=0).expand(heads, -1, -1)).masked_fill_(
        ends == 0, 0.0
    )
    return upto.sub_(F.pad(upto[..., 1:], (0, 1))).sum(1)
