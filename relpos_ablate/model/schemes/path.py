"""PaTH attention (Yang et al., NeurIPS 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations"): the content product q_i·k_j replaced by a product through
data-dependent transforms,

    logit_ij = q_iᵀ (H_i' H_(i'-1) ··· H_(j+1)) k_j,      H_t = I - β_t·w_t·w_tᵀ,

one transform per token t of [memory; x] and head, applied to the key from the one after it up to
the query's own (j = i': no transform). As the reference code (fla-org/flash-linear-attention,
`PaTHAttention` with its defaults): w_t = l2-normalised SiLU(causal depthwise conv, kernel 3, of a
rank-32 projection W_2 W_1 x_t), β_t = 2·σ(W_β x_t + b) in (0, 2) (negative eigenvalues allowed),
the score s·logit with s = 1/sqrt(d_head). It replaces term a (terms 'a' only) and carries the
positions itself (no RoPE). With memory the transforms are recomputed from the memory's layer
inputs, as FoX's gates are; the conv starts afresh at the first memory token (and at a packed
document's first token). A padded key gets β =
0 (H = I). PaTH-FoX: `forget_gate: true`.

Exact, O(K²·d + K·C²) work and O(K²) memory (the logits are materialised), in chunks of C = 64
tokens: within a chunk the products of its transforms come from one unit-triangular solve (the
compact form of a product of Householder-like matrices, `_within_chunks`): the logits between the
chunk's own tokens, its queries taken back to its first token, its keys forward to its last, and the
chunk's product T_c = H_(a+C-1) ··· H_a as a d×d matrix; the keys of earlier chunks are carried
forward chunk by chunk through T_c (K/C steps), and each query meets them after the transforms of
its own chunk up to itself. docs/schemes/score-readers.md#path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.model.documents import causal_conv

W_RANK = 32  # the reference's low-rank w projection
CONV = 3  # the reference's short convolution


class PathTransforms(nn.Module):
    """w_t and β_t per token and head, and the logits through their products."""

    def __init__(self, d_model: int, n_heads: int, d_head: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        self.w_down = nn.Linear(d_model, W_RANK, bias=False)
        self.w_up = nn.Linear(W_RANK, n_heads * d_head, bias=False)
        self.w_conv = nn.Conv1d(
            n_heads * d_head, n_heads * d_head, CONV, groups=n_heads * d_head, bias=False
        )
        self.beta = nn.Linear(d_model, n_heads, bias=True)

    def transforms(
        self,
        keys_input: Tensor,
        key_padding_mask: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(w [B, H, K, dh] unit vectors, β [B, H, K]) from the keys' layer inputs [B, K,
        d_model]; packed documents [B, K]: the convolution stops at a document's first token."""
        b, n_keys, _ = keys_input.shape
        w = self.w_up(self.w_down(keys_input))  # (B, K, H·dh)
        if documents is None:  # causal: token t reads t-2 .. t
            w = self.w_conv(F.pad(w.transpose(1, 2), (CONV - 1, 0)))
        else:
            w = causal_conv(w, self.w_conv.weight, documents).transpose(1, 2)
        w = F.silu(w)  # (B, H·dh, K)
        w = F.normalize(w.view(b, self.n_heads, self.d_head, n_keys).transpose(-1, -2), dim=-1)
        beta = 2 * torch.sigmoid(self.beta(keys_input)).transpose(1, 2)  # (B, H, K)
        if key_padding_mask is not None:
            beta = beta.masked_fill(key_padding_mask[:, None, :], 0.0)
        return w, beta

    def logits(
        self,
        q: Tensor,
        k: Tensor,
        keys_input: Tensor,
        key_padding_mask: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """q_iᵀ H_i' ··· H_(j+1) k_j (unscaled): q [B, H, L, dh] (queries at key indices K - L ..),
        k [B, H, K, dh] -> [B, H, L, K]; entries with j > i' are left 0 (the causal mask hides
        them)."""
        # bf16 products of many transforms would drift
        wide = torch.promote_types(k.dtype, torch.float32)
        with torch.autocast(k.device.type, enabled=False):
            w, beta = self.transforms(keys_input.to(wide), key_padding_mask, documents)
            return path_logits(q.to(wide), k.to(wide), w.to(wide), beta.to(wide)).to(q.dtype)


def path_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, chunk: int = 64) -> Tensor:
    """The module docstring's algorithm: q [B, H, L, dh], k and w [B, H, K, dh], β [B, H, K] -> [B,
    H, L, K]."""
    b, h, n_queries, dh = q.shape
    n_keys = k.shape[2]
    c = min(chunk, n_keys)
    n_chunks = -(-n_keys // c)
    pad = n_chunks * c - n_keys
    # a query row for every key index (memory rows: 0)
    queries = F.pad(q, (0, 0, n_keys - n_queries, pad))
    # β 0: H = I
    keys, w, beta = (F.pad(k, (0, 0, 0, pad)), F.pad(w, (0, 0, 0, pad)), F.pad(beta, (0, pad)))
    shape = (b, h, n_chunks, c)
    queries, keys, w = (t.view(*shape, dh) for t in (queries, keys, w))
    beta = beta.view(*shape, 1)
    intra, starts, ends, chunk_product = _within_chunks(queries, keys, w, beta)
    rows = []
    # earlier chunks' keys, through every transform up to this chunk
    carried = keys.new_zeros(b, h, 0, dh)
    for n in range(n_chunks):
        across = starts[:, :, n] @ carried.transpose(-1, -2)  # (B, H, C, n·C)
        rows.append(F.pad(torch.cat([across, intra[:, :, n]], dim=-1), (0, (n_chunks - n - 1) * c)))
        carried = torch.cat(
            [carried @ chunk_product[:, :, n].transpose(-1, -2), ends[:, :, n]], dim=2
        )
    full = torch.cat(rows, dim=2)  # (B, H, n·C, n·C)
    return full[:, :, n_keys - n_queries : n_keys, :n_keys]


def _within_chunks(
    q: Tensor, k: Tensor, w: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per chunk of C tokens a..e (every tensor [B, H, n, C, ·]): the logits between its own tokens,
    its queries through its transforms back to a (H_a ··· H_i q_i), its keys through them up to e
    (H_e ··· H_(j+1) k_j), and T = H_e ··· H_a [.., d, d]. Expanding H_i ··· H_(j+1) = I -
    Σ_{s=j+1..i} z_s w_sᵀ from the right gives z_s = β_s (w_s - Σ_{r=s+1..i} (w_r·w_s) z_r), a unit
    upper-triangular system in s (the compact form of a product of Householder-like matrices): its
    solution for a query's coefficients a_s = q_i·z_s and for the chunk's end (the z_s with i = e)
    is one triangular solve per chunk."""
    c, dh = q.shape[-2], q.shape[-1]
    offsets = torch.arange(c, device=q.device)
    upper = torch.triu(w @ w.transpose(-1, -2), diagonal=1)  # (.., C, C): w_s·w_r for r > s
    system = torch.eye(c, dtype=q.dtype, device=q.device) + beta * upper  # row s scaled by β_s
    seen = (offsets[:, None] <= offsets[None, :]).to(q.dtype)  # [s, i]: s <= i
    rhs = torch.cat([beta * (w @ q.transpose(-1, -2)) * seen, beta * w], dim=-1)  # (.., C, C + d)
    solved = torch.linalg.solve_triangular(system, rhs, upper=True, unitriangular=True)
    # a[s, i] = q_i·z_s (0 for s > i); z[s] for the chunk's end
    a, z = (solved[..., :c], solved[..., c:])
    before = (offsets[None, :] < offsets[:, None]).to(q.dtype)  # [s, j]: j < s
    key_weights = (w @ k.transpose(-1, -2)) * before  # [s, j]: w_s·k_j where H_s acts on key j
    intra = q @ k.transpose(-1, -2) - a.transpose(-1, -2) @ key_weights  # [i, j]
    starts = q - a.transpose(-1, -2) @ w
    ends = k - key_weights.transpose(-1, -2) @ z
    chunk_product = torch.eye(dh, dtype=q.dtype, device=q.device) - z.transpose(-1, -2) @ w
    return intra, starts, ends, chunk_product
