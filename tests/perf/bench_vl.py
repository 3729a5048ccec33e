"""Benchmark: training steps of a VL family's released shape on real images, mpcore vs transformers.

Usage (one GPU, every side in one run; meant to take 2-3 minutes on an H200):
    python -m tests.perf.bench_vl [OUT.json] [--family qwen2_vl|qwen3_vl|glm4v|qwen3_5_vl]
        [--config 2b|9b|0.8b|tiny]
        [--steps 10] [--warmup N]
        [--seq 8192] [--micro-batch 1] [--image-fraction 0.6] [--activation-checkpointing]
        [--forward-backward-only] [--skip-hf] [--count-params] [--vision-attention flash|cudnn]
        [--data prepared|synthetic] [--timing steady|synced]
Context parallelism (mpcore only; e.g. on nvidia-h200-x2), the tower's work split over the cp
ranks or replicated on each (which to keep at this shape is what the run decides):
    torchrun --nproc-per-node 2 -m tests.perf.bench_vl OUT.json --cp 2 [--cp-mode ring|ulysses]
        [--vision-cp split|replicate]
    Gradients are summed over cp by one all-reduce per tensor after backward; tokens/s is per
    GPU (the step's tokens over cp GPUs).

Model (``--family qwen2_vl --config 2b``, the default): Qwen2-VL-2B's shape, built here (no
download): vision depth 32, width 1280, 16 heads, MLP 5120 (mlp_ratio 4), 2x2 patch merger into
1536; text hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab 151936, tied
embeddings, QKV biases, M-RoPE sections [16, 24, 24], rope theta 1e6. ``--family qwen3_vl``:
Qwen3-VL-2B's config.json (``mpcore.models.common.qwen3_vl.presets.QWEN3_VL_2B``: vision depth 24, width
1024, patch 16, DeepStack after blocks 5, 11, 17; text hidden 2048, 28 layers, 16 heads, 8 KV
heads, head_dim 128, q/k norm, interleaved M-RoPE [24, 20, 20]). ``--family glm4v`` (``--config
9b``): GLM-4.1V-9B's shape with 12 of its 40 decoder layers (``GLM4V_LAYERS``: fp32 master
weights and AdamW state of all 40 do not fit one H200 beside the activations). ``--family
qwen3_5_vl`` (``--config 0.8b``): Qwen3.5-0.8B, the smallest released Qwen3.5 with a vision
tower (every released Qwen3.5 is a ``Qwen3_5ForConditionalGeneration``): its text decoder as
tests/dist/qwen35_0p8b_config.json (hidden 1024, 24 layers, every 4th gated full attention with
8 heads / 2 KV heads of 256, the rest Gated DeltaNet with 16 key and 16 value heads of 128,
MLP 3584, tied 248320 vocab, interleaved M-RoPE [11, 11, 10] over the rotated quarter) and the
release's ``vision_config`` (``QWEN3_5_0P8B_VISION``: depth 12, width 768, 12 heads, MLP 3072,
patch 16, 2x2 merger into 1024, no DeepStack) and special ids (image 248056, video 248057,
vision start 248053, vision end 248054); 0.85 B parameters. Special ids of the real Qwen
vocabulary: image 151655, video 151656, vision start 151652, vision end 151653 (``--data
prepared`` replaces them by its tokenizer's, 2048-2051). Both sides start from fresh random
weights; the family's registry entry builds ours and makes its inputs.

Data (tests/perf/vl_batches.py): every sample is ONE document of exactly ``--seq`` tokens, made
of the shipped real images (launch/data/images, cycled in captions.jsonl order) each as
``<vision_start> <image_pad>*n <vision_end>`` followed by its caption and a newline, images added
while the image tokens stay under ``--image-fraction`` of the sample, then a text tail up to
``--seq``. The images are small (at most 256 px a side), so they are UPSCALED (process_image's
bicubic resize with ``min_pixels``) to a cycle of merged-token counts (``PRESETS``: 400 to ~1.3k
each for 2b, the size of photos and documents in VL training sets; the default 0.6 gives 5
images, ~50% image tokens, ~16.4k patches per 8192-token sample); the pixel content is the real
image's. ``--data prepared`` (default): the samples go through the training data path, a
manifest prepared by ``prepare_vl_dataset`` into a store read by ``VLPackedDataset`` and
``VLDataLoader`` (text from the project's VL tokenizer, targets from the store's loss mask, the
model's four VL ids the tokenizer's; vl_batches.py says what differs and why).
``--data synthetic``: the same samples built in memory, text as UTF-8 bytes (ids 0-255), the real
Qwen2-VL special ids. A step takes ``--micro-batch`` samples, the SAME batches on every side:
transformers gets ``input_ids [B, seq]`` (no padding needed: all samples have the same length),
mpcore the same tokens as one packed stream of B documents.

Step, the SAME on every side: forward + backward + gradient clipping at 1.0 + AdamW (fused on
CUDA; lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on every tensor), fp32 parameters under bf16
autocast (fp32 without autocast on the CPU). ``--forward-backward-only`` drops clipping and the
optimizer step on every side. Each side's step starts from the raw sample with its pixel rows
already on the device and includes its own input preparation. mpcore's is pretrain's
(``mpcore.batches.local_inputs``): the sample's ids, grids and loss mask as the loader gives
them, on the host; labels, M-RoPE positions and vision rows made there by the family's
``local_inputs``, then pinned and copied asynchronously with their ranges known. transformers
gets the ids and loss mask on the device and makes its labels and ``mm_token_type_ids`` (its
M-RoPE index is computed inside its forward).
Sides: mpcore (the family's ``build``, loss = ``output="loss_sum"`` / valid-label count);
transformers' model of the family (``Qwen2VLForConditionalGeneration`` /
``Qwen3VLForConditionalGeneration`` of the family's ``hf_config_dict``, SDPA; flash_attention_2
as a further side only when it imports); the same with liger-kernel's patches for the family
(``apply_liger_kernel_to_qwen2_vl`` / ``_qwen3_vl`` before the model is built, where liger has
them), each patch reported as applied or not (Qwen2-VL's RoPE patch targets a function
transformers 5.x no longer has). Qwen3.5-VL: ``Qwen3_5ForConditionalGeneration``, whose Gated
DeltaNet layers take fla's kernels (and causal_conv1d's) when flash-linear-attention is
installed and its PyTorch fallback otherwise; ``hf_fast_path`` records what it found
(``tests/perf/bench_qwen35.hf_paths``) and the fallback warnings transformers logged during
the baselines. Our side builds it with ``gdn_kernel=auto`` (fla on CUDA when it runs) and
reports the kernel its DeltaNet layers ran (``gdn_kernel``: requested, ran, why).

Reported per side: the step time over ``--steps`` timed steps after ``--warmup`` (by default
one step per distinct batch: the first step on a batch builds cuDNN graphs and may compile a
Triton variant for its image sizes; the steady timing's mean would count it) (``--timing
steady``, the default: the steps back to back, each loss read after the next step was
started, as ``Trainer.fit`` does, mean step time; ``synced``: the median, the device
synchronised around each step, as every VL result before 2026-12-02 was timed; the JSON's ``timing`` says which), tokens/s (all tokens) and text tokens/s
(non-placeholder tokens), peak allocated GiB (reset between sides, everything freed between
sides), first/last loss, the targets per step and a digest of the batches it was fed (both
must agree across sides). Also ``data_path`` and the data (images, image-token fraction, patches
per step; for ``prepared`` the store's counts under ``data.store``), the
parameter counts of both models (built on the meta device; they must agree), and the speedup
and memory ratio against the best baseline. JSON to OUT (default
tests/perf/results/vl_h200.json); a markdown table is printed last.

Without CUDA (``--config tiny``, tests/unit/test_bench_vl_smoke.py): a tiny VL config, small
images, fp32, unfused AdamW, vocab 516 (the smallest SentencePiece vocab the prepared path's
tokenizer allows, 512, and the four VL ids); ``peak_gib`` is null and liger is reported missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mpcore.batches import place
from mpcore.config import load_config
from mpcore.models import ModelConfig, VisionConfig, VLConfig, family_named, family_of
from mpcore.models.common.qwen3_vl.presets import QWEN3_VL_2B, TINY
from mpcore.models.qwen3_vl import config_from_hf as qwen3_vl_from_hf
from mpcore.models.qwen3_vl import config_from_section as qwen3_vl_from_section
from mpcore.parallel.state import ParallelState
from mpcore.processes import init_distributed
from tests.families import hf_classes
from tests.perf.bench_qwen35 import HF_UNFINISHED, deltanet_kernel, fast_path_recorded
from tests.perf.bench_train import _sync, _timed  # (one timing for every benchmark)
from tests.perf.vl_batches import Batch, build_batches, digest

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "vl_h200.json"
OPTIM = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRAD_CLIP = 1.0


def qwen2_vl_2b() -> VLConfig:
    """Qwen2-VL-2B's shape (its config.json values) with the real special-token ids."""
    text = ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                       num_kv_heads=2, intermediate_size=8960, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                       max_position_embeddings=32768, mrope_section=(16, 24, 24))
    vision = VisionConfig(arch="qwen2_vl", depth=32, hidden_size=1280, num_heads=16,
                          intermediate_size=5120, out_hidden_size=1536)
    return VLConfig(text=text, vision=vision, image_token_id=151655, video_token_id=151656,
                    vision_start_token_id=151652, vision_end_token_id=151653)


