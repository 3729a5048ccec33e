"""Qwen3VLModel at tp x cp layouts vs one process and vs transformers (gloo, fp32, CPU).

One 4-process spawn per test runs its cases (tp 2 x cp 4 has an 8-process test of its own).
Layouts: tp in {1, 2} x cp in {1, 2, 4}, ring and Ulysses, SP on and off, the tower's work
split over cp or replicated, activation checkpointing. Streams: the mixed one of
``hf_qwen3_vl_tiny`` (images of different grids and a 3-frame video; a placeholder run crosses
a zigzag cut, asserted), one whose only visual token lands on cp rank 3 of four while rank 0
runs the tower (ranks 0-2 hold no visual token), and one without any image (every rank still
runs the tower: no hang, vision gradients exactly zero). Checked: per-token log-probs vs our
single-process result (<= 1e-5) and vs transformers (<= 1e-4), every parameter's gradient
(tower and DeepStack mergers included; summed over cp as the dp x cp reduction does) vs the
single-process one (rel <= 1e-5) and vs transformers (rel <= 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.hf_io import gather_full
from mpcore.models.qwen3_vl import config_from_hf, local_inputs
from mpcore.models.registry import family_of, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_qwen3_vl_tiny import (
    IMAGE,
    VIDEO,
    reference_loss_grads,
    reference_scores,
    save_hf_model,
)
from tests.dist.hf_qwen3_vl_tiny import stream as make_stream
from tests.dist.test_qwen3_vl_model import rel, score_and_grads

# (tp, cp, cp_mode, sequence_parallel, activation_checkpointing, vision_cp)
BASE = (1, 1, "none", False, False, "split")
ALL = [BASE, (2, 1, "none", False, False, "split"), (2, 1, "none", True, True, "split"),
       (1, 2, "ring", False, False, "split"), (1, 2, "ulysses", False, False, "replicate"),
       (2, 2, "ring", True, False, "split"), (2, 2, "ring", False, False, "split"),
       (2, 2, "ulysses", False, True, "replicate"), (2, 2, "ulysses", True, False, "split"),
       (1, 4, "ring", False, False, "split"), (1, 4, "ulysses", False, False, "replicate")]
QUICK = [BASE, (2, 1, "none", True, False, "split"), (2, 2, "ulysses", True, False, "split"),
         (1, 4, "ring", False, False, "split")]
# The slow test runs what the quick one does not (and BASE, every case's vs-base reference):
# together they cover ALL, and CI, which runs both, computes no case twice.
REST = [BASE, *(layout for layout in ALL if layout not in QUICK)]
STREAMS = {"mixed": None,
           "one_rank": [[3, ("image", 1, 2, 2), 2], [9]],
           "no_image": [[7], [4], [1]]}


def _stream(name: str):
    docs = STREAMS[name]
    return make_stream(seed=5) if docs is None else make_stream(seed=5, docs=docs)


def _logical(grads, cfg, state):
    """Every gradient as the logical (tp=1) HF tensor, on tp rank 0 of cp rank 0; else None."""
    maps = [family_of(cfg).shard_map(cfg, state.tp, r) for r in range(state.tp)]
    full = gather_full(grads, maps, state.tp_group)
    return full if state.tp_rank == 0 and state.cp_rank == 0 else None


def _visual_tokens(state, cfg, s, sp: bool) -> int:
    _, inputs = family_of(cfg).local_inputs(state, s["input_ids"], s["cu_seqlens"], cfg,
                                            sequence_parallel=sp,
                                            image_grid_thw=s["image_grid_thw"],
                                            video_grid_thw=s["video_grid_thw"])
    return int((inputs["vision_rows"] >= 0).sum())


def _worker(rank, world, folder, refs, cases):
    """Every case's differences on this rank; the family is the checkpoint's (this test's
    Qwen3-VL, or test_qwen35_vl_dist's Qwen3.5 VL)."""
    states, results, base = {}, {}, {}
    load_hf = family_of_hf(folder).load_hf
    for name, layout in cases:
        s = _stream(name)
        tp, cp, mode, sp, ckpt, vision_cp = layout
        state = states.setdefault((tp, cp), ParallelState.build(tp, cp))
        model, cfg = load_hf(folder, state, sequence_parallel=sp, cp_mode=mode,
                             activation_checkpointing=ckpt, vision_cp=vision_cp)
        logprobs, entropy, loss, grads = score_and_grads(model, cfg, state, s)
        ref = refs[name]
        out = {"logprobs": float((logprobs.double() - ref["logprobs"]).abs().max()),
               "entropy": float((entropy.double() - ref["entropy"]).abs().max()),
               "loss": abs(loss - ref["loss"]) / ref["loss"],
               "visual_tokens": _visual_tokens(state, cfg, s, sp)}
        gathered = _logical(grads, cfg, state)
        if gathered is not None:
            worst = {n: rel(gathered[n], ref["grads"][n]) for n in ref["grads"]}
            out["grad"], out["worst"] = max(worst.values()), max(worst, key=worst.get)
            out["visual_grad_max"] = max(float(g.abs().max()) for n, g in gathered.items()
                                         if n.startswith("model.visual."))
            deep = [float(g.abs().max()) for n, g in gathered.items() if "deepstack" in n]
            out["deepstack_grad_max"] = max(deep) if deep else None  # None: no DeepStack
            if layout == BASE:
                base[name] = (logprobs, gathered)
            else:
                out["vs_base"] = float((logprobs - base[name][0]).abs().max())
                out["grad_vs_base"] = max(rel(gathered[n], base[name][1][n]) for n in gathered)
        results[(name, layout)] = out
    return results


def _run(tmp_path, cases, world: int = 4, save=save_hf_model, grad_vs_base: float = 1e-5):
    """Run ``cases`` ((stream name, layout) pairs) on the checkpoint ``save`` writes; assert
    every bound (``grad_vs_base``: gradients vs tp = cp = 1, rel); return the visual token
    count of each case per rank."""
    save(seed=0, folder=tmp_path)
    refs = {}
    for name in {n for n, _ in cases}:
        s = _stream(name)
        lp, ent = reference_scores(tmp_path, s)
        loss, grads = reference_loss_grads(tmp_path, s)
        refs[name] = {"logprobs": lp, "entropy": ent, "loss": loss, "grads": grads}
    results = run_distributed(_worker, world, tmp_path, refs, cases, timeout=900)
    visual = {}
    for rank_results in results:
        for key, out in rank_results.items():
            visual.setdefault(key, []).append(out["visual_tokens"])
            assert out["logprobs"] <= 1e-4 and out["entropy"] <= 1e-4, (key, out)
            assert out["loss"] <= 1e-4, (key, out)
            if "grad" in out:
                assert out["grad"] <= 1e-4, (key, out)
                if key[0] == "no_image":
                    assert out["visual_grad_max"] == 0.0, (key, out)
                else:
                    assert out["visual_grad_max"] > 0
                    assert out["deepstack_grad_max"] is None or out["deepstack_grad_max"] > 0
            if "vs_base" in out:
                assert out["vs_base"] <= 1e-5 and out["grad_vs_base"] <= grad_vs_base, (key, out)
    return visual


def _cases(layouts):
    cases = [("mixed", layout) for layout in layouts]
    cases += [(name, layout) for name in ("one_rank", "no_image") for layout in layouts
              if layout == BASE or layout[1] == 4 or layout == (2, 2, "ulysses", True, False,
                                                                 "split")]
    return cases


def test_layouts_match_one_process_and_transformers(tmp_path):
    visual = _run(tmp_path, _cases(QUICK))
    # Rank 3 of cp 4 holds the one visual token; ranks 0-2 hold none but still ran the tower.
    assert visual[("one_rank", (1, 4, "ring", False, False, "split"))] == [0, 0, 0, 1]


@pytest.mark.slow
def test_every_layout_matches_one_process_and_transformers(tmp_path):
    """The layouts of ALL that the quick test above does not run."""
    _run(tmp_path, _cases(REST))


@pytest.mark.slow
def test_tp2_cp4_on_eight_processes(tmp_path):
    """tp 2 x cp 4 (ring; Ulysses would need the 2 local heads divisible by 4), SP on and off."""
    layouts = [BASE, (2, 4, "ring", True, False, "split"), (2, 4, "ring", False, True, "split")]
    _run(tmp_path, [(name, layout) for name in ("mixed", "one_rank") for layout in layouts],
         world=8)


def test_a_placeholder_run_crosses_the_zigzag_cut():
    """The mixed stream at cp = 2 and 4 puts some image's run on two ranks (a run across a
    cut), so the layouts above cover it."""
    from tests.dist.hf_qwen3_vl_tiny import make_hf_model

    hf = make_hf_model(seed=0)
    cfg = config_from_hf({**hf.config.to_dict(),
                          "architectures": ["Qwen3VLForConditionalGeneration"]})
    s = _stream("mixed")
    ids = s["input_ids"]
    for cp in (2, 4):
        owner = torch.full((ids.numel(),), -1)
        for rank in range(cp):
            plan, _ = local_inputs(ParallelState(cp=cp, cp_rank=rank), ids, s["cu_seqlens"], cfg,
                                   image_grid_thw=s["image_grid_thw"],
                                   video_grid_thw=s["video_grid_thw"])
            index = plan.rank_layout(rank).global_index
            owner[index[index >= 0]] = rank
        visual = (ids == IMAGE) | (ids == VIDEO)
        cut = visual[1:] & visual[:-1] & (owner[1:] != owner[:-1])
        assert bool(cut.any()), cp
