"""Training a Qwen3-MoE with parallel.ep = 2 under FSDP2 through mpcore's trainer (gloo):
2 processes (dp = 2, ep = 2) and 4 processes (tp = 2 x dp = 2, ep = 2).

One step of two micro-batches per dp rank: the loss (ce + coef * aux over the WHOLE step:
every rank, every micro-batch), the global gradient norm and every gradient (in its logical
form: FSDP2 shards over dp x cp or, for the experts, over edp gathered, the ep ranks' experts
and the tp pieces put together) equal one process on all four micro-batches' documents as
one stream, same seed. The bad layouts (ep not dividing dp x cp, ep with DDP) are refused
before any compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpcore.build import _expert_parallel_state, build, resolve_device, setup
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.logical import LogicalLayout
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_moe.family import FAMILY, local_inputs
from mpcore.parallel.state import ParallelState
from mpcore.train import Trainer
from tests.dist.harness import run_distributed

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


def _logical_grads(run) -> dict[str, torch.Tensor]:
    """Every gradient in its logical form (HF names, all experts): FSDP2 shards gathered, then
    the ep slices, then the tp pieces (``mpcore.logical``). Collective over the world."""
    s, layout, out = run.state, run.train_state.layout, {}
    for name, p in run.model.named_parameters():  # same order on every rank: collectives
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        g = layout.gather_experts(name, g.detach(), s.ep_group)
        out.update(layout.gather(name, g, s.tp_group))
    return out


def _worker(rank, world, data_dir, run_dir, overrides):
    cfg = _cfg(data_dir, run_dir, *overrides)
    state = setup(cfg)
    run = build(cfg, state, resolve_device(cfg))
    trainer = Trainer(run)
    batches = run.loader.next_step()
    loss = float(trainer._forward_backward(batches))
    norm = float(run.grad_norm())
    grads = _logical_grads(run)
    everyone = [None] * world
    # numpy, pickled by value: a tensor travels to the parent as a shared file descriptor,
    # which may be gone with its rank before the parent reads it
    mine = [{k: v.numpy() for k, v in b.items()} for b in batches] if state.tp_rank == 0 else []
    dist.all_gather_object(everyone, mine)  # one copy of each dp rank's micro-batches
    grads = {k: v.numpy() for k, v in grads.items()} if rank == 0 else None
    return {"loss": loss, "norm": norm, "grads": grads,
            "layout": (state.tp, state.dp, state.ep, state.tp_rank, state.ep_rank),
            "batches": [b for per_rank in everyone for b in per_rank]}


def _check_against_one_process(out, data_dir, tmp_path):
    """Loss, grad norm and every logical gradient of each rank vs one process on the whole
    step (the same seed)."""
    batches = [{k: torch.from_numpy(v) for k, v in b.items()} for b in out[0]["batches"]]
    assert len(batches) == 4  # 2 dp ranks x 2 micro-batches, different documents per rank
    assert not torch.equal(batches[0]["input_ids"], batches[2]["input_ids"])
    loss, norm, ref = _reference(_cfg(data_dir, tmp_path / "ref"), batches)
    for r in out:
        assert abs(r["loss"] - loss) / loss < 1e-5, (r["layout"], r["loss"], loss)
        assert abs(r["norm"] - norm) / norm < 1e-5, (r["layout"], r["norm"], norm)
    assert set(out[0]["grads"]) == set(ref)
    for name, g in out[0]["grads"].items():
        rel = float((torch.from_numpy(g) - ref[name]).norm() / ref[name].norm())
        assert rel < 1e-4, (name, rel)


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
    layout = LogicalLayout(model_cfg, 1, 0)
    logical = {}
    for name, g in grads.items():
        logical.update(layout.gather(name, g, None))
    return float(loss.detach()), norm, logical


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


@pytest.mark.slow
def test_ep2_fsdp_step_equals_one_process_on_the_whole_step(tmp_path, data_dir):
    out = run_distributed(_worker, 2, str(data_dir), str(tmp_path / "run"), ["parallel.ep=2"])
    assert {r["layout"] for r in out} == {(1, 2, 2, 0, 0), (1, 2, 2, 0, 1)}
    _check_against_one_process(out, data_dir, tmp_path)


@pytest.mark.slow
def test_tp2_ep2_fsdp_step_equals_one_process_on_the_whole_step(tmp_path, data_dir):
    out = run_distributed(_worker, 4, str(data_dir), str(tmp_path / "run"),
                          ["parallel.tp=2", "parallel.ep=2"], timeout=400)
    # rank = tp_rank + 2 * dp_rank; ep_rank = dp_rank (dp x cp = 2 = ep, edp = 1)
    assert [r["layout"] for r in out] == [(2, 2, 2, t, e) for e in (0, 1) for t in (0, 1)]
    _check_against_one_process(out, data_dir, tmp_path)


def test_bad_expert_parallel_layouts_are_refused(tmp_path, data_dir):
    with pytest.raises(ValueError, match="parallel.ep=2 needs parallel.data_parallel=fsdp"):
        _cfg(data_dir, tmp_path, "parallel.ep=2", "parallel.data_parallel=ddp")
    with pytest.raises(ValueError, match="parallel.ep=2 must divide dp x cp = 1"):
        setup(_cfg(data_dir, tmp_path, "parallel.ep=2"))
    # tp x ep does not fit the world: 4 ranks at tp = 2 leave dp x cp = 2 for ep = 4
    with pytest.raises(ValueError, match=r"parallel.ep=4 must divide dp x cp = 2 \(world 4 / "
                                         r"tp 2\); choose an ep that divides 2"):
        _expert_parallel_state(_cfg(data_dir, tmp_path, "parallel.tp=2", "parallel.ep=4"), 4,
                               "the config")
