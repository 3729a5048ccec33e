"""Qwen3.5 multi-token prediction under TP x CP (ring, Ulysses) x SP equals one process.

4 processes (gloo, fp32, CPU) load the release-format tiny checkpoint with ``mtp.*``
(``tests.dist.qwen35_mtp_tiny``) at each layout, make this rank's inputs with
``hybrid.mtp.local_inputs`` (``LabelShifter.mtp`` on the global stream, then one split) and
backpropagate ``main / N + w * mtp / N_mtp`` (global means). Per layout: the main and MTP losses
within 1e-5 of tp = cp = 1, every gradient shard (summed over cp) within 1e-5 rel of it (5x for
the DeltaNet decays, as ``test_qwen35_dist``) and within 1e-4 rel of the float64 definition.
The packed documents (lengths 5, 1, 22, 2, 3, 13) include ones with no MTP target and are cut
by the per-document zigzag split, so a shift taken after the split or a target that crossed a
document changes the loss. The default run covers tp 2 x cp 2 with ring, and with Ulysses under
SP and activation checkpointing, against tp = cp = 1, and a tp 2 x cp 2 export that gives the
checkpoint back tensor-equal; the slow one runs tp {1, 2} x cp {1, 2} x {ring, Ulysses} x SP
and cp = 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.hf import export_hf, full_map, load_hf
from mpcore.models.common.hybrid.mtp import local_inputs
from mpcore.parallel.labels import LabelShifter
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.dist.qwen35_mtp_tiny import make_checkpoint, reference
from tests.dist.qwen35_tiny import packed_docs
from tests.dist.test_qwen35_dist import _base_tol, _expected, _rel

LENGTHS = [5, 1, 22, 2, 3, 13]
WEIGHT = 0.3
# (tp, cp, cp_mode, sequence_parallel, activation_checkpointing); the first is the base
FAST = [(1, 1, "none", False, False), (2, 2, "ulysses", True, True),
        (2, 2, "ring", False, False)]
FULL = FAST + [(2, 1, "none", False, False), (2, 1, "none", True, False),
               (1, 2, "ring", False, False), (1, 2, "ulysses", False, False),
               (2, 2, "ring", True, False), (2, 2, "ulysses", False, False),
               (1, 4, "ring", False, False), (1, 4, "ulysses", False, True)]


def _case(folder, state, layout, ids, cu, counts):
    tp, cp, mode, sp, ckpt = layout
    model, cfg = load_hf(folder, state, sequence_parallel=sp, cp_mode=mode,
                         activation_checkpointing=ckpt, gdn_kernel="reference",
                         mtp_loss_weight=WEIGHT)
    _, inputs = local_inputs(state, ids, cu, cfg, sequence_parallel=model.sequence_parallel)
    out = model(**inputs, output="loss")
    sums = torch.stack([out.main.sum(), out.mtp.sum()])
    (sums[0] / counts[0] + WEIGHT * sums[1] / counts[1]).backward()
    sums = sums.detach()
    if cp > 1:
        dist.all_reduce(sums, group=state.cp_group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp_group)
    return cfg, (sums / torch.tensor(counts)).tolist(), {
        n: p.grad for n, p in model.named_parameters()}


def _worker(rank, world, folder, ids, cu, ref, layouts, export_dir):
    labels = LabelShifter()(ids, cu)
    (target,) = LabelShifter().mtp(ids, cu, depth=1)
    counts = (int((labels != -100).sum()), int((target.labels != -100).sum()))
    states, out, base = {}, {}, None
    for layout in layouts:
        state = states.setdefault(layout[:2], ParallelState.build(*layout[:2]))
        cfg, losses, grads = _case(folder, state, layout, ids, cu, counts)
        pieces = full_map(cfg, state.tp, state.tp_rank)
        if base is None:  # tp = cp = 1, as HF tensors
            base = (losses, gather_full(grads, [full_map(cfg, 1, 0)], None))
        vs_ref = {n: _rel(g, _expected(ref["grads"], pieces[n])) for n, g in grads.items()}
        out[layout] = {
            "loss_vs_base": max(abs(a - b) for a, b in zip(losses, base[0], strict=True)),
            "loss_vs_ref": max(abs(losses[0] - ref["main"]), abs(losses[1] - ref["mtp"])),
            "grad_vs_ref": max(vs_ref.values()), "worst": max(vs_ref, key=vs_ref.get),
            "grad_vs_base": max(_rel(g, _expected(base[1], pieces[n])) / _base_tol(n)
                                for n, g in grads.items())}
    state = states[(2, 2)]
    export_hf(load_hf(folder, state, cp_mode="ring", mtp_loss_weight=WEIGHT)[0], state,
              export_dir)
    return out


def _check(tmp_path, layouts):
    folder = str(tmp_path / "ckpt")
    make_checkpoint(folder)
    ids, cu = packed_docs(LENGTHS, seed=4)
    ref = reference(folder, ids, cu, WEIGHT)
    results = run_distributed(_worker, 4, folder, ids, cu, ref, layouts,
                              str(tmp_path / "export"), timeout=900)
    for rank, res in enumerate(results):
        for layout in layouts:
            r = res[layout]
            where = f"rank {rank} {layout}: {r}"
            assert r["loss_vs_base"] <= 1e-5 and r["grad_vs_base"] <= 1e-5, where
            assert r["loss_vs_ref"] <= 1e-5 and r["grad_vs_ref"] <= 1e-4, where
    exported = load_file(Path(tmp_path) / "export" / "model.safetensors")
    original = load_file(Path(folder) / "model.safetensors")
    assert set(exported) == set(original) and "mtp.fc.weight" in exported
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def test_mtp_layouts_match_one_process(tmp_path):
    _check(tmp_path, FAST)


@pytest.mark.slow
def test_mtp_every_layout_matches_one_process(tmp_path):
    _check(tmp_path, FULL)
