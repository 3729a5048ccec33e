"""The trainer's pipeline refusals (``mpcore.pipelined.check_pipeline``) and the parallel
section's pp fields: each names the fix."""

from __future__ import annotations

import pytest

from mpcore.build import run_family
from mpcore.config import load_config
from mpcore.pipelined import check_pipeline


def _check(*overrides: str):
    cfg = load_config(None, ["parallel.pp=2", "data.grad_accum=2", *overrides])
    family = run_family(cfg)
    check_pipeline(cfg, family.config_from_section(cfg.model, None), family)


def test_a_fitting_layout_passes():
    _check()
    _check("parallel.pp_schedule=Interleaved1F1B", "data.grad_accum=4")


@pytest.mark.parametrize("overrides, match", [
    (["data.grad_accum=1"], r"data.grad_accum=1 is the number of micro-batches per step at "
                            r"parallel.pp=2: schedule 1F1B needs at least 2"),
    (["parallel.pp_schedule=Interleaved1F1B", "data.grad_accum=5"], "make 2 rounds"),
    (["parallel.pp_schedule=ZBVZeroBubble", "training.eval_every=10",
      "data.valid_fraction=0.1"], "cannot run validation's forward-only steps"),
    (["model.freeze_vision=true"], "model.freeze_vision is not supported yet"),
    (["model.family=qwen3_moe", "parallel.pp_schedule=ZBVZeroBubble"],
     "a MoE model's step starts with a forward-only counting pass"),
])
def test_refusals_name_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        _check(*overrides)


def test_virtual_stages_default_to_the_schedule():
    assert load_config(None, ["parallel.pp_schedule=1F1B"]).parallel.virtual_stages == 1
    assert load_config(None, ["parallel.pp_schedule=Interleaved1F1B"]
                       ).parallel.virtual_stages == 2
    assert load_config(None, ["parallel.pp_schedule=Interleaved1F1B", "parallel.pp_virtual=3"]
                       ).parallel.virtual_stages == 3
    with pytest.raises(ValueError, match="parallel.pp must be >= 1"):
        load_config(None, ["parallel.pp=0"])
