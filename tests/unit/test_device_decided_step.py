"""Updates decided on the device (``Trainer.launch_step`` with a fused AdamW), on the CPU.

PyTorch's fused AdamW runs on the CPU too, with the same ``grad_scale`` / ``found_inf``
contract as on CUDA, so the path that CUDA training takes is checked here against the host's
decision (the same fused optimizer, with ``decides_on_device`` off): clipping as a divisor,
non-finite steps skipped (weights, moments and step counts untouched), the streak that stops
the run, and ``fit``'s one-step-late reading of the numbers, which must not change them.
``optimizer.backend=triton`` (``TritonAdamW``, its PyTorch update on the CPU) keeps the same
contract: it trains like the fused AdamW and skips the same way.
"""

from __future__ import annotations

import math

import pytest
import torch

import mpcore.build
import mpcore.train
from mpcore.build import build, resolve_device, setup
from mpcore.checkpoint import latest_checkpoint
from mpcore.optim import TritonAdamW, build_optimizer, decides_on_device
from mpcore.train import Trainer, TrainingDiverged, train
from tests.unit.test_train import (  # noqa: F401 (data_dir: a fixture)
    STEPS,
    data_dir,
    fit_with_sigterm_in_step_3,
    poisonable,
    tiny,
)

CLIP = "optimizer.grad_clip=0.05"  # below every step's norm here: each update is clipped


def fused_adamw(model, cfg, device_type):
    """``build_optimizer``'s AdamW (same groups and settings), fused: what CUDA runs get."""
    plain = build_optimizer(model, cfg, device_type)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in plain.param_groups]
    d = plain.defaults
    return torch.optim.AdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], fused=True)


@pytest.fixture
def fused(monkeypatch):
    """Every run built in the test gets PyTorch's fused AdamW on the CPU."""
    monkeypatch.setattr(mpcore.build, "build_optimizer", fused_adamw)


def _host_decides(monkeypatch):
    monkeypatch.setattr(mpcore.train, "decides_on_device", lambda optimizer: False)


def _steps(cfg, n):
    trainer = Trainer(build(cfg, setup(cfg), resolve_device(cfg)))
    out = [trainer.train_step() for _ in range(n)]
    return trainer, out


def test_device_decision_equals_the_host_decision(tmp_path, data_dir, fused, monkeypatch):  # noqa: F811
    cfg = tiny(tmp_path, data_dir, "run", CLIP)
    device_run, device = _steps(cfg, STEPS)
    assert decides_on_device(device_run.run.optimizer)
    _host_decides(monkeypatch)
    _, host = _steps(tiny(tmp_path, data_dir, "host", CLIP), STEPS)
    assert all(norm > 0.05 for _, norm in host)  # clipping ran at every step
    assert device[0] == host[0]  # the first loss comes before any update
    # Clipping divides by (norm + 1e-6) / clip where the host multiplies by its inverse:
    # a few ulp per update.
    for (dl, dn), (hl, hn) in zip(device, host, strict=True):
        assert dl == pytest.approx(hl, rel=1e-5) and dn == pytest.approx(hn, rel=1e-4)
    assert device[-1][0] < device[0][0] - 0.1


def test_fit_reads_a_step_late_and_trains_the_same(tmp_path, data_dir, fused):  # noqa: F811
    _, stepped = _steps(tiny(tmp_path, data_dir, "stepped"), STEPS)
    fitted = train(tiny(tmp_path, data_dir, "fitted"))
    assert fitted.losses == [loss for loss, _ in stepped]
    assert fitted.grad_norms == [norm for _, norm in stepped]
    # Resume on this path: bit-identical to the straight run.
    first = train(tiny(tmp_path, data_dir, "resumed", "checkpoint.every=4",
                       "training.max_steps=4", f"schedule.total_steps={STEPS}"))
    second = train(tiny(tmp_path, data_dir, "resumed", "checkpoint.every=4",
                        f"schedule.total_steps={STEPS}"))
    assert first.losses + second.losses == fitted.losses


