"""Gated DeltaNet in plain PyTorch: the short causal convolution and the chunked gated delta rule.

Layout: packed streams of independent segments (documents, or padding runs), token dim first.
``cu_seqlens [S+1]`` marks the segments; ``positions [T]`` is each token's position inside its
segment. Nothing crosses a segment boundary: the convolution window is cut at the segment's
first token and the recurrent state starts at zero in every segment.

Short convolution (depthwise, causal, kernel K): ``y[t, c] = silu(sum_j w[c, K-1-j] x[t-j, c])``
over the ``j <= positions[t]`` (earlier tokens of the same segment only), computed in the
weight's dtype and returned in x's, as transformers' ``causal_conv1d_fn``.

Gated delta rule, per value head (state ``S [Dk, Dv]``, zero at each segment's start):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
with q, k L2-normalised (``l2norm``) and q scaled by ``Dk ** -0.5``. Value heads are grouped over
key heads: value head h reads key head ``h // (Hv / Hk)``. Everything runs in float32 (float64
for float64 inputs), the output is cast back to q's dtype.

Chunked form (what runs): each segment is cut into chunks of C tokens (its last one padded with
inert tokens, k = v = beta = g = 0, so no chunk holds two segments). Inside a chunk, with
``G_i = g_1 + ... + g_i`` and ``S_0`` the state entering it, the writes
``u_i = beta_i (v_i - exp(G_i) S_0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j)`` solve the
unit lower-triangular system ``(I + A) U = beta V - beta exp(G) K S_0`` with
``A_ij = beta_i exp(G_i - G_j) k_i . k_j`` (j < i); then
    O = exp(G) Q S_0 + (exp(G_i - G_j) q_i . k_j)_{j<=i} U,
    S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T U.
The intra-chunk part is batched over all chunks; only the state passes from chunk to chunk (one
short loop), reset to zero at every chunk that opens a segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64 position of each token inside its segment (``cu_seqlens [S+1]``)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths,
                                  output_size=total)
    return torch.arange(total, device=cu.device) - cu[seg]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution + SiLU of ``x [T, C]`` by ``weight [C, K]``, cut at segment
    starts (``positions [T]``: position inside the segment). Returns ``[T, C]`` in x's dtype."""
    num, kernel = x.shape[0], weight.shape[-1]
    xw = x.to(weight.dtype)
    out = xw * weight[:, kernel - 1]
    for lag in range(1, min(kernel, num + 1)):
        # Token t reads token t - lag only inside its own segment: positions[t] >= lag.
        shifted = torch.cat([xw.new_zeros(lag, xw.shape[1]), xw[:-lag]])
        keep = (positions >= lag).unsqueeze(-1)
        out = out + torch.where(keep, shifted, 0.0) * weight[:, kernel - 1 - lag]
    return F.silu(out).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _chunk_layout(cu_seqlens: torch.Tensor, chunk: int, device):
    """Destination of each token in the per-segment padded buffer, the number of chunks, and
    which chunks open a segment. Reads ``cu_seqlens`` on the host (one sync on a GPU)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    chunks = (lengths + chunk - 1) // chunk  # (S,)
    padded_start = torch.cat([cu.new_zeros(1), chunks.cumsum(0) * chunk])[:-1]  # (S,)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    dest = padded_start[seg] + torch.arange(int(cu[-1])) - cu[seg]  # (T,)
    num_chunks = int(chunks.sum())
    opens = torch.zeros(num_chunks, dtype=torch.bool)
    opens[(padded_start // chunk)[chunks > 0]] = True
    return dest.to(device), num_chunks, opens.tolist()


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                           scale: float | None = None, use_l2norm: bool = True,
                           chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule of a packed stream (module docstring), segment by segment.

    ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]`` (``Hv % Hk == 0``), ``g, beta [T, Hv]`` (g <= 0:
    log decay), ``cu_seqlens [S+1]`` covering all T tokens. Returns ``o [T, Hv, Dv]`` in q's
    dtype; differentiable in q, k, v, g and beta.
    """
    num, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    out_dtype = q.dtype
    if num == 0:
        return v.new_zeros(0, hv, dv).to(out_dtype)
    # Autocast would run the matmuls below in bf16: the rule is fp32 throughout, as in
    # transformers' fallback and fla's accumulators.
    with torch.autocast(q.device.type, enabled=False):
        return _chunked(q, k, v, g, beta, cu_seqlens, scale, use_l2norm, chunk_size, out_dtype)


def _chunked(q, k, v, g, beta, cu_seqlens, scale, use_l2norm, chunk_size, out_dtype):
    """The body of ``chunk_gated_delta_rule`` (autocast off)."""
    _, hk, dk = k.shape
    hv, dv = v.shape[1:]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(compute), k.to(compute)
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    if hv != hk:  # each key head serves Hv / Hk consecutive value heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    v, g, beta = v.to(compute), g.to(compute), beta.to(compute)
    c = chunk_size
    dest, n, opens = _chunk_layout(cu_seqlens, c, q.device)

    def chunked(t):  # (T, H, ...) -> (N, H, C, ...) in the padded buffer
        buf = t.new_zeros((n * c, *t.shape[1:])).index_copy(0, dest, t)
        return buf.view(n, c, *t.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc, bc = (chunked(t) for t in (q, k, v, g, beta))  # (N, H, C, D) / (N, H, C)
    cum = gc.cumsum(-1)  # (N, H, C): G_i
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(c, dtype=compute, device=q.device)
    system = eye + (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    w_v = torch.linalg.solve_triangular(system, bc.unsqueeze(-1) * vc, upper=False,
                                        unitriangular=True)  # (N, H, C, Dv)
    w_k = torch.linalg.solve_triangular(system, (bc * cum.exp()).unsqueeze(-1) * kc,
                                        upper=False, unitriangular=True)  # (N, H, C, Dk)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # (N, H, C, C), causal inside the chunk
    q_decayed = qc * cum.exp().unsqueeze(-1)
    k_decayed = kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (N, H, 1, 1)
    state = q.new_zeros(hv, dk, dv)
    outs = []
    for i in range(n):
        if opens[i]:
            state = q.new_zeros(hv, dk, dv)  # a new segment: nothing carries over
        u = w_v[i] - w_k[i] @ state  # (H, C, Dv)
        outs.append(q_decayed[i] @ state + scores[i] @ u)
        state = chunk_decay[i] * state + k_decayed[i].transpose(-1, -2) @ u
    out = torch.stack(outs).transpose(1, 2).reshape(n * c, hv, dv)  # padded buffer order
    return out.index_select(0, dest).to(out_dtype)
