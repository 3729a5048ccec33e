"""Host syncs of the MoE block (``mpcore.models.common.moe``) in a forward and backward, on the CPU.

On CUDA a host sync is the host waiting for the device: a tensor turned into Python values
(``tolist``, ``item``, ``int()``/``float()``/``bool()`` of a tensor, ``cpu``, ``numpy``) or an
op whose output size depends on the data (``nonzero``, ``bincount``, ``masked_select``,
``unique``, boolean indexing, ``repeat_interleave`` without ``output_size``). ``HostSyncs``
counts both where the CPU can see them: the Python conversions by wrapping them, the ops (and
``aten._local_scalar_dense``, which every scalar conversion reaches) with a dispatch mode.

- ep = 1, grouped GEMM (``torch._grouped_mm``): no sync, forward or backward;
- ep = 1, the per-expert loop: one per forward (it needs its split sizes on the host);
- ep = 2 (two gloo ranks), both paths: exactly one per dispatch, none in the backward; the
  outputs and gradients equal the ep = 1 block's on the same tokens;
- the counter sees each kind of sync above (so the zeros can fail: the block's former
  ``bincount`` and ``counts.tolist()`` at ep = 1 are among them).
``tests/gpu/test_moe_gpu.py`` checks the ep = 1 grouped path on CUDA with
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpcore.models.common.moe import MoeBlock
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed

GROUPED = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                             reason="this torch has no _grouped_mm")
CONVERSIONS = ("tolist", "item", "cpu", "numpy")
DATA_SIZED = {"aten.nonzero.default", "aten.bincount.default", "aten.masked_select.default",
              "aten._unique2.default", "aten.unique_dim.default",
              "aten.unique_consecutive.default", "aten._local_scalar_dense.default"}
HIDDEN, EXPERTS, TOP_K, INTER = 32, 6, 2, 16


class HostSyncs(TorchDispatchMode):
    """Counts host syncs (module docstring) by name while active: ``with HostSyncs() as s``."""

    def __init__(self):
        super().__init__()
        self.seen: Counter[str] = Counter()
        self._patches = contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in DATA_SIZED:
            self.seen[name] += 1
        elif name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self.seen[name] += 1
        elif name.startswith("aten.index.") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]):
            self.seen["boolean index"] += 1
        return func(*args, **kwargs)

    def _wrap(self, name: str) -> None:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            self.seen[name] += 1
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
        self._patches.callback(setattr, torch.Tensor, name, original)

    def __enter__(self):
        for name in CONVERSIONS:
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._patches.close()

    def take(self) -> Counter[str]:
        """The syncs seen since the last ``take``."""
        seen, self.seen = self.seen, Counter()
        return seen


def _block(backend: str, ep_group=None) -> MoeBlock:
    block = MoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, norm_topk_prob=True, ep_group=ep_group,
                     shared_intermediate=8, experts_backend=backend)
    block.reset_parameters(11)  # the same logical weights at any ep
    return block


def _syncs_of_a_step(block: MoeBlock, x: torch.Tensor):
    """(syncs of the forward, of the backward, output, input gradient)."""
    x = x.clone().requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    with HostSyncs() as syncs:
        y = block(x)
        forward = syncs.take()
        (y * g).sum().backward()
        backward = syncs.take()
    return forward, backward, y.detach(), x.grad


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))


def test_the_counter_sees_each_kind_of_sync():
    t, original = torch.tensor([2, 0, 2, 1]), torch.Tensor.tolist
    with HostSyncs() as syncs:
        t.tolist(), t[0].item(), int(t[1]), bool(t[2]), t.cpu(), t.numpy()
        torch.bincount(t), t.nonzero(), t[t > 0], torch.unique(t)
        torch.repeat_interleave(torch.arange(4), t)
        torch.repeat_interleave(torch.arange(4), t, output_size=5)  # sized: no sync
    seen = syncs.seen
    for name in CONVERSIONS:
        assert seen[name] == 1, (name, seen)
    assert seen["aten._local_scalar_dense.default"] == 3  # item, int, bool
    assert seen["aten.bincount.default"] == seen["aten.nonzero.default"] == 1, seen
    assert seen["boolean index"] == seen["aten._unique2.default"] == 1, seen
    assert seen["aten.repeat_interleave.Tensor"] == 1, seen
    assert torch.Tensor.tolist is original  # unwrapped again


@GROUPED
def test_ep1_grouped_forward_and_backward_never_sync():
    forward, backward, y, grad = _syncs_of_a_step(_block("grouped"), _tokens(0))
    assert not forward and not backward, (forward, backward)
    _, _, y_ref, grad_ref = _syncs_of_a_step(_block("reference"), _tokens(0))
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(grad, grad_ref, atol=1e-5)


def test_ep1_loop_syncs_once_per_forward():
    forward, backward, _, _ = _syncs_of_a_step(_block("reference"), _tokens(0))
    assert forward == Counter(tolist=1) and not backward, (forward, backward)


def _ep2(rank, world, backends):
    state = ParallelState.build(ep=2)
    out = {}
    for backend in backends:
        forward, backward, y, grad = _syncs_of_a_step(_block(backend, state.ep_group),
                                                      _tokens(rank))
        _, _, y_ref, grad_ref = _syncs_of_a_step(_block("reference"), _tokens(rank))
        out[backend] = (forward, backward, float((y - y_ref).abs().max()),
                        float((grad - grad_ref).abs().max()))
    return out


def test_ep2_syncs_once_per_dispatch_and_never_in_backward():
    backends = ("reference", "grouped") if hasattr(torch, "_grouped_mm") else ("reference",)
    for by_backend in run_distributed(_ep2, 2, backends):
        for backend, (forward, backward, dy, dgrad) in by_backend.items():
            assert forward == Counter(tolist=1), (backend, forward)
            assert not backward, (backend, backward)
            assert dy < 1e-5 and dgrad < 1e-5, (backend, dy, dgrad)
