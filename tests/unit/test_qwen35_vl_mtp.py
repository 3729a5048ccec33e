"""Qwen3.5 vision-language multi-token prediction (dense and MoE) in one process (fp32, CPU).

The MTP block at t reads the embedding of token t+1 with the tower's rows merged (vLLM's
choice) at the decoder's M-RoPE positions, and is scored on token t+2 unless it is a
placeholder. Against ``tests.dist.qwen35_vl_mtp_tiny``'s float64 reference (transformers' VL
model with the MTP block written out on what its language model receives): the main and MTP
losses, the aux loss over L + 1 layers (MoE), every gradient (the tower's too: its rows reach
the MTP block), and ``score_stream(mtp=True)`` (score.py --mtp) log-probs; with the merged rows
replaced by the placeholder's plain embedding (Megatron-Bridge's choice) the MTP loss moves.
score.py's command (``main``) with ``--mtp`` on lines naming image files gives the reference's
MTP log-probs on transformers' processor output for those files.
The release round-trips byte-equal, and ``mtp.*`` is skipped with one log line when off.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from mpcore.launch.score import score_stream
from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.mtp import MtpOutput
from mpcore.models.common.moe_loss import aux_share, global_counts
from mpcore.models.qwen3_5_vl import FAMILY as VL
from mpcore.models.qwen3_5_vl_moe import FAMILY as VL_MOE
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import stream
from tests.dist.qwen35_vl_mtp_tiny import make_checkpoint, reference
from tests.dist.test_qwen3_vl_model import vision_kwargs

WEIGHT = 0.3


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _step(model, cfg, family, s, moe: bool, **overrides):
    state = ParallelState()
    _, inputs = family.local_inputs(state, s["input_ids"], s["cu_seqlens"], cfg,
                                    **vision_kwargs(s))
    inputs.update(overrides)
    out = model(**inputs, output="loss")
    assert isinstance(out, MtpOutput)
    n, n_mtp = int((inputs["labels"] != -100).sum()), int((inputs["mtp_labels"] != -100).sum())
    ce, mtp = out.main.sum() / n, out.mtp.sum() / n_mtp
    loss, aux = ce + WEIGHT * mtp, None
    if moe:
        stats = model.router_stats()
        aux = aux_share(stats, *global_counts([stats], None))
        loss = loss + cfg.text.router_aux_loss_coef * aux
    loss.backward()
    return {"ce": float(ce.detach()), "mtp": float(mtp.detach()), "count": n,
            "mtp_count": n_mtp, "aux": None if aux is None else float(aux.detach())}, inputs


@pytest.mark.slow  # transformers' float64 VL reference with a tower: ~30 s on a quiet CPU
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_one_process_equals_the_float64_definition(tmp_path, moe):
    family = VL_MOE if moe else VL
    folder = tmp_path / "ckpt"
    make_checkpoint(folder, moe=moe)
    s = stream(seed=3)
    ref = reference(folder, s, WEIGHT, moe=moe)
    model, cfg = family.load_hf(folder, ParallelState(), gdn_kernel="reference",
                                mtp_loss_weight=WEIGHT)
    got, inputs = _step(model, cfg, family, s, moe)
    assert (got["count"], got["mtp_count"]) == (ref["count"], ref["mtp_count"])
    assert bool((inputs["mtp_vision_rows"] >= 0).any())  # some t+1 is an image row
    for key in ("ce", "mtp") + (("aux",) if moe else ()):
        assert abs(got[key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (key, got, ref)
    grads = gather_full({k: p.grad for k, p in model.named_parameters()},
                        [family.shard_map(cfg, 1, 0)], None)
    assert set(grads) <= set(ref["grads"]) and any(k.startswith("mtp.") for k in grads)
    worst = {k: _rel(g, ref["grads"][k]) for k, g in grads.items()}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    logprobs, _ = score_stream(model, ParallelState(), s["input_ids"], s["cu_seqlens"],
                               **vision_kwargs(s), mtp=True)
    assert float((logprobs.double() - ref["mtp_logprobs"]).abs().max()) <= 1e-5
    # Megatron-Bridge's choice (the placeholder's own embedding at t+1) is another function.
    model.zero_grad()
    plain, _ = _step(model, cfg, family, s, moe, mtp_vision_rows=torch.full_like(
        inputs["mtp_vision_rows"], -1), mtp_input_ids=torch.where(
        inputs["mtp_vision_rows"] >= 0, 0, inputs["mtp_input_ids"]))
    assert abs(plain["mtp"] - ref["mtp"]) > 1e-3


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_release_round_trips_byte_equal_and_skips_mtp_when_off(tmp_path, caplog, moe):
    family = VL_MOE if moe else VL
    folder = tmp_path / "ckpt"
    make_checkpoint(folder, moe=moe)
    state = ParallelState()
    model, cfg = family.load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    assert cfg.uses_mtp and model.text.mtp is not None
    family.export_hf(model, state, tmp_path / "out")
    assert ((tmp_path / "out" / "model.safetensors").read_bytes()
            == (folder / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    with caplog.at_level(logging.INFO):
        plain, cfg = family.load_hf(folder, state, gdn_kernel="reference")
    assert plain.text.mtp is None and not cfg.uses_mtp
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    num_mtp = sum(1 for k in load_file(folder / "model.safetensors") if k.startswith("mtp."))
    assert len(lines) == 1 and f"mtp.*: {num_mtp}" in lines[0], lines


PROCESSOR = dict(min_pixels=8 * 8, max_pixels=24 * 24, patch_size=2, temporal_patch_size=2,
                 merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _pictures(folder):
    """Two small RGB files: a PNG and a JPEG of other sizes (other grids)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(5)
    paths = [folder / "pics" / "a.png", folder / "b.jpg"]
    paths[0].parent.mkdir()
    for path, (h, w) in zip(paths, [(13, 19), (22, 9)], strict=True):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return paths


