"""Fused loss heads on CUDA (Triton row kernels, cuBLAS GEMMs) against float64 PyTorch math.

Tolerances (DESIGN.md): bf16/fp16 inputs, loss abs <= 1e-3 and grads rel <= 1e-2; fp32 rel
<= 1e-5. The float64 reference upcasts the very same (rounded) inputs, so only the kernel's own
arithmetic is measured. Shapes: N not a multiple of any block, H not a power of two, padded
vocab rows, V=152064 (not a multiple of the 8192-column block) and a peaked softmax.
"""

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels import _lce_chunks, linear_cross_entropy, linear_logprobs
from mpcore.kernels.linear_cross_entropy import linear_cross_entropy_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rel(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def _inputs(n, h, v_rows, vocab, dtype, peaked=False):
    gen = torch.Generator(device="cuda").manual_seed(n + h + v_rows)
    hidden = torch.randn(n, h, device="cuda", generator=gen)
    weight = torch.randn(v_rows, h, device="cuda", generator=gen) * (2.0 / h**0.5)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    labels[::17] = -100
    if peaked:  # even rows: the label's logit sits ~60 above the rest
        rows = torch.arange(0, n, 2, device="cuda")
        labels[rows] = torch.arange(rows.numel(), device="cuda") % vocab
        weight[labels[rows]] = hidden[rows] * (60.0 / h)
    return (hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels)


def _leaf64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


@pytest.fixture(params=["one_chunk", "many_chunks"])
def chunking(request, monkeypatch):
    if request.param == "many_chunks":
        monkeypatch.setattr(_lce_chunks, "CHUNK_BYTES", 32 * 1024 * 1024)
    return request.param


def _check_ce(n, h, v_rows, vocab, dtype, peaked=False, temperature=1.0):
    hidden, weight, labels = _inputs(n, h, v_rows, vocab, dtype, peaked)
    h64, w64 = _leaf64(hidden, weight)
    ref = F.cross_entropy(h64 @ w64[:vocab].T / temperature, labels)
    loss = linear_cross_entropy(hidden, weight, labels, vocab_size=vocab,
                                temperature=temperature)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == dtype
    assert abs(loss.item() - ref.item()) <= (1e-5 * abs(ref.item()) if dtype == torch.float32
                                             else 1e-3)
    assert _rel(gh, rh) <= grad_tol and _rel(gw, rw) <= grad_tol
    assert (gw[vocab:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_vs_float64(dtype, chunking):
    _check_ce(2000, 1000, 32128, 32000, dtype, temperature=0.9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peaked_softmax(dtype):
    _check_ce(1000, 768, 8192, 8000, dtype, peaked=True)


def test_vocab_152064_not_a_block_multiple():
    _check_ce(513, 256, 152064, 151646, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("peaked", [False, True])
def test_logprobs_entropy_vs_float64(dtype, peaked, chunking):
    n, vocab = 1500, 32000
    hidden, weight, labels = _inputs(n, 1000, 32128, vocab, dtype, peaked)
    lp, ent = linear_logprobs(hidden, weight, labels, vocab_size=vocab, temperature=1.1)
    h64, w64 = _leaf64(hidden, weight)
    log_p = torch.log_softmax(h64 @ w64[:vocab].T / 1.1, -1)
    valid = labels >= 0
    rlp = torch.where(valid, log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    rent = -(log_p.exp() * log_p).sum(-1)
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert (lp - rlp).abs().max() <= tol and (ent - rent).abs().max() <= tol
    a = torch.randn(n, device="cuda", dtype=torch.float64)
    b = torch.randn(n, device="cuda", dtype=torch.float64)
    gh, gw = torch.autograd.grad((lp * a.float() + ent * b.float()).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((rlp * a + rent * b).sum(), (h64, w64))
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(gh, rh) <= grad_tol and _rel(gw, rw) <= grad_tol


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_matches_torch_rows_on_cuda(reduction):
    hidden, weight, labels = _inputs(777, 512, 20000, 19999, torch.bfloat16)
    got = linear_cross_entropy(hidden, weight, labels, reduction=reduction, vocab_size=19999)
    want = linear_cross_entropy_reference(hidden, weight, labels, reduction=reduction,
                                          vocab_size=19999)
    assert (got - want).abs().max() <= 1e-5
    up = torch.randn_like(got)
    g = torch.autograd.grad(got, (hidden, weight), up)
    w = torch.autograd.grad(want, (hidden, weight), up)
    assert _rel(g[0], w[0]) <= 1e-2 and _rel(g[1], w[1]) <= 1e-2


def test_extra_memory_is_grads_plus_one_chunk():
    hidden, weight, labels = _inputs(4096, 2048, 64128, 64000, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, labels)
    torch.cuda.synchronize()
    before_backward = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.cuda.synchronize()
    # The gradients were made in the forward: backward only scales them, allocating nothing.
    assert torch.cuda.max_memory_allocated() - before_backward <= 16 * 2**20
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    assert before_backward - before <= grad_bytes + 2**20
    del loss, grads
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(linear_cross_entropy(hidden, weight, labels), (hidden, weight))
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= grad_bytes + _lce_chunks.CHUNK_BYTES + 64 * 2**20, extra / 2**30


def test_label_out_of_range_raises_on_cuda():
    hidden, weight, labels = _inputs(64, 128, 1000, 1000, torch.bfloat16)
    labels[5] = 1000
    with pytest.raises(ValueError, match="must lie in"):
        linear_cross_entropy(hidden, weight, labels)