def tiny() -> VLConfig:
    """A CPU-sized Qwen2-VL (real 14-px patches, so the shipped images feed it as they are)."""
    text = ModelConfig(vocab_size=516, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, intermediate_size=96, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                       mrope_section=(2, 3, 3))
    vision = VisionConfig(arch="qwen2_vl", depth=2, hidden_size=32, num_heads=2,
                          intermediate_size=64, out_hidden_size=64)
    return VLConfig(text=text, vision=vision, image_token_id=300, video_token_id=301,
                    vision_start_token_id=302, vision_end_token_id=303)


def qwen3_vl_2b():
    """Qwen3-VL-2B's shape (its config.json) with the real special-token ids."""
    return qwen3_vl_from_hf(QWEN3_VL_2B)


def qwen3_vl_tiny():
    """A CPU-sized Qwen3-VL (patch 14, so the shipped images feed it as they are)."""
    ids = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302,
               vision_end_token_id=303)
    return qwen3_vl_from_section({**TINY, "vocab_size": 516}, ids)


GLM4V_LAYERS = 12  # of GLM-4.1V-9B's 40: fp32 master weights + AdamW of all 40 exceed one H200


def _from_yaml(family: str, yaml: str, overrides: list[str], ids: dict):
    section = load_config(REPO / "launch" / "configs" / yaml, overrides).model
    return family_named(family).config_from_section(section, ids)