def _hf_pixels(paths):
    """transformers' processor output for image files: ``(pixel_values, grid [I, 3])``."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Qwen2VLImageProcessorPil(**PROCESSOR)(images=[Image.open(p) for p in paths],
                                                return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_score_cli_mtp_with_image_files_equals_the_float64_definition(tmp_path, moe):
    """score.py's main with ``--mtp`` on lines naming image FILES (``images``: relative and
    absolute paths, one line with two) gives the MTP head's log-probs of the float64
    definition run on transformers' processor output for those files; a text-only line rides
    along, and the main head's log-probs are another function."""
    from mpcore.launch.score import main
    from tests.dist.hf_qwen3_vl_tiny import END, IMAGE, START

    folder = tmp_path / "ckpt"
    make_checkpoint(folder, moe=moe)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    a, b = _pictures(tmp_path)
    gen = torch.Generator().manual_seed(11)

    def text(n):
        return torch.randint(0, IMAGE, (n,), generator=gen).tolist()

    pic = [START, IMAGE, END]
    rows = [({"input_ids": [*text(3), *pic, *text(5)], "images": ["pics/a.png"]}, [a]),
            ({"input_ids": text(9)}, []),
            ({"input_ids": [*pic, *text(2), *pic, *text(4)], "images": [str(b), "pics/a.png"]},
             [b, a])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
    args = ["--hf-checkpoint", str(folder), "--input", str(tmp_path / "in.jsonl")]
    assert main([*args, "--mtp", "--output", str(tmp_path / "mtp.jsonl")]) == 0
    assert main([*args, "--output", str(tmp_path / "main.jsonl")]) == 0
    got = [json.loads(x) for x in (tmp_path / "mtp.jsonl").read_text().splitlines()]
    plain = [json.loads(x) for x in (tmp_path / "main.jsonl").read_text().splitlines()]

    # The reference's stream: each line's ids with every image's run expanded, and the pixels
    # of transformers' processor, images in placeholder order.
    ids, lengths, pixels, grids, per_doc = [], [], [], [], []
    for row, paths in rows:
        line = row["input_ids"]
        if paths:
            px, grid = _hf_pixels(paths)
            runs = iter(int(g.prod()) // 4 for g in grid)
            line = [t for i in line for t in ([IMAGE] * next(runs) if i == IMAGE else [i])]
            pixels.append(px)
            grids.append(grid)
        per_doc.append((sum(len(g) for g in grids[:-1]) if paths else 0, len(paths), 0, 0))
        ids += line
        lengths.append(len(line))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    s = dict(input_ids=torch.tensor(ids), cu_seqlens=cu, per_doc=per_doc,
             pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids),
             pixel_values_videos=None, video_grid_thw=None)
    want = reference(folder, s, WEIGHT, moe=moe)["mtp_logprobs"]
    for d, ((row, paths), line, other) in enumerate(zip(rows, got, plain, strict=True)):
        start, end = int(cu[d]), int(cu[d + 1])
        assert line.get("input_ids", row["input_ids"]) == ids[start:end]
        assert ("input_ids" in line) == bool(paths)
        assert len(line["logprobs"]) == len(other["logprobs"]) == end - start - 1
        diff = (torch.tensor(line["logprobs"], dtype=torch.float64)
                - want[start:end - 1]).abs().max()
        assert float(diff) <= 1e-5, (d, float(diff))
    assert got != plain
