"""The Qwen3-VL vision tower, with its DeepStack mergers, on tensor-parallel layers.

Layout, per tp rank (everything replicated over the tp group; no sequence parallelism):

    pixel_values [N, patch_dim]        rows in processor order (models/vision/plan.py: image,
                                       frame, merge block, patch inside the block)
    h = patch_embed(pixel_values)      [N, hidden]  Conv3d (stride = kernel, bias) as a matmul
    h = h + pos(grid)                  learned square grid, bilinear (align_corners) per image
    for block b: h = h + attention(norm1(h)); h = h + fc2(gelu_tanh(fc1(norm2(h))))
                 b in deepstack_visual_indexes: feature_k = deepstack_merger_k(h)
    out = merger(h)                    [N / m^2, out_hidden]  LayerNorm, m^2 rows as one, MLP

The position resampling is ``F.interpolate(bilinear, align_corners=True)`` of the
``side x side`` table to each image's ``h x w`` patch grid, written as 4 taps per patch
(separable weights) and read in the processor's row order, the same for every frame (as
transformers' ``fast_pos_embed_interpolate``). The merger normalises each patch row
(``hidden``) before merging; a DeepStack merger normalises the merged row (``hidden * m^2``).
Column-parallel layers (wqkv, fc1, mergers' w1) shard outputs over tp, row-parallel ones (wo,
fc2, mergers' w2) all-reduce; norms, the patch and position embeddings are replicated and see
replicated inputs, so their gradients are whole on every tp rank.

Weights: built on meta, materialised, ``init_weights`` draws each LOGICAL full tensor and keeps
this rank's slice (the same function at any tp degree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpcore.kernels.host_checked import copy_to
from mpcore.models.common.norm import LayerNorm, matmul_dtype
from mpcore.models.common.qwen3_vl.config import Qwen3VisionConfig
from mpcore.models.common.tower import TowerBase
from mpcore.models.common.vision_attention import Segments, VisionAttention, rotary_tables
from mpcore.models.common.vision_plan import VisionPlan, plan_vision
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ParallelState, ProcessGroup


class PatchEmbed(nn.Module):
    """``[N, C*T*P*P] -> [N, hidden]``: transformers' Conv3d (stride = kernel, with bias) as
    ``x @ W.view(hidden, -1).T + b``; the weight keeps the Conv3d layout (loads as is)."""

    def __init__(self, cfg: Qwen3VisionConfig, dtype=None):
        super().__init__()
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                 cfg.patch_size)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, tuple(self.weight.shape), lambda full: full, normal_init(0.02),
                    seed)
        with torch.no_grad():
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight.view(self.weight.shape[0], -1),
                        self.bias)


class PositionEmbedding(nn.Module):
    """The learned ``[side^2, hidden]`` position table, resampled to each image (module
    docstring); replicated over tp."""

    def __init__(self, cfg: Qwen3VisionConfig, dtype=None):
        super().__init__()
        self.side = cfg.grid_side
        self.weight = nn.Parameter(torch.empty(cfg.num_position_embeddings, cfg.hidden_size,
                                               dtype=dtype))

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, tuple(self.weight.shape), lambda full: full, normal_init(0.02),
                    seed)

    def forward(self, taps: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``taps [N, 4]`` int64 table rows, ``weights [N, 4]`` fp32 -> ``[N, hidden]``."""
        rows = self.weight.index_select(0, taps.reshape(-1)).view(*taps.shape, -1)
        return (rows * weights[:, :, None].to(rows.dtype)).sum(1)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int):
    """Two taps and weights per target position ``index`` on an axis of ``size`` cells,
    resampled from ``side`` cells with align_corners=True (the end points map to 0, side-1)."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1)
    low = src.floor()
    taps = (low.long()[:, None] + torch.arange(2)).clamp(max=side - 1)  # (N, 2)
    frac = src - low
    return taps, torch.stack([1 - frac, frac], dim=1)


def position_taps(plan: VisionPlan, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(taps [N, 4] int64, weights [N, 4] fp32)`` on the host: the bilinear resampling of
    the ``side x side`` table at each row's (h, w) patch position (``plan.positions``)."""
    grid = torch.tensor(plan.grid, dtype=torch.int64).view(-1, 3)
    sizes = grid[:, 1:].repeat_interleave(grid.prod(1), dim=0)  # (N, 2): each row's (h, w)
    h_taps, h_w = _axis_taps(plan.positions[:, 0], sizes[:, 0], side)
    w_taps, w_w = _axis_taps(plan.positions[:, 1], sizes[:, 1], side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).flatten(1)
    return taps, (h_w[:, :, None] * w_w[:, None, :]).flatten(1)


class MLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))`` with biases; fc1 column-, fc2 row-parallel (tp)."""

    def __init__(self, cfg: Qwen3VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        self.w1 = ColumnParallelLinear(hid, inter, bias=True, group=tp_group, dtype=dtype)
        self.w2 = RowParallelLinear(inter, hid, bias=True, group=tp_group, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # (N, I/tp) -> (N, hidden)


class VisionBlock(nn.Module):
    """Pre-norm residual block: attention over each frame, then the MLP."""

    def __init__(self, cfg: Qwen3VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.attention_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype)
        self.attention = VisionAttention(cfg, tp_group=tp_group, dtype=dtype)
        self.ffn_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype)
        self.feed_forward = MLP(cfg, tp_group, dtype=dtype)

    def forward(self, h, cos, sin, segments: Segments):
        dtype = matmul_dtype(h)  # the norms write what the projections compute in
        h = h + self.attention(self.attention_norm(h, dtype), cos, sin, segments)
        return h + self.feed_forward(self.ffn_norm(h, dtype))


class PatchMerger(nn.Module):
    """``[N, hidden] -> [N / m^2, out_hidden]``: LayerNorm (of each patch row, or with
    ``post_shuffle`` of each merged row), ``m^2`` rows as one, ``w2(gelu(w1(.)))`` (exact GELU;
    w1 column-, w2 row-parallel over tp)."""

    def __init__(self, cfg: Qwen3VisionConfig, tp_group: ProcessGroup | None, *,
                 post_shuffle: bool, dtype=None):
        super().__init__()
        self.width, self.post_shuffle = cfg.hidden_size * cfg.merge_unit, post_shuffle
        self.norm = LayerNorm(self.width if post_shuffle else cfg.hidden_size, cfg.norm_eps,
                              dtype=dtype)
        self.w1 = ColumnParallelLinear(self.width, self.width, bias=True, group=tp_group,
                                       dtype=dtype)
        self.w2 = RowParallelLinear(self.width, cfg.out_hidden_size, bias=True,
                                    group=tp_group, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.post_shuffle:
            x = self.norm(h.reshape(-1, self.width), matmul_dtype(h))
        else:
            x = self.norm(h, matmul_dtype(h)).reshape(-1, self.width)  # (N / m^2, h * m^2)
        return self.w2(F.gelu(self.w1(x)))


class Qwen3VisionTower(TowerBase):
    """The tower (module docstring). ``state_or_tp_group``: a ``ParallelState`` (its tp group),
    a tp ``ProcessGroup`` or None (one process)."""

    def __init__(self, cfg: Qwen3VisionConfig,
                 state_or_tp_group: ParallelState | ProcessGroup | None = None, *,
                 activation_checkpointing: bool = False, attention_kernel: str = "auto",
                 dtype=None):
        super().__init__(cfg, state_or_tp_group, activation_checkpointing, attention_kernel)
        group = self.tp_group
        self.patch_embed = PatchEmbed(cfg, dtype=dtype)
        self.pos_embed = PositionEmbedding(cfg, dtype=dtype)
        self.layers = nn.ModuleList(VisionBlock(cfg, group, dtype=dtype)
                                    for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, group, post_shuffle=False, dtype=dtype)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(cfg, group, post_shuffle=True, dtype=dtype)
            for _ in cfg.deepstack_visual_indexes)
        for layer in self.layers:
            layer.attention.kernel = attention_kernel

    def _check_pixels(self, pixel_values: torch.Tensor, plan: VisionPlan) -> None:
        cfg = self.cfg
        if (pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim
                or not pixel_values.is_floating_point()):
            raise ValueError(f"pixel_values must be float [num_patches, {cfg.patch_dim}] "
                             f"(in_channels * temporal_patch_size * patch_size^2), got "
                             f"{pixel_values.dtype} {tuple(pixel_values.shape)}")
        if pixel_values.shape[0] != plan.num_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw "
                             f"{[list(g) for g in plan.grid]} implies sum(t*h*w) = "
                             f"{plan.num_patches} patches; pass the grid of these pixels")

    def forward(self, pixel_values: torch.Tensor, grid_thw
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(merged [N / m^2, out_hidden], [feature_k [N / m^2, out_hidden]])`` of the items
        ``grid_thw`` (int ``[I, 3]`` or nested list, read on the host); ``pixel_values [N,
        patch_dim]`` in their order. Replicated over tp. Bad input raises ``ValueError``
        before any compute."""
        plan = plan_vision(self.cfg, grid_thw)
        self._check_pixels(pixel_values, plan)
        device, cfg = pixel_values.device, self.cfg
        taps, weights = position_taps(plan, cfg.grid_side)
        h = self.patch_embed(pixel_values)  # (N, hidden)
        h = h + self.pos_embed(copy_to(taps, device), copy_to(weights, device)).to(h.dtype)
        cos, sin = rotary_tables(copy_to(plan.positions, device), cfg.head_dim, cfg.rope_theta)
        frames = Segments(plan.frame_cu, plan.max_frame, device)
        features = []
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, frames, use_reentrant=False)
            else:
                h = layer(h, cos, sin, frames)
            if i in cfg.deepstack_visual_indexes:
                # Features in block order (decoder layer k adds the k-th of them), each
                # through the merger at its entry's place in the list, as transformers does.
                k = cfg.deepstack_visual_indexes.index(i)
                features.append(self.deepstack_mergers[k](h))
        return self.merger(h), features

    def rows(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """``[N / m^2, (1 + K) * out_hidden]``: the merged rows and the K DeepStack features
        side by side, so one row exchange (``mpcore.models.common.vision_cp``) moves them all."""
        merged, features = self(pixel_values, grid_thw)
        return torch.cat([merged, *features], dim=1)
