"""Models vs Hugging Face transformers at every tp x cp layout (gloo, fp32, CPU).

One 4-process spawn runs every case (process groups are the expensive part): for each family
(Llama 3 + rope scaling, Qwen2 + QKV bias + replicated kv head, Qwen3 + QK-norm + tied), each
layout tp in {1, 2} x cp in {1, 2} (ring, ulysses) x SP on/off, on a packed stream of documents
of odd lengths (one of a single token):
  - per-token log-probs and entropy through launch/score.py's code path vs transformers run per
    document in float64 (max abs diff <= 1e-4), and vs our tp=cp=1 result (<= 1e-5);
  - the mean loss and every parameter's gradient shard vs transformers' (rel <= 1e-4);
  - dp: replicas score different sequences and rank 0 gets them back in input order;
  - export at tp=2 x cp=2 -> transformers loads the same weights; build_model's init is the
    same function at tp=1 and tp=2.
A second test runs launch/score.py itself under torchrun with 4 processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpcore.launch.score import gather_in_order, score_sequences, score_stream
from mpcore.models import local_text_inputs
from mpcore.models.common.decoder import build_model
from mpcore.models.common.decoder_hf import shard_map
from mpcore.models.llama.hf import config_from_hf, export_hf, load_hf_model
from mpcore.parallel.collectives import gather_last_dim
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_tiny import (
    FAMILIES,
    VOCAB,
    packed_docs,
    reference_loss_grads,
    reference_scores,
    save_hf_model,
)

REPO = Path(__file__).resolve().parents[2]
LENGTHS = [7, 13, 1, 10, 5]
# (tp, cp, cp_mode, sequence_parallel, activation_checkpointing)
LAYOUTS = [(1, 1, "none", False, False), (2, 1, "none", False, False),
           (2, 1, "none", True, True), (1, 2, "ring", False, False),
           (1, 2, "ulysses", False, True), (2, 2, "ring", False, False),
           (2, 2, "ring", True, False), (2, 2, "ulysses", False, False),
           (2, 2, "ulysses", True, True)]


def _expected_shard(full: dict, pieces) -> torch.Tensor:
    """This rank's shard of HF tensors ``full`` (pieces of ``shard_map``), padding zero."""
    parts = []
    for p in pieces:
        t = full[p.name].float()
        stop = min(p.stop, t.shape[p.dim])
        part = t.narrow(p.dim, p.start, stop - p.start)
        if stop < p.stop:
            part = torch.cat([part, part.new_zeros(p.stop - stop, *t.shape[1:])])
        parts.append(part)
    return torch.cat(parts, dim=pieces[0].dim)


