"""TransformerEngine as the linear layers' GEMM backend, without TE (CI and the CPU machines):
the config keys, the errors with the install hint, ``auto``'s fallback (logged once), and the
layers' ``gemm`` hook. TE itself runs in tests/gpu/test_te_gpu.py."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
import torch.nn.functional as F

from mpcore.build import build
from mpcore.config import load_config
from mpcore.parallel import te
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.state import ParallelState
from mpcore.parallel.te import TEGemm, forward_region

no_te = pytest.mark.skipif(te.te_available(), reason="TransformerEngine is installed here")
HINT = re.escape(te.TE_INSTALL)


def test_config_linear_backend_and_recipes():
    assert load_config(None, []).model.linear_backend == "native"
    for backend, fp8 in (("te", "none"), ("te", "te_delayed"), ("auto", "te_current"),
                         ("auto", "tensorwise"), ("native", "tensorwise")):
        m = load_config(None, [f"model.linear_backend={backend}", f"model.fp8={fp8}"]).model
        assert (m.linear_backend, m.fp8) == (backend, fp8)
        assert "linear_backend" not in m.shape_fields()
    with pytest.raises(ValueError, match="model.linear_backend must be one of"):
        load_config(None, ["model.linear_backend=apex"])
    with pytest.raises(ValueError, match="TransformerEngine recipe; set model.linear_backend=te"):
        load_config(None, ["model.fp8=te_delayed"])  # linear_backend native by default
    with pytest.raises(ValueError, match="mpcore's own kernel"):
        load_config(None, ["model.linear_backend=te", "model.fp8=tensorwise"])


@no_te
@pytest.mark.parametrize("backend, fp8", [("te", "none"), ("te", "te_current"),
                                          ("auto", "te_delayed")])
def test_named_te_without_te_raises_with_the_install_hint(backend, fp8):
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=HINT):
            te.resolve_linear_backend(backend, device, fp8)
    with pytest.raises(ValueError, match=HINT):
        te.use_te(torch.nn.Linear(4, 4), "none" if fp8 == "none" else fp8)


@no_te
def test_build_with_te_raises_before_any_data_or_model():
    cfg = load_config(None, ["model.linear_backend=te", "training.device=cpu"])
    with pytest.raises(ValueError, match=HINT):
        build(cfg, ParallelState(), torch.device("cpu"))


def test_resolve_rejects_unknown_names_and_crossed_recipes():
    with pytest.raises(ValueError, match="unknown linear backend"):
        te.resolve_linear_backend("cublas", "cpu")
    with pytest.raises(ValueError, match="set model.linear_backend=te"):
        te.resolve_linear_backend("native", "cuda", "te_current")
    with pytest.raises(ValueError, match="fp8=te_current"):
        te.resolve_linear_backend("te", "cuda", "tensorwise")
    with pytest.raises(ValueError, match="unknown TransformerEngine recipe"):
        te.use_te(torch.nn.Linear(4, 4), "tensorwise")
    assert te.resolve_linear_backend("native", "cuda", "tensorwise") == "native"


def test_auto_falls_back_to_native_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(te, "_logged", set())
    with caplog.at_level(logging.INFO, logger="mpcore.parallel.te"):
        assert te.resolve_linear_backend("auto", "cpu") == "native"
        assert te.resolve_linear_backend("auto", "cpu") == "native"
        assert te.resolve_linear_backend("auto", "cpu", "tensorwise") == "native"
    lines = [r.getMessage() for r in caplog.records if r.name == "mpcore.parallel.te"]
    assert lines == ["model.linear_backend=auto: using native (device cpu)"], lines
    assert te.resolve_linear_backend("native", "cpu") == "native"


def test_layers_run_natively_and_through_a_gemm_hook():
    """Default: ``gemm`` is None and the layers are ``F.linear``. With a ``gemm`` (what
    ``use_te`` sets) the local product is the hook's, the bias still ours, added after."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=g, requires_grad=True)
    col = ColumnParallelLinear(32, 48, bias=True)
    row = RowParallelLinear(48, 16, bias=True)
    for i, layer in enumerate((col, row)):
        layer.reset_parameters(i)
        with torch.no_grad():
            layer.bias.normal_(generator=g)
        assert layer.gemm is None and "gemm" not in layer.extra_repr()
    ref = F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias)
    torch.testing.assert_close(row(col(x)), ref, rtol=0, atol=0)
    calls = []

    def doubled(x, w):  # any (x, w) -> x @ w.T implementation may stand in
        calls.append(w)
        return 2 * (x @ w.t())

    keys = [sorted(m.state_dict()) for m in (col, row)]
    col.gemm = row.gemm = doubled
    out = row(col(x))
    assert calls[0] is col.weight and calls[1] is row.weight
    mid = 2 * (x @ col.weight.t()) + col.bias
    torch.testing.assert_close(out, 2 * (mid @ row.weight.t()) + row.bias)
    out.sum().backward()
    assert col.weight.grad is not None and x.grad is not None
    assert [sorted(m.state_dict()) for m in (col, row)] == keys


