"""Qwen3.5 vision-language: Qwen3-VL's tower (no DeepStack) feeding the Qwen3.5 hybrid decoder.

Layout and forward are ``mpcore.models.common.vl_model.VisionLanguageModel``'s: the per-token tensors
of the GLOBAL stream (``input_ids [L]``, M-RoPE ``position_ids [3, L]``, ``labels [L]``,
``vision_rows [L]``, by Qwen3-VL's position rule, ``mpcore.models.common.qwen3_vl.inputs``) split by one
``ContextPlan``; the micro-batch's ``pixel_values [N, patch_dim]`` and ``grid_thw [I, 3]`` whole
on every cp rank.

    h = text.tok_embeddings(input_ids)           # (L or L/tp under SP, hidden)
    h[slots] = visual(pixel_values, grid_thw)[vision_rows[slots]]   # the merged rows, over cp
    out = text.decode(h, ...)                    # Gated DeltaNet / gated attention layers

The decoder is ``mpcore.models.common.hybrid.model.Qwen35Transformer`` with interleaved M-RoPE over each
head's rotated dims: under cp its full-attention layers run ring or Ulysses attention on the
zigzag layout and its DeltaNet layers the head all-to-all (``mpcore.models.common.hybrid.cp``), both on the
same local tokens whose rows the tower's cp split delivered. No rows are added after decoder
layers (the tower has no DeepStack), so ``rows`` is one ``hidden`` wide.
"""

from __future__ import annotations

import torch

from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid.kernels import check_available
from mpcore.models.common.hybrid.model import Qwen35Transformer
from mpcore.models.common.hybrid.vl_config import Qwen35VLConfig
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower
from mpcore.models.common.vl_model import VisionLanguageModel
from mpcore.parallel.state import ParallelState


class Qwen35VLModel(VisionLanguageModel):
    """The model (module docstring); ``decoder_options`` may name ``gdn_kernel``
    (``mpcore.models.common.hybrid.kernels``). Build it with :func:`build_model`."""

    tower_cls = Qwen3VisionTower
    decoder_cls = Qwen35Transformer


def make_model(cfg: Qwen35VLConfig, state: ParallelState, *, device: torch.device | str = "cpu",
               fp8: str = "none", dtype: torch.dtype = torch.float32,
               model_cls: type[Qwen35VLModel] = Qwen35VLModel, **options) -> Qwen35VLModel:
    """The ``model_cls`` on the meta device (``build_model`` and ``load_hf_model`` materialise
    it); ``options``: ``VisionLanguageModel``'s keyword arguments. Raises ``ValueError`` for an fp8
    recipe or DeltaNet kernel that ``device`` cannot run, and when ``cfg`` does not fit
    ``state`` (``check_parallel``)."""
    check_fp8(fp8, device)
    check_available(options.get("gdn_kernel", "auto"), device)
    with torch.device("meta"):
        return model_cls(cfg, state, fp8=fp8, dtype=dtype, **options)


def build_model(cfg: Qwen35VLConfig, state: ParallelState, *, seed: int = 0,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                **options) -> Qwen35VLModel:
    """Create on meta, materialise this rank's shards on ``device`` and initialise them from
    ``seed`` (the same function at any tp degree); ``options``: ``make_model``'s."""
    model = make_model(cfg, state, device=device, dtype=dtype, **options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
