"""kernels.host_checked: ranges taken on the host, and the layers that trust them (the
embedding and the loss heads still raise on ids outside the vocab). That no sync happens on
CUDA is checked in tests/gpu/test_master_linear_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kernels import host_checked, linear_cross_entropy
from parallel.layers import VocabParallelEmbedding


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
