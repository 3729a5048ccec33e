"""TransformerEngine as the GEMM of our TP layers (``mpcore.parallel.te``) on CUDA: bf16 against the
native layers, TE's FP8 recipes against bf16, and a decoder that trains with them.

Bounds. bf16 (same weights, both cuBLAS bf16 GEMMs with fp32 accumulation): only summation
order and the rounding of the bias add differ, rel <= 1e-2 (the numerics policy for bf16).
FP8 (e4m3 x and w, e5m2 gradients; derivation in tests/unit/test_fp8_linear.py): rms rel error
~0.05 on y, ~0.08 on the gradients, so y rel < 0.1 and gradient cosine > 0.99 against bf16.
Delayed scaling quantizes with the scales of earlier calls (the first uses scale 1), so its
layers run a few warm-up calls first, as in training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mpcore.parallel.te
from mpcore.build import build, setup
from mpcore.config import load_config
from mpcore.models import ModelConfig, build_model
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.state import ParallelState
from mpcore.parallel.te import TEGemm, forward_region, use_te
from mpcore.train import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="TransformerEngine needs CUDA")]
pytest.importorskip("transformer_engine.pytorch",
                    reason="TransformerEngine is not installed (pip install -e \".[te]\")")
fp8_gpu = pytest.mark.skipif(torch.cuda.is_available() and
                             torch.cuda.get_device_capability() < (8, 9),
                             reason="FP8 GEMMs need compute capability >= 8.9")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _pair(seed: int):
    """A column-parallel [q; k; v]-like projection and a row-parallel one after it, fp32
    master weights and random biases on CUDA."""
    col = ColumnParallelLinear(1024, 1536, bias=True, partition_sizes=[1024, 256, 256],
                               device="cuda")
    row = RowParallelLinear(1536, 1024, bias=True, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i, layer in enumerate((col, row)):
        layer.reset_parameters(seed + i)
        with torch.no_grad():
            layer.bias.normal_(0, 0.1, generator=g)
    return col, row


def _run(col, row, x, dy, calls: int = 1):
    """y, dx and the four parameter gradients of the last of ``calls`` fwd+bwd under bf16
    autocast."""
    for _ in range(calls):
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        xl = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = row(col(xl))
        y.backward(dy)
    grads = {n: p.grad for n, p in [*col.named_parameters("col"), *row.named_parameters("row")]}
    return y.detach(), xl.grad, grads


@pytest.mark.parametrize("rows", [1024, 1001])
def test_te_bf16_matches_native(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", generator=g)
    dy = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    col, row = _pair(0)
    col_te, row_te = copy.deepcopy(col), copy.deepcopy(row)
    keys = [sorted(m.state_dict()) for m in (col, row)]
    assert use_te(col_te) == use_te(row_te) == 1
    assert isinstance(col_te.gemm, TEGemm) and "gemm=te(fp8=none)" in col_te.extra_repr()
    assert [sorted(m.state_dict()) for m in (col_te, row_te)] == keys  # no TE keys or params
    assert len(list(col_te.parameters())) == 2
    y, dx, grads = _run(col, row, x, dy)
    y_te, dx_te, grads_te = _run(col_te, row_te, x, dy)
    assert y_te.dtype == y.dtype and dx_te.dtype == torch.float32
    assert all(grads_te[n].dtype == torch.float32 for n in grads)
    errs = {"y": _rel(y_te, y), "dx": _rel(dx_te, dx)}
    errs.update({n: _rel(grads_te[n], grads[n]) for n in grads})
    print(f"te bf16 vs native, rows {rows}:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.parametrize("recipe", ["none", "te_current"])
def test_te_fp32_weight_gradient_through_main_grad(recipe):
    """TE writes the fp32 master's gradient itself (``fuse_wgrad_accumulation`` into the
    alias's ``main_grad``): over two accumulated micro-batches it is at least as close to
    float64 as TE's bf16 gradient cast by autograd (bf16), and within FP8 noise of it."""
    if recipe != "none" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    assert mpcore.parallel.te._overwrites_main_grad(mpcore.parallel.te.transformer_engine())
    g = torch.Generator(device="cuda").manual_seed(5)
    xs = [torch.randn(1000, 1024, device="cuda", generator=g).bfloat16() for _ in range(2)]
    dys = [torch.randn(1000, 768, device="cuda", generator=g).bfloat16() for _ in range(2)]
    layers = {}
    for fused in (True, False):
        layer = ColumnParallelLinear(1024, 768, device="cuda")
        layer.reset_parameters(7)
        use_te(layer, recipe)
        layer.gemm.fp32_wgrad = fused
        for x, dy in zip(xs, dys, strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.backward(dy)
        assert layer.weight.grad.dtype == torch.float32 and not hasattr(layer.weight,
                                                                         "main_grad")
        layers[fused] = layer
    exact = sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys, strict=True))
    err, err_b = _rel(layers[True].weight.grad, exact), _rel(layers[False].weight.grad, exact)
    print(f"te {recipe} dw rel err vs float64: fp32 main_grad {err:.2e}, bf16 {err_b:.2e}")
    if recipe == "none":
        assert err < 1e-5 and err <= err_b
    else:  # FP8 operands: the same quantized GEMM, only the output rounding differs
        assert _rel(layers[True].weight.grad, layers[False].weight.grad) < 1e-2
        assert err <= err_b * 1.01


