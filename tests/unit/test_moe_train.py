"""Training a Qwen3-MoE through the registry (model.family qwen3_moe, ep = 1, one process).

- One step of two micro-batches: the trainer's loss is ``ce + coef * aux`` with aux the
  statistic of the WHOLE step (its counting pass), equal to the same model computing it on
  one stream of every document; so is every gradient. Without the counting pass (each
  micro-batch's own loads) the gradients differ by far more than the tolerance.
- launch/configs/qwen3_moe_tiny.yaml trains (cut to a few steps) and its loss falls; resume
  is bit-identical (meta.json round trip of the MoE config).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from mpcore.build import build, resolve_device, resolve_model_config, setup
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_moe.family import FAMILY, local_inputs
from mpcore.parallel.state import ParallelState
from mpcore.train import Trainer, train

MOE = ["model.family=qwen3_moe", "model.moe.num_experts=4", "model.moe.num_experts_per_tok=2",
       "model.moe.moe_intermediate_size=32", "model.moe.router_aux_loss_coef=0.5"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


def _dense_cfg(tmp, data_dir, *extra):
    return load_config(None, [
        "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=128",
        f"data.cache_dir={data_dir}", "data.default_vocab_size=512", "data.seq_len=64",
        "data.micro_batch=2", "data.grad_accum=2", "optimizer.lr=1e-2",
        "schedule.warmup_steps=2", "training.max_steps=6", "training.device=cpu",
        f"logging.run_dir={tmp}/run", "logging.log_every=100", "checkpoint.every=0", *extra])


def _cfg(tmp, data_dir, *extra):
    return _dense_cfg(tmp, data_dir, *MOE, *extra)


def _one_stream(batches):
    ids = torch.cat([b["input_ids"] for b in batches])
    lengths = torch.cat([b["cu_seqlens"][1:] - b["cu_seqlens"][:-1] for b in batches])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return ids, cu


def test_step_loss_and_grads_are_the_whole_batch_statistic(tmp_path, data_dir):
    cfg = _cfg(tmp_path, data_dir)
    state = setup(cfg)
    run = build(cfg, state, resolve_device(cfg))
    trainer = Trainer(run)
    batches = run.loader.next_step()
    assert len(batches) == 2
    loss = float(trainer._forward_backward(batches))
    grads = {n: p.grad.clone() for n, p in run.module.named_parameters()}
    one = FAMILY.build(run.model_cfg, ParallelState(), seed=cfg.training.seed)
    ids, cu = _one_stream(batches)
    _, inputs = local_inputs(ParallelState(), ids, cu)
    per_token = one(**inputs, output="loss")
    stats = one.router_stats()
    counts, rows = global_counts([stats], None)
    valid = int((inputs["labels"] != -100).sum())
    ref = per_token.sum() / valid + 0.5 * aux_share(stats, counts, rows)
    ref.backward()
    ref = float(ref.detach())
    assert abs(loss - ref) / ref < 1e-5
    rel = {n: float((grads[n] - p.grad).norm() / p.grad.norm())
           for n, p in one.named_parameters()}
    assert max(rel.values()) < 1e-4, max(rel, key=rel.get)
    metrics = trainer.last_moe.metrics()
    assert metrics["dropped_tokens"] == 0
    assert sum(metrics["expert_load"]) == 2 * 2 * int(cu[-1])  # layers x k x T
    # The bug the counting pass avoids: each micro-batch's own loads in its share.
    for p in one.parameters():
        p.grad = None
    for b in batches:
        _, inp = local_inputs(ParallelState(), b["input_ids"], b["cu_seqlens"])
        per_token = one(**inp, output="loss")
        st = one.router_stats()
        c, r = global_counts([st], None)
        (per_token.sum() / valid + 0.5 * aux_share(st, c, r)).backward()
    wrong = max(float((grads[n] - p.grad).norm() / p.grad.norm())
                for n, p in one.named_parameters() if "feed_forward.gate" in n)
    assert wrong > 1e-3


def trains_and_resumes_bit_identically(yaml, tmp, common: list[str], steps: int) -> list[dict]:
    """``yaml`` with ``common`` trains ``steps`` steps straight (run a: the loss falls by more
    than 0.1) and in two halves resumed from a checkpoint (run b) with the same losses, bit for
    bit (also the Qwen3.5-MoE tests'). Returns run a's metrics rows (at least one)."""
    straight = train(load_config(yaml, [*common, f"logging.run_dir={tmp}/a",
                                        f"training.max_steps={steps}", "checkpoint.every=0"])
                     ).losses
    assert straight[-1] < straight[0] - 0.1
    half = [*common, f"logging.run_dir={tmp}/b", f"checkpoint.every={steps // 2}"]
    first = train(load_config(yaml, [*half, f"training.max_steps={steps // 2}"])).losses
    second = train(load_config(yaml, [*half, f"training.max_steps={steps}"])).losses
    assert first + second == straight
    rows = [json.loads(line) for line in (tmp / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows
    return rows


def test_tiny_yaml_trains_and_resumes_bit_identically(tmp_path, data_dir):
    common = [f"data.cache_dir={data_dir}", "data.default_vocab_size=512",
              "model.vocab_size=512", "data.seq_len=64", "training.device=cpu",
              "schedule.warmup_steps=2", "schedule.total_steps=8", "logging.log_every=100"]
    yaml = "launch/configs/qwen3_moe_tiny.yaml"
    rows = trains_and_resumes_bit_identically(yaml, tmp_path, common, 8)
    moe = load_config(yaml).model.moe
    for row in rows:  # the step's global router statistics, in every logged row
        load = row["expert_load"]
        assert len(load) == moe.num_experts and row["dropped_tokens"] == 0
        assert sum(load) % moe.num_experts_per_tok == 0 and sum(load) > 0
        assert row["expert_imbalance"] == pytest.approx(max(load) / (sum(load) / len(load)))
        assert row["aux_loss"] > 0 and math.isfinite(row["z_loss"])
    meta_cfg = FAMILY.config_from_dict(dataclasses.asdict(FAMILY.config_from_section(
        load_config(yaml).model, None)))
    assert meta_cfg.num_experts == 8 and meta_cfg.norm_topk_prob


def test_bad_expert_layouts_and_models_are_refused_before_the_model_is_built(tmp_path,
                                                                              data_dir):
    fit = "model and parallel sections do not fit"
    with pytest.raises(ValueError, match=f"{fit}.*num_experts 4 is not divisible by ep 3"):
        resolve_model_config(_cfg(tmp_path, data_dir, "parallel.ep=3"))
    with pytest.raises(ValueError, match=f"{fit}.*ep=2 but this model has no experts"):
        resolve_model_config(_dense_cfg(tmp_path, data_dir, "parallel.ep=2"))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 is above num_experts 4"):
        resolve_model_config(_cfg(tmp_path, data_dir, "model.moe.num_experts_per_tok=5"))


@pytest.mark.parametrize("saved_moe", [True, False], ids=["moe_to_dense", "dense_to_moe"])
def test_checkpoint_of_the_other_family_is_refused_before_any_step(tmp_path, data_dir,
                                                                   saved_moe):
    one_step = ["training.max_steps=1", "checkpoint.every=1"]
    saved, other = (_cfg, _dense_cfg) if saved_moe else (_dense_cfg, _cfg)
    assert train(saved(tmp_path, data_dir, *one_step)).step == 1
    names = ("qwen3_moe", "llama") if saved_moe else ("llama", "qwen3_moe")
    with pytest.raises(ValueError, match=f"holds a {names[0]} model .* this config builds a "
                                         f"{names[1]} model"):
        train(other(tmp_path, data_dir, "training.max_steps=2"))
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]  # no step of the other model ran
    assert (tmp_path / "run" / "checkpoints" / "step-1").is_dir()  # kept, not set aside
