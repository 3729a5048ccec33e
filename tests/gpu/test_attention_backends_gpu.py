"""Each attention backend on CUDA (bf16) against the exact reference in fp32 on the same bf16
inputs: output, lse and the gradients of q, k and v.

Cases: fixed-length documents (dense cuDNN and flash), packed documents of lengths 1, odd and
long (flash; sdpa_cudnn must refuse), GQA, head dims 64 and 128, and the zigzag ring's blocks
at cp=2 run on one GPU (each rank's blocks merged with the lse and differentiated with the
merged out/lse, as ``ring.py`` does), so the lse of each backend is what the merge needs.
Tolerances (DESIGN's bf16 rule): norm-wise relative error <= 1e-2 on out and gradients; lse
absolute <= 2e-2 (fp32 lse from bf16 scores of magnitude ~10).
"""

import pytest
import torch

from parallel.attention import context_attention
from parallel.attention.primitive import (
    attention_with_lse,
    block_backward,
    block_forward,
    plan_block,
)
from parallel.attention.reference import merge_partials, reference_backward, reference_forward

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _meta(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return doc, torch.arange(sum(lengths)) - starts[doc]


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _qkv(num, heads, kv_heads, dim, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(num, h, dim, device="cuda", generator=g).to(BF16)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _check(name, got, want, tol=1e-2):
    err = _rel(got, want)
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def _reference(q, k, v, dq_out, doc_q, pos_q, doc_k, pos_k, scale):
    """fp32 forward and backward on the same (bf16) values."""
    meta = [t.cuda() for t in (doc_q, pos_q, doc_k, pos_k)]
    out, lse = reference_forward(q.float(), k.float(), v.float(), *meta, scale)
    grads = reference_backward(dq_out.float(), q.float(), k.float(), v.float(), out, lse,
                               *meta, scale)
    return out, lse, grads


@pytest.mark.parametrize("backend", ["flash", "sdpa_cudnn", "auto"])
@pytest.mark.parametrize("lengths, heads, kv_heads, dim", [
    ([1024] * 4, 32, 8, 64), ([777] * 3, 8, 2, 128), ([2048] * 2, 16, 16, 64)])
def test_fixed_length_documents(backend, lengths, heads, kv_heads, dim):
    doc, pos = _meta(lengths)
    q, k, v = _qkv(sum(lengths), heads, kv_heads, dim, seed=len(lengths))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_with_lse(*leaves, doc_q=doc, pos_q=pos, cu_seqlens=_cu(lengths),
                                  backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    want, want_lse, grads = _reference(q, k, v, dout, doc, pos, doc, pos, dim ** -0.5)
    assert out.dtype == BF16 and lse.dtype == torch.float32 and lse.shape == want_lse.shape
    _check(f"{backend} out", out, want)
    assert (lse - want_lse).abs().max().item() <= 2e-2, f"{backend} lse"
    for n, leaf, g in zip("qkv", leaves, grads, strict=True):
        _check(f"{backend} d{n}", leaf.grad, g)


def test_packed_documents_flash_and_sdpa_refuses():
    lengths = [1, 300, 5, 4634, 1, 77, 2048]  # length 1, odd, long
    doc, pos = _meta(lengths)
    q, k, v = _qkv(sum(lengths), 32, 8, 64, seed=3)
    for backend in ("flash", "auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = context_attention(*leaves, doc_id=doc, pos=pos, cu_seqlens=_cu(lengths),
                                backend=backend)
        dout = torch.randn_like(out)
        out.backward(dout)
        want, _, grads = _reference(q, k, v, dout, doc, pos, doc, pos, 64 ** -0.5)
        _check(f"{backend} out", out, want)
        for n, leaf, g in zip("qkv", leaves, grads, strict=True):
            _check(f"{backend} d{n}", leaf.grad, g)
    with pytest.raises(ValueError, match="segments have different lengths"):
        context_attention(q, k, v, doc_id=doc, pos=pos, cu_seqlens=_cu(lengths),
                          backend="sdpa_cudnn")


def _zigzag(lengths, cp, rank):
    docs, poss = [], []
    for d, n in enumerate(lengths):
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            docs.append(torch.full((chunk,), d))
            poss.append(torch.arange(c * chunk, (c + 1) * chunk))
    return torch.cat(docs), torch.cat(poss)


@pytest.mark.parametrize("backend", ["flash", "sdpa_cudnn"])
def test_zigzag_ring_blocks_merge_with_the_lse(backend):
    """Ring steps at cp=2 on one GPU: per rank, every block's partial result merged with its
    lse, then each block's backward given the MERGED out/lse; against the reference of the
    rank's queries over all keys."""
    lengths, cp, heads, kv_heads, dim = [2048, 2048, 2048], 2, 16, 4, 64
    scale = dim ** -0.5
    metas = [_zigzag(lengths, cp, r) for r in range(cp)]
    num = metas[0][0].numel()
    qkv = [_qkv(num, heads, kv_heads, dim, seed=10 + r) for r in range(cp)]
    douts = [torch.randn(num, heads, dim, device="cuda").to(BF16) for _ in range(cp)]
    all_doc = torch.cat([m[0] for m in metas])
    all_pos = torch.cat([m[1] for m in metas])
    all_k = torch.cat([t[1] for t in qkv])
    all_v = torch.cat([t[2] for t in qkv])
    dk_sum = torch.zeros(all_k.shape, device="cuda")
    dv_sum = torch.zeros(all_v.shape, device="cuda")
    dk_want = torch.zeros(all_k.shape, device="cuda")
    dv_want = torch.zeros(all_v.shape, device="cuda")
    for rank in range(cp):
        q = qkv[rank][0]
        blocks = [plan_block(q, *metas[rank], *metas[src], None, backend) for src in range(cp)]
        assert all(c.backend == backend for b in blocks for c in b.calls)
        out = torch.zeros(q.shape, device="cuda")
        lse = torch.full((heads, num), float("-inf"), device="cuda")
        for src, block in enumerate(blocks):
            out, lse = merge_partials(out, lse, *block_forward(q, qkv[src][1], qkv[src][2],
                                                               block, scale))
        want_out, want_lse, (dq_w, dk_w, dv_w) = _reference(
            q, all_k, all_v, douts[rank], *metas[rank], all_doc, all_pos, scale)
        _check(f"{backend} rank {rank} out", out, want_out)
        assert (lse - want_lse).abs().max().item() <= 2e-2, f"rank {rank} lse"
        dq = torch.zeros(q.shape, device="cuda")
        for src, block in enumerate(blocks):
            g = block_backward(douts[rank], q, qkv[src][1], qkv[src][2], out.to(BF16), lse,
                               block, scale)
            dq += g[0].float()
            dk_sum[src * num:(src + 1) * num] += g[1].float()
            dv_sum[src * num:(src + 1) * num] += g[2].float()
        _check(f"{backend} rank {rank} dq", dq, dq_w)
        dk_want += dk_w
        dv_want += dv_w
    _check(f"{backend} dk", dk_sum, dk_want)
    _check(f"{backend} dv", dv_sum, dv_want)
