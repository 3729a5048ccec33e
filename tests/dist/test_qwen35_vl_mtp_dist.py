"""Qwen3.5 vision-language multi-token prediction (dense and MoE) at tp x cp (ring, Ulysses)
x SP x ep layouts equals one process and the float64 definition (4 processes, gloo, fp32).

The checkpoints and reference are ``tests.dist.qwen35_vl_mtp_tiny``'s; the stream is
``hf_qwen3_vl_tiny``'s mixed one (images of several grids, a 3-frame video; placeholder runs
cut by the zigzag split, so the image row of token t+1 often lives on another cp rank than
position t: the shifted ``mtp_vision_rows`` ask the tower split for it). Every rank makes its
inputs with the family's ``local_inputs`` (the MTP ids, rows and labels shifted on the GLOBAL
stream, then one split) and backpropagates ``ce / N + w * mtp / N_mtp`` (MoE: ``+ coef * aux``
over every token and the L + 1 layers); gradients are summed over cp (experts: over edp). Per
layout: the loss within 1e-5 rel of one process and of the reference, every gradient shard
within 4e-5 rel of one process (the VL bound, ``test_qwen35_vl_dist``: the tower's small
gradients through the fp32 DeltaNet recurrence) and 1e-4 rel of the reference.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.registry import family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.hf_qwen3_vl_tiny import stream
from tests.dist.qwen35_vl_mtp_tiny import make_checkpoint, reference
from tests.dist.test_qwen3_moe_dist import _expected, _reduce_grads, _rel
from tests.dist.test_qwen3_vl_model import vision_kwargs

WEIGHT = 0.3
# (tp, cp, cp_mode, sequence_parallel, ep, vision_cp); dp = 1
DENSE = [(2, 2, "ring", True, 1, "split"), (2, 2, "ulysses", False, 1, "replicate"),
         (1, 4, "ulysses", False, 1, "split"), (1, 4, "ring", False, 1, "split")]
MOE = [(2, 2, "ring", False, 1, "split"), (2, 2, "ulysses", False, 2, "split"),
       (1, 4, "ring", False, 2, "split"), (1, 4, "ulysses", False, 4, "replicate")]


def _train(folder, state, s, counts, layout):
    """One step on the whole stream: ``(cfg, global loss, reduced grads by our name)``."""
    _, _, mode, sp, _, vision_cp = layout
    family = family_of_hf(folder)
    model, cfg = family.load_hf(folder, state, cp_mode=mode, sequence_parallel=sp,
                                vision_cp=vision_cp, gdn_kernel="reference",
                                mtp_loss_weight=WEIGHT)
    _, inputs = family.local_inputs(state, s["input_ids"], s["cu_seqlens"], cfg,
                                    sequence_parallel=model.sequence_parallel,
                                    **vision_kwargs(s))
    out = model(**inputs, output="loss")
    share = out.main.sum() / counts[0] + WEIGHT * out.mtp.sum() / counts[1]
    if hasattr(model, "router_stats"):
        stats = model.router_stats()
        share = share + cfg.text.router_aux_loss_coef * aux_share(
            stats, *global_counts([stats], state.dp_cp_group))
    share.backward()
    loss = share.detach()
    if state.dp_cp_group is not None:
        dist.all_reduce(loss, group=state.dp_cp_group)
    _reduce_grads(model, state)
    return family, cfg, float(loss), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank, world, folder, s, ref, layouts):
    counts = (ref["count"], ref["mtp_count"])
    family, cfg, base_loss, grads = _train(folder, ParallelState(), s, counts,
                                           (1, 1, "none", False, 1, "split"))
    base = gather_full(grads, [family.shard_map(cfg, 1, 0)], None)
    out = {}
    for layout in layouts:
        tp, cp, _, _, ep, _ = layout
        state = ParallelState.build(tp=tp, cp=cp, ep=ep)
        _, _, loss, gs = _train(folder, state, s, counts, layout)
        pieces = family.shard_map(cfg, tp, state.tp_rank)
        vs_base = {n: _rel(g, _expected(base, pieces[n], state, n)) for n, g in gs.items()}
        vs_ref = {n: _rel(g, _expected(ref["grads"], pieces[n], state, n))
                  for n, g in gs.items()}
        out[layout] = {"loss_vs_base": abs(loss - base_loss) / base_loss,
                       "loss_vs_ref": abs(loss - ref["loss"]) / ref["loss"],
                       "grad_vs_base": max(vs_base.values()),
                       "grad_vs_ref": max(vs_ref.values()), "worst": max(vs_ref, key=vs_ref.get)}
    return out


@pytest.mark.slow  # four ranks, a tower and a float64 VL reference: minutes on 2 cores
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vl_mtp_layouts_match_one_process_and_the_definition(tmp_path, moe):
    folder = tmp_path / "ckpt"
    make_checkpoint(folder, moe=moe)
    s = stream(seed=3)
    ref = reference(folder, s, WEIGHT, moe=moe)
    ref["grads"] = {k: v.detach() for k, v in ref["grads"].items()}
    results = run_distributed(_worker, 4, str(folder), s, ref, MOE if moe else DENSE,
                              timeout=1500)
    for rank, res in enumerate(results):
        for layout, r in res.items():
            where = f"rank {rank} {layout}: {r}"
            assert r["loss_vs_base"] <= 1e-5 and r["grad_vs_base"] <= 4e-5, where
            assert r["loss_vs_ref"] <= 1e-5 and r["grad_vs_ref"] <= 1e-4, where
