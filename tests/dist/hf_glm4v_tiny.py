"""A tiny random transformers GLM-4V, packed streams of images, videos and text, references.

Documents: text-only ones of odd lengths, ones with 1-2 images of different grids, and one with a
3-frame video (``<video_start>``, per frame ``<image_start>`` placeholders ``<image_end>`` and a
timestamp token, ``<video_end>``; all placeholders use the image id, as GLM-4V's processor
writes them). transformers places the image rows of a sequence at every placeholder, so a
document mixes no images with a video. References run transformers one document at a time in
float32, with ``mm_token_type_ids`` built here from how each document was made. transformers is
imported inside the functions: spawned ranks import this module and should not pay for it.
"""

from __future__ import annotations

import torch

VOCAB = 160
IMAGE, VIDEO, I_START, I_END, V_START, V_END = 150, 151, 152, 153, 154, 155
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=I_START,
              image_end_token_id=I_END, video_start_token_id=V_START, video_end_token_id=V_END)
TEXT = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5})
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=128,
              image_size=8, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
              in_channels=3)
PATCH_DIM = 3 * 2 * 2 * 2
# Documents: (text before, [image grids], video grid or None, text after); grids in patches.
DOCS = [(5, [(1, 4, 6)], None, 4), (7, [], None, 0), (2, [(1, 6, 4), (1, 2, 2)], None, 3),
        (3, [], (3, 4, 4), 2), (1, [], None, 0), (3, [(1, 8, 8)], None, 6), (4, [], None, 0)]


def make_hf_model(seed: int, tie: bool = False):
    """A float32 transformers ``Glm4vForConditionalGeneration`` with fresh random weights."""
    import transformers

    config = transformers.Glm4vConfig(text_config=dict(TEXT), vision_config=dict(VISION),
                                      tie_word_embeddings=tie, **TOKENS)
    model = transformers.Glm4vForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)
    return model


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)


def stream(seed: int, docs=DOCS):
    """``dict`` of the packed stream: ``input_ids [T]``, ``cu_seqlens``, ``types [T]`` (0 text,
    1 image, 2 video placeholder), ``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``, and ``docs``: per document its images' indices
    and its video's index (or None)."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, IMAGE, (n,), generator=gen).tolist()  # noqa: E731
    ids, types, lengths, images, videos, per_doc = [], [], [], [], [], []
    for before, grids, video, after in docs:
        doc, kinds = text(before), [0] * before
        mine = list(range(len(images), len(images) + len(grids)))
        for t, h, w in grids:
            run = t * h * w // 4
            doc += [I_START] + [IMAGE] * run + [I_END]
            kinds += [0] + [1] * run + [0]
            images.append((t, h, w))
        vid = None
        if video is not None:
            t, h, w = video
            vid = len(videos)
            videos.append(video)
            doc += [V_START]
            kinds += [0]
            for f in range(t):
                doc += [I_START] + [IMAGE] * (h * w // 4) + [I_END, f + 1]
                kinds += [0] + [2] * (h * w // 4) + [0, 0]
            doc += [V_END]
            kinds += [0]
        doc += text(after)
        kinds += [0] * after
        ids += doc
        types += kinds
        lengths.append(len(doc))
        per_doc.append((mine, vid))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    pix = lambda grids: torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM,  # noqa: E731
                                    generator=gen)
    grid = lambda g: torch.tensor(g, dtype=torch.int64).view(-1, 3)  # noqa: E731
    return dict(input_ids=torch.tensor(ids), cu_seqlens=cu, types=torch.tensor(types),
                pixel_values=pix(images), image_grid_thw=grid(images),
                pixel_values_videos=pix(videos), video_grid_thw=grid(videos), docs=per_doc)


def _rows(grids: torch.Tensor, which: list[int]) -> slice:
    sizes = [int(t * h * w) for t, h, w in grids.tolist()]
    start = sum(sizes[:which[0]]) if which else 0
    return slice(start, start + sum(sizes[i] for i in which))


def reference_logprobs(model, s: dict) -> torch.Tensor:
    """``[T]`` fp32: transformers' log p(next | prefix) per document (0 at each document's last
    token), each document run alone with its own images or video."""
    out = torch.zeros(s["input_ids"].numel())
    cu = s["cu_seqlens"].tolist()
    for d, (images, video) in enumerate(s["docs"]):
        a, b = cu[d], cu[d + 1]
        kwargs = {}
        if images:
            kwargs.update(pixel_values=s["pixel_values"][_rows(s["image_grid_thw"], images)],
                          image_grid_thw=s["image_grid_thw"][images])
        if video is not None:
            kwargs.update(pixel_values_videos=s["pixel_values_videos"][
                _rows(s["video_grid_thw"], [video])],
                video_grid_thw=s["video_grid_thw"][[video]])
        ids = s["input_ids"][a:b][None]
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=s["types"][a:b][None],
                           **kwargs).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        out[a:b - 1] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out


def reference_positions(model, s: dict) -> torch.Tensor:
    """``[3, T]``: transformers' ``get_rope_index`` per document."""
    cu = s["cu_seqlens"].tolist()
    parts = []
    for d, (images, video) in enumerate(s["docs"]):
        a, b = cu[d], cu[d + 1]
        pos, _ = model.model.get_rope_index(
            s["input_ids"][a:b][None], s["types"][a:b][None],
            image_grid_thw=s["image_grid_thw"][images] if images else None,
            video_grid_thw=s["video_grid_thw"][[video]].clone() if video is not None else None)
        parts.append(pos[:, 0])
    return torch.cat(parts, dim=1)


def reference_loss_grads(model, s: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' mean next-token loss over the stream (targets that are text, per document,
    summed then divided by their count) and every parameter's gradient, by HF name."""
    model.zero_grad()
    cu = s["cu_seqlens"].tolist()
    count, losses = 0, []
    for d, (images, video) in enumerate(s["docs"]):
        a, b = cu[d], cu[d + 1]
        kwargs = {}
        if images:
            kwargs.update(pixel_values=s["pixel_values"][_rows(s["image_grid_thw"], images)],
                          image_grid_thw=s["image_grid_thw"][images])
        if video is not None:
            kwargs.update(pixel_values_videos=s["pixel_values_videos"][
                _rows(s["video_grid_thw"], [video])],
                video_grid_thw=s["video_grid_thw"][[video]])
        ids = s["input_ids"][a:b]
        logits = model(input_ids=ids[None], mm_token_type_ids=s["types"][a:b][None],
                       **kwargs).logits[0]
        targets = ids[1:].clone()
        targets[targets == IMAGE] = -100
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], targets,
                                                        ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