@fp8_gpu
@pytest.mark.parametrize("recipe", ["te_delayed", "te_current"])
@pytest.mark.parametrize("rows", [4096, 1001])  # 1001: rows padded to a multiple of 8
def test_te_fp8_recipes_against_bf16(recipe, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", generator=g)
    dy = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    col, row = _pair(1)
    col_te, row_te = copy.deepcopy(col), copy.deepcopy(row)
    use_te(col_te, recipe)
    use_te(row_te, recipe)
    y, dx, grads = _run(col, row, x, dy)
    y8, dx8, grads8 = _run(col_te, row_te, x, dy, calls=3 if recipe == "te_delayed" else 1)
    rel_y = _rel(y8, y)
    cos = {"dx": _cos(dx8, dx), **{n: _cos(grads8[n], grads[n]) for n in grads}}
    print(f"{recipe} vs bf16, rows {rows}: y rel {rel_y:.3e}, grad cosines",
          {k: f"{v:.5f}" for k, v in cos.items()})
    assert rel_y < 0.1 and all(c > 0.99 for c in cos.values()), (rel_y, cos)


@fp8_gpu
@pytest.mark.parametrize("recipe", ["none", "te_current", "te_delayed"])
def test_forward_region_opens_one_te_autocast(monkeypatch, recipe):
    """Inside ``forward_region`` the layers run in its one ``te.autocast`` (none of their own);
    current scaling and bf16 then give the same numbers as per-call regions, and delayed
    scaling stays within FP8 error of them."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2048, 1024, device="cuda", generator=g)
    dy = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    col, row = _pair(3)
    use_te(col, recipe)
    use_te(row, recipe)
    y_call, dx_call, grads_call = _run(col, row, x, dy, calls=3)
    opened = []
    real = mpcore.parallel.te._autocast
    monkeypatch.setattr(mpcore.parallel.te, "_autocast",
                        lambda te, r: opened.append(r) or real(te, r))
    region = forward_region(torch.nn.Sequential(col, row))
    for _ in range(3):
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        xl = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16), region():
            y = row(col(xl))
        y.backward(dy)
    assert len(opened) == 3  # one per forward, none per layer
    grads = {n: p.grad for n, p in [*col.named_parameters("col"), *row.named_parameters("row")]}
    if recipe == "te_delayed":
        assert _rel(y, y_call) < 0.1 and _cos(xl.grad, dx_call) > 0.99
    else:
        assert torch.equal(y, y_call) and torch.equal(xl.grad, dx_call)
        assert all(torch.equal(grads[n], grads_call[n]) for n in grads)


def _train(cfg: ModelConfig, recipe: str | None, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps of a fresh decoder (seed 3) on fixed random batches,
    bf16 autocast; ``recipe``: None for native, else TE with that fp8 recipe."""
    model = build_model(cfg, ParallelState(), device="cuda", seed=3)
    if recipe is not None:
        assert use_te(model.layers, recipe) == 4 * cfg.num_layers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    num, losses = 2048, []
    cu = torch.tensor([0, 1024, 2048], dtype=torch.int32, device="cuda")
    pos = torch.arange(1024, device="cuda").repeat(2)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size // 8, (num + 1,), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:-1], pos, cu_seqlens=cu, labels=ids[1:], output="loss_sum") / num
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@fp8_gpu
def test_decoder_trains_with_te_and_tracks_bf16():
    """A small vocabulary slice (ids below V/8) makes the loss fall fast from ln V: the FP8
    runs must fall with the bf16 run, step by step."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8,
                      num_kv_heads=2, intermediate_size=1408)
    steps = 12
    runs = {name: _train(cfg, recipe, steps) for name, recipe in
            (("bf16", None), ("te", "none"), ("te_delayed", "te_delayed"),
             ("te_current", "te_current"))}
    for name, losses in runs.items():
        print(name, " ".join(f"{v:.4f}" for v in losses))
    ref = runs["bf16"]
    assert ref[-1] < ref[0] - 0.5  # it trains
    for name, bound in (("te", 1e-2), ("te_delayed", 3e-2), ("te_current", 3e-2)):
        losses = runs[name]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        worst = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
        assert worst < bound, (name, worst, losses, ref)


class _Tokens:
    """Loader stand-in: one micro-batch of 4 random documents of 256 tokens per step."""

    def __init__(self, vocab: int):
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(0)

    def next_step(self):
        cu = torch.arange(0, 5 * 256, 256, dtype=torch.int32)
        return [{"input_ids": torch.randint(0, self.vocab, (1024,), generator=self.gen),
                 "cu_seqlens": cu, "position_ids": torch.arange(256).repeat(4)}]

    def state_dict(self) -> dict:
        return {}


@fp8_gpu
@pytest.mark.parametrize("ckpt", [False, True])
def test_pretrain_build_with_te(tmp_path, ckpt):
    """``mpcore.build.build`` with ``model.linear_backend=te`` (the tiny default model): the
    decoder layers' linears run TE's recipe, the checkpoint keys are the native run's, and
    training steps (with activation checkpointing too: TE's forward runs again in the
    backward) stay finite."""
    overrides = ["training.device=cuda", "checkpoint.resume=false", "checkpoint.every=0",
                 f"logging.run_dir={tmp_path}", f"parallel.activation_checkpointing={ckpt}"]
    runs = {}
    for backend, fp8 in (("native", "none"), ("te", "te_delayed")):
        cfg = load_config(None, [*overrides, f"model.linear_backend={backend}",
                                 f"model.fp8={fp8}"])
        run = build(cfg, setup(cfg), torch.device("cuda"), loader=_Tokens(cfg.model.vocab_size))
        trainer = Trainer(run)
        runs[backend] = (run, [trainer.train_step()[0] for _ in range(4)])
    (native, native_losses), (te_run, te_losses) = runs["native"], runs["te"]
    gemm = te_run.model.layers[0].feed_forward.w2.gemm
    assert isinstance(gemm, TEGemm) and gemm.fp8 == "te_delayed"
    assert native.model.layers[0].feed_forward.w2.gemm is None
    assert sorted(te_run.model.state_dict()) == sorted(native.model.state_dict())
    print("native", native_losses, "te_delayed", te_losses)
    assert all(abs(a - b) / b < 5e-2 for a, b in zip(te_losses, native_losses, strict=True))


@fp8_gpu
def test_te_under_fsdp2_takes_the_gathered_bf16_weight(tmp_path):
    """FSDP2 on a one-rank world, as ``mpcore.build`` wraps (bf16 ``MixedPrecisionPolicy``):
    every forward TE gets the all-gathered bf16 weight, not our fp32 master, and quantizes it;
    gradients reach the sharded fp32 parameters. Losses equal the unwrapped TE run's up to the
    one rounding of the weight to bf16 before quantization."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, intermediate_size=512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1025,), generator=g).cuda()
    cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
    pos = torch.arange(1024, device="cuda")
    losses = {}
    for wrap in (False, True):
        model = build_model(cfg, ParallelState(), device="cuda", seed=3)
        use_te(model.layers, "te_current")
        seen = []  # the dtype of the weight TE multiplies with
        model.layers[0].feed_forward.w2.gemm.module.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(m.weight.dtype))
        if wrap:
            kwargs = dict(mesh=init_device_mesh("cuda", (1,)), mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            for layer in model.layers:
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[wrap] = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[:-1], pos, cu_seqlens=cu, labels=ids[1:], output="loss_sum")
            (loss / 1024).backward()
            assert all(p.grad is not None for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[wrap].append(loss.item() / 1024)
        assert set(seen) == {torch.bfloat16 if wrap else torch.float32}, seen
    print("te_current unwrapped", losses[False], "fsdp2", losses[True])
    assert all(abs(a - b) / a < 1e-2 for a, b in zip(losses[True], losses[False], strict=True))


def _fp8_run(tmp_path, run_dir: str, *overrides: str):
    from mpcore.train import train

    cfg = load_config(None, ["training.device=cuda", "training.max_steps=12",
                             "checkpoint.every=6", "checkpoint.keep_last=2",
                             "checkpoint.async_save=false", f"data.cache_dir={tmp_path / 'data'}",
                             f"logging.run_dir={tmp_path / run_dir}", "model.linear_backend=te",
                             "model.fp8=te_delayed", *overrides])
    return train(cfg).losses


@fp8_gpu
def test_te_delayed_scaling_state_resumes_the_uninterrupted_curve(tmp_path, caplog,
                                                                  monkeypatch):
    """The amax histories and scales are checkpointed: a te_delayed run resumed from step 6
    continues the uninterrupted curve (within 1e-4 relative, the same bound as a bf16 resume
    here), and far closer than the same resume with the FP8 state dropped (the control: its
    histories restart empty and the first steps quantize with scale 1)."""
    import logging
    import shutil

    from mpcore.train_state import TrainState

    whole = _fp8_run(tmp_path, "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-12")
    shutil.copytree(tmp_path / "resumed", tmp_path / "control")
    with caplog.at_level(logging.INFO, logger="mpcore.train_state"):
        resumed = _fp8_run(tmp_path, "resumed")
    assert "restored FP8 scaling state of" in caplog.text and "as saved" in caplog.text
    monkeypatch.setattr(TrainState, "_restore_fp8", lambda self, *a: None)
    control = _fp8_run(tmp_path, "control")
    assert len(resumed) == len(control) == 6
    gap = max(abs(a - b) / abs(b) for a, b in zip(resumed, whole[6:], strict=True))
    control_gap = max(abs(a - b) / abs(b) for a, b in zip(control, whole[6:], strict=True))
    print("resumed gap", gap, "control gap", control_gap)
    assert gap <= 1e-4 and control_gap > 10 * max(gap, 1e-6), (gap, control_gap)


@fp8_gpu
def test_bf16_checkpoint_resumes_into_te_delayed_and_back_with_a_note(tmp_path, caplog):
    """A native bf16 checkpoint resumed with te_delayed starts the histories empty, and a
    te_delayed checkpoint resumed as bf16 ignores its FP8 state: both say so, both train."""
    import logging

    native = ("model.linear_backend=native", "model.fp8=none")
    with caplog.at_level(logging.INFO, logger="mpcore.train_state"):
        _fp8_run(tmp_path, "run", *native, "training.max_steps=6")
        into_fp8 = _fp8_run(tmp_path, "run", "training.max_steps=9")
        assert "the checkpoint has no FP8 scaling state" in caplog.text
        back = _fp8_run(tmp_path, "run", *native, "training.max_steps=12")
        assert "this run does not use it" in caplog.text
    assert len(into_fp8) == 3 and len(back) == 3
    assert all(torch.isfinite(torch.tensor(into_fp8 + back)))
