"""The Gated DeltaNet reference ops (models/common/hybrid/deltanet.py) against a naive per-token
recurrence in float64 and against transformers' own torch functions, on packed documents of
lengths 1, 2, 3 (shorter than the conv window), odd and long (several chunks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpcore.models.common.hybrid.deltanet import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    segment_positions,
)

LENGTHS = [1, 2, 3, 37, 130, 5]
HK, HV, DK, DV, K = 2, 4, 8, 6, 4


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _inputs(lengths, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, HK, DK, generator=gen, dtype=dtype)
    k = torch.randn(t, HK, DK, generator=gen, dtype=dtype)
    v = torch.randn(t, HV, DV, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(t, HV, generator=gen, dtype=dtype)) * 0.3
    beta = torch.rand(t, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _naive(q, k, v, g, beta, cu, reset=True):
    """Token by token, the state reset at each document (``reset=False``: one stream)."""
    q, k = l2norm(q) * DK ** -0.5, l2norm(k)
    q, k = q.repeat_interleave(HV // HK, 1), k.repeat_interleave(HV // HK, 1)
    out = torch.zeros_like(v)
    state = q.new_zeros(HV, DK, DV)
    starts = set(cu[:-1].tolist())
    for t in range(q.shape[0]):
        if reset and t in starts:
            state = q.new_zeros(HV, DK, DV)
        state = state * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * err)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_rule_equals_naive_recurrence_and_its_gradients(chunk):
    cu = _cu(LENGTHS)
    args = [t.requires_grad_() for t in _inputs(LENGTHS)]
    ours = chunk_gated_delta_rule(*args, cu, chunk_size=chunk)
    naive = _naive(*args, cu)
    assert (ours - naive).abs().max() < 1e-10
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), args)
    naive_grads = torch.autograd.grad((naive * weights).sum(), args)
    for a, b in zip(grads, naive_grads, strict=True):
        assert (a - b).abs().max() < 1e-9


def test_packed_stream_equals_documents_one_by_one():
    """A state or window leaking across a boundary changes the later documents: the check
    below sees the leak (the naive run without resets differs), and ours has none."""
    cu = _cu(LENGTHS)
    q, k, v, g, beta = _inputs(LENGTHS)
    packed = chunk_gated_delta_rule(q, k, v, g, beta, cu, chunk_size=16)
    x = torch.randn(sum(LENGTHS), 5, dtype=torch.float64)
    w = torch.randn(5, K, dtype=torch.float64)
    conv = causal_conv1d(x, w, segment_positions(cu, x.shape[0]))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        one = torch.tensor([0, b - a])
        alone = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one,
                                       chunk_size=16)
        assert (packed[a:b] - alone).abs().max() < 1e-12
        conv_alone = causal_conv1d(x[a:b], w, torch.arange(b - a))
        assert (conv[a:b] - conv_alone).abs().max() < 1e-14
    leaky = _naive(q, k, v, g, beta, cu, reset=False)
    assert (leaky - packed).abs().max() > 1e-3
    leaky_conv = causal_conv1d(x, w, torch.arange(x.shape[0]))
    assert (leaky_conv - conv).abs().max() > 1e-3


def test_matches_transformers_torch_functions_per_document():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    cu = _cu(LENGTHS)
    q, k, v, g, beta = _inputs(LENGTHS, dtype=torch.float32, seed=3)
    ours = chunk_gated_delta_rule(q, k, v, g, beta, cu)
    x = torch.randn(sum(LENGTHS), 7)
    w = torch.randn(7, K)
    conv = causal_conv1d(x, w, segment_positions(cu, x.shape[0]))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref, _ = hf.torch_chunk_gated_delta_rule(
            q[None, a:b], k[None, a:b], v[None, a:b], g=g[None, a:b], beta=beta[None, a:b],
            use_qk_l2norm_in_kernel=True)
        assert (ours[a:b] - ref[0]).abs().max() < 1e-5
        ref_conv = hf.causal_conv1d_fn(x[None, a:b].transpose(1, 2), w, None, activation="silu")
        assert (conv[a:b] - ref_conv[0].t()).abs().max() < 1e-6


def test_dtypes_and_empty():
    cu = _cu([3, 70])
    args = _inputs([3, 70], dtype=torch.bfloat16)
    out = chunk_gated_delta_rule(*args, cu)
    assert out.dtype == torch.bfloat16 and out.shape == (73, HV, DV)
    ref = chunk_gated_delta_rule(*(a.double() for a in args), cu)
    assert (out.double() - ref).abs().max() < 3e-2
    empty = _inputs([1])
    out = chunk_gated_delta_rule(*(t[:0] for t in empty), torch.tensor([0]))
    assert out.shape == (0, HV, DV)


def test_kernel_choice_on_cpu():
    from mpcore.models.common.hybrid import kernels

    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert kernels.resolve("auto", x) == "reference"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kernels.resolve("fla", x)
    with pytest.raises(ValueError, match="gdn_kernel must be one of"):
        kernels.resolve("triton", x)
