"""TP/SP layers at tp in {1, 2, 4}, SP on and off, against single-process torch references.

The reference weights are drawn the way the layers' init draws the logical full tensor (normal,
std 0.02, from a generator with the same seed), then put into plain ``nn.Linear`` /
``nn.Embedding`` / ``F.cross_entropy``; nothing of ours is in the reference path.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpcore.parallel.cross_entropy import vocab_parallel_cross_entropy
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _full(seed, *shape, std=0.02):
    return torch.empty(*shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tokens(x, tp, rank, sp):
    return x.chunk(tp)[rank] if sp else x


def _mlp_case(state, sp):
    """Column(in=12 -> 16, bias) -> gelu -> Row(16 -> 12, bias), vs two nn.Linear."""
    tp, rank, group = state.tp, state.tp_rank, state.tp_group
    T, d_in, d_hid = 8, 12, 16
    col = ColumnParallelLinear(d_in, d_hid, bias=True, group=group, sequence_parallel=sp)
    row = RowParallelLinear(d_hid, d_in, bias=True, group=group, sequence_parallel=sp)
    col.reset_parameters(seed=11)
    row.reset_parameters(seed=22)
    ref1, ref2 = nn.Linear(d_in, d_hid), nn.Linear(d_hid, d_in)
    with torch.no_grad():
        ref1.weight.copy_(_full(11, d_hid, d_in))
        ref1.bias.copy_(_full(12, d_hid))
        ref2.weight.copy_(_full(22, d_in, d_hid))
        ref2.bias.zero_()
        row.bias.copy_(_rand(5, d_in))  # a non-zero bias so its gradient path is exercised
        ref2.bias.copy_(_rand(5, d_in))
    x_full = _rand(1, T, d_in).requires_grad_()
    g_full = _rand(2, T, d_in)
    (ref2(F.gelu(ref1(x_full))) * g_full).sum().backward()

    x = _tokens(x_full.detach(), tp, rank, sp).clone().requires_grad_()
    y = row(F.gelu(col(x)))
    torch.testing.assert_close(y, _tokens(ref2(F.gelu(ref1(x_full))), tp, rank, sp), **TOL)
    (y * _tokens(g_full, tp, rank, sp)).sum().backward()
    torch.testing.assert_close(x.grad, _tokens(x_full.grad, tp, rank, sp), **TOL)
    torch.testing.assert_close(col.weight.grad, ref1.weight.grad.chunk(tp)[rank], **TOL)
    torch.testing.assert_close(col.bias.grad, ref1.bias.grad.chunk(tp)[rank], **TOL)
    torch.testing.assert_close(row.weight.grad, ref2.weight.grad.chunk(tp, dim=1)[rank], **TOL)
    torch.testing.assert_close(row.bias.grad, ref2.bias.grad, **TOL)


def _column_gather_case(state, sp):
    """Column with gather_output and fused parts [8, 4, 4] (a QKV-like projection)."""
    tp, rank, group = state.tp, state.tp_rank, state.tp_group
    col = ColumnParallelLinear(6, 16, group=group, gather_output=True, sequence_parallel=sp,
                               partition_sizes=[8, 4, 4])
    col.reset_parameters(seed=33)
    w = _full(33, 16, 6).requires_grad_()
    x_full = _rand(3, 8, 6).requires_grad_()
    g = _rand(4, 8, 16)
    ref = x_full @ w.T
    (ref * g).sum().backward()
    x = _tokens(x_full.detach(), tp, rank, sp).clone().requires_grad_()
    y = col(x)
    # Gathered output is in rank-major part order: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...].
    perm = torch.cat([p.chunk(tp)[r] for r in range(tp) for p in
                      torch.arange(16).split([8, 4, 4])])
    torch.testing.assert_close(y, ref[:, perm], **TOL)
    (y * g[:, perm]).sum().backward()
    torch.testing.assert_close(x.grad, _tokens(x_full.grad, tp, rank, sp), **TOL)
    mine = torch.cat([p.chunk(tp)[rank] for p in torch.arange(16).split([8, 4, 4])])
    torch.testing.assert_close(col.weight.grad, w.grad[mine], **TOL)


def _embedding_case(state, sp, vocab):
    tp, rank, group = state.tp, state.tp_rank, state.tp_group
    emb = VocabParallelEmbedding(vocab, 6, group=group, sequence_parallel=sp)
    emb.reset_parameters(seed=44)
    ref = nn.Embedding(vocab, 6)
    with torch.no_grad():
        ref.weight.copy_(_full(44, vocab, 6))
    ids = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(5))
    ids[0], ids[1] = vocab - 1, 0  # both ends of the vocab
    g = _rand(6, 12, 6)
    (ref(ids) * g).sum().backward()
    y = emb(ids)
    torch.testing.assert_close(y, _tokens(ref(ids), tp, rank, sp), **TOL)
    (y * _tokens(g, tp, rank, sp)).sum().backward()
    padded = torch.cat([ref.weight.grad, torch.zeros(emb.padded_vocab - vocab, 6)])
    torch.testing.assert_close(emb.weight.grad, padded.chunk(tp)[rank], **TOL)
    try:
        emb(torch.tensor([vocab]))
    except ValueError as e:
        assert f"outside the vocab [0, {vocab})" in str(e)
    else:
        raise AssertionError("id == vocab was embedded silently")


def _cross_entropy_case(state, vocab):
    tp, rank, group = state.tp, state.tp_rank, state.tp_group
    padded = -(-vocab // tp) * tp
    logits_full = _rand(7, 10, vocab) * 3
    # Padding columns get huge values: if they leaked into the softmax the loss would show it.
    logits_pad = torch.cat([logits_full, torch.full((10, padded - vocab), 50.0)], dim=1)
    labels = torch.randint(0, vocab, (10,), generator=torch.Generator().manual_seed(8))
    labels[2] = -100
    labels[3] = vocab - 1
    g = _rand(9, 10)
    ref_in = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, labels, reduction="none", ignore_index=-100)
    (ref * g).sum().backward()
    local = logits_pad.chunk(tp, dim=1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, vocab_size=vocab, group=group)
    torch.testing.assert_close(loss, ref, **TOL)
    (loss * g).sum().backward()
    ref_grad = torch.cat([ref_in.grad, torch.zeros(10, padded - vocab)], dim=1)
    torch.testing.assert_close(local.grad, ref_grad.chunk(tp, dim=1)[rank], **TOL)


def _layers(rank, world):
    state = ParallelState.build(tp=world)
    for sp in (False, True):
        _mlp_case(state, sp)
        _column_gather_case(state, sp)
        _embedding_case(state, sp, vocab=64)
    _cross_entropy_case(state, vocab=64)
    return True


def _uneven_vocab(rank, world):
    state = ParallelState.build(tp=world)
    _embedding_case(state, False, vocab=1000)
    _cross_entropy_case(state, vocab=1000)
    return True


def test_layers_tp1():
    assert _layers(0, 1)


def test_layers_tp2_tp4():
    for tp in (2, 4):
        assert all(run_distributed(_layers, tp))


@pytest.mark.slow
def test_uneven_vocab_1000_tp3():
    assert all(run_distributed(_uneven_vocab, 3))
