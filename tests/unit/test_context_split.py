"""Context split (parallel/context.py), single process: every rank simulated in one loop.

References are plain-Python per-document loops over the unsplit stream, not our own code.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcore.parallel import ContextPlan, LabelShifter, loss_share, split_batch
from mpcore.parallel.loss import global_valid_count

IGNORE = -100


def reference_labels(ids, cu, mask=None, ignored=()):
    out = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        for t in range(start, end):
            ok = t + 1 < end and (mask is None or mask[t + 1]) and ids[t + 1] not in ignored
            out.append(ids[t + 1] if ok else IGNORE)
    return out


def doc_of(cu, t):
    return next(d for d in range(len(cu) - 1) if cu[d] <= t < cu[d + 1])


@st.composite
def cases(draw):
    lengths = draw(st.lists(st.integers(1, 13), min_size=1, max_size=5))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    with_mask = draw(st.booleans())
    ignored = tuple(draw(st.sets(st.integers(1, 30), max_size=3)))
    return dict(cu=cu, total=total, cp=draw(st.sampled_from([1, 2, 4])),
                layout=draw(st.sampled_from(["contiguous", "zigzag"])),
                pad_multiple=draw(st.sampled_from([1, 2])), with_mask=with_mask, ignored=ignored,
                seed=draw(st.integers(0, 2**16)))


def check_padding(plan, cu):
    cp, m, total = plan.cp, plan.pad_multiple, plan.total
    n, p = plan.doc_lengths.tolist(), plan.padded_doc_lengths.tolist()
    assert plan.local_length * cp == plan.padded_total == sum(p)
    assert plan.local_length % m == 0
    if plan.layout == "zigzag":
        assert all(pd % (2 * cp) == 0 and pd >= nd for pd, nd in zip(p, n, strict=True))
        assert all(pd - nd < 2 * cp for pd, nd in zip(p[:-1], n[:-1], strict=True))
        assert plan.padded_total - sum((nd + 2 * cp - 1) // (2 * cp) * 2 * cp for nd in n) < \
            cp * math.lcm(2, m)
    else:
        assert p[:-1] == n[:-1] and plan.padded_total - total < cp * m


def check_rank(plan, rank, cu):
    """Segments never cross documents; positions and chunks agree with global indices."""
    lay = plan.rank_layout(rank)
    gi, doc_id, pos = lay.global_index.tolist(), lay.doc_id.tolist(), lay.positions_in_doc.tolist()
    seg = lay.cu_seqlens.tolist()
    assert lay.cu_seqlens.dtype == torch.int32 and seg[0] == 0 and seg[-1] == plan.local_length
    assert all(b > a for a, b in zip(seg[:-1], seg[1:], strict=True))
    assert lay.max_seqlen == max(b - a for a, b in zip(seg[:-1], seg[1:], strict=True))
    for a, b in zip(seg[:-1], seg[1:], strict=True):
        assert len(set(doc_id[a:b])) == 1
        real = [g for g in gi[a:b] if g >= 0]
        assert len(real) in (0, b - a), "padding shares a segment with real tokens"
        if real:
            assert len({doc_of(cu, g) for g in real}) == 1 and real == sorted(real)
            assert doc_id[a] == doc_of(cu, real[0])
        else:
            assert doc_id[a] >= plan.num_docs
    for g, p in zip(gi, pos, strict=True):
        if g >= 0:
            assert p == g - cu[doc_of(cu, g)]
    covered = []
    for ch in lay.chunks:
        for k in range(ch.length):
            i, off = ch.local_start + k, ch.doc_start + k
            real = off < plan.doc_lengths[ch.doc]
            assert gi[i] == (cu[ch.doc] + off if real else -1)
            covered.append(i)
    assert covered == list(range(plan.local_length))
    if plan.layout == "zigzag":
        c = plan.padded_doc_lengths // (2 * plan.cp)
        expected = [(d, k * int(c[d]), int(c[d])) for d in range(plan.num_docs)
                    for k in (rank, 2 * plan.cp - 1 - rank)]
        assert [(ch.doc, ch.doc_start, ch.length) for ch in lay.chunks] == expected
    return lay


def check_mask_contract(plan, layouts, cu):
    """Build the attention mask from (doc_id, positions_in_doc) across ranks; compare."""
    doc_id = torch.cat([lay.doc_id for lay in layouts])
    pos = torch.cat([lay.positions_in_doc for lay in layouts])
    gi = torch.cat([lay.global_index for lay in layouts])
    visible = (doc_id[:, None] == doc_id[None, :]) & (pos[None, :] <= pos[:, None])
    real = gi >= 0
    doc = torch.tensor([doc_of(cu, g) if g >= 0 else -1 for g in gi.tolist()])
    expected = (doc[:, None] == doc[None, :]) & (gi[None, :] <= gi[:, None])
    sub = real[:, None] & real[None, :]
    assert torch.equal(visible[sub], expected[sub])
    assert not visible[real][:, ~real].any() and not visible[~real][:, real].any()
    assert visible.diagonal().all()  # every query sees at least itself: no empty softmax row


@settings(max_examples=50, deadline=None)
@given(cases())
def test_split_properties(case):
    cu, total, cp = case["cu"], case["total"], case["cp"]
    gen = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(1, 30, (total,), generator=gen)
    mask = (torch.rand(total, generator=gen) > 0.3) if case["with_mask"] else None
    labels = LabelShifter(ignore_token_ids=case["ignored"])(ids, torch.tensor(cu), mask)
    expected = reference_labels(ids.tolist(), cu, None if mask is None else mask.tolist(),
                                case["ignored"])
    assert labels.tolist() == expected
    plan = ContextPlan(torch.tensor(cu, dtype=torch.int32), total, cp, case["layout"],
                       case["pad_multiple"])
    check_padding(plan, cu)
    mrope = torch.randint(0, 1000, (3, total), generator=gen)
    hidden = torch.randn(total, 5, generator=gen)
    layouts, shards = [], {"ids": [], "mrope": [], "hidden": []}
    for rank in range(cp):
        lay = check_rank(plan, rank, cu)
        layouts.append(lay)
        gi = lay.global_index
        local_labels = plan.split(labels, rank, pad_value=IGNORE)
        for i, g in enumerate(gi.tolist()):
            assert local_labels[i].item() == (expected[g] if g >= 0 else IGNORE)
        local_mrope = plan.split(mrope, rank)
        assert local_mrope.shape == (3, plan.local_length)
        assert torch.equal(local_mrope[:, gi >= 0], mrope[:, gi[gi >= 0]])
        assert (local_mrope[:, gi < 0] == 0).all()
        shards["ids"].append(plan.split(ids, rank))
        shards["mrope"].append(local_mrope)
        shards["hidden"].append(plan.split(hidden, rank, dim=0))
    all_gi = torch.cat([lay.global_index for lay in layouts])
    assert sorted(all_gi[all_gi >= 0].tolist()) == list(range(total))
    assert torch.equal(plan.gather_from_shards(shards["ids"]), ids)
    assert torch.equal(plan.gather_from_shards(shards["mrope"]), mrope)
    assert torch.equal(plan.gather_from_shards(shards["hidden"], dim=0), hidden)
    check_mask_contract(plan, layouts, cu)
    if case["layout"] == "zigzag":
        # Causal work (keys per query) on padded documents is the same on every rank.
        work = [sum((ch.doc_start + k + 1) for ch in lay.chunks for k in range(ch.length))
                for lay in layouts]
        assert len(set(work)) == 1


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_real_causal_work(cp):
    lengths = [8 * cp, 2 * cp, 6 * cp]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    work = {}
    for layout in ("zigzag", "contiguous"):
        plan = ContextPlan(cu, None, cp, layout)
        work[layout] = [int((plan.rank_layout(r).positions_in_doc + 1).sum()) for r in range(cp)]
    assert len(set(work["zigzag"])) == 1
    assert len(set(work["contiguous"])) > 1  # the imbalance zigzag exists to remove


def test_root_cause_slice_then_roll_is_wrong_exactly_at_boundaries():
    cp, cu = 2, [0, 5, 8, 16, 20]  # documents of 5, 3, 8 and 4 tokens
    ids = torch.randperm(1000)[:20] + 1  # distinct ids: no accidental agreement
    shifter = LabelShifter()
    labels = shifter(ids, torch.tensor(cu))
    assert labels.tolist() == reference_labels(ids.tolist(), cu)
    # A roll over the unsplit packed stream is wrong exactly at the document ends.
    rolled = torch.roll(ids, -1)
    assert set((rolled != labels).nonzero().view(-1).tolist()) == {4, 7, 15, 19}
    plan = ContextPlan(torch.tensor(cu), 20, cp, "contiguous")
    assert plan.local_length == 10 and plan.padded_total == 20
    differ = set()
    for rank in range(cp):
        gi = plan.rank_layout(rank).global_index
        naive = torch.roll(plan.split(ids, rank), -1)  # the bug: shift after the split
        ours = plan.split(labels, rank, pad_value=IGNORE)  # shift, then split
        differ |= {int(gi[i]) for i in (naive != ours).nonzero().view(-1)}
        for i, g in enumerate(gi.tolist()):
            d = doc_of(cu, g)
            assert ours[i] == (ids[g + 1] if g + 1 < cu[d + 1] else IGNORE)
    shard_ends = {9, 19}
    doc_ends = {4, 7, 15, 19}
    assert differ == shard_ends | doc_ends


@settings(max_examples=40, deadline=None)
@given(cases())
def test_root_cause_property(case):
    """Slice-then-roll differs from ours iff t ends a document or its local successor is not t+1."""
    cu, total = case["cu"], case["total"]
    ids = torch.randperm(10 * total, generator=torch.Generator().manual_seed(case["seed"]))
    ids = ids[:total] + 1
    labels = LabelShifter()(ids, torch.tensor(cu))
    plan = ContextPlan(torch.tensor(cu), total, case["cp"], case["layout"], case["pad_multiple"])
    doc_ends = {e - 1 for e in cu[1:]}
    for rank in range(case["cp"]):
        gi = plan.rank_layout(rank).global_index.tolist()
        naive = torch.roll(plan.split(ids, rank), -1)
        ours = plan.split(labels, rank, pad_value=IGNORE)
        for i, g in enumerate(gi):
            if g < 0:
                assert ours[i] == IGNORE
                continue
            successor = gi[(i + 1) % len(gi)]
            assert bool(naive[i] != ours[i]) == (g in doc_ends or successor != g + 1)
            assert ours[i] == (IGNORE if g in doc_ends else ids[g + 1])


def test_split_batch_moves_every_tensor_together():
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    total = 11
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (total,), generator=gen)
    labels = LabelShifter()(ids, cu)
    batch = dict(input_ids=ids, labels=labels, position_ids=torch.randint(0, 9, (3, total)),
                 loss_mask=torch.rand(total, generator=gen) > 0.5, loss_weights=torch.rand(total),
                 cu_seqlens=cu, inputs_embeds=torch.randn(total, 4), pixel_values=torch.randn(2, 7))
    plan = ContextPlan(cu, total, 2, "zigzag")
    for rank in range(2):
        out = split_batch(batch, plan, rank, pad_id=7, replicate=("pixel_values",),
                          token_dims={"inputs_embeds": 0})
        gi = plan.rank_layout(rank).global_index
        real, pad = gi >= 0, gi < 0
        assert pad.any()
        for key in ("input_ids", "labels", "position_ids", "loss_mask", "loss_weights"):
            assert torch.equal(out[key][..., real], batch[key][..., gi[real]])
        assert torch.equal(out["inputs_embeds"][real], batch["inputs_embeds"][gi[real]])
        assert (out["labels"][pad] == IGNORE).all() and (out["input_ids"][pad] == 7).all()
        assert not out["loss_mask"][pad].any() and (out["loss_weights"][pad] == 0).all()
        assert out["pixel_values"] is batch["pixel_values"]
        assert torch.equal(out["cu_seqlens"], plan.rank_layout(rank).cu_seqlens)


def test_split_and_gather_are_differentiable():
    cu = torch.tensor([0, 5, 9])
    plan = ContextPlan(cu, 9, 2, "zigzag", pad_multiple=2)
    x = torch.randn(9, 3, requires_grad=True)
    w = torch.randn(9, 3)
    out = plan.gather_from_shards([plan.split(x, r, dim=0) for r in range(2)], dim=0)
    (out * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_split_loss_shares_add_up_to_the_unsplit_mean():
    cu = torch.tensor([0, 7, 8, 19])
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 40, (19,), generator=gen)
    labels = LabelShifter()(ids, cu, torch.rand(19, generator=gen) > 0.4)
    per_token = torch.rand(19, generator=gen, dtype=torch.float64) + 0.5
    valid = labels != IGNORE
    expected = per_token[valid].mean()
    for layout in ("contiguous", "zigzag"):
        plan = ContextPlan(cu, None, 4, layout)
        local_labels = [plan.split(labels, r, pad_value=IGNORE) for r in range(4)]
        local_loss = [plan.split(per_token, r, pad_value=float("nan")) for r in range(4)]
        n = global_valid_count(local_labels, None)
        assert int(n) == int(valid.sum())
        total = sum(loss_share(lo, la, n) for lo, la in zip(local_loss, local_labels, strict=True))
        assert torch.allclose(total, expected, rtol=1e-12, atol=0)


def _plan():
    return ContextPlan(torch.tensor([0, 3, 7]), 7, 2, "zigzag")


BAD_INPUTS = [
    (lambda: ContextPlan(None, 8, 2, "striped"), "unknown context-parallel layout"),
    (lambda: ContextPlan(None, 8, 0, "zigzag"), "cp must be a positive integer"),
    (lambda: ContextPlan(None, 8, 2, "zigzag", pad_multiple=0), "pad_multiple"),
    (lambda: ContextPlan(None, None, 2, "zigzag"), "pass total"),
    (lambda: ContextPlan(None, 0, 2, "zigzag"), "total must be a positive"),
    (lambda: ContextPlan(torch.tensor([0, 3, 7]), 8, 2, "zigzag"), "ends at 7"),
    (lambda: ContextPlan(torch.tensor([1, 3, 7]), None, 2, "zigzag"), "start at 0"),
    (lambda: ContextPlan(torch.tensor([0, 3, 3, 7]), None, 2, "zigzag"), "strictly increasing"),
    (lambda: ContextPlan(torch.tensor([[0, 7]]), None, 2, "zigzag"), "1-D"),
    (lambda: _plan().split(torch.arange(8), 0), "T=7"),
    (lambda: _plan().split(torch.arange(7)[None].expand(3, 7).T, 0), "T=7"),
    (lambda: _plan().split(torch.arange(7), 2), "rank must be"),
    (lambda: _plan().split(torch.arange(7), 0, dim=1), "no dim 1"),
    (lambda: _plan().split([0] * 7, 0), "torch.Tensor"),
    (lambda: _plan().gather_from_shards([torch.zeros(8)]), "1 shards"),
    (lambda: _plan().gather_from_shards([torch.zeros(4), torch.zeros(3)]), "L=4"),
    (lambda: _plan().gather_from_shards([torch.zeros(4), torch.zeros(2, 4)]), "same shape"),
    (lambda: _plan().gather(torch.zeros(8), None), "cp=2"),
    (lambda: split_batch({"labels": torch.zeros(6)}, _plan(), 0), "T=7"),
    (lambda: split_batch({"labels": list(range(7))}, _plan(), 0), "replicate"),
    (lambda: split_batch({"cu_seqlens": torch.tensor([0, 2, 7])}, _plan(), 0), "differs"),
    (lambda: loss_share(torch.zeros(8), torch.zeros(7, dtype=torch.long), 3), "shape"),
    (lambda: loss_share(torch.zeros(7), torch.zeros(7), 3), "bool valid mask"),
    (lambda: loss_share(torch.zeros(7, dtype=torch.long), torch.zeros(7).bool(), 3), "floating"),
    (lambda: global_valid_count([], None), "no labels"),
]


@pytest.mark.parametrize("call,match", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()