def glm4v_9b():
    """GLM-4.1V-9B's shape (launch/configs/glm4v_9b.yaml: tower depth 24 / width 1536, decoder
    hidden 4096 with 32 q / 2 kv heads, MLP 13696, untied 151552 vocab) with ``GLM4V_LAYERS``
    decoder layers, GLM's real image / start / end ids."""
    ids = dict(image_token_id=151343, video_token_id=151344, vision_start_token_id=151339,
               vision_end_token_id=151340)
    return _from_yaml("glm4v", "glm4v_9b.yaml", [f"model.num_layers={GLM4V_LAYERS}"], ids)


def glm4v_tiny():
    """A CPU-sized GLM-4V (launch/configs/glm4v_tiny.yaml at vocab 518)."""
    ids = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302,
               vision_end_token_id=303)
    return _from_yaml("glm4v", "glm4v_tiny.yaml", ["model.vocab_size=518"], ids)


# Qwen3.5-0.8B's released config.json: the text part is tests/dist/qwen35_0p8b_config.json (it
# carries no tower); the tower and the special ids are these.
QWEN3_5_0P8B_TEXT = REPO / "tests" / "dist" / "qwen35_0p8b_config.json"
QWEN3_5_0P8B_VISION = {
    "model_type": "qwen3_5", "depth": 12, "hidden_size": 768, "num_heads": 12,
    "intermediate_size": 3072, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
    "spatial_merge_size": 2, "out_hidden_size": 1024, "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []}
QWEN3_5_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                   vision_end_token_id=248054)


