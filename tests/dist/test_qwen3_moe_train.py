"""Training a Qwen3-MoE with parallel.ep = 2 under FSDP2 (2 gloo processes: dp = 2, ep = 2).

One step of two micro-batches per rank, through mpcore's trainer: the loss (ce + coef * aux
over the WHOLE step: both ranks, both micro-batches), every gradient (experts sharded over
edp, each ep rank holding half the experts; the rest over dp x cp) and the global gradient
norm equal one process on all four micro-batches' documents as one stream. The bad layouts
(ep not dividing dp x cp, ep with DDP, ep with checkpoints) are refused before any compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from models.common.moe_loss import aux_share, global_counts
from models.qwen3_moe.family import FAMILY, local_inputs
from models.qwen3_moe.model import is_expert_param
from mpcore.build import build, resolve_device, setup
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.train import Trainer
from parallel.state import ParallelState

COEF = 0.5


def _cfg(data_dir, run_dir, *extra):
    return load_config(None, [
        "model.family=qwen3_moe", "model.vocab_size=512", "model.hidden_size=64",
        "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=128", "model.moe.num_experts=4",
        "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=32",
        f"model.moe.router_aux_loss_coef={COEF}", f"data.cache_dir={data_dir}",
        "data.default_vocab_size=512", "data.seq_len=64", "data.micro_batch=2",
        "data.grad_accum=2", "training.device=cpu", f"logging.run_dir={run_dir}",
        "checkpoint.every=0", "checkpoint.resume=false", *extra])


def _one_stream(batches):
    ids = torch.cat([b["input_ids"] for b in batches])
    lengths = torch.cat([b["cu_seqlens"][1:] - b["cu_seqlens"][:-1] for b in batches])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return ids, cu


def _worker(rank, world, data_dir, run_dir):
    cfg = _cfg(data_dir, run_dir, "parallel.ep=2")
    state = setup(cfg)
    assert (state.ep, state.dp) == (2, 2)
    run = build(cfg, state, resolve_device(cfg))
    trainer = Trainer(run)
    batches = run.loader.next_step()
    loss = float(trainer._forward_backward(batches))
    norm = float(run.grad_norm())
    grads = {}
    for name, p in run.model.named_parameters():  # same order on every rank: collectives
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    everyone = [None] * world
    dist.all_gather_object(everyone, [{k: v.clone() for k, v in b.items()} for b in batches])
    return {"loss": loss, "norm": norm, "grads": grads, "ep_rank": state.ep_rank,
            "batches": [b for per_rank in everyone for b in per_rank]}


def _reference(cfg, batches):
    model_cfg = FAMILY.config_from_section(cfg.model, None)
    one = FAMILY.build(model_cfg, ParallelState(), seed=cfg.training.seed)
    ids, cu = _one_stream(batches)
    _, inputs = local_inputs(ParallelState(), ids, cu)
    per_token = one(**inputs, output="loss")
    stats = one.router_stats()
    counts, rows = global_counts([stats], None)
    valid = int((inputs["labels"] != -100).sum())
    loss = per_token.sum() / valid + COEF * aux_share(stats, counts, rows)
    loss.backward()
    grads = {n: p.grad for n, p in one.named_parameters()}
    norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
    return float(loss.detach()), norm, grads


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


@pytest.mark.slow
def test_ep2_fsdp_step_equals_one_process_on_the_whole_step(tmp_path, data_dir):
    out = run_distributed(_worker, 2, str(data_dir), str(tmp_path / "run"))
    batches = out[0]["batches"]
    assert len(batches) == 4  # 2 ranks x 2 micro-batches, different documents per rank
    assert not torch.equal(batches[0]["input_ids"], batches[2]["input_ids"])
    loss, norm, ref = _reference(_cfg(data_dir, tmp_path / "ref"), batches)
    for r in out:
        assert abs(r["loss"] - loss) / loss < 1e-5, (r["loss"], loss)
        assert abs(r["norm"] - norm) / norm < 1e-5, (r["norm"], norm)
        for name, g in r["grads"].items():
            want = ref[name]
            if is_expert_param(name):  # this ep rank's half of the experts
                half = want.shape[0] // 2
                want = want[r["ep_rank"] * half:(r["ep_rank"] + 1) * half]
            rel = float((g - want).norm() / want.norm())
            assert rel < 1e-4, (name, rel)
    assert {r["ep_rank"] for r in out} == {0, 1}


def test_bad_expert_parallel_layouts_are_refused(tmp_path, data_dir):
    with pytest.raises(ValueError, match="parallel.ep=2 needs parallel.data_parallel=fsdp"):
        _cfg(data_dir, tmp_path, "parallel.ep=2", "parallel.data_parallel=ddp")
    with pytest.raises(ValueError, match="parallel.ep=2 must divide dp x cp = 1"):
        setup(_cfg(data_dir, tmp_path, "parallel.ep=2"))
    with pytest.raises(ValueError, match="checkpoints of ep-split experts are not written"):
        from mpcore.build import _expert_parallel_state

        _expert_parallel_state(_cfg(data_dir, tmp_path, "parallel.ep=2", "checkpoint.every=5"),
                               2, "the config")
