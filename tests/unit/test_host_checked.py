"""mpcore.kernels.host_checked: ranges taken on the host, and the layers that trust them (the
embedding and the loss heads still raise on ids outside the vocab). That no sync happens on
CUDA is checked in tests/gpu/test_master_linear_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mpcore.kernels import host_checked, linear_cross_entropy
from mpcore.parallel.layers import VocabParallelEmbedding


def test_records_the_range_without_the_ignored_value():
    t = host_checked.to_device(torch.tensor([4, -100, 9, 2]), torch.device("cpu"), ignore=-100)
    assert host_checked.known_range(t, -100) == (2, 9)
    assert host_checked.known_range(t) is None  # recorded for another ignore value
    assert host_checked.known_range(t.clone(), -100) is None  # a different tensor
    t.add_(1)  # changed in place: no longer known
    assert host_checked.known_range(t, -100) is None


def test_all_ignored_and_empty():
    t = host_checked.to_device(torch.full((5,), -100), torch.device("cpu"), ignore=-100)
    lo, hi = host_checked.known_range(t, -100)
    assert lo > hi
    e = host_checked.to_device(torch.zeros(0, dtype=torch.int64), torch.device("cpu"))
    lo, hi = host_checked.known_range(e)
    assert lo > hi


def test_rejects_float_input():
    with pytest.raises(ValueError, match="integer tensor on the host"):
        host_checked.to_device(torch.zeros(3), torch.device("cpu"))


def test_embedding_raises_on_a_known_out_of_range_id():
    emb = VocabParallelEmbedding(10, 4)
    emb.reset_parameters(0)
    ok = host_checked.to_device(torch.tensor([0, 9, 3]), torch.device("cpu"))
    assert emb(ok).shape == (3, 4)
    bad = host_checked.to_device(torch.tensor([0, 10]), torch.device("cpu"))
    with pytest.raises(ValueError, match="token id 10 is outside the vocab"):
        emb(bad)


@pytest.mark.parametrize("label", [12, -3])
def test_head_raises_on_known_out_of_range_labels(label):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(12, 8, generator=g)
    labels = host_checked.to_device(torch.tensor([1, -100, label, 5]), torch.device("cpu"),
                                    ignore=-100)
    with pytest.raises(ValueError, match="out of range"):
        linear_cross_entropy(h, w, labels)
    good = host_checked.to_device(torch.tensor([1, -100, 11, 5]), torch.device("cpu"),
                                  ignore=-100)
    ref = torch.nn.functional.cross_entropy(h.double() @ w.double().t(),
                                            torch.tensor([1, -100, 11, 5]))
    assert torch.allclose(linear_cross_entropy(h, w, good).double(), ref, atol=1e-5)


def test_host_copy_is_kept_on_request_and_dropped_on_change():
    host = torch.tensor([0, 3, 7], dtype=torch.int32)
    moved = host_checked.to_device(host.clone(), torch.device("cpu"), keep_host=True)
    assert torch.equal(host_checked.host_copy(moved), host)
    plain = host_checked.to_device(host.clone(), torch.device("cpu"))
    assert host_checked.host_copy(plain) is None
    moved.add_(0)  # an in-place change (even of nothing) bumps the version: ask the device
    assert host_checked.host_copy(moved) is None


def test_value_range_and_host_values_fall_back_to_the_tensor():
    """The recorded range / host copy when there is one (a stale record is not used), else the
    tensor's own values."""
    t = host_checked.to_device(torch.tensor([5, 1, 8]), torch.device("cpu"), keep_host=True)
    host_checked._known[t] = host_checked._known[t]._replace(lo=-7)  # what the host recorded
    assert host_checked.value_range(t) == (-7, 8)
    assert torch.equal(host_checked.host_values(t), torch.tensor([5, 1, 8]))
    t.add_(1)  # changed in place: measured again
    assert host_checked.value_range(t) == (2, 9)
    assert torch.equal(host_checked.host_values(t), torch.tensor([6, 2, 9]))
    plain = torch.tensor([3, -2])
    assert host_checked.value_range(plain) == (-2, 3)
    assert torch.equal(host_checked.host_values(plain), plain)


def test_local_inputs_record_every_tensor():
    from mpcore.batches import local_inputs
    from mpcore.config import load_config
    from mpcore.models.llama import FAMILY
    from mpcore.parallel.state import ParallelState

    cfg = load_config(None, [])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    batch = {"input_ids": torch.arange(12) % 7, "cu_seqlens": cu,
             "position_ids": torch.cat([torch.arange(5), torch.arange(7)])}
    inputs = local_inputs(batch, ParallelState(), cfg, torch.device("cpu"), FAMILY, None)
    assert host_checked.known_range(inputs["input_ids"]) == (0, 6)
    assert host_checked.known_range(inputs["position_ids"]) == (0, 6)
    lo, hi = host_checked.known_range(inputs["labels"], -100)
    assert 0 <= lo <= hi <= 6
    assert torch.equal(host_checked.host_copy(inputs["cu_seqlens"]).long(), cu.long())
