"""The Triton row kernels of the fused loss heads, run by Triton's interpreter on CPU tensors.

Triton decides at ``@triton.jit`` time whether a kernel is interpreted, so the checks run in a
fresh subprocess with ``TRITON_INTERPRET=1`` set before anything imports ``kernels``. The tensors
are CPU tensors, which only the interpreter accepts, and the subprocess also checks that the
kernel object is an ``InterpretedFunction``. fp32 and fp16 only: bf16 ``tl.dot`` is wrong under
the interpreter (DESIGN.md); these kernels have no dot, but bf16 is left to the GPU tests.
"""


import pytest

from tests.unit.interpret import needs_triton, run_under_interpreter


def _close(actual, expected, rel):

    actual, expected = actual.double(), expected.double()
    err = ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


def _check_rows(dtype):
    import torch

    from mpcore.kernels import _lce_triton as tri
    from mpcore.kernels._lce_chunks import TorchRows, grad_view

    n, v, n_valid = 13, 77, 70  # 7 padding columns; blocks of 16 leave a ragged tail
    rel = 1e-5 if dtype == torch.float32 else 2e-3
    logits = (torch.randn(n, v) * 3).to(dtype)
    tgt = torch.randint(-1, n_valid, (n,), dtype=torch.int32)
    tgt[0] = -1
    for inv_temp, entropy in ((1.0, True), (1.25, False)):
        got = tri.row_stats(logits, tgt, n_valid, inv_temp, entropy, block=16)
        want = TorchRows.row_stats(logits, tgt, n_valid, inv_temp, entropy)
        _close(got, want, 1e-5)
    empty = tri.row_stats(logits, tgt.fill_(-1), 0, 1.0, True, block=16)  # all-padding shard
    assert torch.isneginf(empty[0]).all() and (empty[1:] == 0).all()

    tgt = torch.randint(-1, n_valid, (n,), dtype=torch.int32)
    stats = TorchRows.row_stats(logits, tgt, n_valid, 0.8, True)
    lse, ez = stats[0] + stats[1].log(), stats[0] + stats[3] / stats[1]
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    for ent_args in ((ez, g_ent), (None, None)):
        got, want = torch.full_like(logits, float("nan")), torch.empty_like(logits)
        tri.row_grad(logits, got, tgt, lse, ent_args[0], g_lp, ent_args[1], n_valid, 0.8,
                     block=32)
        TorchRows.row_grad(logits, want, tgt, lse, ent_args[0], g_lp, ent_args[1], n_valid, 0.8)
        assert (got[:, n_valid:] == 0).all()
        _close(got, want, rel)

    got, want = torch.full_like(logits, float("nan")), torch.empty_like(logits)
    s_got = tri.row_stats_and_grad(logits, got, tgt, g_lp, n_valid, 0.8, block=16)
    s_want = TorchRows.row_stats_and_grad(logits, want, tgt, g_lp, n_valid, 0.8)
    _close(s_got[:3], s_want[:3], 1e-5)
    _close(got, want, rel)

    # fp32 logits holding their own 16-bit gradient in the first half of each row.
    logits32 = torch.randn(n, v) * 3
    want = torch.empty(n, v, dtype=torch.float16)
    TorchRows.row_stats_and_grad(logits32.clone(), want, tgt, g_lp, n_valid, 0.8)
    got = grad_view(logits32, torch.float16)
    tri.row_stats_and_grad(logits32, got, tgt, g_lp, n_valid, 0.8, block=16)
    _close(got, want, 2e-3)


def _check_scale():
    import torch

    from mpcore.kernels import _lce_triton as tri

    x = torch.randn(10001, dtype=torch.float16)
    y = x.clone()
    tri.scale_(y, torch.tensor(1.0))
    assert torch.equal(y, x)
    tri.scale_(y, torch.tensor(-0.37))
    assert torch.equal(y, (x.float() * -0.37).half())
    for s in (1.0, -0.37):  # out of place: always written, the product rounded once
        z = tri.scale_to(x, torch.tensor(s), torch.float32)
        assert z.dtype == torch.float32 and torch.equal(z, x.float() * s)


def _check_engine():
    import torch
    import torch.nn.functional as F

    from mpcore.kernels import _lce_chunks
    from mpcore.kernels.linear_cross_entropy import _cross_entropy, _logprobs

    _lce_chunks.CHUNK_BYTES = 8 * 50 * 4  # 8-row chunks: 5 chunks for 37 tokens
    n, h, v_rows, vocab = 37, 24, 50, 45
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v_rows, h) / h**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    labels[[3, 20]] = -100
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logits = h64 @ w64[:vocab].T / 0.7
    for reduction in ("mean", "none"):
        loss = _cross_entropy(hidden, weight, labels, -100, reduction, 0.7, vocab, None, "triton")
        ref = F.cross_entropy(logits, labels, reduction=reduction)
        _close(loss, ref, 1e-5)
        up = torch.randn_like(ref)
        got = torch.autograd.grad(loss, (hidden, weight), up.float())
        want = torch.autograd.grad(ref, (h64, w64), up, retain_graph=True)
        for a, b in zip(got, want, strict=True):
            _close(a, b, 1e-5)
    lp, ent = _logprobs(hidden, weight, labels, 0.7, vocab, None, True, -100, "triton")
    log_p = torch.log_softmax(logits, -1)
    rlp = torch.where(labels >= 0, log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    rent = -(log_p.exp() * log_p).sum(-1)
    _close(lp, rlp, 1e-5)
    _close(ent, rent, 1e-5)
    a, b = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    got = torch.autograd.grad((lp * a.float() + ent * b.float()).sum(), (hidden, weight))
    want = torch.autograd.grad((rlp * a + rent * b).sum(), (h64, w64))
    for x, y in zip(got, want, strict=True):
        _close(x, y, 1e-5)


def _main():
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import _lce_triton

    assert isinstance(_lce_triton._lce_rows_kernel, InterpretedFunction), "not interpreted"
    torch.manual_seed(0)
    _check_rows(torch.float32)
    _check_rows(torch.float16)
    _check_scale()
    _check_engine()
    print("INTERPRETED-OK")


@needs_triton
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__name__, "INTERPRETED-OK")


if __name__ == "__main__":
    _main()
