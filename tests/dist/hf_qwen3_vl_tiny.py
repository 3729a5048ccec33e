"""Tiny random transformers Qwen3-VL models, packed Qwen3-VL streams, references.

The decoder has an explicit head dim (16, not hidden / heads = 8), interleaved M-RoPE
``[4, 2, 2]``, three layers and two DeepStack features from vision blocks ``[2, 0]`` (out of
order on purpose: feature k is the k-th in block order, through merger ``index(block)``). The
position table is 4 x 4, smaller and larger than the grids it is resampled to. Documents mix
text-only ones of odd lengths, images of different grids and a 3-frame video laid out as the
processor does (timestamp text, vision start, one frame's run, vision end, per frame).
References run transformers in float64, one document at a time, with that document's items.
transformers is imported inside functions: spawned test ranks import this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
              vision_end_token_id=END)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 2, 2], "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32,
              patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
              num_position_embeddings=16, deepstack_visual_indexes=[2, 0])
PATCH_DIM = 3 * 2 * 2 * 2
# Documents: list of parts; an int is that many random text tokens, ("image", t, h, w) an
# image, ("video", t, h, w) a video (frame by frame with a 2-token timestamp before each).
DOCS = [[5, ("image", 1, 4, 6), 4], [7], [2, ("image", 1, 6, 4), 1, ("image", 1, 2, 2), 3],
        [1], [3, ("video", 3, 4, 4), 2], [3, ("image", 1, 8, 10), 6], [4]]


def make_hf_model(seed: int, tie: bool = False, text=None, vision=None):
    """A float32 transformers Qwen3-VL model with fresh random weights (eval mode)."""
    import transformers

    config = transformers.Qwen3VLConfig(text_config=dict(text or TEXT),
                                        vision_config=dict(vision or VISION),
                                        tie_word_embeddings=tie, **TOKENS)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)


def stream(seed: int, docs=DOCS):
    """A packed stream: ``dict(input_ids [T], cu_seqlens [D+1], pixel_values, image_grid_thw,
    pixel_values_videos, video_grid_thw, per_doc)``; ``per_doc[d]``: the document's
    ``(first image, images, first video, videos)``. Absent kinds are None."""
    gen = torch.Generator().manual_seed(seed)
    ids, lengths, grids, per_doc = [], [], {"image": [], "video": []}, []
    for parts in docs:
        doc = []
        first = (len(grids["image"]), len(grids["video"]))
        for part in parts:
            if isinstance(part, int):
                doc += torch.randint(0, IMAGE, (part,), generator=gen).tolist()
                continue
            kind, t, h, w = part
            grids[kind].append((t, h, w))
            if kind == "image":
                doc += [START] + [IMAGE] * (t * h * w // 4) + [END]
            else:
                for _ in range(t):  # a timestamp, then the frame
                    doc += torch.randint(0, IMAGE, (2,), generator=gen).tolist()
                    doc += [START] + [VIDEO] * (h * w // 4) + [END]
        per_doc.append((first[0], len(grids["image"]) - first[0], first[1],
                        len(grids["video"]) - first[1]))
        ids += doc
        lengths.append(len(doc))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    out = dict(input_ids=torch.tensor(ids), cu_seqlens=cu, per_doc=per_doc)
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        g = grids[kind]
        patches = sum(t * h * w for t, h, w in g)
        out[key] = torch.randn(patches, PATCH_DIM, generator=gen) if g else None
        out[f"{kind}_grid_thw"] = torch.tensor(g, dtype=torch.int64).view(-1, 3) if g else None
    return out


def _slice(pixels, grid, first, num):
    if not num:
        return None, None
    rows = [int(r.prod()) for r in grid]
    start = sum(rows[:first])
    return pixels[start:start + sum(rows[first:first + num])], grid[first:first + num]


def doc_inputs(s: dict, d: int, dtype=torch.float64) -> tuple[dict, int, int]:
    """transformers' keyword arguments for document ``d`` alone, and its ``[a, b)`` span."""
    a, b = int(s["cu_seqlens"][d]), int(s["cu_seqlens"][d + 1])
    ids = s["input_ids"][a:b]
    fi, ni, fv, nv = s["per_doc"][d]
    kwargs = dict(input_ids=ids[None])
    pix, grid = _slice(s["pixel_values"], s["image_grid_thw"], fi, ni)
    if pix is not None:
        kwargs.update(pixel_values=pix.to(dtype), image_grid_thw=grid)
    pix, grid = _slice(s["pixel_values_videos"], s["video_grid_thw"], fv, nv)
    if pix is not None:
        kwargs.update(pixel_values_videos=pix.to(dtype), video_grid_thw=grid)
    if ni or nv:
        kwargs["mm_token_type_ids"] = ((ids == IMAGE).long() + 2 * (ids == VIDEO).long())[None]
    return kwargs, a, b


def load(folder, dtype=torch.float64, **options):
    """transformers' model of ``folder``; ``options``: ``from_pretrained``'s (a MoE model's
    ``experts_implementation="eager"``: its grouped GEMM takes no float64)."""
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype,
                                                                    **options).eval()


def reference_scores(folder, s: dict, **options):
    """transformers (float64, per document): ``logprobs [T]`` (0 at each document's last token
    and where the target is a placeholder), ``entropy [T]``."""
    model = load(folder, **options)
    total = s["input_ids"].numel()
    logprobs = torch.zeros(total, dtype=torch.float64)
    entropy = torch.zeros(total, dtype=torch.float64)
    with torch.no_grad():
        for d in range(len(s["per_doc"])):
            kwargs, a, b = doc_inputs(s, d)
            doc = kwargs["input_ids"][0]
            logp = F.log_softmax(model(**kwargs).logits[0].double(), dim=-1)
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
            target = logp[:-1].gather(1, doc[1:, None])[:, 0]
            placeholder = (doc[1:] == IMAGE) | (doc[1:] == VIDEO)
            logprobs[a:b - 1] = torch.where(placeholder, 0.0, target)
    return logprobs, entropy


def reference_loss_grads(folder, s: dict, aux: bool = False, **options):
    """transformers (float64): mean next-token loss over every valid target of the stream and
    every parameter's gradient by HF name (``lm_head`` dropped when tied). With ``aux`` (a MoE
    decoder) the loss adds ``router_aux_loss_coef`` times transformers' own
    ``load_balancing_loss_func`` of every document's router logits together: the whole batch
    as one process sees it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load(folder, **options)
    total, count, router = torch.zeros((), dtype=torch.float64), 0, []
    for d in range(len(s["per_doc"])):
        kwargs, _, _ = doc_inputs(s, d)
        doc = kwargs["input_ids"][0]
        out = model(**kwargs, **({"output_router_logits": True} if aux else {}))
        logits = out.logits[0].double()
        keep = (doc[1:] != IMAGE) & (doc[1:] != VIDEO)
        total = total + F.cross_entropy(logits[:-1][keep], doc[1:][keep], reduction="sum")
        count += int(keep.sum())
        if aux:
            router.append(out.router_logits)
    loss = total / count
    if aux:
        text = model.config.text_config
        per_layer = tuple(torch.cat([r[i] for r in router]) for i in range(len(router[0])))
        loss = loss + text.router_aux_loss_coef * load_balancing_loss_func(
            per_layer, text.num_experts, text.num_experts_per_tok)
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
             for n, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return float(loss.detach()), grads