def test_triton_adamw_trains_like_the_fused_adamw(tmp_path, data_dir, monkeypatch):  # noqa: F811
    cfg = tiny(tmp_path, data_dir, "triton", CLIP, "optimizer.backend=triton")
    triton_run, triton = _steps(cfg, STEPS)
    assert isinstance(triton_run.run.optimizer, TritonAdamW)
    assert decides_on_device(triton_run.run.optimizer)
    monkeypatch.setattr(mpcore.build, "build_optimizer", fused_adamw)
    _, fused = _steps(tiny(tmp_path, data_dir, "fused", CLIP), STEPS)
    assert triton[0] == fused[0]
    # The fused kernel keeps some scalar products in float64 where TritonAdamW rounds its
    # step coefficients to float32 once: a few ulp per update.
    for (tl, tn), (fl, fn) in zip(triton, fused, strict=True):
        assert tl == pytest.approx(fl, rel=1e-5) and tn == pytest.approx(fn, rel=1e-4)


@pytest.mark.parametrize("first, second", [("torch", "triton"), ("triton", "torch")])
def test_a_checkpoint_resumes_across_optimizer_backends(tmp_path, data_dir, first, second):  # noqa: F811
    """4 steps with one optimizer.backend, saved, 4 more resumed with the other (an allowed
    change): the losses of 8 straight steps with torch's AdamW, to a few ulp per update."""
    straight = train(tiny(tmp_path, data_dir, "straight", "optimizer.backend=torch")).losses
    resumed = []
    for backend, steps in ((first, 4), (second, STEPS)):
        resumed += train(tiny(tmp_path, data_dir, "switched", "checkpoint.every=4",
                              f"training.max_steps={steps}", f"schedule.total_steps={STEPS}",
                              f"optimizer.backend={backend}")).losses
    assert len(resumed) == STEPS and resumed[:4] == pytest.approx(straight[:4], rel=1e-6)
    assert resumed == pytest.approx(straight, rel=1e-5)


@pytest.mark.parametrize("backend", ["fused", "triton"])
def test_non_finite_step_is_skipped_on_the_device(tmp_path, data_dir, backend, request):  # noqa: F811
    if backend == "fused":
        request.getfixturevalue("fused")
    chosen = "optimizer.backend=" + ("triton" if backend == "triton" else "torch")
    run, trainer, poison = poisonable(tiny(tmp_path, data_dir, "run", "training.max_bad_steps=2",
                                           chosen))
    assert isinstance(run.optimizer, TritonAdamW) == (backend == "triton")
    trainer.train_step()

    def snapshot():
        state = run.optimizer.state
        return ({n: p.detach().clone() for n, p in run.model.named_parameters()},
                [{k: v.clone() for k, v in state[p].items()} for p in run.model.parameters()])

    weights, moments = snapshot()
    poison["on"] = True
    loss, norm = trainer.train_step()
    assert math.isnan(loss) and (trainer.bad_steps, trainer.consecutive_bad) == (1, 1)
    after_weights, after_moments = snapshot()
    assert all(torch.equal(after_weights[n], w) for n, w in weights.items())
    for got, want in zip(after_moments, moments, strict=True):  # incl. the step counts
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    poison["on"] = False
    loss, _ = trainer.train_step()
    assert math.isfinite(loss) and trainer.consecutive_bad == 0
    assert not all(torch.equal(p, weights[n]) for n, p in run.model.named_parameters())
    # fit reads each step during the next one (checkpoint.every=0, log_every=100): the
    # streak of 2 (steps 4 and 5) is seen after step 6 was launched, and named as 4-5.
    poison["on"] = True
    with pytest.raises(TrainingDiverged, match=r"steps 4-5 had a non-finite"):
        trainer.fit()
    assert (trainer.step, trainer.settled_step, trainer.bad_steps) == (6, 5, 3)


def test_sigterm_stops_at_the_same_step(tmp_path, data_dir, fused):  # noqa: F811
    cfg = tiny(tmp_path, data_dir)
    result = fit_with_sigterm_in_step_3(cfg)  # one process: its own flag, read at once
    assert (result.status, result.step) == ("preempted", 3)
    assert latest_checkpoint(cfg.checkpoint_dir).name == "step-3"
    assert len(result.losses) == 3
