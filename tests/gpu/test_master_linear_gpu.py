"""fp32 master weights under CUDA autocast: the weight gradients written in fp32 by the GEMMs
(``mpcore.kernels.master_linear`` in our linear layers, the fused CE head's ``dw``), and the host-side
id and label ranges (``mpcore.kernels.host_checked``) that spare the embedding and the head their
device sync.

References: the autocast graph that ran before (``F.linear`` on the cast operands, the head on
a bf16 copy of the weight) and float64 math on the same rounded operands. The forward and
``dx`` are the same bf16 GEMMs; ``dw`` in fp32 must be at least as close to float64 as the
bf16-rounded one and within fp32 accumulation error of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpcore.kernels import host_checked, linear_cross_entropy
from mpcore.kernels.linear_cross_entropy import _check_label_range
from mpcore.kernels.master_linear import master_linear_applies, mm_has_out_dtype
from mpcore.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and not mm_has_out_dtype("cuda"),
                                 reason="this torch's mm has no out_dtype")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rows", [4096, 1001])
def test_layer_grads_come_out_of_the_gemm_in_fp32(rows):
    layer = ColumnParallelLinear(1024, 768, bias=True, device="cuda")
    layer.reset_parameters(0)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    dy = torch.randn(rows, 768, device="cuda", generator=g).bfloat16()
    xm = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert master_linear_applies(xm, layer.weight) == torch.bfloat16
        y = layer(xm)
    assert "MasterLinear" in type(y.grad_fn).__name__
    y.backward(dy)
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone()
    b.requires_grad_()
    xr = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = F.linear(xr, w, b)  # what the layer ran before
    y_ref.backward(dy)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert _rel(xm.grad, xr.grad) < 1e-3
    exact = dy.double().t() @ x.double()
    err, err_ref = _rel(layer.weight.grad, exact), _rel(w.grad, exact)
    print(f"rows {rows}: dw rel err fp32-out {err:.2e}, autocast (bf16 dw) {err_ref:.2e}")
    assert layer.weight.grad.dtype == torch.float32 and err < 1e-5 and err <= err_ref
    assert _rel(layer.bias.grad, dy.double().sum(0)) < 1e-5


def test_ce_head_takes_the_master_weight():
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, v = 3001, 512, 50000
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::13] = -100
    hm, wm = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hm, wm, labels)
    loss.backward()
    hb, wb = hidden.clone().requires_grad_(), weight.bfloat16().requires_grad_()
    loss_b = linear_cross_entropy(hb, wb, labels)  # the bf16 weight the op saw before
    loss_b.backward()
    assert wm.grad.dtype == torch.float32
    assert torch.equal(loss, loss_b) and torch.equal(hm.grad, hb.grad)
    # Same bf16 sum over the chunks; the scale is applied in fp32 and rounded once more for bf16
    assert torch.equal(wm.grad.bfloat16(), wb.grad)
    h64, w64 = hidden.double().requires_grad_(), wb.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w64.t(), labels).backward()
    err, err_b = _rel(wm.grad, w64.grad), _rel(wb.grad, w64.grad)
    print(f"head dw rel err: fp32 out {err:.2e}, bf16 {err_b:.2e}")
    assert err < 1e-2 and err <= err_b


def test_host_checked_ids_and_labels_need_no_device_sync():
    emb = VocabParallelEmbedding(1000, 64, device="cuda")
    emb.reset_parameters(0)
    ids = host_checked.to_device(torch.randint(0, 1000, (4096,)).pin_memory(),
                                 torch.device("cuda"), non_blocking=True)
    labels = torch.randint(0, 1000, (4096,))
    labels[::7] = -100
    labels = host_checked.to_device(labels, torch.device("cuda"), ignore=-100)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = emb(ids)
        _check_label_range(labels, 1000, -100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (4096, 64)
    unknown = ids.clone()  # not recorded: checked on the device, with a sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            emb(unknown)
    finally:
        torch.cuda.set_sync_debug_mode("default")
