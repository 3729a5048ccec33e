"""The batches of tests/perf/bench_vl.py: one composition of the shipped real images, two paths.

Composition (both paths): every sample is ONE document of exactly ``seq`` tokens, made of the
shipped real images (launch/data/images, cycled in captions.jsonl order; image k of the run at
``image_tokens[k % len]`` merged tokens) each as ``<vision_start> <image_pad>*n <vision_end>``
followed by its caption and a newline, images added while the image tokens stay under
``fraction`` of the sample, then a text tail (all captions, cycled) up to ``seq``. The images
are small (at most 256 px a side), so they are UPSCALED: the bicubic resize of
``process_image`` with ``min_pixels = tokens * (patch * merge)^2`` and twice that as
``max_pixels``; the pixel content is the real image's.

``prepared`` (the default), the training data path end to end: the samples are written as an
interleaved manifest (mpcore/data/vl_manifest.py) in a temporary folder, prepared by
``prepare_vl_dataset`` into a memory-mapped store and read back by ``VLPackedDataset`` (budgets
of ``seq`` tokens) and ``VLDataLoader`` (micro-batches of ``collate_vl``), as pretrain's
``build_vl_loaders``. What the path cannot express, and its nearest equivalent:
- per-image sizes: ``min_pixels``/``max_pixels`` are per store (a sample may only lower
  ``max_pixels``), so the manifest's images are the upscaled PNGs (``<name>.<tokens>.png``, the
  same resize) and the store is prepared with ``resize=False``: its pixel rows are bit for bit
  ``process_image``'s of the original file.
- byte-level text: the store's ids come from the project's VL tokenizer, here the default
  corpus's SentencePiece model (``prepare_default``, vocab ``text_vocab``) plus the four VL ids,
  and the model takes its special ids from it (as the qwen2_vl family's
  ``config_from_section`` does). Each text item is encoded on its own (as prepare does), so the tail is the longest prefix of the
  captions that fits and one-token words fill the rest: every sample is ``seq`` tokens with its
  EOS, so budgets hold one sample and no padding.
- targets: the store's loss mask (captions, tail and EOS; never ``<vs> <pad>* <ve>``).
``synthetic``: the same composition in memory; text as UTF-8 bytes, ids 0-255 (any ids < vocab
cost the same), targets every non-placeholder token, no EOS.

A :class:`Batch` is one step's ``B`` samples: transformers takes ``ids [B, seq]`` (no padding:
every sample has ``seq`` tokens), mpcore the same tokens as one packed stream of B documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import tempfile
from pathlib import Path

import torch

from mpcore.data import VLDataLoader, VLDataset, VLPackedDataset, VLTokenizer
from mpcore.data.corpus import prepare_default
from mpcore.data.images import load_image, num_placeholders, process_image, smart_resize
from mpcore.data.vl_dataset import prepare_vl_dataset
from mpcore.data.vl_manifest import ImageSettings

IMAGES = Path(__file__).resolve().parents[2] / "launch" / "data" / "images"


@dataclasses.dataclass
class Batch:
    """``ids [B, T]`` int64, ``pixels [N, patch_dim]`` fp32 (images in stream order), ``grid
    [I, 3]`` int64 (kept on the CPU: mpcore reads it on the host), ``cu_seqlens [D+1]`` int32 of
    the packed stream, ``loss_mask [B, T]`` bool (prepared) or None (synthetic)."""

    ids: torch.Tensor
    pixels: torch.Tensor
    grid: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor | None = None

    def to(self, device) -> Batch:
        mask = None if self.loss_mask is None else self.loss_mask.to(device)
        return Batch(self.ids.to(device), self.pixels.to(device), self.grid,
                     self.cu_seqlens.to(device), mask)

    def targets(self, image_id: int) -> torch.Tensor:
        """bool [B, T]: which tokens are targets (the store's mask, else every non-placeholder)."""
        return self.ids != image_id if self.loss_mask is None else self.loss_mask


def digest(tensors) -> str:
    """sha256 (16 hex digits) of the tensors' bytes: what a side fed its model."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _captions() -> list[dict]:
    return [json.loads(line) for line in (IMAGES / "captions.jsonl").read_text().splitlines()
            if line.strip()]


def _resized(cfg, name: str, tokens: int, cache: dict):
    """Image ``name`` (PIL RGB) at about ``tokens`` merged tokens, as process_image resizes."""
    from PIL import Image

    if (name, tokens) not in cache:
        factor = cfg.vision.patch_size * cfg.vision.spatial_merge_size
        image = load_image(IMAGES / name)
        h, w = smart_resize(image.height, image.width, factor=factor,
                            min_pixels=tokens * factor**2, max_pixels=2 * tokens * factor**2)
        cache[name, tokens] = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    return cache[name, tokens]


def compose(cfg, seq: int, image_tokens, fraction: float, num: int, text_len, room: int,
            cache: dict) -> list[tuple[list[tuple[str, int, str]], int]]:
    """``num`` samples, each ``([(image, merged tokens, caption text)], tokens used)`` within
    ``room`` tokens (module docstring); ``text_len(text)`` counts a text's ids."""
    entries, factor = _captions(), cfg.vision.patch_size * cfg.vision.spatial_merge_size
    out, k = [], 0
    for _ in range(num):
        parts, used, placeholders = [], 0, 0
        while True:
            entry, tokens = entries[k % len(entries)], image_tokens[k % len(image_tokens)]
            image = _resized(cfg, entry["image"], tokens, cache)
            n = image.width * image.height // factor**2
            caption = entry["caption"] + "\n"
            block = n + 2 + text_len(caption)
            if parts and (placeholders + n > fraction * seq or used + block > room):
                break
            if used + block > room:
                raise ValueError(f"--seq {seq} cannot hold one image of {n} tokens and its "
                                 f"caption; raise --seq")
            parts.append((entry["image"], tokens, caption))
            used, placeholders, k = used + block, placeholders + n, k + 1
        out.append((parts, used))
    return out


def _stack(samples: list[tuple[list[int], list[torch.Tensor], list]], seq: int) -> Batch:
    ids = torch.tensor([s[0] for s in samples], dtype=torch.int64)
    cu = torch.arange(0, ids.numel() + 1, seq, dtype=torch.int32)
    return Batch(ids, torch.cat([p for s in samples for p in s[1]]),
                 torch.tensor([g for s in samples for g in s[2]], dtype=torch.int64), cu)


def synthetic_batches(cfg, seq: int, image_tokens, fraction: float, micro_batch: int,
                      num_batches: int) -> list[Batch]:
    """``num_batches`` batches of ``micro_batch`` in-memory samples (module docstring)."""
    def text_ids(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    tail = text_ids("\n".join(e["caption"] for e in _captions()) + "\n")
    cache, v, samples = {}, cfg.vision, []
    for parts, _ in compose(cfg, seq, image_tokens, fraction, num_batches * micro_batch,
                            lambda s: len(text_ids(s)), seq, cache):
        ids, pixels, grids = [], [], []
        for name, tokens, caption in parts:
            image = _resized(cfg, name, tokens, cache)
            rows, grid = process_image(image, patch_size=v.patch_size,
                                       temporal_patch_size=v.temporal_patch_size,
                                       merge_size=v.spatial_merge_size, resize=False,
                                       max_pixels=image.width * image.height, name=name)
            n = num_placeholders(grid, v.spatial_merge_size)
            ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * n,
                    cfg.vision_end_token_id, *text_ids(caption)]
            pixels.append(rows)
            grids.append(grid)
        ids += [tail[i % len(tail)] for i in range(seq - len(ids))]
        samples.append((ids, pixels, grids))
    return [_stack(samples[i:i + micro_batch], seq)
            for i in range(0, len(samples), micro_batch)]


def _fill(tok: VLTokenizer, text: str, count: int) -> list[dict]:
    """Manifest text items of exactly ``count`` ids (each item encoded alone, as prepare does):
    the longest prefix of ``text`` (cycled) that fits, then one-token words."""
    if count <= 0:
        return []
    text = text * (count // len(tok.encode(text)) + 2)
    lo, hi = 0, len(text)  # the largest prefix length of at most count ids
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(text[:mid])) <= count else (lo, mid - 1)
    items = [text[:lo]] if text[:lo].strip() else []
    word = next(w for w in text.split() if len(tok.encode(w)) == 1)
    items += [word] * (count - sum(len(tok.encode(t)) for t in items))
    return [{"text": t} for t in items]


def prepared_batches(cfg, seq: int, image_tokens, fraction: float, micro_batch: int,
                     num_batches: int, text_vocab: int, folder: Path):
    """``(cfg with the tokenizer's VL ids, batches, store stats)``: the samples written as a
    manifest into ``folder``, prepared into ``folder/store`` and read by the loader."""
    tok = VLTokenizer(prepare_default(folder / "tokenizer", text_vocab)[0])
    cfg = dataclasses.replace(cfg, **tok.token_ids())
    (folder / "images").mkdir()
    tail, cache, lines = "\n".join(e["caption"] for e in _captions()) + "\n", {}, []
    for parts, used in compose(cfg, seq, image_tokens, fraction, num_batches * micro_batch,
                               lambda s: len(tok.encode(s)), seq - 1, cache):  # 1: the EOS
        content = []
        for name, tokens, caption in parts:
            path = folder / "images" / f"{name}.{tokens}.png"
            if not path.exists():
                _resized(cfg, name, tokens, cache).save(path, compress_level=1)
            content += [{"image": f"images/{path.name}"}, {"text": caption}]
        lines.append(json.dumps({"content": content + _fill(tok, tail, seq - 1 - used)}))
    (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    v = cfg.vision
    largest = max(image.width * image.height for image in cache.values())
    settings = ImageSettings(v.patch_size, v.temporal_patch_size, v.spatial_merge_size,
                             min_pixels=min(largest, ImageSettings.min_pixels),
                             max_pixels=largest, resize=False)
    ds = VLDataset(prepare_vl_dataset(folder / "manifest.jsonl", folder / "store", tok,
                                      settings, progress=False))
    assert (ds.lengths == seq).all(), ds.lengths  # _fill's exact count
    packed = VLPackedDataset(ds, seq, seed=0, pad_id=tok.eos_id)
    loader = VLDataLoader(packed, micro_batch, 1, 1, 0, seed=0)
    batches = []
    for _ in range(loader.steps_per_epoch):  # every sample once
        mb = next(loader)
        batches.append(Batch(mb["input_ids"].view(micro_batch, seq), mb["pixel_values"],
                             mb["image_grid_thw"], mb["cu_seqlens"],
                             mb["loss_mask"].view(micro_batch, seq)))
    m = ds.meta
    store = {key: m[f"num_{key}"] for key in ("samples", "images", "tokens", "image_tokens",
                                              "target_tokens", "pixel_rows")}
    return cfg, batches, {**store, "pad_tokens": packed.num_pad_tokens, "budgets": len(packed),
                          "tokenizer": {"text_vocab_size": tok.text_vocab_size,
                                        **tok.token_ids()},
                          "image_settings": dataclasses.asdict(settings)}


NOTES = {
    "synthetic": {"text_encoding": "UTF-8 bytes as ids 0-255; captions from captions.jsonl, "
                                   "the tail cycles through all captions",
                  "images": "launch/data/images, resized by process_image (min/max_pixels) to "
                            "the merged-token counts of the config's cycle"},
    "prepared": {"text_encoding": "the VL tokenizer (default corpus SentencePiece + 4 VL ids); "
                                  "captions from captions.jsonl, the tail cycles through all "
                                  "captions, one-token words fill each sample to seq",
                 "images": "launch/data/images upscaled (process_image's bicubic resize) to "
                           "the merged-token counts of the config's cycle, written as PNG, "
                           "prepared with resize=False"}}


def data_report(cfg, batches: list[Batch], data: str) -> dict:
    """What one step holds, averaged over the distinct batches."""
    images = [b.grid.shape[0] for b in batches]
    tokens = [b.ids.numel() for b in batches]
    image_tokens = [int((b.ids == cfg.image_token_id).sum()) for b in batches]
    return {"distinct_batches": len(batches), "images_per_step": statistics.mean(images),
            "tokens_per_step": tokens[0],
            "image_tokens_per_step": statistics.mean(image_tokens),
            "text_tokens_per_step": tokens[0] - statistics.mean(image_tokens),
            "image_token_fraction": sum(image_tokens) / sum(tokens),
            "patches_per_step": statistics.mean(b.pixels.shape[0] for b in batches),
            "target_tokens_per_step": statistics.mean(
                int(b.targets(cfg.image_token_id)[:, 1:].sum()) for b in batches),
            "image_grids_first_step": batches[0].grid.tolist(),
            "batches_sha256": digest(t for b in batches for t in (b.ids, b.pixels, b.grid)),
            **NOTES[data]}


def build_batches(data: str, cfg, seq: int, image_tokens, fraction: float, micro_batch: int,
                  num_batches: int, text_vocab: int):
    """``(cfg, batches, data report)`` of ``--data prepared|synthetic`` (module docstring); the
    prepared store lives in a temporary folder, removed once the batches are in memory."""
    if data == "synthetic":
        batches = synthetic_batches(cfg, seq, image_tokens, fraction, micro_batch, num_batches)
        return cfg, batches, data_report(cfg, batches, data)
    with tempfile.TemporaryDirectory(prefix="bench_vl_") as tmp:
        cfg, batches, store = prepared_batches(cfg, seq, image_tokens, fraction, micro_batch,
                                               num_batches, text_vocab, Path(tmp))
    return cfg, batches, {**data_report(cfg, batches, data), "store": store}
