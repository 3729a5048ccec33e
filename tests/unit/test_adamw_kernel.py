"""AdamW in Triton (``mpcore.kernels.adamw``, ``mpcore.optim.TritonAdamW``): the update against
``torch.optim.AdamW`` (fp32, and the same math in float64) over several steps with weight decay,
a changing learning rate, a gradient divisor and a skipped step; checkpoints that move between
the two optimizers; bad input; and the Triton kernel itself run on CPU tensors by the Triton
interpreter (this file re-runs itself with TRITON_INTERPRET=1) and compiled for sm_90 to check
that its accesses are 16-byte vectors."""

import copy
import os

import pytest
import torch

from mpcore.kernels.adamw import adamw_step_, adamw_step_reference_, step_coefficients
from mpcore.optim import TritonAdamW
from tests.unit.interpret import global_accesses, needs_triton, run_under_interpreter, sm90_ptx

# Ragged sizes (not multiples of the kernel's block), a matrix and a 0-d parameter.
SHAPES = [(37, 53), (5000,), (3,), (2049,), ()]
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
LRS = [3e-3, 2e-3, 5e-4, 1e-3]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype))
            for s in SHAPES]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    # Scales spread over decades, as a model's are, so eps and the moments matter.
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** (i - 3)).to(dtype)
            for i, s in enumerate(SHAPES)]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0}]


def _run(opt_cls, params, steps, grad_scale=None, found_inf=None, **kw):
    opt = opt_cls(_groups(params), **HYPER, **kw)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        for p, g in zip(params, _grads(step, params[0].dtype), strict=True):
            p.grad = g
        if grad_scale is not None:
            opt.grad_scale, opt.found_inf = grad_scale(step), found_inf(step)
        opt.step()
    return opt


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_matches_torch_adamw_and_float64():
    ours, theirs, exact = _params(), _params(), _params(torch.float64)
    opt = _run(TritonAdamW, ours, 6)
    _run(torch.optim.AdamW, theirs, 6, foreach=False)
    _run(torch.optim.AdamW, exact, 6, foreach=False)
    for i, (a, b, c) in enumerate(zip(ours, theirs, exact, strict=True)):
        assert _rel_err(a, b) < 1e-6, f"param {i} vs torch fp32"
        assert _rel_err(a, c) < 1e-6, f"param {i} vs torch float64"
        assert not torch.equal(a, _params()[i]), f"param {i} did not move"
        state = opt.state[a]
        assert state["step"].dtype == torch.float32 and state["step"].item() == 6


def test_grad_scale_divides_and_found_inf_skips():
    """Step 2 is skipped (nothing changes, its count stays); every gradient is divided by a
    per-step scale: equal to torch's AdamW on pre-divided gradients that never sees step 2."""
    scales = [2.0, 0.5, 7.0, 3.0, 1.0]
    ours = _params()
    opt = _run(TritonAdamW, ours, 5, grad_scale=lambda s: torch.tensor(scales[s]),
               found_inf=lambda s: torch.tensor(float(s == 2)))
    theirs = _params()
    want = torch.optim.AdamW(_groups(theirs), **HYPER, foreach=False)
    for step in range(5):
        if step == 2:
            continue
        for group in want.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        for p, g in zip(theirs, _grads(step), strict=True):
            p.grad = g / scales[step]
        want.step()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert _rel_err(a, b) < 1e-6, f"param {i}"
        assert opt.state[a]["step"].item() == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel_err(opt.state[a][key], want.state[b][key]) < 1e-6, f"{key} {i}"


