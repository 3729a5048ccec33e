"""VLModel vs transformers' Qwen2-VL / Qwen2.5-VL, single process (CPU, fp32 vs float64).

A packed stream mixing text-only documents of odd lengths with documents holding 1-2 images of
different grids: per-token log-probs and entropy within 1e-4 of transformers run per document,
the mean loss and the gradient of every parameter (vision tower included) within 1e-4 rel;
tied and untied embeddings; export -> transformers loads the same function; bad inputs raise
before any compute."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.hf_io import _scatter_back
from mpcore.models.qwen2_vl.hf import export_hf_vl, load_hf_vl_model, vl_shard_map
from mpcore.models.qwen2_vl.inputs import local_vl_inputs
from mpcore.parallel.state import ParallelState
from tests.dist.hf_vl_tiny import (
    IMAGE,
    reference_loss_grads,
    reference_scores,
    save_hf_vl_model,
    vl_stream,
)

CASES = [("qwen2_vl", False), ("qwen2_vl", True), ("qwen2_5_vl", False)]


def hf_named(cfg, grads: dict) -> dict:
    """tp=1 gradients (or weights) of our parameters as hub tensors (fused parts put back)."""
    out: dict[str, torch.Tensor] = {}
    for name, pieces in vl_shard_map(cfg, 1, 0).items():
        _scatter_back(grads[name].detach(), pieces, out)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def score_and_grads(model, cfg, state, ids, cu, pixels, grid):
    """``(logprobs [T], entropy [T], loss, {name: grad})`` at this rank's layout (cp gathered;
    gradients summed over cp, as the dp x cp reduction would)."""
    plan, inputs = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels,
                                   image_grid_thw=grid,
                                   sequence_parallel=model.sequence_parallel)
    with torch.no_grad():
        logprobs, entropy = model(**inputs, output="logprobs")
    logprobs, entropy = plan.gather(logprobs, state.cp_group), plan.gather(entropy, state.cp_group)
    per_token = model(**inputs, output="loss")
    count = int((inputs["labels"] != -100).sum())
    total = per_token.sum()
    if state.cp > 1:
        import torch.distributed as dist

        counts = torch.tensor([count, float(total.detach())], dtype=torch.float64)
        dist.all_reduce(counts, group=state.cp_group)
        count, loss = int(counts[0]), float(counts[1]) / float(counts[0])
    else:
        loss = float(total.detach()) / count
    (total / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if state.cp > 1:
        for g in grads.values():
            dist.all_reduce(g, group=state.cp_group)
    return logprobs, entropy, loss, grads


@pytest.mark.parametrize(("arch", "tie"), [
    *CASES[:2], pytest.param(*CASES[2], marks=pytest.mark.slow)])  # Qwen2.5-VL: ~26 s
def test_matches_transformers(arch, tie, tmp_path):
    save_hf_vl_model(arch, seed=0, folder=tmp_path, tie=tie)
    ids, cu, pixels, grid, per_doc = vl_stream(seed=1)
    ref_lp, ref_ent = reference_scores(tmp_path, ids, cu, pixels, grid, per_doc)
    ref_loss, ref_grads = reference_loss_grads(tmp_path, ids, cu, pixels, grid, per_doc)
    state = ParallelState.build()
    model, cfg = load_hf_vl_model(tmp_path, state)
    logprobs, entropy, loss, grads = score_and_grads(model, cfg, state, ids, cu, pixels, grid)
    assert float((logprobs.double() - ref_lp).abs().max()) <= 1e-4
    assert float((entropy.double() - ref_ent).abs().max()) <= 1e-4
    assert bool((logprobs[:-1][ids[1:] == IMAGE] == 0).all())  # placeholders are no targets
    assert abs(loss - ref_loss) / ref_loss <= 1e-4
    named = hf_named(cfg, grads)
    assert set(named) == set(ref_grads)
    worst = {n: rel(named[n], ref_grads[n]) for n in ref_grads}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert any(n.startswith("visual.") and float(ref_grads[n].abs().max()) > 0 for n in named)


@pytest.mark.parametrize(("arch", "tie"), CASES[1:])
def test_export_round_trip(arch, tie, tmp_path):
    save_hf_vl_model(arch, seed=3, folder=tmp_path / "in", tie=tie)
    state = ParallelState.build()
    model, _ = load_hf_vl_model(tmp_path / "in", state)
    export_hf_vl(model, state, tmp_path / "out")
    ids, cu, pixels, grid, per_doc = vl_stream(seed=4)
    a = reference_scores(tmp_path / "in", ids, cu, pixels, grid, per_doc)
    b = reference_scores(tmp_path / "out", ids, cu, pixels, grid, per_doc)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_vision_inputs_raise(tmp_path):
    save_hf_vl_model("qwen2_vl", seed=0, folder=tmp_path)
    state = ParallelState.build()
    model, cfg = load_hf_vl_model(tmp_path, state)
    ids, cu, pixels, grid, _ = vl_stream(seed=1)
    _, inputs = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(ValueError, match=r"pixel_values has shape \(\d+, 23\) but grid_thw"):
        model(**{**inputs, "pixel_values": pixels[:, :23]})
    with pytest.raises(ValueError, match="disagree between input_ids"):
        rows = inputs["vision_rows"].clone()
        rows[0] = 0
        model(**{**inputs, "vision_rows": rows})
    with pytest.raises(ValueError, match="grid_thw is given without pixel_values"):
        model(**{**inputs, "pixel_values": None})
    with pytest.raises(ValueError, match="not a vision-language model"):
        from tests.dist.hf_tiny import save_hf_model

        save_hf_model("qwen2", 0, tmp_path / "decoder")
        load_hf_vl_model(tmp_path / "decoder", state)


def test_placed_inputs_are_checked_on_the_host(tmp_path):
    """Inputs placed by ``mpcore.batches.place`` keep their host copies of ``input_ids`` and
    ``vision_rows``: the placeholder checks and the placeholders' positions come from there
    (no device sync on CUDA; ``tests/gpu/test_vl_gpu.py`` checks that), with the same outputs
    and the same errors as the device path. A row changed in place after placing is no longer
    the host copy's: it is checked on the device, and still caught."""
    from mpcore.batches import place
    from mpcore.kernels import host_checked
    from mpcore.models.registry import family_of

    save_hf_vl_model("qwen2_vl", seed=0, folder=tmp_path)
    state = ParallelState.build()
    model, cfg = load_hf_vl_model(tmp_path, state)
    ids, cu, pixels, grid, _ = vl_stream(seed=1)
    _, raw = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels, image_grid_thw=grid)
    _, local = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels, image_grid_thw=grid)
    placed = place(local, family_of(cfg), torch.device("cpu"))
    grids = [tuple(g) for g in grid.tolist()]
    check = model._check_vision
    assert check(raw["input_ids"], raw["vision_rows"], pixels, grids)[1] is None
    rows, host_rows = check(placed["input_ids"], placed["vision_rows"], pixels, grids)
    assert host_rows is not None and torch.equal(host_rows, rows)
    with torch.no_grad():
        want = model(**raw, output="logprobs")
        got = model(**placed, output="logprobs")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def placed_with(edit):
        _, local = local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels,
                                   image_grid_thw=grid)
        edit(local["vision_rows"])
        return place(local, family_of(cfg), torch.device("cpu"))

    first_text = int((raw["vision_rows"] < 0).nonzero()[0])
    first_image = int((raw["vision_rows"] >= 0).nonzero()[0])
    text_row = placed_with(lambda r: r.__setitem__(first_text, 0))
    image_row = placed_with(lambda r: r.__setitem__(first_image, 10**6))
    for bad, message in [(text_row, "disagree between input_ids"),
                         (image_row, r"refers to row 1000000 but the vision input has")]:
        assert host_checked.host_copy(bad["vision_rows"]) is not None  # the host path
        with pytest.raises(ValueError, match=message):
            model(**bad, output="logprobs")
    stale = place(local_vl_inputs(state, ids, cu, cfg, pixel_values=pixels,
                                  image_grid_thw=grid)[1], family_of(cfg), torch.device("cpu"))
    stale["vision_rows"][first_text] = 0  # after placing: the host copy no longer holds it
    assert host_checked.host_copy(stale["vision_rows"]) is None  # the device path
    with pytest.raises(ValueError, match="disagree between input_ids"):
        model(**stale, output="logprobs")


def test_vl_checkpoint_passed_to_the_decoder_loader_raises(tmp_path):
    from mpcore.models import load_hf_model

    save_hf_vl_model("qwen2_vl", seed=0, folder=tmp_path)
    with pytest.raises(ValueError, match="vision-language checkpoint; load it with "
                                         "mpcore.models.load_hf_vl_model"):
        load_hf_model(tmp_path, ParallelState.build())