def qwen3_5_vl_0p8b():
    """Qwen3.5-0.8B's shape, tower included (module docstring), with the real special ids."""
    hf = json.loads(QWEN3_5_0P8B_TEXT.read_text())
    return family_named("qwen3_5_vl").config_from_hf(
        {**hf, **QWEN3_5_IDS, "vision_config": QWEN3_5_0P8B_VISION})


def qwen3_5_vl_tiny():
    """A CPU-sized Qwen3.5-VL (launch/configs/qwen35_vl_tiny.yaml at vocab 516: 3 DeltaNet
    layers and one gated full-attention layer, a 2-block tower of patch 16)."""
    ids = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302,
               vision_end_token_id=303)
    return _from_yaml("qwen3_5_vl", "qwen35_vl_tiny.yaml", ["model.vocab_size=516"], ids)


# family -> name -> (config, default seq, merged tokens per image (cycled with the images),
# text vocab of the prepared path's tokenizer)
PRESETS = {
    "qwen2_vl": {"2b": (qwen2_vl_2b, 8192, (1024, 400, 700, 1300, 560, 880), 2048),
                 "tiny": (tiny, 256, (9, 16, 6), 512)},
    "qwen3_vl": {"2b": (qwen3_vl_2b, 8192, (1024, 400, 700, 1300, 560, 880), 2048),
                 "tiny": (qwen3_vl_tiny, 256, (9, 16, 6), 512)},
    "glm4v": {"9b": (glm4v_9b, 8192, (1024, 400, 700, 1300, 560, 880), 2048),
              "tiny": (glm4v_tiny, 256, (9, 16, 6), 512)},
    "qwen3_5_vl": {"0.8b": (qwen3_5_vl_0p8b, 8192, (1024, 400, 700, 1300, 560, 880), 2048),
                   "tiny": (qwen3_5_vl_tiny, 256, (9, 16, 6), 512)},
}
# family -> transformers' model module (and liger's apply_liger_kernel_to_<name>) where the
# two names differ
HF_MODULES = {"qwen3_5_vl": "qwen3_5"}


