"""Updates decided on the device over 2 gloo ranks (FSDP2 dp=2, PyTorch's fused AdamW on the
CPU, as CUDA runs get it): the ranks train as with the host's decision, and a stop asked on one
rank only, read a step late, stops both ranks together one step later, saved there."""

from __future__ import annotations

import pytest

from mpcore.checkpoint import latest_checkpoint
from mpcore.data import prepare_default
from tests.dist.harness import run_distributed
from tests.dist.test_train_layouts import tiny


def _stop_on_rank_1(rank, world, tmp):
    import mpcore.build
    from mpcore.build import build, resolve_device, setup
    from mpcore.optim import decides_on_device
    from mpcore.train import Trainer
    from tests.unit.test_device_decided_step import fused_adamw

    out = {}
    plain = mpcore.build.build_optimizer
    for mode in ("host", "device"):
        mpcore.build.build_optimizer = fused_adamw if mode == "device" else plain
        try:
            cfg = tiny(tmp, mode, "data.micro_batch=1", "optimizer.grad_clip=0.05")
            run = build(cfg, setup(cfg), resolve_device(cfg))
        finally:
            mpcore.build.build_optimizer = plain
        trainer = Trainer(run)
        next_step = run.loader.next_step

        def next_step_asking_stop(trainer=trainer, next_step=next_step):
            if rank == 1 and trainer.step == 2:  # step 3's data: as if SIGTERM came then
                trainer.stop_requested = True
            return next_step()

        run.loader.next_step = next_step_asking_stop
        result = trainer.fit()
        out[mode] = (decides_on_device(run.optimizer), result.status, result.step,
                     result.losses, latest_checkpoint(cfg.checkpoint_dir).name)
    return out


@pytest.mark.slow
def test_one_ranks_stop_stops_both_a_step_later(tmp_path):
    prepare_default(tmp_path / "data", 512)
    by_rank = run_distributed(_stop_on_rank_1, 2, str(tmp_path), timeout=300)
    assert by_rank[0] == by_rank[1]
    host, device = by_rank[0]["host"], by_rank[0]["device"]
    assert host[:3] == (False, "preempted", 3) and host[4] == "step-3"
    assert device[:3] == (True, "preempted", 4) and device[4] == "step-4"
    assert device[3][0] == host[3][0]  # before any update
    assert device[3][:3] == pytest.approx(host[3], rel=1e-5)  # clip: a few ulp per update
