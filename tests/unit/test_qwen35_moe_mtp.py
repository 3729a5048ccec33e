"""Qwen3.5-MoE multi-token prediction in one process (fp32, CPU): the MTP layer's MoE
feed-forward against a float64 definition, its router balanced with the decoder's, the release's
``mtp.*`` read in both expert layouts and written back, and the skip when MTP is off.

The checkpoint is ``tests.dist.qwen35_moe_mtp_tiny``'s (transformers' tiny
``Qwen3_5MoeForCausalLM`` plus random release-format ``mtp.*``); the reference is transformers'
decoder in float64 with the MTP block and the aux loss over L + 1 layers written out there.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.moe_hf import export_hf, full_map, load_hf
from mpcore.models.common.hybrid.mtp import MtpOutput
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_5_moe import FAMILY
from mpcore.parallel.state import ParallelState
from tests.dist.qwen35_moe_mtp_tiny import make_checkpoint, reference
from tests.dist.qwen35_tiny import packed_docs

LENGTHS = [5, 1, 30, 2, 3, 13]  # documents of 1 and 2 tokens have no MTP target
WEIGHT = 0.3


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_mtp") / "ckpt"
    make_checkpoint(folder)
    ids, cu = packed_docs(LENGTHS, seed=4)
    return folder, ids, cu


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _step(model, cfg, state, ids, cu):
    """One process's ``ce / N + w * mtp / N_mtp + coef * aux`` backpropagated; the parts."""
    _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
    out = model(**inputs, output="loss")
    assert isinstance(out, MtpOutput)
    n, n_mtp = int((inputs["labels"] != -100).sum()), int((inputs["mtp_labels"] != -100).sum())
    stats = model.router_stats()
    counts, rows = global_counts([stats], None)
    aux = aux_share(stats, counts, rows)
    ce, mtp = out.main.sum() / n, out.mtp.sum() / n_mtp
    (ce + WEIGHT * mtp + cfg.router_aux_loss_coef * aux).backward()
    return {"ce": float(ce.detach()), "mtp": float(mtp.detach()), "aux": float(aux.detach()),
            "count": n, "mtp_count": n_mtp, "rows": int(rows)}


@pytest.mark.slow  # transformers' float64 MoE reference: ~20 s on a quiet CPU
@pytest.mark.parametrize("packed", [False, True], ids=["per_expert", "packed"])
def test_one_process_equals_the_float64_definition(tmp_path, packed):
    folder = tmp_path / "ckpt"
    make_checkpoint(folder, packed=packed)
    ids, cu = packed_docs(LENGTHS, seed=4)
    ref = reference(folder, ids, cu, WEIGHT)
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    got = _step(model, cfg, state, ids, cu)
    # the router rows: L decoder layers and the MTP layer, every token of the batch
    assert got["rows"] == (cfg.num_layers + 1) * int(cu[-1]) == (cfg.num_layers + 1) * (
        ref["rows"])
    assert (got["count"], got["mtp_count"]) == (ref["count"], ref["mtp_count"])
    for key in ("ce", "mtp", "aux"):
        assert abs(got[key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (key, got, ref)
    grads = gather_full({k: p.grad for k, p in model.named_parameters()},
                        [full_map(cfg, 1, 0)], None)
    assert set(grads) == set(ref["grads"])
    worst = {k: _rel(g, ref["grads"][k]) for k, g in grads.items()}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    mtp_router = "mtp.layers.0.mlp.gate.weight"
    assert float(ref["grads"][mtp_router].norm()) > 0 and worst[mtp_router] <= 1e-4
    with torch.no_grad():
        _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
        (_, _), (mtp_lp, _) = model(**inputs, output="logprobs")
    assert float((mtp_lp.double() - ref["mtp_logprobs"]).abs().max()) <= 1e-5


def test_mtp_router_pooled_only_when_the_block_ran(release):
    folder, ids, cu = release
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    assert model.mtp.layers[0].feed_forward in model.moe_blocks()
    _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
    with torch.no_grad():
        model(**inputs, output="loss")
        with_mtp = model.router_stats()
        plain = {k: v for k, v in inputs.items() if not k.startswith("mtp_")}
        main_only = model(**plain, output="loss")
        without = model.router_stats()
    tokens = int(cu[-1])
    assert int(with_mtp.tokens) == (cfg.num_layers + 1) * tokens
    assert int(without.tokens) == cfg.num_layers * tokens  # no stale MTP rows
    base, _ = load_hf(folder, state, gdn_kernel="reference")
    assert base.mtp is None
    with torch.no_grad():
        assert torch.equal(base(**plain, output="loss"), main_only)


def test_release_round_trips_byte_equal_and_skips_mtp_when_off(release, tmp_path, caplog):
    folder = release[0]
    state = ParallelState()
    model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    export_hf(model, state, tmp_path / "out")
    assert ((tmp_path / "out" / "model.safetensors").read_bytes()
            == (folder / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    with caplog.at_level(logging.INFO):
        plain, cfg = load_hf(folder, state, gdn_kernel="reference")
    assert plain.mtp is None and not cfg.uses_mtp
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    num_mtp = sum(1 for k in load_file(folder / "model.safetensors") if k.startswith("mtp."))
    assert len(lines) == 1 and f"mtp.*: {num_mtp}" in lines[0], lines


def test_packed_mtp_experts_load_as_the_per_expert_ones(release, tmp_path):
    folder = release[0]
    packed = tmp_path / "packed"
    make_checkpoint(packed, packed=True)
    state = ParallelState()
    a, cfg = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    b, _ = load_hf(packed, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    full = [gather_full(dict(m.named_parameters()), [full_map(cfg, 1, 0)], None) for m in (a, b)]
    assert set(full[0]) == set(full[1])
    for name in full[0]:  # same seed: the same values, stored two ways
        assert torch.equal(full[0][name], full[1][name]), name


def test_score_mtp_gives_the_mtp_heads_logprobs(release, tmp_path):
    from mpcore.launch.score import main

    folder, ids, cu = release
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=1.0)
    with torch.no_grad():
        _, inputs = FAMILY.local_inputs(state, ids, cu, cfg)
        (_, _), (want, _) = model(**inputs, output="logprobs")  # checked vs float64 above
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"input_ids": ids[a:b].tolist()}) + "\n" for a, b in bounds))
    assert main(["--hf-checkpoint", str(folder), "--input", str(tmp_path / "in.jsonl"),
                 "--mtp", "--output", str(tmp_path / "mtp.jsonl")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "mtp.jsonl").read_text().splitlines()]
    for (a, b), row in zip(bounds, rows, strict=True):
        assert len(row["logprobs"]) == b - a - 1
        got = torch.tensor(row["logprobs"], dtype=torch.float64)
        assert torch.allclose(got, want[a:b - 1].double(), rtol=0, atol=1e-5), (a, b)
