"""Fused linear cross-entropy / log-prob heads (CPU path) against float64 PyTorch math.

Shapes are chosen to be awkward: N not a multiple of any block, H not a power of two, weight
rows past ``vocab_size`` (padding), and a chunk budget so small that every call walks many token
chunks (the CUDA path uses the same chunk engine).
"""

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels import _lce_chunks, linear_cross_entropy, linear_logprobs
from mpcore.kernels.linear_cross_entropy import (
    linear_cross_entropy_reference,
    linear_logprobs_reference,
)

N, H, V_ROWS, VOCAB = 37, 24, 50, 45  # weight has 50 rows, the last 5 are padding


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    # 8 rows of 50 fp32 logits per chunk: a 37-token call walks 5 chunks, the last one short.
    monkeypatch.setattr(_lce_chunks, "CHUNK_BYTES", 8 * V_ROWS * 4)


def _inputs(dtype=torch.float32, scale=1.0, ignore_index=-100):
    hidden = (torch.randn(N, H) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(V_ROWS, H) / H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (N,))
    labels[[2, 11, 30]] = ignore_index
    return hidden, weight, labels


def _leaf64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _rel(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _ref_logprobs(hidden, weight, labels, temperature, ignore_index=-100):
    log_p = torch.log_softmax(hidden @ weight[:VOCAB].T / temperature, dim=-1)
    valid = labels != ignore_index
    lp = torch.where(valid, log_p.gather(1, labels.clamp(0, VOCAB - 1)[:, None])[:, 0], 0.0)
    return lp, -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_cross_entropy_matches_float64(reduction, temperature, ignore_index):
    hidden, weight, labels = _inputs(ignore_index=ignore_index)
    loss = linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                reduction=reduction, temperature=temperature, vocab_size=VOCAB)
    h64, w64 = _leaf64(hidden, weight)
    ref = F.cross_entropy(h64 @ w64[:VOCAB].T / temperature, labels, ignore_index=ignore_index,
                          reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert _rel(loss, ref) < 1e-5
    if reduction == "none":
        assert (loss[labels == ignore_index] == 0).all()
    up = torch.randn_like(ref)
    gh, gw = torch.autograd.grad(loss, (hidden, weight), up.float())
    rh, rw = torch.autograd.grad(ref, (h64, w64), up)
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    assert _rel(gh, rh) < 1e-5 and _rel(gw, rw) < 1e-5
    assert (gw[VOCAB:] == 0).all()  # padding rows never enter the softmax


@pytest.mark.parametrize("temperature", [1.0, 1.6])
def test_logprobs_and_entropy_match_float64(temperature):
    hidden, weight, labels = _inputs(scale=2.0)
    lp, ent = linear_logprobs(hidden, weight, labels, temperature=temperature, vocab_size=VOCAB)
    h64, w64 = _leaf64(hidden, weight)
    rlp, rent = _ref_logprobs(h64, w64, labels, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    assert _rel(lp, rlp) < 1e-5 and _rel(ent, rent) < 1e-5
    assert (lp[labels < 0] == 0).all()
    a, b = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    gh, gw = torch.autograd.grad((lp * a.float()).sum() + (ent * b.float()).sum(),
                                 (hidden, weight), retain_graph=True)
    rh, rw = torch.autograd.grad((rlp * a).sum() + (rent * b).sum(), (h64, w64),
                                 retain_graph=True)
    assert _rel(gh, rh) < 1e-5 and _rel(gw, rw) < 1e-5
    # Each output alone (the other's gradient is None in autograd).
    gh_lp = torch.autograd.grad((lp * a.float()).sum(), hidden, retain_graph=True)[0]
    assert _rel(gh_lp, torch.autograd.grad((rlp * a).sum(), h64, retain_graph=True)[0]) < 1e-5
    gh_ent = torch.autograd.grad((ent * b.float()).sum(), hidden)[0]
    assert _rel(gh_ent, torch.autograd.grad((rent * b).sum(), h64)[0]) < 1e-5


def test_logprobs_without_entropy_and_peaked_softmax():
    hidden, weight, labels = _inputs()
    weight.data[7] = hidden.detach()[0] * 4.0  # token 0: logit 7 towers over the rest
    lp, ent = linear_logprobs(hidden, weight, labels, vocab_size=VOCAB, with_entropy=False)
    assert ent is None
    h64, w64 = _leaf64(hidden, weight)
    rlp, rent = _ref_logprobs(h64, w64, labels, 1.0)
    assert rent[0] < 1e-6  # the test really is peaked
    assert _rel(lp, rlp) < 1e-5
    _, ent = linear_logprobs(hidden, weight, labels, vocab_size=VOCAB)
    assert (ent - rent).abs().max() < 1e-5
    up = torch.randn(N, dtype=torch.float64)
    gw = torch.autograd.grad((lp * up.float()).sum(), weight)[0]
    assert _rel(gw, torch.autograd.grad((rlp * up).sum(), w64)[0]) < 1e-5


def test_grad_paths_and_no_grad_agree():
    hidden, weight, labels = _inputs()
    full = linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    gh, gw = torch.autograd.grad(full, (hidden, weight))
    only_h = linear_cross_entropy(hidden, weight.detach(), labels, vocab_size=VOCAB)
    only_w = linear_cross_entropy(hidden.detach(), weight, labels, vocab_size=VOCAB)
    with torch.no_grad():
        none = linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    assert torch.allclose(only_h, full) and torch.allclose(only_w, full)
    assert torch.allclose(none, full, rtol=1e-6)
    assert torch.equal(torch.autograd.grad(only_h, hidden)[0], gh)
    assert torch.equal(torch.autograd.grad(only_w, weight)[0], gw)


def test_reference_entry_points_match_public_api():
    hidden, weight, labels = _inputs()
    for reduction in ("mean", "none"):
        a = linear_cross_entropy(hidden, weight, labels, reduction=reduction, temperature=0.9)
        b = linear_cross_entropy_reference(hidden, weight, labels, reduction=reduction,
                                           temperature=0.9)
        assert torch.equal(a, b)
    lp, ent = linear_logprobs(hidden, weight, labels)
    rlp, rent = linear_logprobs_reference(hidden, weight, labels)
    assert torch.equal(lp, rlp) and torch.equal(ent, rent)


def test_all_ignored_mean_is_nan_with_zero_grads():
    hidden, weight, labels = _inputs()
    labels[:] = -100
    loss = linear_cross_entropy(hidden, weight, labels)
    assert torch.isnan(loss)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert (gh == 0).all() and (gw == 0).all()


def test_second_backward_of_stored_grads_raises():
    hidden, weight, labels = _inputs()
    loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_fp32_outputs_and_input_dtype_grads(dtype):
    hidden, weight, labels = _inputs(dtype)
    loss = linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    lp, ent = linear_logprobs(hidden, weight, labels, vocab_size=VOCAB)
    h64, w64 = _leaf64(hidden, weight)
    ref = F.cross_entropy(h64 @ w64[:VOCAB].T, labels)
    assert loss.dtype == lp.dtype == ent.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 2e-2
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    assert gh.dtype == gw.dtype == dtype
    assert _rel(gh, rh) < 2e-2 and _rel(gw, rw) < 2e-2


def test_torch_compile_fullgraph_matches_eager():
    hidden, weight, labels = _inputs()

    def step(h, w, y):
        loss = linear_cross_entropy(h, w, y, vocab_size=VOCAB, temperature=0.8)
        lp, ent = linear_logprobs(h, w, y, vocab_size=VOCAB)
        return loss + 0.1 * (lp.sum() + ent.sum())

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager = step(hidden, weight, labels)
    got = compiled(hidden, weight, labels)
    assert torch.allclose(got, eager, rtol=1e-6)
    ge = torch.autograd.grad(eager, (hidden, weight))
    gc = torch.autograd.grad(got, (hidden, weight))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ge, gc, strict=True))


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_logprobs])
def test_bad_inputs_raise_with_the_fix(fn):
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="shifted BEFORE the sequence split"):
        fn(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight width"):
        fn(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="floating"):
        fn(torch.randint(0, 3, (N, H)), weight, labels)
    with pytest.raises(ValueError, match="same dtype"):
        fn(hidden.half(), weight, labels)
    with pytest.raises(ValueError, match="must lie in"):
        fn(hidden, weight, torch.where(labels == 4, VOCAB, labels), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="must lie in"):
        fn(hidden, weight, torch.where(labels == 4, -1, labels))
    with pytest.raises(ValueError, match="vocab_size"):
        fn(hidden, weight, labels, vocab_size=V_ROWS + 1)
    with pytest.raises(ValueError, match="temperature"):
        fn(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="integer"):
        fn(hidden, weight, labels.float())


def test_bad_reduction_raises():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="avg")


def test_autocast_runs_the_heads_in_the_autocast_dtype():
    """Under autocast fp32 inputs are cast like nn.Linear's: the result equals the call on
    bf16 inputs, and the gradients come back to the fp32 leaves."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, 24, generator=g, requires_grad=True)
    weight = torch.randn(50, 24, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, labels)
        logprobs, entropy = linear_logprobs(hidden, weight, labels)
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()
    assert torch.equal(loss, linear_cross_entropy(h16, w16, labels))
    want_lp, want_ent = linear_logprobs(h16, w16, labels)
    assert torch.equal(logprobs, want_lp) and torch.equal(entropy, want_ent)
    (loss + logprobs.sum()).backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="same dtype"):  # outside autocast: still explicit
        linear_cross_entropy(hidden, w16, labels)
