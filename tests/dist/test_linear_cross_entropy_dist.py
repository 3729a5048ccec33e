"""Vocab-parallel fused loss heads on 2 and 4 gloo ranks against the unsharded float64 math.

One spawn of 4 ranks covers tp=4 (the world group) and tp=2 (groups {0,1} and {2,3}). Every
rank builds the same full weight from one seed and keeps its rows; hidden states and labels are
replicated, as in a TP group. The hidden gradient each rank returns is its partial sum over its
shard, so the test all-reduces it before comparing (the TP layer's f mapping does that in a
model). Vocab sizes leave padding rows, and at tp=4 one case leaves the last shard all padding.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist.harness import run_distributed

N, H = 37, 24


class _CountAllReduce:
    """Counts the all-reduces the engine issues (the collectives still run)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _rel(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _check_case(group, v_local, vocab, temperature, counter):
    from mpcore.kernels import linear_cross_entropy, linear_logprobs

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(1000 * tp + vocab)
    full_w = torch.randn(v_local * tp, H, generator=gen) / H**0.5
    hidden0 = torch.randn(N, H, generator=gen)
    labels = torch.randint(0, vocab, (N,), generator=gen)
    labels[[1, 17, 36]] = -100
    rows = slice(rank * v_local, (rank + 1) * v_local)
    h64, w64 = (t.double().requires_grad_() for t in (hidden0, full_w))
    logits = h64 @ w64[:vocab].T / temperature
    kw = dict(temperature=temperature, vocab_size=vocab, group=group)
    where = f"tp={tp} rank={rank} vocab={vocab}"

    def compare(out, ref, up, name, calls):
        hidden = hidden0.clone().requires_grad_()
        weight = full_w[rows].clone().requires_grad_()
        counter.calls = 0
        got = out(hidden, weight)
        assert counter.calls == calls, f"{where} {name}: {counter.calls} all-reduces"
        assert _rel(got, ref) < 1e-5, f"{where} {name}: value {_rel(got, ref):.2e}"
        counter.calls = 0
        gh, gw = torch.autograd.grad(got, (hidden, weight), up.float())
        assert counter.calls == 0, f"{where} {name}: backward ran collectives"
        dist.all_reduce(gh, group=group)  # the partial hidden gradients sum to the full one
        rh, rw = torch.autograd.grad(ref, (h64, w64), up, retain_graph=True)
        assert _rel(gh, rh) < 1e-5, f"{where} {name}: hidden grad {_rel(gh, rh):.2e}"
        assert _rel(gw, rw[rows]) < 1e-5, f"{where} {name}: weight grad {_rel(gw, rw[rows]):.2e}"

    num_chunks = -(-N // 8)
    for reduction in ("mean", "sum", "none"):
        ref = F.cross_entropy(logits, labels, reduction=reduction)
        calls = 2 * num_chunks if reduction != "none" else 2
        compare(lambda h, w, r=reduction: linear_cross_entropy(h, w, labels, reduction=r, **kw),
                ref, torch.randn_like(ref), f"ce {reduction}", calls)
    log_p = torch.log_softmax(logits, -1)
    rlp = torch.where(labels >= 0, log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    rent = -(log_p.exp() * log_p).sum(-1)
    a, b = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)

    def logprobs_mix(h, w):
        lp, ent = linear_logprobs(h, w, labels, **kw)
        return torch.stack([lp, ent])

    compare(logprobs_mix, torch.stack([rlp, rent]), torch.stack([a, b]), "logprobs", 2)


def _run(rank, world_size):
    from mpcore.kernels import _lce_chunks

    _lce_chunks.CHUNK_BYTES = 8 * 16 * 4  # 8 rows of fp32 logits at v_local=16: 5 chunks
    counter = _CountAllReduce(dist.all_reduce)
    _lce_chunks.dist.all_reduce = counter
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    torch.manual_seed(0)
    _check_case(pair, 16, 29, 1.0, counter)  # tp=2: rank 1 holds 16..31, 13 real rows
    _check_case(None if world_size == 1 else dist.group.WORLD, 16, 61, 0.8, counter)
    _check_case(dist.group.WORLD, 16, 40, 1.3, counter)  # tp=4: rank 3 is all padding
    return True


@pytest.mark.slow
def test_vocab_parallel_matches_unsharded():
    assert run_distributed(_run, 4) == [True] * 4
