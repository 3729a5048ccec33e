"""Qwen3.5-MoE multi-token prediction at tp x cp (ring, Ulysses) x ep x dp layouts equals one
process and the float64 definition (4 processes, gloo, fp32, CPU).

The checkpoint is ``tests.dist.qwen35_moe_mtp_tiny``'s (the MTP layer's MLP a MoE block). The
global batch is four packed streams (documents of 1 and 2 tokens, with no MTP target, and
documents cut by the zigzag split); dp rank d trains on its share, so dp ranks see different
expert loads. Each rank makes its inputs with the family's ``local_inputs``
(``LabelShifter.mtp`` on the GLOBAL stream, then one split) and backpropagates
``ce / N + w * mtp / N_mtp + coef * aux`` (N, N_mtp: the batch's valid targets; aux over every
token of every rank and over the decoder's layers AND the MTP layer); gradients are summed
over dp x cp (experts: over edp). Per layout: the summed loss within 1e-5 rel of one process
and of the float64 reference, every gradient shard within 1e-5 rel of one process (3e-5 for
DeltaNet's decay vectors, as ``test_qwen35_moe_dist``) and 1e-4 rel of the reference. Then a
tp 2 x ep 2 export gives the release back byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.moe_hf import export_hf, full_map, load_hf
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_5_moe import FAMILY
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.qwen35_moe_mtp_tiny import make_checkpoint, reference
from tests.dist.qwen35_tiny import packed_docs
from tests.dist.test_qwen3_moe_dist import _concat, _expected, _my_streams, _reduce_grads, _rel

STREAMS = [[7, 3, 1], [22, 2], [10, 5], [4, 9]]
WEIGHT = 0.3
GATES = ("linear_attention.A_log", "linear_attention.dt_bias")
# (tp, cp, cp_mode, ep); dp = 4 / (tp cp)
LAYOUTS = [(2, 2, "ring", 1), (2, 2, "ulysses", 1), (1, 2, "ring", 2), (2, 1, "none", 2),
           (1, 1, "none", 4)]


def _counts(streams) -> tuple[int, int]:
    """The batch's valid next-token and MTP (t+2) targets."""
    lengths = [int(n) for _, cu in streams for n in (cu[1:] - cu[:-1]).tolist()]
    return sum(n - 1 for n in lengths), sum(max(n - 2, 0) for n in lengths)


def _train(folder, state, streams, counts, cp_mode="none"):
    """One step on this dp rank's streams: ``(global loss, reduced grads by our name)``."""
    model, cfg = load_hf(folder, state, cp_mode=cp_mode, gdn_kernel="reference",
                         mtp_loss_weight=WEIGHT)
    ids, cu = _concat(_my_streams(state, streams))
    _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
    out = model(**inputs, output="loss")
    stats = model.router_stats()
    c, rows = global_counts([stats], state.dp_cp_group)
    share = (out.main.sum() / counts[0] + WEIGHT * out.mtp.sum() / counts[1]
             + cfg.router_aux_loss_coef * aux_share(stats, c, rows))
    share.backward()
    loss = share.detach()
    if state.dp_cp_group is not None:
        dist.all_reduce(loss, group=state.dp_cp_group)
    _reduce_grads(model, state)
    return cfg, float(loss), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank, world, folder, streams, ref, export_dir):
    counts = _counts(streams)
    cfg, base_loss, grads = _train(folder, ParallelState(), streams, counts)
    base = gather_full(grads, [full_map(cfg, 1, 0)], None)
    out = {}
    for tp, cp, mode, ep in LAYOUTS:
        state = ParallelState.build(tp=tp, cp=cp, ep=ep)
        _, loss, gs = _train(folder, state, streams, counts, mode)
        pieces = full_map(cfg, tp, state.tp_rank)
        vs_base = {n: _rel(g, _expected(base, pieces[n], state, n)) for n, g in gs.items()}
        vs_ref = {n: _rel(g, _expected(ref["grads"], pieces[n], state, n))
                  for n, g in gs.items()}
        out[(tp, cp, mode, ep)] = {
            "loss_vs_base": abs(loss - base_loss) / base_loss,
            "loss_vs_ref": abs(loss - ref["loss"]) / ref["loss"],
            "grad_vs_base": max(v for n, v in vs_base.items() if not n.endswith(GATES)),
            "gates_vs_base": max(v for n, v in vs_base.items() if n.endswith(GATES)),
            "grad_vs_ref": max(vs_ref.values()), "worst": max(vs_ref, key=vs_ref.get),
            "mtp_experts_split": gs["mtp.layers.0.feed_forward.experts.w13"].shape[0]
            == cfg.num_experts // ep}
    state = ParallelState.build(tp=2, cp=1, ep=2)
    model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    export_hf(model, state, export_dir)
    return out


@pytest.mark.slow  # four ranks, five layouts and a float64 MoE reference: minutes on 2 cores
def test_moe_mtp_layouts_match_one_process_and_the_definition(tmp_path):
    folder = tmp_path / "ckpt"
    make_checkpoint(folder)
    streams = [packed_docs(lengths, 20 + i) for i, lengths in enumerate(STREAMS)]
    ids, cu = _concat(streams)
    ref = reference(folder, ids, cu, WEIGHT)
    results = run_distributed(_worker, 4, str(folder), streams, ref,
                              str(tmp_path / "export"), timeout=1200)
    for rank, res in enumerate(results):
        for layout, r in res.items():
            where = f"rank {rank} {layout}: {r}"
            assert r["loss_vs_base"] <= 1e-5 and r["grad_vs_base"] <= 1e-5, where
            assert r["gates_vs_base"] <= 3e-5, where
            assert r["loss_vs_ref"] <= 1e-5 and r["grad_vs_ref"] <= 1e-4, where
            assert r["mtp_experts_split"], where
    assert (Path(tmp_path) / "export" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors").read_bytes()