def _train_step(model, optimizer, args, loss_fn, group=None):
    """``step(i)``: loss_fn(i) -> scalar loss; backward (gradients summed over ``group``: the
    cp ranks hold the same weights); clip + optimizer step unless ``--forward-backward-only``;
    zero grads; the loss, detached (``_timed`` reads it as a float)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> float:
        loss = loss_fn(i)
        loss.backward()
        if group is not None:
            for p in params:  # one bucket per tensor: simple, not what FSDP/DDP would do
                dist.all_reduce(p.grad, group=group)
        if not args.forward_backward_only:
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if group is not None:  # each cp rank's loss is its share of the global mean
            dist.all_reduce(loss, group=group)
        return loss

    return step


def _optimizer(model, cuda: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), fused=cuda or None, **OPTIM)


def _rates(result: dict, batches: list[Batch], image_id: int, gpus: int = 1) -> dict:
    seconds = result["step_ms"] / 1e3 * gpus  # per GPU: the step's tokens over its GPUs
    text = statistics.mean(int((b.ids != image_id).sum()) for b in batches)
    result["tokens_per_s_per_gpu"] = batches[0].ids.numel() / seconds
    result["text_tokens_per_s_per_gpu"] = text / seconds
    return result


def bench_mpcore(args, cfg, batches: list[Batch], device) -> dict:
    cuda = device.type == "cuda"
    state = ParallelState.build(1, args.cp)
    family = family_of(cfg)
    # the Qwen3.5 families: fla's kernels on CUDA where they run, else the reference (warned)
    hybrid = {"gdn_kernel": "auto"} if "gdn_kernel" in family.options else {}
    model = family.build(cfg, state, device=device, dtype=torch.float32,
                         activation_checkpointing=args.activation_checkpointing,
                         vision_attention=args.vision_attention,
                         cp_mode=args.cp_mode if args.cp > 1 else "none",
                         vision_cp=args.vision_cp, **hybrid)
    model.train()
    optimizer = _optimizer(model, cuda)
    # As pretrain's step (mpcore.batches.local_inputs): the tokens are planned on the host and
    # copied asynchronously with their ranges known; the pixels sit on the device beforehand,
    # as on the transformers side.
    pixels = [b.pixels.to(device) for b in batches]

    def inputs(i: int) -> dict:
        b = batches[i % len(batches)]
        mask = None if b.loss_mask is None else b.loss_mask.view(-1)
        _, local = family.local_inputs(state, b.ids.view(-1), b.cu_seqlens, cfg,
                                       pixel_values=pixels[i % len(batches)],
                                       image_grid_thw=b.grid, loss_mask=mask)
        return place(local, family, device)

    def loss_fn(i: int) -> torch.Tensor:
        kwargs = inputs(i)
        count = (kwargs["labels"] != -100).sum()  # valid targets (no placeholder, no doc end)
        if state.cp > 1:  # the global count: each cp rank holds a share of the targets
            dist.all_reduce(count, group=state.cp_group)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss_sum = model(**kwargs, output="loss_sum")  # () fp32
        return loss_sum / count

    group = state.cp_group if state.cp > 1 else None
    result = _rates(_timed(_train_step(model, optimizer, args, loss_fn, group), args.steps,
                           args.warmup, steady=args.timing == "steady"),
                    batches, cfg.image_token_id, state.cp)
    prep = []
    for i in range(5):  # the host-side input preparation alone (it is inside step_ms)
        _sync()
        start = time.perf_counter()
        inputs(i)
        _sync()
        prep.append(time.perf_counter() - start)
    result["input_prep_ms"] = 1e3 * statistics.median(prep)
    targets = torch.stack([(inputs(i)["labels"] != -100).sum() for i in range(len(batches))])
    if group is not None:  # each cp rank holds a share of the targets
        dist.all_reduce(targets, group=group)
    result["target_tokens_per_step"] = targets.double().mean().item()
    result["batches_sha256"] = digest(t for b, p in zip(batches, pixels, strict=True)
                                      for t in (b.ids.view(-1), p, b.grid))
    result["vision_attention"] = model.vision_kernel(args.vision_attention)  # what auto ran
    if hybrid:
        result["gdn_kernel"] = deltanet_kernel(model, device)
    return result


def hf_config(cfg):
    """transformers' config of ``cfg`` (the config.json our export writes)."""
    config_cls, _ = hf_classes(family_of(cfg).name)
    fields = family_of(cfg).hf_config_dict(cfg)
    fields.pop("model_type")
    fields["text_config"] = {**fields["text_config"], "use_cache": False}
    return config_cls(**fields)


def _hf_model(cfg, attn: str, device):
    _, model_cls = hf_classes(family_of(cfg).name)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 2B CPU init takes a while
        model = model_cls._from_config(hf_config(cfg), attn_implementation=attn)
    return model.to(device)


def apply_liger(family: str) -> dict:
    """Apply liger-kernel's patches for ``family`` (transformers' module name: ``HF_MODULES``;
    class level, before the model is built);
    which of them can take effect on the installed transformers. ``ImportError`` when liger
    has none for the family."""
    import importlib

    import liger_kernel.transformers as liger

    apply = getattr(liger, f"apply_liger_kernel_to_{family}", None)
    if apply is None:
        raise ImportError(f"liger-kernel {getattr(liger, '__version__', '')} has no "
                          f"apply_liger_kernel_to_{family}")
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n in dir(m) if n.endswith("RMSNorm")]
    found = {"rope": hasattr(m, "apply_multimodal_rotary_pos_emb"), "rms_norm": bool(names),
             "layer_norm": hasattr(m, "LayerNorm"),
             "swiglu": any(n.endswith("MLP") for n in dir(m)),
             "fused_linear_cross_entropy": True}
    wanted = dict(rope=True, rms_norm=True, layer_norm=True, swiglu=True,
                  fused_linear_cross_entropy=True)
    accepted = inspect.signature(apply).parameters
    asked = {k: v for k, v in wanted.items() if k in accepted}
    try:
        apply(**asked)
    except NotImplementedError as e:
        # liger 0.8.5's GLM-4V entry has no RoPE kernel and refuses before it patches
        # anything: ask for the other patches again, RoPE off (its own default there).
        if not asked.get("rope"):
            raise
        apply(**{**asked, "rope": False})
        found["rope"] = f"refused: {e}"
    return {k: v for k, v in found.items() if k in accepted}


