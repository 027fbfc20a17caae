"""A ReLU MLP of one scalar, 1 -> U -> H, evaluated as the piecewise-linear function it is (FIRE's
MLP).

Unit k switches at its breakpoint τ_k = -b1_k / W1_k, so between consecutive breakpoints the active
units are fixed and f_h(x) = α_h + β_h·x, α = b2 + Σ_active W2·b1, β = Σ_active W2·W1. A pair then
costs a lookup of its piece and one multiply-add per head instead of a U-wide hidden layer, a GEMM
and their backward (FIRE's block of 256 x 4096 pairs, H = 8, on CPU: forward ~2.5x, forward +
backward ~2x faster). Gradients reach W1, b1, W2 and b2 through the small [H, S] tables α and β
(autograd), x through β.

On its breakpoint a unit is off (torch's ReLU has derivative 0 at 0), which neither neighbouring
interval says for every unit at once; so the pieces are the open intervals and the breakpoints
themselves: piece 2i is the interval above i breakpoints, an odd piece a breakpoint. Only gradients
see the difference (f is continuous): values are taken from the interval below a breakpoint. Where
-b1/W1 is not a float, the float nearest it counts as the breakpoint: one x per unit whose gradient
follows rounding, as the fp32 layers' did near it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def relu_mlp(first: nn.Linear, second: nn.Linear, x: Tensor) -> Tensor:
    """second(relu(first(x))) for every element of x: [H, *x.shape], in the parameters' dtype under
    autocast too (where the layers ran in bf16: lookups and a multiply-add gain nothing from it).
    Without autograd, no graph and nothing saved."""
    breakpoints, alpha, beta = pieces(first, second)
    if torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad):
        return _PiecewiseLinear.apply(x, alpha, beta, breakpoints)
    return _evaluate(x, alpha[:, ::2], beta[:, ::2], torch.bucketize(x, breakpoints))


def pieces(first: nn.Linear, second: nn.Linear) -> tuple[Tensor, Tensor, Tensor]:
    """(the U breakpoints, sorted; α and β [H, 2U + 1] per piece, differentiable in the parameters).

    x lies in piece #breakpoints < x + #breakpoints <= x. Unit k is on where x > τ_k, the pieces
    from 2·#breakpoints <= τ_k on (W1_k > 0), or where x < τ_k, those up to 2·#breakpoints < τ_k
    (W1_k < 0). A unit without a finite breakpoint (W1_k = 0, or -b1/W1 overflows) is on everywhere
    or nowhere, as b1_k > 0 says; its breakpoint is +inf, past every x, so that their number is U
    whatever the weights (no data-dependent shape: no GPU sync, no graph break under
    torch.compile)."""
    w1, b1 = first.weight[:, 0], first.bias  # (U,)
    with torch.no_grad():
        tau = -b1 / w1
        finite = tau.isfinite()
        tau = torch.where(finite, tau, float("inf"))
        breakpoints = tau.sort().values
        # (U,)
        below, upto = (
            torch.searchsorted(breakpoints, tau),
            torch.searchsorted(breakpoints, tau, right=True),
        )
        piece = torch.arange(2 * len(breakpoints) + 1, device=w1.device)[:, None]  # (S, 1)
        on = torch.where(
            finite, ((w1 > 0) & (piece >= 2 * upto)) | ((w1 < 0) & (piece <= 2 * below)), b1 > 0
        )
    on = on.to(w1.dtype)  # (S, U)
    # products summed by hand rather than by @, which autocast would round to bf16
    alpha = second.bias[:, None] + (second.weight[:, None, :] * b1 * on).sum(-1)  # (H, S)
    beta = (second.weight[:, None, :] * w1 * on).sum(-1)  # (H, S)
    return breakpoints, alpha, beta


def _evaluate(x: Tensor, alpha: Tensor, beta: Tensor, below: Tensor) -> Tensor:
    """α + β·x of the interval each x lies in or ends (α, β [H, U + 1] of the intervals; below:
    #breakpoints < x): [H, *x.shape]."""
    # (H, N): gather reads it ~1.7x faster than index_select
    index = below.view(1, -1).expand(len(alpha), -1)
    out = alpha.gather(1, index).view(len(alpha), *x.shape)
    return out.addcmul_(beta.gather(1, index).view_as(out), x)


class _PiecewiseLinear(torch.autograd.Function):
    """α[:, piece] + β[:, piece]·x with the gradients of α and β summed over each piece's pairs."""

    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, beta: Tensor, breakpoints: Tensor) -> Tensor:
        below = torch.bucketize(x, breakpoints)
        ctx.save_for_backward(x, beta, breakpoints, below)
        return _evaluate(x, alpha[:, ::2], beta[:, ::2], below)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, beta, breakpoints, below = ctx.saved_tensors
        rows = x.flatten(0, -2) if x.dim() > 1 else x.view(1, -1)  # (R, K)
        # (see pieces)
        piece = (below + torch.bucketize(x, breakpoints, right=True)).view(rows.shape)
        g = grad.reshape(len(beta), *rows.shape)  # (H, R, K)
        grad_x = grad_alpha = grad_beta = None
        if ctx.needs_input_grad[0]:
            grad_x = (
                (g * beta.gather(1, piece.view(1, -1).expand(len(beta), -1)).view_as(g))
                .sum(0)
                .view_as(x)
            )
        if ctx.needs_input_grad[1]:
            grad_alpha = _piece_sums(g, piece, beta.shape[1])
        if ctx.needs_input_grad[2]:
            grad_beta = _piece_sums(g * rows, piece, beta.shape[1])
        return grad_x, grad_alpha, grad_beta, None


def _piece_sums(values: Tensor, piece: Tensor, n_pieces: int) -> Tensor:
    """Σ of values [H, R, K] over the pairs of each piece [R, K]: [H, S]. Row by row first, then
    over the rows: one running fp32 sum per piece over a block's pairs (index_add_, as fast) erred
    ~10x more, and more than the MLP's GEMM; float64 sums would cost a third more time."""
    h, r, _ = values.shape
    return values.new_zeros(h, r, n_pieces).scatter_add_(2, piece.expand_as(values), values).sum(1)
