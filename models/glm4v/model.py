"""The GLM-4V model: its vision tower feeding the shared decoder with GLM's sandwich-norm block.

Layout and forward are those of ``mpcore.models.common.vl_model.VisionLanguageModel`` (the per-token
inputs from ``mpcore.models.glm4v.inputs``, split by one ``ContextPlan``; the tower's rows scattered into this
rank's placeholders, the tower's work spread over cp by ``mpcore.models.common.vision_cp``); what
differs is the tower (``mpcore.models.glm4v.tower``) and the decoder block, four RMSNorms per layer:

    h = h + attention_out_norm(attention(attention_norm(h)))
    h = h + ffn_out_norm(feed_forward(ffn_norm(h)))

As in ``DecoderLayer`` each residual add runs fused into the norm after it, so a layer hands
the next ``(h, delta)`` with ``delta`` its (post-normed) MLP output. Under sequence parallelism
the two output norms see token shards, so their weights' gradients are summed over tp.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mpcore.models.common.attention import Attention
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.mlp import FeedForward
from mpcore.models.common.norm import RMSNorm, matmul_dtype
from mpcore.models.common.vl_model import VisionLanguageModel
from mpcore.models.glm4v.config import Glm4vConfig, config_from_hf
from mpcore.models.glm4v.hf import load_hf_weights
from mpcore.models.glm4v.tower import Glm4vVisionTower
from mpcore.parallel.state import ParallelState


class Glm4vDecoderLayer(nn.Module):
    """The sandwich-norm block (module docstring); ``DecoderLayer``'s constructor and forward."""

    def __init__(self, cfg, state: ParallelState, *, sequence_parallel: bool, fp8: str = "none",
                 dtype=None, index: int = 0):
        super().__init__()
        del index  # every layer is the same block
        norm = dict(group=state.tp_group, sum_grad_over_tp=sequence_parallel and state.tp > 1,
                    dtype=dtype)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.attention = Attention(cfg, tp_group=state.tp_group,
                                   sequence_parallel=sequence_parallel, fp8=fp8, dtype=dtype)
        self.attention_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.feed_forward = FeedForward(cfg, tp_group=state.tp_group,
                                        sequence_parallel=sequence_parallel, fp8=fp8,
                                        dtype=dtype)
        self.ffn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)

    def forward(self, h, delta, cos, sin, plan):
        dtype = matmul_dtype(h)
        if delta is None:
            x = self.attention_norm(h, dtype)
        else:
            h, x = self.attention_norm.add(h, delta, dtype)
        attended = self.attention_out_norm(self.attention(x, cos, sin, plan), dtype)
        h, x = self.ffn_norm.add(h, attended, dtype)
        return h, self.ffn_out_norm(self.feed_forward(x), dtype)


class Glm4vModel(VisionLanguageModel):
    """GLM-4V (module docstring): the shared vision-language model over GLM's decoder block
    and tower."""

    tower_cls = Glm4vVisionTower
    decoder_layer = Glm4vDecoderLayer


def materialise(model: nn.Module, device, seed: int) -> None:
    model.to_empty(device=device)
    init_weights(model, seed)


def build_model(cfg: Glm4vConfig, state: ParallelState, *, device="cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0, **options) -> Glm4vModel:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``); ``options``:
    ``Glm4vModel``'s keyword arguments."""
    with torch.device("meta"):
        model = Glm4vModel(cfg, state, dtype=dtype, **options)
    materialise(model, device, seed)
    return model


def load_hf_model(folder: str | Path, state: ParallelState, *, device="cpu",
                  dtype: torch.dtype = torch.float32, **options) -> tuple[Glm4vModel, Glm4vConfig]:
    """``(model, cfg)`` of a GLM-4V checkpoint folder with this rank's shards loaded."""
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Glm4vModel(cfg, state, dtype=dtype, **options)
    materialise(model, device, seed=0)  # buffers (rotary tables); parameters overwritten next
    load_hf_weights(model, folder, state)
    return model, cfg
