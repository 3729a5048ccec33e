"""Qwen3-MoE at ep x tp x cp x dp layouts vs transformers on the whole batch (gloo, fp32, CPU).

One 4-process spawn runs every layout (tp, cp, cp_mode, ep; dp = 4 / (tp cp)):
    (1,1,-,1) (1,1,-,2) (1,1,-,4) (2,1,-,2) (1,2,ring,2) (1,2,ring,4) (2,2,ring,2)
    (2,2,ulysses,1)
The global batch is four packed streams; dp rank d scores / trains on its share of them, so
dp ranks see different expert loads. Per layout:
  - per-token log-probs of every stream vs transformers per document (<= 1e-4) and vs our
    ep = tp = cp = 1 result (<= 1e-5);
  - the loss ``ce + coef * aux`` (aux over every token of every rank) and every gradient
    shard (non-expert grads summed over dp x cp, expert grads over edp; expert shards are the
    ep slices) vs transformers (rel <= 1e-4) and vs our ep = 1 layout (rel <= 1e-5);
  - with two micro-batches per rank (counting pass first): the same loss and gradients;
  - an average of per-rank (or per-micro-batch) aux values is off by far more than the
    tolerance: the test can see the bug it guards against.
A second case: ep = 4 on streams so short that some expert gets no token and some ep rank
receives no row; it still joins every all-to-all and matches the ep = 1 result.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpcore.models.common.moe_decoder_hf import load_hf_model, shard_map
from mpcore.models.common.moe_hf import is_expert_param
from mpcore.models.common.moe_loss import aux_share, global_counts, load_balancing_loss
from mpcore.models.qwen3_moe.family import local_inputs
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_moe_tiny import packed_docs, reference, save_hf_model

STREAMS = [[7, 3], [13, 1], [10, 5], [4, 9]]  # document lengths of the four streams
LAYOUTS = [(1, 1, "none", 1), (1, 1, "none", 2), (1, 1, "none", 4), (2, 1, "none", 2),
           (1, 2, "ring", 2), (1, 2, "ring", 4), (2, 2, "ring", 2), (2, 2, "ulysses", 1)]


def _streams(seed: int, lengths=STREAMS):
    return [packed_docs(ls, seed + i) for i, ls in enumerate(lengths)]


def _concat(streams):
    ids = torch.cat([s[0] for s in streams])
    lengths = torch.cat([s[1][1:] - s[1][:-1] for s in streams])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return ids, cu


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _expected(full: dict, pieces, state, name) -> torch.Tensor:
    """This rank's shard of HF tensors ``full``: its tp pieces (vocab padding zero), then its
    ep slice of an expert tensor."""
    parts = []
    for p in pieces:
        t = full[p.name].double()
        stop = min(p.stop, t.shape[p.dim])
        part = t.narrow(p.dim, p.start, stop - p.start)
        if stop < p.stop:
            part = torch.cat([part, part.new_zeros(p.stop - stop, *t.shape[1:])])
        parts.append(part)
    t = torch.cat(parts, pieces[0].dim)
    if is_expert_param(name):
        local = t.shape[0] // state.ep
        t = t[state.ep_rank * local:(state.ep_rank + 1) * local]
    return t


def _reduce_grads(model, state):
    for name, p in model.named_parameters():
        group = state.edp_group if is_expert_param(name) else state.dp_cp_group
        if group is not None:
            dist.all_reduce(p.grad, group=group)


def _train(model, state, micro_batches, labels_total):
    """Loss (ce + coef * aux, global) and reduced gradients of one step over ``micro_batches``
    (this rank's ``(ids, cu)`` each); a counting pass first when there are several."""
    coef = model.cfg.router_aux_loss_coef
    inputs = [local_inputs(state, ids, cu)[1] for ids, cu in micro_batches]
    if len(inputs) > 1:
        with torch.no_grad():
            stats = []
            for kw in inputs:
                model(**kw, output="loss")
                stats.append(model.router_stats())
    counts = rows = None
    logged, naive = torch.zeros(()), []
    for kw in inputs:
        per_token = model(**kw, output="loss")
        st = model.router_stats()
        if len(inputs) == 1:
            stats = [st]
        if counts is None:
            counts, rows = global_counts(stats, state.dp_cp_group)
        share = per_token.sum() / labels_total + coef * aux_share(st, counts, rows)
        share.backward()
        logged += share.detach()
        naive.append(float(load_balancing_loss(st.counts, st.prob_sum.detach(), st.tokens)))
    if state.dp_cp_group is not None:
        dist.all_reduce(logged, group=state.dp_cp_group)
    _reduce_grads(model, state)
    return float(logged), naive, {n: p.grad for n, p in model.named_parameters()}


def _my_streams(state, streams):
    per = len(streams) // state.dp
    return streams[state.dp_rank * per:(state.dp_rank + 1) * per]


def _case(folder, layout, streams, ref, base):
    tp, cp, mode, ep = layout
    state = ParallelState.build(tp=tp, cp=cp, ep=ep)
    from mpcore.launch.score import score_stream

    model, cfg = load_hf_model(folder, state, cp_mode=mode)
    logprobs = torch.cat([score_stream(model, state, ids, cu)[0] for ids, cu in streams])
    mine = _my_streams(state, streams)
    labels = sum(int(cu[-1]) - (cu.numel() - 1) for _, cu in streams)
    loss, naive, grads = _train(model, state, [_concat(mine)], labels)
    pieces = shard_map(cfg, tp, state.tp_rank)
    rel = {n: _rel(g, _expected(ref["grads"], pieces[n], state, n)) for n, g in grads.items()}
    out = {"logprobs": float((logprobs.double() - ref["logprobs"]).abs().max()),
           "loss": abs(loss - ref["loss"]) / ref["loss"], "grad": max(rel.values()),
           "worst": max(rel, key=rel.get), "logprobs_t": logprobs, "naive": naive}
    if base is not None:
        out["vs_base"] = float((logprobs - base["logprobs_t"]).abs().max())
        out["grad_vs_base"] = max(_rel(g, _expected(base["grads"], pieces[n], state, n))
                                  for n, g in grads.items())
    # Two micro-batches per rank (one document each), the counting pass first.
    for p in model.parameters():
        p.grad = None
    mb = [(ids[a:b], torch.tensor([0, b - a]))
          for ids, cu in mine for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    loss2, naive2, grads2 = _train(model, state, mb, labels)
    out["accum_loss"] = abs(loss2 - ref["loss"]) / ref["loss"]
    out["accum_grad"] = max(_rel(g, _expected(ref["grads"], pieces[n], state, n))
                            for n, g in grads2.items())
    out["naive_mb"] = naive2
    return out, state


def _full_grads(model, cfg) -> dict:
    """tp = ep = 1 gradients by HF (fused) name."""
    table, params = shard_map(cfg, 1, 0), dict(model.named_parameters())
    out = {}
    for name, pieces in table.items():
        sizes = [p.stop - p.start for p in pieces]
        for p, part in zip(pieces, params[name].grad.split(sizes, pieces[0].dim), strict=True):
            out[p.name] = part
    return out


def _worker(rank, world, folder, streams, ref):
    results, base = {}, None
    for layout in LAYOUTS:
        out, state = _case(folder, layout, streams, ref, base)
        if layout == LAYOUTS[0]:
            model, cfg = load_hf_model(folder, ParallelState())  # our one-process grads
            labels = sum(int(cu[-1]) - (cu.numel() - 1) for _, cu in streams)
            _, _, _ = _train(model, ParallelState(), [_concat(streams)], labels)
            base = {"logprobs_t": out["logprobs_t"], "grads": _full_grads(model, cfg)}
        gathered = [None] * world
        naive = [out["naive"], out["naive_mb"]]
        dist.all_gather_object(gathered, naive)
        out["naive_all"] = gathered if state.tp_rank == 0 else None
        out.pop("logprobs_t")
        results[layout] = out
    return results


@pytest.mark.slow
def test_ep_tp_cp_dp_layouts_match_transformers_on_the_whole_batch(tmp_path):
    save_hf_model(0, tmp_path)
    streams = _streams(10)
    ref = reference(tmp_path, *_concat(streams))
    per_rank = run_distributed(_worker, 4, str(tmp_path), streams, ref, timeout=900)
    for rank, results in enumerate(per_rank):
        for layout, r in results.items():
            where = f"rank {rank} layout {layout}: {r}"
            assert r["logprobs"] < 1e-4 and r["loss"] < 1e-5 and r["grad"] < 1e-4, where
            assert r["accum_loss"] < 1e-5 and r["accum_grad"] < 1e-4, where
            if "vs_base" in r:
                assert r["vs_base"] < 1e-5 and r["grad_vs_base"] < 1e-5, where
    # The guarded bug: averaging per-rank (dp=4) or per-micro-batch aux values.
    naive = per_rank[0][LAYOUTS[0]]["naive_all"]
    per_rank_mean = sum(n[0][0] for n in naive) / 4
    per_mb = [v for n in naive for v in n[1]]
    for wrong in (per_rank_mean, sum(per_mb) / len(per_mb)):
        assert abs(wrong - ref["aux"]) / ref["aux"] > 1e-2, (wrong, ref["aux"])


def _empty_worker(rank, world, folder, streams, ref):
    state = ParallelState.build(ep=4)  # dp = 4: the ep group is the whole world
    model, cfg = load_hf_model(folder, state)
    labels = sum(int(cu[-1]) - (cu.numel() - 1) for _, cu in streams)
    loss, _, grads = _train(model, state, [streams[state.dp_rank]], labels)
    per_layer = torch.stack([b.last_stats.counts for b in model.moe_blocks()])
    dist.all_reduce(per_layer)  # [layers, E]: every rank's tokens
    received = per_layer.view(len(cfg.moe_layers), 4, -1).sum(-1)  # [layers, ep rank]
    pieces = shard_map(cfg, 1, 0)
    one, _ = load_hf_model(folder, ParallelState())  # our one process on the whole batch
    _train(one, ParallelState(), [_concat(streams)], labels)
    base = _full_grads(one, cfg)
    rel = {n: _rel(g, _expected(base, pieces[n], state, n)) for n, g in grads.items()
           if "feed_forward" in n}
    grad = max(rel.values())
    absolute = max(float((g.double() - _expected(base, pieces[n], state, n)).abs().max())
                   for n, g in grads.items())
    hf = {n: _rel(g, _expected(ref["grads"], pieces[n], state, n)) for n, g in grads.items()
          if "feed_forward" in n}  # router and experts vs transformers
    return {"loss": abs(loss - ref["loss"]) / ref["loss"], "grad": grad,
            "moe_grad_vs_hf": max(hf.values()), "abs": absolute,
            "worst": max(rel, key=rel.get), "empty_expert": bool((per_layer == 0).any()),
            "empty_rank": bool((received == 0).any())}


@pytest.mark.slow
def test_ep4_with_an_expert_and_a_rank_that_get_no_token(tmp_path):
    save_hf_model(0, tmp_path)
    # Seeds chosen so that in layer 2 experts 0, 2 and 3 get no token (ep rank 1 none).
    streams = [packed_docs([2], 300 + i) for i in range(4)]
    ref = reference(tmp_path, *_concat(streams))
    for r in run_distributed(_empty_worker, 4, str(tmp_path), streams, ref):
        assert r["empty_expert"] and r["empty_rank"], r  # the case really happens
        # The router's and experts' gradients vs our ep = 1 process (rel 1e-5) and transformers
        # (rel 1e-4); every gradient within 1e-6 absolute. (On 2-token documents the q/k-norm
        # gradients are sums that nearly cancel: their relative error is 2e-4 between any two
        # fp32 summation orders, dp = 4 vs one process alike.)
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["moe_grad_vs_hf"] < 1e-4, r
        assert r["abs"] < 1e-6, r


def _export_worker(rank, world, folder, out):
    state = ParallelState.build(tp=2, ep=2)  # dp = 2: each ep rank reads half the experts
    model, _ = load_hf_model(folder, state)
    from mpcore.models.common.moe_decoder_hf import export_hf

    export_hf(model, state, out)
    return state.ep_rank


def test_export_at_tp2_ep2_from_the_fused_layout_loads_in_transformers(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.dist.hf_moe_tiny import make_hf_model

    save_hf_model(5, tmp_path / "released")  # for its config.json
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "released" / "config.json").read_text())
    theirs = {k: v.contiguous() for k, v in make_hf_model(5).state_dict().items()}
    save_file(theirs, fused / "model.safetensors", metadata={"format": "pt"})
    ranks = run_distributed(_export_worker, 4, str(fused), str(tmp_path / "out"))
    assert sorted(ranks) == [0, 0, 1, 1]
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