def liger_modules(model) -> dict:
    """How many modules of the built model are liger's, per kind, and whether the forward is
    liger's fused-linear-cross-entropy one."""
    counts: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name.startswith("Liger"):
            counts[name] = counts.get(name, 0) + 1
    forward = type(model).forward
    counts["lce_forward"] = "liger" in (getattr(forward, "__module__", "") or "")
    return counts


def bench_hf(args, cfg, batches: list[Batch], device, attn: str = "sdpa",
             liger: bool = False) -> dict:
    cuda = device.type == "cuda"
    name = family_of(cfg).name
    patches = apply_liger(HF_MODULES.get(name, name)) if liger else None
    model = _hf_model(cfg, attn, device)
    model.train()
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = _optimizer(model, cuda)
    takes_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters
    on_device = [dataclasses.replace(b.to(device), grid=b.grid.to(device)) for b in batches]

    def labels(b: Batch) -> torch.Tensor:  # [B, T]; transformers shifts them itself
        return b.ids.masked_fill(~b.targets(cfg.image_token_id), -100)

    def loss_fn(i: int) -> torch.Tensor:
        b = on_device[i % len(on_device)]
        kwargs = ({"mm_token_type_ids": (b.ids == cfg.image_token_id).int()} if takes_types
                  else {})
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = model(input_ids=b.ids, pixel_values=b.pixels, image_grid_thw=b.grid,
                        labels=labels(b), use_cache=False, **kwargs)
        return out.loss

    result = _rates(_timed(_train_step(model, optimizer, args, loss_fn), args.steps,
                           args.warmup, steady=args.timing == "steady"),
                    batches, cfg.image_token_id)
    result["target_tokens_per_step"] = statistics.mean(
        int((labels(b)[:, 1:] != -100).sum()) for b in on_device)
    result["batches_sha256"] = digest(t for b in on_device for t in (b.ids, b.pixels, b.grid))
    result["attn_implementation"] = attn
    if liger:
        result["liger_patches_applicable"] = patches
        result["liger_modules"] = liger_modules(model)
    return result


