"""The fused rope and SwiGLU passes skip their custom op's dispatch in eager mode and keep the op
under torch.compile (mpcore.kernels._triton.eager_or_op): one eager step records no ``mpcore::`` op in
the profiler and gives the same values and gradients as the op called directly; a compiled
step's graph holds the ops (so compile keeps them whole, without a graph break)."""

import torch
from torch.profiler import ProfilerActivity, profile

from mpcore.kernels import rope as rope_module
from mpcore.kernels import swiglu as swiglu_module
from mpcore.kernels.rope import rope
from mpcore.kernels.swiglu import swiglu


def _tables(t, d):
    angle = torch.arange(t)[:, None] * torch.arange(1, d // 2 + 1)[None, :] * 0.1
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


def _step(x, weight):
    cos, sin = _tables(6, 8)
    h = x @ weight  # (6, 32): rope on 2 heads of 8, then swiglu of 16 -> 8
    q = rope(h[:, :16].reshape(6, 2, 8), cos, sin, torch.float32)
    y = swiglu(h[:, 16:])
    return (q.square().sum() + y.square().sum())


def _inputs():
    torch.manual_seed(0)
    return torch.randn(6, 12), torch.randn(12, 32, requires_grad=True)


def _ops_in(events) -> set[str]:
    return {e.name for e in events if e.name.startswith("mpcore::")}


def test_eager_step_dispatches_no_custom_op():
    x, weight = _inputs()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = _step(x, weight)
        loss.backward()
    assert _ops_in(prof.events()) == set()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_eager_values_equal_the_ops():
    x, weight = _inputs()
    cos, sin = _tables(6, 8)
    h = (x @ weight).detach()
    q = h[:, :16].reshape(6, 2, 8).contiguous()
    got = rope(q, cos, sin, torch.float32)
    want = rope_module._rope_fwd_op(q, cos, sin, torch.float32, "torch")
    assert torch.equal(got, want)
    gu = h[:, 16:].contiguous()
    assert torch.equal(swiglu(gu), swiglu_module._swiglu_fwd_op(gu, "torch"))
    dy = torch.randn(6, 8)
    assert torch.equal(swiglu_module._swiglu_bwd(gu, dy, "torch"),
                       swiglu_module._swiglu_bwd_op(gu, dy, "torch"))


def test_compiled_graph_keeps_the_ops():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))  # subgraphs included
        return gm.forward

    x, weight = _inputs()
    got = torch.compile(_step, backend=backend, fullgraph=True)(x, weight)
    assert any("mpcore.rope_fwd" in g for g in graphs), graphs
    assert any("mpcore.swiglu_fwd" in g for g in graphs), graphs
    torch.testing.assert_close(got, _step(x, weight), rtol=1e-6, atol=0)
