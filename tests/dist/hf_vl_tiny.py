"""Tiny random Qwen2-VL / Qwen2.5-VL models of transformers, packed VL streams, references.

The stream mixes text-only documents of odd lengths with documents holding 1-3 images of
different grids (and, for the position test, a video). Each image is ``<vision_start>``, its
placeholder run (``t*h*w / 4`` ids), ``<vision_end>``. References run transformers in float64,
one document at a time, with that document's images. transformers is imported inside the
functions: the spawned test ranks import this module and should not pay for it.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
              vision_end_token_id=END)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 1, 1]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                     patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    "qwen2_5_vl": dict(depth=3, hidden_size=16, out_hidden_size=32, intermediate_size=24,
                       num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                       in_channels=3, window_size=8, fullatt_block_indexes=[1],
                       tokens_per_second=2),
}
CLASSES = {"qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig"),
           "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig")}
PATCH_DIM = 3 * 2 * 2 * 2
# Documents: (text before, [image grids], text after); grids (t, h, w) in patches.
DOCS = [(5, [(1, 4, 6)], 4), (7, [], 0), (2, [(1, 6, 4), (1, 2, 2)], 3), (1, [], 0),
        (3, [(1, 8, 8)], 6), (4, [], 0)]


def make_hf_vl_model(arch: str, seed: int, tie: bool = False):
    """A float32 transformers VL model of ``arch`` with fresh random weights (eval mode)."""
    import transformers

    model_name, config_name = CLASSES[arch]
    config = getattr(transformers, config_name)(
        text_config=dict(TEXT), vision_config=dict(VISION[arch]), tie_word_embeddings=tie,
        **TOKENS)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name or "ln_q" in name else 0.15 * noise)
    return model


def save_hf_vl_model(arch: str, seed: int, folder, tie: bool = False) -> None:
    make_hf_vl_model(arch, seed, tie).save_pretrained(folder)


def vl_stream(seed: int, docs=DOCS):
    """``(input_ids [T], cu_seqlens [D+1], pixel_values [N, 24], grid [I, 3], per_doc)`` where
    ``per_doc[d] = (first image, number of images)`` of document d."""
    gen = torch.Generator().manual_seed(seed)
    ids, lengths, grids, per_doc = [], [], [], []
    for before, images, after in docs:
        doc = torch.randint(0, IMAGE, (before,), generator=gen).tolist()
        per_doc.append((len(grids), len(images)))
        for t, h, w in images:
            doc += [START] + [IMAGE] * (t * h * w // 4) + [END]
            grids.append((t, h, w))
        doc += torch.randint(0, IMAGE, (after,), generator=gen).tolist()
        ids += doc
        lengths.append(len(doc))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, PATCH_DIM, generator=gen)
    return torch.tensor(ids), cu, pixels, torch.tensor(grids, dtype=torch.int64).view(-1, 3), \
        per_doc


def _doc_logits(model, ids, pixels, grid):
    kwargs = {}
    if grid.numel():
        kwargs = dict(pixel_values=pixels, image_grid_thw=grid)
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == IMAGE).long()[None]
    return model(input_ids=ids[None], **kwargs).logits[0].double()


def _doc_inputs(ids, cu, pixels, grid, per_doc, d):
    a, b = int(cu[d]), int(cu[d + 1])
    first, num = per_doc[d]
    rows = [int(r.prod()) for r in grid]
    start = sum(rows[:first])
    stop = start + sum(rows[first:first + num])
    return ids[a:b], pixels[start:stop], grid[first:first + num], a, b


def _load(folder):
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64)
    return model.eval()


def reference_scores(folder, ids, cu, pixels, grid, per_doc):
    """transformers (float64, per document): ``logprobs [T]`` (0 at each document's last token
    and where the target is a placeholder), ``entropy [T]``."""
    model = _load(folder)
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    entropy = torch.zeros(ids.numel(), dtype=torch.float64)
    with torch.no_grad():
        for d in range(cu.numel() - 1):
            doc, pix, g, a, b = _doc_inputs(ids, cu, pixels.double(), grid, per_doc, d)
            logp = F.log_softmax(_doc_logits(model, doc, pix, g), dim=-1)
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
            target = logp[:-1].gather(1, doc[1:, None])[:, 0]
            logprobs[a:b - 1] = torch.where(doc[1:] == IMAGE, 0.0, target)
    return logprobs, entropy


def reference_loss_grads(folder, ids, cu, pixels, grid, per_doc):
    """transformers (float64): mean next-token loss over every valid target of the stream
    (placeholders are never targets), and every parameter's gradient by hub name."""
    model = _load(folder)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for d in range(cu.numel() - 1):
        doc, pix, g, _, _ = _doc_inputs(ids, cu, pixels.double(), grid, per_doc, d)
        logits = _doc_logits(model, doc, pix, g)
        keep = doc[1:] != IMAGE
        total = total + F.cross_entropy(logits[:-1][keep], doc[1:][keep], reduction="sum")
        count += int(keep.sum())
    (total / count).backward()
    grads = {}
    for name, p in model.named_parameters():
        hub = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        grads[hub] = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return float(total.detach() / count), grads
