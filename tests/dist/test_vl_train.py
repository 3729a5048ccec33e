"""Training the VL model end to end (CPU, gloo, fp32) on the shipped image set blended with the
default text corpus, so micro-batches with and without images alternate.

Same seed and data, 8 steps: tp=2 (with and without SP), cp=2 (ring and Ulysses; the tower's
work split over cp, or replicated), dp=2 (FSDP2, DDP) give the loss of tp=1 at every step
within 1e-5 rel. A resumed run continues the uninterrupted one bit for bit; a tp=2 checkpoint
resumes at tp=1 (logical checkpoints); a frozen tower stays frozen; the export loads in
transformers with the same log-probs; the default command trains and its loss falls.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.config import load_config
from mpcore.data import prepare_vl_default
from mpcore.train import train
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.slow  # VL training in several layouts (a 30 s module fixture)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "vl_tiny.yaml"
STEPS = 8
SAVE_AT = 4
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ring_replicate": ["parallel.cp=2", "parallel.cp_mode=ring",
                           "model.vision_cp=replicate"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "dp2_fsdp": ["parallel.data_parallel=fsdp", "data.micro_batch=1"],
    "dp2_ddp": ["parallel.data_parallel=ddp", "data.micro_batch=1"],
}


def tiny(tmp, run: str, *overrides: str):
    """vl_tiny.yaml, smaller: a 1-kv-head decoder (replicated at tp=2) and a 2-head tower."""
    return load_config(str(CONFIG), [
        "model.vocab_size=516", "model.hidden_size=32", "model.num_heads=4",
        "model.num_kv_heads=1", "model.intermediate_size=64", "model.mrope_section=[2,1,1]",
        "model.tie_embeddings=false", "model.vision.hidden_size=32", "model.vision.num_heads=2",
        "model.vision.intermediate_size=64", f"data.cache_dir={tmp}/data",
        "data.default_vocab_size=512", "data.micro_batch=2", "data.grad_accum=2",
        "optimizer.lr=1e-2", "schedule.warmup_steps=2", f"training.max_steps={STEPS}",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "logging.log_every=100",
        "checkpoint.every=0", *overrides])


def _layouts(rank, world, tmp):
    out = {}
    for name, overrides in LAYOUTS.items():
        extra = [f"checkpoint.every={SAVE_AT}", "checkpoint.keep_last=5"] if name == "tp2" else []
        result = train(tiny(tmp, name, *overrides, *extra))
        out[name] = result.losses
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_layouts")
    prepare_vl_default(tmp / "data", 512)
    ref = train(tiny(tmp, "ref", f"checkpoint.every={SAVE_AT}", "checkpoint.keep_last=5"))
    by_rank = run_distributed(_layouts, 2, str(tmp), timeout=600)
    return tmp, ref.losses, by_rank


def test_every_layout_matches_tp1(runs):
    _, losses, by_rank = runs
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    for name in LAYOUTS:
        assert by_rank[0][name] == by_rank[1][name], name
        for step, (got, want) in enumerate(zip(by_rank[0][name], losses, strict=True)):
            assert math.isclose(got, want, rel_tol=1e-5), (name, step + 1, got, want)


def test_resume_is_bit_identical_and_reshards(runs):
    tmp, losses, _ = runs
    for source, run in (("ref", "resumed"), ("tp2", "resharded")):
        folder = tmp / run / "checkpoints"
        shutil.copytree(tmp / source / "checkpoints" / f"step-{SAVE_AT}", folder / f"step-{SAVE_AT}")
        result = train(tiny(tmp, run))
        assert result.step == STEPS and len(result.losses) == STEPS - SAVE_AT
        if run == "resumed":
            assert result.losses == losses[SAVE_AT:], (result.losses, losses[SAVE_AT:])
        else:
            for got, want in zip(result.losses, losses[SAVE_AT:], strict=True):
                assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_frozen_tower_stays_frozen(runs):
    tmp, _, _ = runs
    from mpcore.build import build, setup
    from mpcore.train import Trainer

    cfg = tiny(tmp, "frozen", "model.freeze_vision=true")
    run = build(cfg, setup(cfg), torch.device("cpu"))
    unfrozen = build(tiny(tmp, "unfrozen"), setup(cfg), torch.device("cpu"))
    # First step, same weights and batch: the text side's gradients do not depend on whether
    # the tower trains (its forward is the same), so they agree exactly.
    batches = run.loader.next_step()
    unfrozen.loader.next_step()
    Trainer(run)._forward_backward(batches)
    Trainer(unfrozen)._forward_backward(batches)
    for (name, p), q in zip(run.model.text.named_parameters(), unfrozen.model.text.parameters(),
                            strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert all(p.grad is None for p in run.model.visual.parameters())
    assert any(float(p.grad.abs().max()) > 0 for p in unfrozen.model.visual.parameters())
    run.optimizer.zero_grad(set_to_none=True)
    visual = {k: v.clone() for k, v in run.model.visual.state_dict().items()}
    text = {k: v.clone() for k, v in run.model.text.state_dict().items()}
    trainer = Trainer(run)
    for _ in range(2):
        loss, _ = trainer.train_step()
        assert math.isfinite(loss)
    assert all(torch.equal(v, visual[k]) for k, v in run.model.visual.state_dict().items())
    assert any(not torch.equal(v, text[k]) for k, v in run.model.text.state_dict().items())


def test_text_only_manifest_trains_and_image_data_needs_a_vl_model(runs, tmp_path):
    tmp, _, _ = runs
    from mpcore.data import prepare_vl_dataset
    from mpcore.data.vl_default import DEFAULT_SETTINGS

    manifest = tmp_path / "text.jsonl"
    manifest.write_text("".join(json.dumps({"text": f"line {i} of a text-only manifest"}) + "\n"
                                for i in range(16)))
    folder = prepare_vl_dataset(manifest, tmp_path / "text_vl", tmp / "data" / "default_v512.model",
                                DEFAULT_SETTINGS, progress=False)
    result = train(tiny(tmp, "text_only", f"data.vl_paths=[{folder}]", "training.max_steps=2",
                        "data.grad_accum=1"))
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    with pytest.raises(ValueError, match="holds image-text data but the model has no vision"):
        train(load_config(None, [f"data.vl_paths=[{folder}]", "training.device=cpu",
                                 f"logging.run_dir={tmp_path}/text_model",
                                 f"data.cache_dir={tmp}/data", "data.default_vocab_size=512",
                                 "model.vocab_size=512"]))


def test_export_loads_in_transformers(runs):
    tmp, _, _ = runs
    from tests.dist.hf_vl_tiny import _doc_logits

    out = tmp / "hf"
    proc = subprocess.run([sys.executable, "-m", "mpcore.launch.export_hf", "--checkpoint",
                           str(tmp / "ref" / "checkpoints"), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"} <= {
        p.name for p in out.iterdir()}
    import transformers

    from mpcore.data.vl_tokenizer import VLTokenizer
    from mpcore.models import load_hf_vl_model
    from mpcore.parallel.state import ParallelState

    ours_tok = VLTokenizer(out / "tokenizer.model")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("a red square\n  x")["input_ids"] == ours_tok.encode("a red square\n  x")
    assert hf_tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_end|>"]) == [
        ours_tok.image_pad_id, ours_tok.vision_end_id]

    hf = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    ours, cfg = load_hf_vl_model(out, ParallelState.build())
    # The image settings training used, as transformers' processor: the same rows and grid.
    from mpcore.data.images import load_image, process_image
    from mpcore.data.vl_default import DEFAULT_SETTINGS

    image = load_image(REPO / "launch" / "data" / "images" / "astronaut.jpg")
    theirs = transformers.AutoImageProcessor.from_pretrained(out)(images=[image],
                                                                  return_tensors="pt")
    s = DEFAULT_SETTINGS
    rows, grid = process_image(image, patch_size=s.patch_size,
                               temporal_patch_size=s.temporal_patch_size,
                               merge_size=s.merge_size, min_pixels=s.min_pixels,
                               max_pixels=s.max_pixels)
    assert theirs["image_grid_thw"].tolist() == [list(grid)]
    assert torch.allclose(theirs["pixel_values"].float(), rows, atol=1e-5)
    text_cfg = hf.config.text_config  # bos / eos / pad: the tokenizer's, inside the vocabulary
    assert (text_cfg.bos_token_id, text_cfg.eos_token_id, text_cfg.pad_token_id) == (
        ours_tok.bos_id, ours_tok.eos_id, ours_tok.eos_id)
    assert max(text_cfg.bos_token_id, text_cfg.eos_token_id) < cfg.text.vocab_size
    assert hf_tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    ids = torch.tensor([5, 7, cfg.vision_start_token_id, *[cfg.image_token_id] * 4,
                        cfg.vision_end_token_id, 9, 11])
    pixels = torch.randn(16, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])
    from mpcore.models.qwen2_vl.inputs import local_vl_inputs

    _, inputs = local_vl_inputs(ParallelState.build(), ids, torch.tensor([0, ids.numel()]), cfg,
                                pixel_values=pixels, image_grid_thw=grid)
    with torch.no_grad():
        ours_logits = ours(**inputs, output="logits")[:, :cfg.text.vocab_size]
        from tests.dist import hf_vl_tiny

        hf_vl_tiny.IMAGE = cfg.image_token_id  # the tiny helpers' placeholder id -> this model's
        theirs = _doc_logits(hf, ids, pixels, grid)
    assert float((ours_logits.double() - theirs).abs().max()) <= 1e-4


def test_default_command_trains(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         str(REPO / "launch" / "pretrain.py"), str(CONFIG), f"logging.run_dir={tmp_path}/run",
         f"data.cache_dir={tmp_path}/data", "training.max_steps=12", "logging.log_every=1",
         "training.device=cpu"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, rows
    # Image placeholders are a share of the tokens: half the budgets come from the image set.
    shares = [r["image_tokens_per_s"] / r["tokens_per_s"] for r in rows]
    assert all(0 <= x < 1 for x in shares) and sum(shares) > 0, shares
    assert "image_tokens_per_s" in proc.stdout