def _loss_and_grads(model, state, ids, cu):
    """Global mean loss and gradient shards (summed over cp) of one packed stream."""
    _, inputs = local_text_inputs(state, ids, cu, sequence_parallel=model.sequence_parallel)
    count = int(cu[-1]) - (cu.numel() - 1)  # every token but each document's last
    per_token = model(**inputs, output="loss")
    (per_token.sum() / count).backward()
    local = per_token.detach().sum()
    if state.cp > 1:
        dist.all_reduce(local, group=state.cp_group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp_group)
    return float(local) / count, {n: p.grad for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _parity_case(folder, state, layout, ids, cu, ref, base):
    tp, cp, mode, sp, ckpt = layout
    model, cfg = load_hf_model(folder, state, sequence_parallel=sp, cp_mode=mode,
                               activation_checkpointing=ckpt)
    logprobs, entropy = score_stream(model, state, ids, cu)
    loss, grads = _loss_and_grads(model, state, ids, cu)
    pieces = shard_map(cfg, state.tp, state.tp_rank)
    grad_rel = {n: _rel(g, _expected_shard(ref["grads"], pieces[n])) for n, g in grads.items()}
    out = {"logprobs": float((logprobs.double() - ref["logprobs"]).abs().max()),
           "entropy": float((entropy.double() - ref["entropy"]).abs().max()),
           "loss": abs(loss - ref["loss"]) / ref["loss"],
           "grad": max(grad_rel.values()), "worst": max(grad_rel, key=grad_rel.get),
           "num_grads": len(grads)}
    if base is not None:  # vs our own single-process result
        out["vs_base"] = float((logprobs - base[0]).abs().max())
        out["grad_vs_base"] = max(
            _rel(g, _expected_shard(base[1], pieces[n])) for n, g in grads.items())
    return out, (logprobs, entropy)


def _hf_named_grads(cfg, grads_tp1: dict) -> dict:
    """Our tp=1 gradients renamed to HF tensors (tp=1 shard map: one piece or a fused concat)."""
    out = {}
    for name, pieces in shard_map(cfg, 1, 0).items():
        sizes = [p.stop - p.start for p in pieces]
        for p, part in zip(pieces, grads_tp1[name].split(sizes, dim=pieces[0].dim), strict=True):
            out[p.name] = part.narrow(p.dim, 0, min(part.shape[p.dim], p.shape[p.dim]))
    return out


def _worker(rank, world, folders, ids, cu, refs, export_dir):
    states = {}
    results = {}
    for family, folder in folders.items():
        base = None
        for layout in LAYOUTS:
            tp, cp = layout[:2]
            state = states.setdefault((tp, cp), ParallelState.build(tp, cp))
            out, scores = _parity_case(folder, state, layout, ids, cu, refs[family], base)
            if layout[:2] == (1, 1):
                cfg = config_from_hf(folder)
                model, _ = load_hf_model(folder, state)
                base = (scores[0], _hf_named_grads(cfg, _loss_and_grads(model, state, ids,
                                                                        cu)[1]))
            results[(family, layout)] = out
        export_hf(load_hf_model(folder, states[(2, 2)], cp_mode="ring")[0], config_from_hf(folder),
                  states[(2, 2)], Path(export_dir) / family)
    results["dp"] = _dp_case(folders["qwen2"], states[(1, 2)], ids, cu, refs["qwen2"])
    results["init"] = _init_case(folders["llama"], states, ids, cu)
    results["errors"] = _bad_input_case(folders["qwen2"], states[(2, 1)])
    return results


def _bad_input_case(folder, state):
    """At tp=2: ids past the vocab (inside rank 1's padded shard) and an SP length that does not
    split over tp raise ValueError on every rank, before any collective."""
    model, _ = load_hf_model(folder, state, sequence_parallel=True)
    errors = []
    for ids in (torch.tensor([3, 5, VOCAB, 7]), torch.tensor([3, 5, 7])):
        n = ids.numel()
        try:
            model(ids, torch.arange(n), cu_seqlens=torch.tensor([0, n]), labels=ids)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _dp_case(folder, state, ids, cu, ref):
    """tp=1 x cp=2 x dp=2: round-robin sequences, rank 0 gathers them in input order."""
    model, _ = load_hf_model(folder, state, cp_mode="ulysses")
    seqs = [ids[a:b].tolist() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    mine = list(range(state.dp_rank, len(seqs), state.dp))
    results = score_sequences(model, state, [seqs[i] for i in mine])
    ordered = gather_in_order(results, mine, state, len(seqs))
    if ordered is None:
        return None
    worst = 0.0
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        assert len(ordered[i]["logprobs"]) == b - a - 1 == len(ordered[i]["entropy"])
        worst = max([worst, *(abs(x - y) for x, y in zip(
            ordered[i]["logprobs"], ref["logprobs"][a:b - 1].tolist(), strict=True))])
    return worst


def _init_case(folder, states, ids, cu):
    """build_model with one seed: logits at tp=2 (gathered over tp) equal those at tp=1."""
    cfg = config_from_hf(folder)
    logits = []
    for key in ((1, 1), (2, 1)):
        state = states[key]
        model = build_model(cfg, state, seed=7)
        _, inputs = local_text_inputs(state, ids, cu)
        with torch.no_grad():
            out = model(**inputs, output="logits")
        logits.append(gather_last_dim(out, state.tp_group)[:, :VOCAB])
    return float((logits[0] - logits[1]).abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    ids, cu = packed_docs(LENGTHS, seed=11)
    folders, refs, states = {}, {}, {}
    for i, family in enumerate(FAMILIES):
        folders[family] = str(root / family)
        states[family] = save_hf_model(family, seed=100 + i, folder=folders[family])
        logprobs, entropy = reference_scores(folders[family], ids, cu)
        loss, grads = reference_loss_grads(folders[family], ids, cu)
        refs[family] = {"logprobs": logprobs, "entropy": entropy, "loss": loss, "grads": grads}
    return folders, refs, states, ids, cu, root


@pytest.mark.slow
def test_models_match_transformers_at_every_layout(checkpoints):
    folders, refs, hf_states, ids, cu, root = checkpoints
    export_dir = root / "export"
    results = run_distributed(_worker, 4, folders, ids, cu, refs, str(export_dir), timeout=600)
    for rank, res in enumerate(results):
        for family in FAMILIES:
            for layout in LAYOUTS:
                r = res[(family, layout)]
                where = f"rank {rank} {family} {layout}: {r}"
                assert r["logprobs"] <= 1e-4 and r["entropy"] <= 1e-4, where
                assert r["loss"] <= 1e-4 and r["grad"] <= 1e-4, where
                assert r.get("vs_base", 0.0) <= 1e-5 and r.get("grad_vs_base", 0.0) <= 1e-5, where
        assert res["init"] <= 1e-5, res["init"]
        assert len(res["errors"]) == 2, res["errors"]
        assert "outside the vocab" in res["errors"][0] and "pad_multiple=tp" in res["errors"][1]
    assert results[0]["dp"] is not None and results[0]["dp"] <= 1e-4, results[0]["dp"]
    from transformers import AutoModelForCausalLM

    for family, folder in folders.items():
        exported = AutoModelForCausalLM.from_pretrained(export_dir / family).eval()
        original = AutoModelForCausalLM.from_pretrained(folder).eval()
        for name, tensor in hf_states[family].items():
            assert torch.equal(exported.state_dict()[name], tensor), (family, name)
        with torch.no_grad():
            assert torch.equal(exported(ids[None]).logits, original(ids[None]).logits), family


@pytest.mark.slow
def test_score_script_under_torchrun(checkpoints, tmp_path):
    folders, refs, _, ids, cu, _ = checkpoints
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    seqs = [ids[a:b].tolist() for a, b in bounds]
    mask = [1] * len(seqs[1])
    mask[4] = 0  # token 4 is no target: logprobs[3] must be 0
    rows = [{"input_ids": s} for s in seqs]
    rows[1]["loss_mask"] = mask
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--standalone", str(REPO / "launch" / "score.py"),
           "--hf-checkpoint", folders["qwen3"], "--tp", "2", "--cp", "2", "--cp-mode", "ring",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-4000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == len(seqs)
    ref = refs["qwen3"]
    for i, (a, b) in enumerate(bounds):
        want_lp = ref["logprobs"][a:b - 1].clone()
        if i == 1:
            want_lp[3] = 0.0
        assert len(out[i]["logprobs"]) == b - a - 1 == len(out[i]["entropy"])
        if b - a > 1:
            assert float((torch.tensor(out[i]["logprobs"]).double() - want_lp).abs().max()) <= 1e-4
            assert float((torch.tensor(out[i]["entropy"]).double()
                          - ref["entropy"][a:b - 1]).abs().max()) <= 1e-4
