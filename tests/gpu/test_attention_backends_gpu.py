"""Each attention backend on CUDA (bf16) against the exact reference in fp32 on the same bf16
inputs: output, lse and the gradients of q, k and v.

Cases: fixed-length documents (dense cuDNN, flash, TE's fused attention), packed documents of
lengths 1, odd and long (flash and te_fused; sdpa_cudnn must refuse), te_fused's own calls
(causal with fewer queries than keys per segment, full with other key lengths), GQA, head dims
64 and 128, and the zigzag ring's blocks at cp=2 run on one GPU (each rank's blocks merged with
the lse and differentiated with the merged out/lse, as ``ring.py`` does), so the lse of each
backend is what the merge needs. te_fused cases skip without TransformerEngine.
Tolerances (DESIGN's bf16 rule): norm-wise relative error <= 1e-2 on out and gradients; lse
absolute <= 2e-2 (fp32 lse from bf16 scores of magnitude ~10).
"""

import pytest
import torch

from mpcore.parallel.attention import context_attention, flash
from mpcore.parallel.attention.primitive import (
    attention_with_lse,
    block_backward,
    block_forward,
    plan_block,
)
from mpcore.parallel.attention.reference import (
    merge_partials,
    reference_backward,
    reference_forward,
)
from mpcore.parallel.te import te_available

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
needs_te = pytest.mark.skipif(not te_available(), reason="TransformerEngine not installed")
TE = pytest.param("te_fused", marks=needs_te)


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


@pytest.mark.parametrize("backend", ["flash", "sdpa_cudnn", "auto", TE])
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


PACKED = [1, 300, 5, 4634, 1, 77, 2048]  # length 1, odd, long


@pytest.mark.parametrize("backend, dim", [("flash", 64), ("auto", 64), ("flash", 128),
                                          pytest.param("te_fused", 64, marks=needs_te),
                                          pytest.param("te_fused", 128, marks=needs_te)])
def test_packed_documents_flash_and_sdpa_refuses(backend, dim):
    doc, pos = _meta(PACKED)
    heads, kv_heads = (32, 8) if dim == 64 else (16, 4)
    q, k, v = _qkv(sum(PACKED), heads, kv_heads, dim, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*leaves, doc_id=doc, pos=pos, cu_seqlens=_cu(PACKED),
                            backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    want, _, grads = _reference(q, k, v, dout, doc, pos, doc, pos, dim ** -0.5)
    _check(f"{backend} out", out, want)
    for n, leaf, g in zip("qkv", leaves, grads, strict=True):
        _check(f"{backend} d{n}", leaf.grad, g)
    with pytest.raises(ValueError, match="segments have different lengths"):
        context_attention(q, k, v, doc_id=doc, pos=pos, cu_seqlens=_cu(PACKED),
                          backend="sdpa_cudnn")


def _side(lengths, offsets):
    """(doc, pos) of segments of ``lengths`` starting at positions ``offsets``."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return doc, torch.arange(sum(lengths)) - starts[doc] + torch.tensor(offsets)[doc]


@needs_te
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, dim", [(32, 8, 64), (16, 4, 128)])
def test_te_fused_calls(causal, heads, kv_heads, dim):
    """One planned call run by te_fused (``flash.run_forward`` / ``run_backward``), the kinds
    a ring block makes: causal with fewer queries than keys in some segments (bottom-right
    aligned: queries are the LAST positions of their keys), and full with other key lengths
    (every key of the segment visible; more queries than keys in one segment)."""
    len_k = [1, 300, 5, 4634, 1, 77, 2048]
    len_q = [1, 151, 5, 4000, 1, 30, 2048] if causal else [3, 300, 1, 1024, 7, 77, 4096]
    if causal:  # query j of a segment of m over n keys sits at position n - m + j
        doc_q, pos_q = _side(len_q, [n - m for m, n in zip(len_q, len_k, strict=True)])
        doc_k, pos_k = _side(len_k, [0] * len(len_k))
    else:  # pos 0 everywhere: same document is the whole mask
        doc_q, doc_k = _side(len_q, [0] * len(len_q))[0], _side(len_k, [0] * len(len_k))[0]
        pos_q, pos_k = torch.zeros_like(doc_q), torch.zeros_like(doc_k)
    scale = dim ** -0.5
    q = _qkv(sum(len_q), heads, kv_heads, dim, seed=21)[0]
    k, v = _qkv(sum(len_k), heads, kv_heads, dim, seed=22)[1:]
    call = flash.FlashCall(causal, None, None, _cu(len_q).cuda(), _cu(len_k).cuda(),
                           max(len_q), max(len_k), False, "te_fused")
    out, lse = flash.run_forward(q, k, v, [call], scale)
    dout = torch.randn_like(q)
    dq, dk, dv = flash.run_backward(dout, q, k, v, out, lse, [call], scale)
    want, want_lse, grads = _reference(q, k, v, dout, doc_q, pos_q, doc_k, pos_k, scale)
    assert out.dtype == BF16 and lse.dtype == torch.float32 and lse.shape == want_lse.shape
    _check("te_fused out", out, want)
    assert (lse - want_lse).abs().max().item() <= 2e-2, "te_fused lse"
    assert dk.shape == k.shape and dv.shape == v.shape  # per kv head (GQA in the kernel)
    for n, got, g in zip("qkv", (dq, dk, dv), grads, strict=True):
        _check(f"te_fused d{n}", got, g)


@needs_te
def test_te_fused_refuses_what_it_cannot_take():
    doc, pos = torch.zeros(64, dtype=torch.long), torch.arange(64)
    q = torch.randn(64, 4, 64, device="cuda")
    with pytest.raises(ValueError, match="'te_fused' cannot run here: it takes float16"):
        context_attention(q, q, q, doc_id=doc, pos=pos, backend="te_fused")
    q = q[..., :48].repeat(1, 1, 4).to(BF16)  # head dim 192
    with pytest.raises(ValueError, match="head_dim a multiple of 8 up to 128"):
        context_attention(q, q, q, doc_id=doc, pos=pos, backend="te_fused")


def _zigzag(lengths, cp, rank):
    docs, poss = [], []
    for d, n in enumerate(lengths):
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            docs.append(torch.full((chunk,), d))
            poss.append(torch.arange(c * chunk, (c + 1) * chunk))
    return torch.cat(docs), torch.cat(poss)


EQUAL, RAGGED = [2048, 2048, 2048], [2048, 1024, 516, 4]  # ragged: chunks of 129 and 1


@pytest.mark.parametrize("backend, lengths", [
    ("flash", EQUAL), ("sdpa_cudnn", EQUAL), pytest.param("te_fused", EQUAL, marks=needs_te),
    ("flash", RAGGED), pytest.param("te_fused", RAGGED, marks=needs_te)])
def test_zigzag_ring_blocks_merge_with_the_lse(backend, lengths):
    """Ring steps at cp=2 on one GPU: per rank, every block's partial result merged with its
    lse, then each block's backward given the MERGED out/lse; against the reference of the
    rank's queries over all keys."""
    cp, heads, kv_heads, dim = 2, 16, 4, 64
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