def test_forward_region_is_a_null_context_without_te_layers():
    model = torch.nn.Sequential(ColumnParallelLinear(16, 32), RowParallelLinear(32, 16))
    region = forward_region(model)
    with region():
        pass
    assert region is contextlib.nullcontext


def test_forward_region_refuses_mixed_recipes():
    col, row = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)
    for layer, fp8 in ((col, "te_delayed"), (row, "te_current")):
        layer.gemm = TEGemm.__new__(TEGemm)  # no TE here: only the recipe name is read
        layer.gemm.fp8 = fp8
    with pytest.raises(ValueError, match="mix fp8 recipes"):
        forward_region(torch.nn.Sequential(col, row))


class _StandInLinearFn(torch.autograd.Function):
    """TE's ``_Linear`` contract for ``fuse_wgrad_accumulation`` (transformer_engine/pytorch/
    module/linear.py): the weight's gradient goes into ``weight.main_grad`` (read in the
    backward; overwritten when ``weight.overwrite_main_grad``, else added to) and none is
    returned for the weight; without the flag the gradient is returned."""

    @staticmethod
    def forward(ctx, x, weight, fuse, seen):
        ctx.save_for_backward(x, weight)
        ctx.fuse, ctx.seen, ctx.weight_object = fuse, seen, weight
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = dy.t() @ x
        if not ctx.fuse:
            return dy @ weight, dw, None, None
        main_grad = ctx.weight_object.main_grad
        ctx.seen.append(main_grad.data_ptr())
        if getattr(ctx.weight_object, "overwrite_main_grad", False):
            main_grad.copy_(dw)
        else:
            main_grad.add_(dw)
        return dy @ weight, None, None, None


class _StandInTE:
    """Just enough of ``transformer_engine.pytorch`` for ``TEGemm``: ``Linear`` and
    ``autocast``."""

    def __init__(self):
        self.seen = []

    def autocast(self, enabled, recipe):
        return contextlib.nullcontext()

    def Linear(self, in_features, out_features, bias, params_dtype, device):  # noqa: N802
        seen = self.seen

        class Linear:
            fuse_wgrad_accumulation = False

            def __init__(self):
                self._parameters = {"weight": None}

            def __call__(self, x):
                return _StandInLinearFn.apply(x, self._parameters["weight"],
                                              self.fuse_wgrad_accumulation, seen)

        return Linear()


@pytest.mark.parametrize("overwrite", [True, False])
def test_te_gemm_fp32_weight_gradient_goes_through_main_grad(monkeypatch, overwrite):
    """The fp32 weight's gradient is written into ``main_grad`` by the (stand-in) TE backward
    and comes back to autograd as an ordinary gradient: equal to F.linear's over two
    micro-batches (accumulated in .grad), the buffer taken as .grad without a copy on the
    first, post-accumulate hooks fired, and no buffer allocated before the backward."""
    fake = _StandInTE()
    monkeypatch.setattr(te, "transformer_engine", lambda: fake)
    monkeypatch.setitem(te._OVERWRITES, "overwrite", overwrite)
    g = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(24, 40, bias=False)
    layer.reset_parameters(0)
    ref = ColumnParallelLinear(24, 40, bias=False)
    ref.load_state_dict(layer.state_dict())
    layer.gemm = TEGemm(40, 24)
    assert layer.gemm.overwrite is overwrite
    hooked = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.clone()))
    for micro in range(2):
        x = torch.randn(2, 5, 24, generator=g, requires_grad=True)
        out = layer(x)
        assert not hasattr(layer.weight, "main_grad")
        out.square().sum().backward()
        ref(x.detach()).square().sum().backward()
        if micro == 0:
            assert layer.weight.grad.data_ptr() == fake.seen[0]  # taken, not copied
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    assert len(fake.seen) == 2 and len(hooked) == 2
    torch.testing.assert_close(hooked[-1], ref.weight.grad)
    with torch.no_grad():  # no gradient wanted: the plain TE call, no buffer
        layer(torch.randn(3, 24))
    assert len(fake.seen) == 2
