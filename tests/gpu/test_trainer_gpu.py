"""The training step on CUDA decides its update on the device (fused AdamW's ``found_inf`` and
``grad_scale``): launching a step asks the host to wait for nothing, ``fit`` (which reads each
step's numbers during the next one) gives the losses of one ``train_step`` at a time, and the
device's decision trains as the host's did (clipping on: a few ulp per update apart)."""

from __future__ import annotations

import pytest
import torch

import mpcore.train
from mpcore.build import build, resolve_device, setup
from mpcore.config import load_config
from mpcore.optim import decides_on_device
from mpcore.train import Trainer, train
from tests.perf.profile_train import sync_sites

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without CUDA
STEPS = 6


def _cfg(tmp_path, run: str, *overrides: str):
    return load_config(None, ["training.device=cuda", f"training.max_steps={STEPS}",
                              "checkpoint.every=0", "checkpoint.resume=false",
                              "logging.log_every=100", "optimizer.grad_clip=0.05",
                              f"data.cache_dir={tmp_path / 'data'}",
                              f"logging.run_dir={tmp_path / run}", *overrides])


def _trainer(cfg) -> Trainer:
    return Trainer(build(cfg, setup(cfg), resolve_device(cfg)))


def test_launching_a_step_never_waits_for_the_gpu(tmp_path):
    trainer = _trainer(_cfg(tmp_path, "run"))
    assert decides_on_device(trainer.run.optimizer)
    for _ in range(2):  # first use: allocator, kernel compiles, cuDNN plans
        trainer.train_step()
    torch.cuda.synchronize()
    launched = []
    syncs = sync_sites(lambda: launched.append(trainer.launch_step()))
    assert not syncs, dict(syncs)
    loss, norm = trainer.settle(launched[0])
    assert torch.isfinite(torch.tensor([loss, norm])).all() and norm > 0.05


def test_fit_gives_the_losses_of_one_step_at_a_time(tmp_path):
    trainer = _trainer(_cfg(tmp_path, "stepped"))
    stepped = [trainer.train_step() for _ in range(STEPS)]
    fitted = train(_cfg(tmp_path, "fitted"))
    assert fitted.losses == [loss for loss, _ in stepped]
    assert fitted.grad_norms == [norm for _, norm in stepped]


def test_device_decision_trains_as_the_host_decision(tmp_path, monkeypatch):
    """Within the GPU's own run-to-run spread: the host path twice, the device path once (the
    kernels' atomics make two runs of one path differ; Adam's first updates amplify that)."""

    def losses(run: str) -> list[float]:
        trainer = _trainer(_cfg(tmp_path, run))
        return [trainer.train_step()[0] for _ in range(STEPS)]

    device = losses("device")
    monkeypatch.setattr(mpcore.train, "decides_on_device", lambda optimizer: False)
    host, again = losses("host"), losses("host_again")
    spread = max(abs(a - b) for a, b in zip(host, again, strict=True))
    gap = max(abs(a - b) for a, b in zip(device, host, strict=True))
    print(f"device vs host {gap:.3e}, host vs host {spread:.3e}", device, host, again)
    assert device[0] == pytest.approx(host[0], rel=1e-6)  # before any update
    # Deterministic here (spread 0): the clip's rounding alone, amplified over 6 steps (1.7e-5).
    assert gap <= 4 * spread + 1e-4 * abs(host[0])