def count_params(cfg) -> dict:
    """Parameter counts of our model (the family's logical count) and transformers' (built on
    the meta device)."""
    _, model_cls = hf_classes(family_of(cfg).name)
    with torch.device("meta"):
        theirs = model_cls._from_config(hf_config(cfg))
    return {"mpcore": family_of(cfg).num_params(cfg)["total"],
            "transformers": sum(p.numel() for p in theirs.parameters())}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _guarded(name: str, fn, *args, **kwargs) -> dict:
    """One side's result, or ``{"failed": message and traceback tail}``, so that one broken
    side (an out-of-memory peer, say) does not lose the others; memory is freed either way."""
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        traceback.print_exc()
        result = {"failed": f"{type(e).__name__}: {e}"[:1000],
                  "traceback": traceback.format_exc()[-3000:]}
    _free()  # after the handler: its traceback no longer holds the side's tensors
    print(f"   {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return result


def _write_json(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def run_baselines(args, cfg, batches: list[Batch], device, report: dict) -> None:
    """Every transformers side; for a Qwen3.5 family also ``hf_fast_path``
    (``bench_qwen35.fast_path_recorded``)."""
    with fast_path_recorded(report, record="gdn_kernel" in family_of(cfg).options):
        _run_baselines(args, cfg, batches, device, report)


def _run_baselines(args, cfg, batches: list[Batch], device, report: dict) -> None:
    import transformers
    from transformers.utils import is_flash_attn_2_available

    report["transformers_version"] = transformers.__version__
    report["hf"] = _guarded("transformers", bench_hf, args, cfg, batches, device)
    if device.type == "cuda" and is_flash_attn_2_available():
        report["hf_fa2"] = _guarded("transformers fa2", bench_hf, args, cfg, batches,
                                    device, attn="flash_attention_2")
    else:
        report["hf_fa2"] = {"missing": "flash_attention_2 is not available (flash-attn "
                                       "package or CUDA missing)"}
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        report["hf_liger"] = {"missing": str(e)}
        return
    from importlib.metadata import version

    report["liger_kernel_version"] = version("liger-kernel")
    if device.type != "cuda":  # its Triton kernels take CUDA tensors only
        report["hf_liger"] = {"missing": "liger-kernel imports but needs CUDA"}
        return
    report["hf_liger"] = _guarded("transformers + liger", bench_hf, args, cfg, batches,
                                  device, liger=True)


def compare(report: dict) -> None:
    """Speedup and memory ratio of mpcore against the fastest baseline that ran."""
    ran = {k: report[k] for k in ("hf", "hf_fa2", "hf_liger")
           if "step_ms" in report.get(k, {})}
    if not ran or "step_ms" not in report["mpcore"]:
        return
    best = max(ran, key=lambda k: ran[k]["tokens_per_s_per_gpu"])
    ours, base = report["mpcore"], ran[best]
    report["best_baseline"] = best
    report["speedup_vs_best_baseline"] = ours["tokens_per_s_per_gpu"] / base[
        "tokens_per_s_per_gpu"]
    report["memory_ratio_vs_best_baseline"] = (
        None if ours["peak_gib"] is None or base["peak_gib"] is None
        else ours["peak_gib"] / base["peak_gib"])


def table(report: dict) -> str:
    names = {"mpcore": "mpcore", "hf": "transformers (SDPA)", "hf_fa2": "transformers (FA2)",
             "hf_liger": "transformers + liger-kernel"}
    lines = ["| | tokens/s | text tokens/s | peak GiB | step ms | first / last loss |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, name in names.items():
        side = report.get(key)
        if side is None:
            continue
        if "step_ms" not in side:
            why = " ".join(str(next(iter(side.values()))).split())[:100].replace("|", "/")
            lines.append(f"| {name} | {next(iter(side))}: {why} | | | | |")
            continue
        peak = "-" if side["peak_gib"] is None else f"{side['peak_gib']:.1f}"
        lines.append(f"| {name} | {side['tokens_per_s_per_gpu']:.0f} | "
                     f"{side['text_tokens_per_s_per_gpu']:.0f} | {peak} | "
                     f"{side['step_ms']:.1f} | {side['first_loss']:.3f} / "
                     f"{side['last_loss']:.3f} |")
    if "speedup_vs_best_baseline" in report:
        mem = report["memory_ratio_vs_best_baseline"]
        lines.append(f"\nmpcore vs {report['best_baseline']}: "
                     f"{report['speedup_vs_best_baseline']:.2f}x tokens/s, memory "
                     f"{'-' if mem is None else f'{mem:.2f}x'}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    parser.add_argument("--family", default="qwen2_vl", choices=sorted(PRESETS),
                        help="the model family (its released shape or a tiny one, --config)")
    parser.add_argument("--config", default=None, choices=["2b", "9b", "0.8b", "tiny"],
                        help="the family's large shape (2b; glm4v: 9b; qwen3_5_vl: 0.8b) or a "
                             "tiny one")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (default: one per distinct batch, so no "
                             "batch's first-time work, cuDNN graphs and Triton variants for "
                             "its image sizes, lands in the timed steps)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sample (default: 8192 for 2b, 256 for tiny)")
    parser.add_argument("--micro-batch", type=int, default=1, help="samples per step")
    parser.add_argument("--image-fraction", type=float, default=0.6,
                        help="images are added while their tokens stay under this share")
    parser.add_argument("--data", default="prepared", choices=["prepared", "synthetic"],
                        help="batches through the prepared-data path (manifest, store, "
                             "loader) or built in memory (tests/perf/vl_batches.py)")
    parser.add_argument("--distinct-batches", type=int, default=4,
                        help="different batches, cycled over the steps")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--timing", default="steady", choices=["steady", "synced"],
                        help="steady: steps back to back, each loss read during the next "
                             "step (mean); synced: the device synchronised around each step "
                             "(median)")
    parser.add_argument("--forward-backward-only", action="store_true",
                        help="time forward + backward only (no clipping, no optimizer step)")
    parser.add_argument("--skip-hf", action="store_true", help="only time mpcore")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallelism (under torchrun with --nproc-per-node CP; "
                             "mpcore only)")
    parser.add_argument("--cp-mode", default="ring", choices=["ring", "ulysses"])
    parser.add_argument("--vision-cp", default="split", choices=["split", "replicate"],
                        help="how the cp ranks share the tower's work (mpcore.models.common.vision_cp)")
    parser.add_argument("--vision-attention", default="auto", choices=["auto", "flash", "cudnn"],
                        help="mpcore's vision attention kernel on CUDA "
                             "(mpcore.models.common.vision_attention; auto: the family's, "
                             "VisionLanguageModel.auto_vision_attention)")
    parser.add_argument("--count-params", action="store_true",
                        help="print both models' parameter counts (meta device) and exit")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.distinct_batches
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 1 or args.distinct_batches < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --micro-batch >= 1, "
                     "--distinct-batches >= 1")
    if not 0 < args.image_fraction < 1:
        parser.error("--image-fraction must be in (0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = PRESETS[args.family]
    args.config = args.config or next(k for k in shapes if k != "tiny")
    if args.config not in shapes:
        raise SystemExit(f"--family {args.family} has the shapes {sorted(shapes)}, not "
                         f"{args.config}")
    make_config, default_seq, image_tokens, text_vocab = shapes[args.config]
    cfg = make_config()
    params = count_params(cfg)
    print(f"parameters (meta device): mpcore {params['mpcore']:,}, transformers "
          f"{params['transformers']:,}", flush=True)
    if args.count_params:
        return 0 if params["mpcore"] == params["transformers"] else 1
    seq = args.seq or default_seq
    init_distributed(300.0)  # under torchrun: NCCL on CUDA (device LOCAL_RANK), gloo on CPU
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != args.cp:
        raise SystemExit(f"--cp {args.cp} needs exactly {args.cp} processes (torchrun "
                         f"--nproc-per-node {args.cp}), got {world}")
    if args.cp > 1:
        args.skip_hf = True  # the baselines run on one GPU
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    cfg, batches, data = build_batches(args.data, cfg, seq, image_tokens, args.image_fraction,
                                       args.micro_batch, args.distinct_batches, text_vocab)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "family": args.family, "config": args.config,
              "seq": seq,
              "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup,
              "activation_checkpointing": args.activation_checkpointing,
              "vision_attention": args.vision_attention, "cp": args.cp,
              "cp_mode": args.cp_mode if args.cp > 1 else None,
              "vision_cp": args.vision_cp if args.cp > 1 else None,
              "forward_backward_only": args.forward_backward_only,
              "step": "forward + backward" + ("" if args.forward_backward_only else
                                             " + clip 1.0 + AdamW (fused on CUDA)"),
              "autocast": "bfloat16" if device.type == "cuda" else None,
              "num_params": params, "data_path": args.data, "data": data}
    print(json.dumps(report["data"], indent=1), flush=True)
    report["mpcore"] = _guarded("mpcore", bench_mpcore, args, cfg, batches, device)
    lead = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(args.out)
    if not args.skip_hf:
        if lead:  # our row kept, and said to be alone, should the process end in theirs
            _write_json(out, {**report, "hf": HF_UNFINISHED})
        run_baselines(args, cfg, batches, device, report)
        compare(report)
    if lead:
        _write_json(out, report)
        print(json.dumps(report, indent=1))
        print(f"\nwrote {out}\n{table(report)}")
    if dist.is_initialized():
        dist.destroy_process_group()
    ran = [report[k] for k in ("mpcore", "hf", "hf_liger") if "step_ms" in report.get(k, {})]
    ok = "step_ms" in report["mpcore"] and all(math.isfinite(r["last_loss"]) for r in ran)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