def test_a_skipped_step_changes_nothing_bitwise():
    params = _params()
    opt = _run(TritonAdamW, params, 2)
    before = copy.deepcopy((params, opt.state_dict()))
    for p, g in zip(params, _grads(9), strict=True):
        p.grad = g
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    opt.step()
    after_sd = opt.state_dict()
    for a, b in zip(params, before[0], strict=True):
        assert torch.equal(a, b)
    for idx, state in before[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(after_sd["state"][idx][key], value), (idx, key)


@pytest.mark.parametrize("first, second", [(torch.optim.AdamW, TritonAdamW),
                                           (TritonAdamW, torch.optim.AdamW)])
def test_state_dict_moves_between_optimizers(first, second):
    """Three steps with one, its state dict loaded into the other, three more: the same as
    six steps with torch's AdamW (checkpoints do not depend on optimizer.backend)."""
    straight = _params()
    _run(torch.optim.AdamW, straight, 6)
    params = _params()
    opt = _run(first, params, 3)
    sd = opt.state_dict()
    nxt = second(_groups(params), **HYPER)
    nxt.load_state_dict(sd)
    for step in range(3, 6):
        for group in nxt.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        nxt.step()
    for i, (a, b) in enumerate(zip(params, straight, strict=True)):
        assert _rel_err(a, b) < 1e-6, f"param {i}"
        assert nxt.state[a]["step"].item() == 6


def test_parameters_without_gradients_are_left_alone():
    params = _params()
    opt = TritonAdamW(_groups(params), **HYPER)
    params[1].grad = torch.ones(SHAPES[1])
    before = [p.detach().clone() for p in params]
    opt.step()
    assert set(opt.state) == {params[1]}
    assert not torch.equal(params[1], before[1])
    assert all(torch.equal(p, b)
               for i, (p, b) in enumerate(zip(params, before, strict=True)) if i != 1)


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="amsgrad=True.*optimizer.backend=torch"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    p = [torch.zeros(4, dtype=torch.bfloat16)]
    coefs = step_coefficients([torch.ones(())], 1e-3, 0.9, 0.95, 0.0)
    one, zero = torch.ones(()), torch.zeros(())
    with pytest.raises(ValueError, match="float32 parameters and moments.*backend=torch"):
        adamw_step_(p, p, p, p, coefs, one, zero, 0.9, 0.95, 1e-8)
    f = [torch.zeros(4)]
    with pytest.raises(ValueError, match=r"gradient of torch.float32 \(3,\) for a parameter of "
                                         r"\(4,\)"):
        adamw_step_(f, [torch.zeros(3)], f, f, coefs, one, zero, 0.9, 0.95, 1e-8)
    with pytest.raises(ValueError, match="contiguous"):
        wide = [torch.zeros(4, 2)[:, 0]]
        adamw_step_(wide, wide, wide, wide, coefs, one, zero, 0.9, 0.95, 1e-8)


def test_step_coefficients_in_float64():
    steps = [torch.tensor(1.0), torch.tensor(1000.0)]
    got = step_coefficients(steps, 1e-3, 0.9, 0.999, 0.1)
    for i, t in enumerate((1, 1000)):
        want = [1e-3 / (1 - 0.9**t), (1 - 0.999**t) ** 0.5, 1e-4]
        assert got[i].tolist() == pytest.approx(want, rel=1e-7)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("grad", ["float32", "bfloat16"])
def test_full_blocks_compile_to_16_byte_vectors(grad):
    """For sm_90 (no GPU needed): with the addresses marked 16-byte aligned, a full block's
    fp32 state is read and written in 16-byte vectors (the update is bandwidth-bound: 28 bytes
    per element), with an fp32 or a bf16 gradient; without the mark (a tensor at an
    odd offset), nothing is vectorised, which is why the host checks the alignment."""
    from mpcore.kernels import adamw as module

    sig = {"table_ptr": "*i64", "blocks_ptr": "*i64", "coef_ptr": "*fp32", "scale_ptr": "*fp32",
           "skip_ptr": "*fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}
    kinds = {}
    for aligned in (True, False):
        ptx = sm90_ptx(module._adamw_kernel, sig, {"GRAD": getattr(tl_types(), grad),
                                                    "ALIGNED": aligned, "BLOCK": module.BLOCK},
                       num_warps=module.NUM_WARPS)
        kinds[aligned] = global_accesses(ptx)
    assert "st.global.v4.b32" in kinds[True] and "ld.global.v4.b32" in kinds[True], kinds[True]
    assert not any(".v" in a for a in kinds[False]), kinds[False]


def tl_types():
    import triton.language as tl

    return tl


@needs_triton
@pytest.mark.slow
def test_triton_kernel_under_interpreter():
    run_under_interpreter(__name__, "interpreter checks passed: 2")


def _check_kernel_equals_reference(grad_dtype):
    """The kernel and the reference on the same inputs (ragged sizes, an unaligned tensor, bf16
    or fp32 gradients, weight decay, a divisor) over three steps, then a skipped one."""
    shapes = [(3000,), (17, 5), (2048,), (1,)]
    g = torch.Generator().manual_seed(1)
    state = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    state[2] = [v.abs() for v in state[2]]
    runs = [copy.deepcopy(state) for _ in range(2)]
    for run in runs:  # the first tensors at an odd offset: not 16-byte aligned
        for part in run:
            buf = torch.empty(part[0].numel() + 1)
            buf[1:].copy_(part[0])
            part[0] = buf[1:]
    steps = [torch.tensor(5.0) for _ in shapes]
    for step in range(4):
        coefs = step_coefficients([s + step for s in steps], 2e-3, 0.9, 0.95, 0.1)
        grads = [torch.randn(s, generator=g).to(grad_dtype) for s in shapes]
        scale, skip = torch.tensor(1.7), torch.tensor(float(step == 3))
        before = copy.deepcopy(runs[0])
        for fn, (p, m, v) in zip((adamw_step_, adamw_step_reference_), runs, strict=True):
            fn(p, grads, m, v, coefs, scale, skip, 0.9, 0.95, 1e-8)
        for which, (a, b) in enumerate(zip(*runs, strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.allclose(x, y, rtol=2e-6, atol=1e-9), (grad_dtype, step, which)
        if step == 3:
            assert all(torch.equal(x, y) for a, b in zip(runs[0], before, strict=True)
                       for x, y in zip(a, b, strict=True))


def _interpreter_checks():
    from triton.runtime.interpreter import InterpretedFunction

    from mpcore.kernels import adamw as module

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(module._adamw_kernel, InterpretedFunction), "not interpreted"
    for dtype in (torch.float32, torch.bfloat16):
        _check_kernel_equals_reference(dtype)
    print("interpreter checks passed: 2")


if __name__ == "__main__":
    _interpreter_checks()
