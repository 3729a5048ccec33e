"""Training a tiny Qwen2-VL on prepared data with a video (one process, CPU, fp32).

A manifest of a video caption (3 frames: odd, so the last repeats), an interleaved line (text,
an image, a video, text) and text lines is prepared for qwen2_vl; launch/configs/vl_tiny.yaml
(smaller) trains on it. The first step's micro-batch carries ``pixel_values_videos`` /
``video_grid_thw``, its loss equals transformers' on the same batch with the same (initial)
weights, exported to a ``Qwen2VLForConditionalGeneration`` folder: float64, one document at a
time with that document's image and video rows, cross-entropy over the targets of
``loss_mask`` (never a placeholder, never across a document), averaged over all of them.
Three steps train finitely. The check would fail with the videos dropped or misplaced: a batch
whose video rows are changed gives another loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mpcore.build import build, setup
from mpcore.config import load_config
from mpcore.data import prepare_default, prepare_vl_dataset
from mpcore.data.videos import VideoSettings
from mpcore.data.vl_manifest import ImageSettings
from mpcore.models import family_named
from mpcore.train import Trainer

REPO = Path(__file__).resolve().parents[2]


def frames(n: int, height: int, width: int, seed: int) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [gen.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(n)]


def save(folder: Path, name: str, images) -> list[str]:
    names = []
    for k, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{name}{k}.png")
        names.append(f"{name}{k}.png")
    return names


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_video_train")
    tokenizer = prepare_default(tmp / "data", 512)[0]
    (tmp / "src").mkdir()
    still = save(tmp / "src", "img", frames(1, 30, 40, 0))[0]
    lines = [{"video": save(tmp / "src", "a", frames(3, 30, 50, 1)), "caption": "Red then blue."},
             {"content": [{"text": "Question:", "target": False}, {"image": still},
                          {"video": save(tmp / "src", "b", frames(4, 40, 40, 2))},
                          {"text": "the answer is a moving square."}]}]
    lines += [{"text": f"plain line {i} of words"} for i in range(3)]
    manifest = tmp / "src" / "m.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    family = family_named("qwen2_vl")
    image = ImageSettings.for_family(family, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    video = VideoSettings.for_family(family, min_pixels=28 * 28, max_pixels=28 * 28 * 6)
    folder = prepare_vl_dataset(manifest, tmp / "vl", tokenizer, image, progress=False,
                                video=video)
    return tmp, folder


def tiny(tmp: Path, folder: Path, run: str):
    return load_config(str(REPO / "launch" / "configs" / "vl_tiny.yaml"), [
        "model.vocab_size=516", "model.hidden_size=32", "model.num_heads=4",
        "model.num_kv_heads=2", "model.intermediate_size=64", "model.mrope_section=[2,1,1]",
        "model.tie_embeddings=false", "model.vision.hidden_size=32", "model.vision.num_heads=2",
        "model.vision.intermediate_size=64", f"data.cache_dir={tmp}/data",
        "data.default_vocab_size=512", f"data.vl_paths=[{folder}]", "data.seq_len=256",
        "data.micro_batch=1", "data.grad_accum=1", "training.max_steps=3",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "checkpoint.every=0"])


def _take(grid: torch.Tensor, pointer: int, tokens: int) -> tuple[int, int]:
    """``(items, rows)`` of the grids from ``pointer`` whose placeholders add up to ``tokens``."""
    items = rows = 0
    while tokens > 0:
        n = int(grid[pointer + items].prod())
        tokens -= n // 4
        rows += n
        items += 1
    assert tokens == 0
    return items, rows


def transformers_loss(folder: Path, batch: dict, ids_of: dict) -> float:
    """The mean cross-entropy of the batch's targets under transformers (float64, per doc)."""
    import transformers

    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float64).eval()
    ids, mask, cu = batch["input_ids"], batch["loss_mask"], batch["cu_seqlens"].tolist()
    image, video = ids_of["image_token_id"], ids_of["video_token_id"]
    pointer = {"image": [0, 0], "video": [0, 0]}
    total, count = 0.0, 0
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        doc = ids[a:b]
        kwargs = {}
        for kind, key, pid in (("image", "pixel_values", image),
                               ("video", "pixel_values_videos", video)):
            grid = batch.get(f"{kind}_grid_thw")
            tokens = int((doc == pid).sum())
            if not tokens:
                continue
            item, row = pointer[kind]
            n_items, n_rows = _take(grid, item, tokens)
            kwargs[key] = batch[key][row:row + n_rows].double()
            kwargs[f"{kind}_grid_thw"] = grid[item:item + n_items]
            pointer[kind] = [item + n_items, row + n_rows]
        targets = mask[a + 1:b] & (doc[1:] != image) & (doc[1:] != video)
        if not bool(targets.any()):
            continue
        if kwargs:
            kwargs["mm_token_type_ids"] = ((doc == image).long() + 2 * (doc == video).long())[None]
        with torch.no_grad():
            logits = hf(input_ids=doc[None], **kwargs).logits[0, :-1].double()
        losses = F.cross_entropy(logits, doc[1:], reduction="none")
        total += float(losses[targets].sum())
        count += int(targets.sum())
    assert pointer["video"][0] == len(batch["video_grid_thw"])
    return total / count


def test_first_step_loss_is_transformers_and_training_is_finite(prepared):
    tmp, folder = prepared
    cfg = tiny(tmp, folder, "run")
    run = build(cfg, setup(cfg), torch.device("cpu"))
    family = family_named("qwen2_vl")
    family.export_hf(run.model, run.state, tmp / "hf0")
    start = run.loader.state_dict()
    (batch,) = run.loader.next_step()
    run.loader.load_state_dict(start)
    assert batch["video_grid_thw"].shape[0] >= 1
    assert batch["pixel_values_videos"].shape[1] == 1176
    token_ids = {k: getattr(run.model_cfg, k) for k in ("image_token_id", "video_token_id")}
    want = transformers_loss(tmp / "hf0", batch, token_ids)
    trainer = Trainer(run)
    losses = [trainer.train_step()[0] for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - want) <= 1e-5 * abs(want), (losses[0], want)
    # the reference sees the video rows: other rows, another loss
    changed = {**batch, "pixel_values_videos": batch["pixel_values_videos"].flip(0)}
    assert abs(transformers_loss(tmp / "hf0", changed, token_ids) - want) > 1e-4
