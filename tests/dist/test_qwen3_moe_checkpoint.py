"""Checkpoints of a Qwen3-MoE whose experts are split over ep ranks (gloo, 2 processes, CPU).

The checkpoint's logical form holds every expert of every layer (``mpcore.logical``), so:
  - a run at ep = 2 (dp = 2, FSDP2: experts sharded over edp) that stops at step 3 and
    resumes gives the loss curve of the uninterrupted ep = 2 run, bit for bit;
  - its step-3 checkpoint loads at ep = 1 (two processes, and one process) and a one-process
    checkpoint loads at ep = 2: the next step's loss equals the one-process reference run's
    within 1e-5 (the tolerance of the other layout-change resumes, test_train_layouts.py);
  - the ep = 2 run itself trains the same function as one process (losses within 1e-5).
The aux coefficient is large (0.5), so a checkpoint with one ep rank's experts in the other's
place, or the experts of one rank only, changes the next loss by far more than 1e-5.
A third case: 4 processes at dp = 4, ep = 2 (two ep groups; the experts are gathered only over
the writing rank's ep group, onto it): the checkpoint tensors of a fresh model, over all ranks,
are the one-process ones bit for bit, each written by exactly one rank.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.distributed as dist

from mpcore.build import build, resolve_device, setup
from mpcore.checkpoint import stored_tensors
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.train import train
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.slow  # seven short training runs

STEPS, SAVE_AT = 6, 3


def _cfg(tmp, run: str, *extra: str):
    return load_config(None, [
        "model.family=qwen3_moe", "model.vocab_size=512", "model.hidden_size=64",
        "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=128", "model.moe.num_experts=4",
        "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=32",
        "model.moe.router_aux_loss_coef=0.5", f"data.cache_dir={tmp}/data",
        "data.default_vocab_size=512", "data.seq_len=64", "data.micro_batch=2",
        "data.grad_accum=2", "optimizer.lr=1e-2", "schedule.warmup_steps=2",
        f"schedule.total_steps={STEPS}", f"training.max_steps={STEPS}", "training.device=cpu",
        f"logging.run_dir={tmp}/{run}", "logging.log_every=100", "checkpoint.every=0",
        "checkpoint.keep_last=5", *extra])


TWO = ["data.micro_batch=1"]  # dp = 2: the same global batch as one process
EP2 = [*TWO, "parallel.ep=2"]


def _copy_step(tmp, source: str, run: str) -> None:
    shutil.copytree(f"{tmp}/{source}/checkpoints/step-{SAVE_AT}",
                    f"{tmp}/{run}/checkpoints/step-{SAVE_AT}")


def _resume_one_step(tmp, run: str, *extra: str) -> list[float]:
    return train(_cfg(tmp, run, *extra, f"training.max_steps={SAVE_AT + 1}")).losses


def _two_ranks(rank, world, tmp):
    out = {"straight": train(_cfg(tmp, "ep2", *EP2)).losses}
    half = [*EP2, f"checkpoint.every={SAVE_AT}"]
    first = train(_cfg(tmp, "ep2_half", *half, f"training.max_steps={SAVE_AT}")).losses
    second = train(_cfg(tmp, "ep2_half", *half)).losses
    out["resumed"] = first + second
    for run, source, extra in (("ep1_from_ep2", "ep2_half", TWO), ("ep2_from_one", "one", EP2)):
        if rank == 0:
            _copy_step(tmp, source, run)
        dist.barrier()
        out[run] = _resume_one_step(tmp, run, *extra)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ckpt")
    prepare_default(tmp / "data", 512)
    one = train(_cfg(tmp, "one", f"checkpoint.every={SAVE_AT}")).losses
    by_rank = run_distributed(_two_ranks, 2, str(tmp), timeout=600)
    _copy_step(tmp, "ep2_half", "one_from_ep2")
    by_rank[0]["one_from_ep2"] = _resume_one_step(tmp, "one_from_ep2")
    return tmp, one, by_rank


def test_ep2_trains_as_one_process_and_resumes_bit_identically(runs):
    _, one, by_rank = runs
    assert by_rank[0]["straight"] == by_rank[1]["straight"]  # global values on every rank
    straight = by_rank[0]["straight"]
    assert len(straight) == STEPS and straight[-1] < straight[0] - 0.1, straight
    for step, (got, want) in enumerate(zip(straight, one, strict=True)):
        assert math.isclose(got, want, rel_tol=1e-5), (step + 1, got, want)
    for r in by_rank:
        assert r["resumed"] == straight, (r["resumed"], straight)


def test_checkpoint_holds_every_expert_and_the_ep_it_was_saved_at(runs):
    tmp = runs[0]
    folder = tmp / "ep2_half" / "checkpoints" / f"step-{SAVE_AT}"
    stored = stored_tensors(folder)
    assert json.loads((folder / "meta.json").read_text())["layout"]["ep"] == 2
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts."
        assert tuple(stored[f"model/{name}gate_up_proj"][0]) == (4, 64, 64)
        assert tuple(stored[f"model/{name}down_proj"][0]) == (4, 64, 32)
        assert tuple(stored[f"optim/{name}gate_up_proj/exp_avg"][0]) == (4, 64, 64)
    one = stored_tensors(tmp / "one" / "checkpoints" / f"step-{SAVE_AT}")
    logical = lambda d: {k: v for k, v in d.items() if not k.startswith("rng/")}  # noqa: E731
    assert logical(one) == logical(stored)  # the same keys and shapes at ep = 1 and ep = 2


@pytest.mark.parametrize("run", ["ep1_from_ep2", "ep2_from_one", "one_from_ep2"])
def test_checkpoint_loads_at_another_ep(runs, run):
    _, one, by_rank = runs
    got = by_rank[0][run]
    assert len(got) == 1, got
    assert math.isclose(got[0], one[SAVE_AT], rel_tol=1e-5), (run, got, one[SAVE_AT])
    if run != "one_from_ep2":
        assert by_rank[1][run] == got


def _collect(rank, world, tmp, *extra):
    """The checkpoint tensors this rank writes for a fresh model (``TrainState.collect``), and
    the shape of what ``gather_experts_to`` leaves on it for ep rank 1 (None: nothing)."""
    del rank, world
    cfg = _cfg(tmp, "collect", *extra)
    run = build(cfg, setup(cfg), resolve_device(cfg))
    tensors = {k: v for k, v in run.train_state.collect().items() if not k.startswith("rng/")}
    name = next(n for n in run.train_state.layout.names if n in run.train_state.layout.experts)
    local = run.train_state.params[name]
    local = local.full_tensor() if hasattr(local, "full_tensor") else local
    got = run.train_state.layout.gather_experts_to(name, local, run.state.ep_group, 1)
    return tensors, None if got is None else tuple(got.shape)


def test_ep2_of_dp4_checkpoint_tensors_are_one_process_ones_written_once(tmp_path):
    prepare_default(tmp_path / "data", 512)
    one, full = _collect(0, 1, str(tmp_path))
    out = run_distributed(_collect, 4, str(tmp_path), "data.micro_batch=1",
                          "data.grad_accum=1", "parallel.ep=2", timeout=400)
    # ep rank 1 (ranks 1 and 3) gets every expert; ep rank 0 (ranks 0 and 2) holds none.
    assert [shape for _, shape in out] == [None, full, None, full], (out, full)
    by_rank = [tensors for tensors, _ in out]
    writers = {}
    for rank, tensors in enumerate(by_rank):
        for key in tensors:
            writers.setdefault(key, []).append(rank)
    assert set(writers) == set(one) and all(len(w) == 1 for w in writers.values()), writers
    experts = [k for k in one if ".mlp.experts." in k]
    assert len(experts) == 4 and len({writers[k][0] for k in experts}) > 1, writers
    for key, (rank,) in writers.items():
        assert torch.equal(by_rank[rank][key], one[key]), key
