"""LabelShifter at depth k (multi-token prediction) against a plain definition, and through the
context split.

The reference is the definition in parallel/labels.py's docstring, written as a loop over
Python ints: mtp_ids_k[t] = ids[t+k] inside t's document (fill otherwise), labels at shift s:
ids[t+s] if t+s is inside t's document, is a target under the loss mask and not an ignored id.
"""

from __future__ import annotations

import pytest
import torch

from mpcore.parallel import ContextPlan, LabelShifter, split_batch

IGNORE = -100


def _reference(ids, lengths, mask, shift, ignored=()):
    out, start = [], 0
    for n in lengths:
        for t in range(start, start + n):
            s = t + shift
            ok = s < start + n and (mask is None or mask[s]) and ids[s] not in ignored
            out.append(ids[s] if ok else IGNORE)
        start += n
    return out


def _reference_ids(ids, lengths, k, fill):
    out, start = [], 0
    for n in lengths:
        out += [ids[t + k] if t + k < start + n else fill for t in range(start, start + n)]
        start += n
    return out


def _stream(lengths, seed, vocab=50, masked=True):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(1, vocab, (total,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = (torch.rand(total, generator=g) < 0.7) if masked else None
    return ids, cu, mask


# Documents of length 1, 2, k, k+1 and long for k up to 3, packed together, in a few orders.
LENGTHS = [[1, 2, 3, 4, 37], [37, 1, 1, 4, 2, 3], [5], [2, 1], [3, 4, 3, 4, 29, 1]]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("masked", [False, True])
def test_every_depth_equals_the_definition(lengths, masked):
    ids, cu, mask = _stream(lengths, seed=len(lengths) + 7 * masked, masked=masked)
    shifter = LabelShifter(ignore_token_ids=(7,))
    plain = ids.tolist()
    m = None if mask is None else mask.tolist()
    for target in shifter.mtp(ids, cu, mask, depth=3, fill_id=0):
        k = target.depth
        assert target.input_ids.tolist() == _reference_ids(plain, lengths, k, 0)
        assert target.labels.tolist() == _reference(plain, lengths, m, k + 1, (7,))
        assert target.labels.dtype == torch.int64
    for shift in (1, 2, 5):
        assert shifter(ids, cu, mask, shift=shift).tolist() == _reference(plain, lengths, m,
                                                                          shift, (7,))


def test_depth_one_is_the_next_token_labels_bit_for_bit():
    ids, cu, mask = _stream([1, 2, 3, 4, 37], seed=3)
    shifter = LabelShifter()
    assert torch.equal(shifter(ids, cu, mask), shifter(ids, cu, mask, shift=1))
    assert shifter(ids, cu, mask).tolist() == _reference(ids.tolist(), [1, 2, 3, 4, 37],
                                                         mask.tolist(), 1)


def test_a_masked_span_crossing_a_document_boundary():
    lengths = [6, 6]
    ids, cu, _ = _stream(lengths, seed=5, masked=False)
    mask = torch.zeros(12, dtype=torch.bool)
    mask[4:9] = True  # the last two tokens of doc 0 and the first three of doc 1
    (d1, d2) = LabelShifter().mtp(ids, cu, mask, depth=2)
    # depth 1 targets are 2 ahead: t=2,3 reach 4,5 (doc 0); t=6 reaches 8 (doc 1); t=4,5 would
    # reach 6,7 in doc 1 and must not.
    assert [t for t in range(12) if d1.labels[t] != IGNORE] == [2, 3, 6]
    assert [t for t in range(12) if d2.labels[t] != IGNORE] == [1, 2]


def test_no_target_crosses_into_the_next_document_however_deep():
    lengths = [3, 3, 3]
    ids = torch.arange(10, 19)
    cu = torch.tensor([0, 3, 6, 9])
    for target in LabelShifter().mtp(ids, cu, depth=4, fill_id=1):
        for t in range(9):
            doc = t // 3
            label = int(target.labels[t])
            if label != IGNORE:
                assert (label - 10) // 3 == doc
            ahead = int(target.input_ids[t])
            assert ahead == 1 or (ahead - 10) // 3 == doc
    assert sum(lengths) == 9


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_shifted_before_the_split_each_rank_holds_the_global_targets(layout, cp):
    lengths = [1, 2, 3, 4, 37, 9]
    ids, cu, mask = _stream(lengths, seed=12)
    shifter = LabelShifter()
    depth = 2
    targets = shifter.mtp(ids, cu, mask, depth=depth)
    batch = {"input_ids": ids, "cu_seqlens": cu, "loss_mask": mask,
             "labels": shifter(ids, cu, mask)}
    for t in targets:
        batch[f"mtp_input_ids_{t.depth}"] = t.input_ids
        batch[f"mtp_labels_{t.depth}"] = t.labels
    plan = ContextPlan(cu, ids.numel(), cp, layout)
    wrong = 0
    for rank in range(cp):
        local = split_batch(batch, plan, rank)
        index = plan.rank_layout(rank).global_index
        real = index >= 0
        for t in targets:
            got = local[f"mtp_labels_{t.depth}"]
            assert torch.equal(got[real], t.labels[index[real]])
            assert bool((got[~real] == IGNORE).all())
            assert torch.equal(local[f"mtp_input_ids_{t.depth}"][real], t.input_ids[index[real]])
            # The bug this guards against: the same shift taken on the rank's own shard (its
            # local documents and mask), after the split.
            after = shifter(local["input_ids"], local["cu_seqlens"], local["loss_mask"],
                            shift=t.depth + 1)
            wrong += int((after[real] != got[real]).sum())
    assert wrong > 0, "a shift after the split went unnoticed: the test cannot fail"


def test_bad_depth_shift_and_fill_are_refused():
    ids = torch.arange(1, 6)
    with pytest.raises(ValueError, match="depth must be a positive int"):
        LabelShifter().mtp(ids, depth=0)
    with pytest.raises(ValueError, match="shift must be a positive int"):
        LabelShifter()(ids, shift=0)
    with pytest.raises(ValueError, match="fill_id must be a token id"):
        LabelShifter().mtp(ids, depth=1, fill_id=-1)
