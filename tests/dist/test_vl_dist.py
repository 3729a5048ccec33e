"""VLModel at every tp x cp layout vs transformers and vs one process (gloo, fp32, CPU).

One 4-process spawn runs every case. Layouts: tp in {1, 2} x cp in {1, 2, 4}, ring and Ulysses,
SP on and off, the vision work split over cp or replicated, activation checkpointing. Streams:
the mixed one of ``hf_vl_tiny`` (images straddle the zigzag chunks), one whose only image
token lands on a single cp rank of four (rank 0 runs the tower, rank 3 needs the row: the
all-gather's backward must bring the gradient back), and one with no image at all (every rank
still runs the tower: no hang, vision gradients exactly zero). Checked: per-token log-probs
vs transformers (<= 1e-4) and vs our single-process result (<= 1e-5), the mean loss and every
parameter's gradient (summed over cp, as the dp x cp reduction does) vs transformers (rel
<= 1e-4) and vs the single-process gradient (rel <= 1e-5).
"""

from __future__ import annotations

import pytest

from mpcore.models.common.hf_io import gather_full
from mpcore.models.qwen2_vl.hf import load_hf_vl_model, vl_shard_map
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_vl_tiny import (
    reference_loss_grads,
    reference_scores,
    save_hf_vl_model,
    vl_stream,
)
from tests.dist.test_vl_model import rel, score_and_grads

pytestmark = pytest.mark.slow  # every VL layout against transformers

# (tp, cp, cp_mode, sequence_parallel, activation_checkpointing, vision_cp)
LAYOUTS = [(1, 1, "none", False, False, "split"), (2, 1, "none", False, False, "split"),
           (2, 1, "none", True, True, "split"), (1, 2, "ring", False, False, "split"),
           (1, 2, "ulysses", False, False, "replicate"), (2, 2, "ring", True, False, "split"),
           (2, 2, "ulysses", False, True, "replicate"), (2, 2, "ulysses", True, False, "split"),
           (1, 4, "ring", False, False, "split"), (1, 4, "ulysses", False, False, "replicate")]
STREAMS = {"mixed": None,
           "one_rank": [(3, [(1, 2, 2)], 2), (9, [], 0)],
           "no_image": [(7, [], 0), (4, [], 0), (1, [], 0)]}
CASES = [("qwen2_vl", "mixed"), ("qwen2_5_vl", "mixed"), ("qwen2_vl", "one_rank"),
         ("qwen2_vl", "no_image")]


def _stream(name: str):
    docs = STREAMS[name]
    return vl_stream(seed=5) if docs is None else vl_stream(seed=5, docs=docs)


def _worker(rank, world, folders, refs):
    states, results = {}, {}
    for arch, stream in CASES:
        ids, cu, pixels, grid, _ = _stream(stream)
        if not grid.numel():
            pixels = grid = None
        base = None
        for layout in LAYOUTS:
            tp, cp, mode, sp, ckpt, vision_cp = layout
            state = states.setdefault((tp, cp), ParallelState.build(tp, cp))
            model, cfg = load_hf_vl_model(folders[arch], state, sequence_parallel=sp,
                                          cp_mode=mode, activation_checkpointing=ckpt,
                                          vision_cp=vision_cp)
            logprobs, entropy, loss, grads = score_and_grads(model, cfg, state, ids, cu,
                                                             pixels, grid)
            ref = refs[(arch, stream)]
            gathered = _logical(grads, cfg, state)
            out = {"logprobs": float((logprobs.double() - ref["logprobs"]).abs().max()),
                   "entropy": float((entropy.double() - ref["entropy"]).abs().max()),
                   "loss": abs(loss - ref["loss"]) / ref["loss"]}
            if gathered is not None:
                worst = {n: rel(gathered[n], ref["grads"][n]) for n in ref["grads"]}
                out["grad"] = max(worst.values())
                out["worst"] = max(worst, key=worst.get)
                out["visual_grad_max"] = max(float(g.abs().max()) for n, g in gathered.items()
                                             if n.startswith("visual."))
                if base is None:
                    base = (logprobs, gathered)
                else:
                    out["vs_base"] = float((logprobs - base[0]).abs().max())
                    out["grad_vs_base"] = max(rel(gathered[n], base[1][n]) for n in gathered)
            results[(arch, stream, layout)] = out
    return results


def _logical(grads, cfg, state):
    """Every gradient as the logical (tp=1) hub tensor, on tp rank 0 of cp rank 0; else None."""
    maps = [vl_shard_map(cfg, state.tp, r) for r in range(state.tp)]
    full = gather_full(grads, maps, state.tp_group)
    return full if state.tp_rank == 0 and state.cp_rank == 0 else None


def test_every_layout_matches_transformers_and_one_process(tmp_path):
    folders, refs = {}, {}
    for arch in ("qwen2_vl", "qwen2_5_vl"):
        folders[arch] = tmp_path / arch
        save_hf_vl_model(arch, seed=0, folder=folders[arch])
    for arch, stream in CASES:
        ids, cu, pixels, grid, per_doc = _stream(stream)
        lp, ent = reference_scores(folders[arch], ids, cu, pixels, grid, per_doc)
        loss, grads = reference_loss_grads(folders[arch], ids, cu, pixels, grid, per_doc)
        refs[(arch, stream)] = {"logprobs": lp, "entropy": ent, "loss": loss, "grads": grads}
    results = run_distributed(_worker, 4, folders, refs, timeout=600)
    for rank_results in results:
        for key, out in rank_results.items():
            assert out["logprobs"] <= 1e-4 and out["entropy"] <= 1e-4, (key, out)
            assert out["loss"] <= 1e-4, (key, out)
            if "grad" in out:
                assert out["grad"] <= 1e-4, (key, out)
                if key[1] == "no_image":
                    assert out["visual_grad_max"] == 0.0, (key, out)
                else:
                    assert out["visual_grad_max"] > 0.0, (key, out)
            if "vs_base" in out:
                assert out["vs_base"] <= 1e-5 and out["grad_vs_base"] <= 1e-5, (key, out)
