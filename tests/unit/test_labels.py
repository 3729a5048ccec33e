"""LabelShifter, position_ids and pack_padded against plain-Python per-document references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcore.parallel import LabelShifter
from mpcore.parallel.labels import check_cu_seqlens, pack_padded, position_ids

IGNORE = -100


def reference_labels(ids, lengths, mask=None, ignored=(), ignore_index=IGNORE):
    """Per-document next token, written as a loop over documents."""
    out, start = [], 0
    for n in lengths:
        for t in range(start, start + n):
            nxt = t + 1
            ok = nxt < start + n and (mask is None or mask[nxt]) and ids[nxt] not in ignored
            out.append(ids[nxt] if ok else ignore_index)
        start += n
    return out


def cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@st.composite
def packed_streams(draw):
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    total = sum(lengths)
    ids = draw(st.lists(st.integers(0, 12), min_size=total, max_size=total))
    mask = draw(st.none() | st.lists(st.booleans(), min_size=total, max_size=total))
    ignored = tuple(draw(st.sets(st.integers(0, 12), max_size=3)))
    return lengths, ids, mask, ignored


@settings(max_examples=50, deadline=None)
@given(packed_streams(), st.sampled_from([torch.int32, torch.int64]))
def test_shift_matches_per_document_reference(stream, cu_dtype):
    lengths, ids, mask, ignored = stream
    shifter = LabelShifter(ignore_token_ids=ignored)
    labels = shifter(torch.tensor(ids), torch.tensor(cumulative(lengths), dtype=cu_dtype),
                     None if mask is None else torch.tensor(mask))
    assert labels.dtype == torch.int64
    assert labels.tolist() == reference_labels(ids, lengths, mask, ignored)


def test_known_stream_and_last_token_of_every_document():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    labels = LabelShifter()(ids, torch.tensor([0, 3, 4, 6]))
    assert labels.tolist() == [6, 7, IGNORE, IGNORE, 10, IGNORE]
    assert LabelShifter()(ids).tolist() == [6, 7, 8, 9, 10, IGNORE]  # None: one document


def test_loss_mask_and_ignored_ids_act_on_the_target_token():
    ids = torch.tensor([1, 2, 3, 4, 5])
    mask = torch.tensor([1, 1, 0, 1, 1])  # token 2 (value 3) is not a target
    labels = LabelShifter(ignore_index=-1, ignore_token_ids=(5,))(ids, loss_mask=mask)
    assert labels.tolist() == [2, -1, 4, -1, -1]


def test_position_ids_restart_per_document():
    assert position_ids(torch.tensor([0, 3, 4, 6]), 6).tolist() == [0, 1, 2, 0, 0, 1]
    assert position_ids(None, 4).tolist() == [0, 1, 2, 3]


def _padded_batch(rows, seqlen, left, generator):
    """rows: real lengths; returns ids [B, S] with random pad values, attention mask, loss mask."""
    ids = torch.randint(0, 50, (len(rows), seqlen), generator=generator)
    attn = torch.zeros(len(rows), seqlen, dtype=torch.bool)
    for b, n in enumerate(rows):
        if left:
            attn[b, seqlen - n:] = True
        else:
            attn[b, :n] = True
    ids[~attn] = -7  # pad value that must never become a label
    loss_mask = torch.rand(len(rows), seqlen, generator=generator) > 0.3
    return ids, attn, loss_mask


@pytest.mark.parametrize("left", [False, True])
def test_from_padded_and_pack_padded_agree_with_reference(left):
    gen = torch.Generator().manual_seed(1)
    rows = [5, 1, 7, 3]
    ids, attn, loss_mask = _padded_batch(rows, 7, left, gen)
    shifter = LabelShifter(ignore_token_ids=(3,))
    labels = shifter.from_padded(ids, attn.int(), loss_mask)
    assert (labels[~attn] == IGNORE).all()
    packed = pack_padded(ids, attn, loss_mask)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == cumulative(rows)
    assert packed.input_ids.tolist() == ids[attn].tolist()
    expected = reference_labels(packed.input_ids.tolist(), rows, packed.loss_mask.tolist(), (3,))
    assert labels[attn].tolist() == expected
    assert shifter(packed.input_ids, packed.cu_seqlens, packed.loss_mask).tolist() == expected
    assert packed.position_ids.tolist() == [p for n in rows for p in range(n)]


def test_from_padded_without_mask_is_one_document_per_row():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert LabelShifter().from_padded(ids).tolist() == [[2, 3, IGNORE], [5, 6, IGNORE]]
    # A fully padded row is allowed here: nothing to predict.
    labels = LabelShifter().from_padded(ids, torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert labels.tolist() == [[2, 3, IGNORE], [IGNORE] * 3]


BAD_INPUTS = [
    (lambda s: s(torch.tensor([1.0, 2.0])), "integer token ids"),
    (lambda s: s(torch.tensor([True, False])), "integer token ids"),
    (lambda s: s([1, 2, 3]), "torch.Tensor"),
    (lambda s: s(torch.tensor([[1, 2], [3, 4]])), "from_padded"),
    (lambda s: s(torch.tensor([], dtype=torch.long)), "empty"),
    (lambda s: s(torch.tensor([1, -2, 3])), "negative"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([1, 3])), "start at 0"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2, 3])), "strictly increasing"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3])), "strictly increasing"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([0, 2])), "ends at 2"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 4])), "ends at 4"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([[0, 3]])), "1-D"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([3])), "at least 2"),
    (lambda s: s(torch.tensor([1, 2, 3]), torch.tensor([0.0, 3.0])), "integer tensor"),
    (lambda s: s(torch.tensor([1, 2, 3]), loss_mask=torch.ones(4, dtype=torch.bool)), "shape"),
    (lambda s: s(torch.tensor([1, 2, 3]), loss_mask=torch.ones(1, dtype=torch.bool)), "shape"),
    (lambda s: s(torch.tensor([1, 2, 3]), loss_mask=torch.tensor([0.5, 1.0, 1.0])), "0 and 1"),
    (lambda s: LabelShifter(ignore_index=2)(torch.tensor([1, 2, 3])), "equals ignore_index"),
    (lambda s: s.from_padded(torch.tensor([1, 2])), "2-D"),
    (lambda s: s.from_padded(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 1]])), "between"),
    (lambda s: s.from_padded(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1]])), "shape"),
    (lambda s: s.from_padded(torch.tensor([[1, -2, 3]]), torch.tensor([[1, 1, 1]])), "negative"),
    (lambda s: pack_padded(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 1], [0, 0]])),
     "no real token"),
    (lambda s: pack_padded(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 0]]).bool(),
                           torch.ones(1, 2)), "shape"),
    (lambda s: LabelShifter(ignore_index=1.5), "ignore_index must be an int"),
    (lambda s: LabelShifter(ignore_token_ids=("a",)), "ignore_token_ids"),
    (lambda s: position_ids(torch.tensor([0, 2, 5]), 4), "ends at 5"),
    (lambda s: check_cu_seqlens([0, 3, 3], 3), "strictly increasing"),
]


@pytest.mark.parametrize("call,match", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call(LabelShifter())
