"""The Qwen2-VL / Qwen2.5-VL vision tower on tensor-parallel layers.

Layout, per tp rank (everything replicated over the tp group; no sequence parallelism):

    pixel_values [N, patch_dim]        rows in processor order (models/common/vision_plan.py)
    h = patch_embed(pixel_values)      [N, hidden]  Conv3d(stride = kernel) as one matmul
    h = h[row_order]                   Qwen2.5-VL: units into window order
    for block: h = h + attention(attention_norm(h)); h = h + feed_forward(ffn_norm(h))
    out = merger(h)                    [N / m^2, out_hidden]  norm, view m^2 rows as one, MLP
    out = out[unit_inverse]            Qwen2.5-VL: back to the input's unit order

Blocks (``cfg.arch``): qwen2_vl = LayerNorm, attention over each frame, LayerNorm, fc1 ->
quick_gelu (``mpcore.kernels.quick_gelu``) -> fc2; qwen2_5_vl = RMSNorm, attention over each window
(each frame in the ``fullatt_block_indexes`` blocks), RMSNorm, gated SiLU MLP with biases.
Column-parallel layers (wqkv, w1 / w13, merger.w1) shard the output over tp, row-parallel ones
(wo, w2, merger.w2) all-reduce; norms and the patch embedding are replicated and see
replicated inputs, so their gradients are whole on every rank.

Weights: built on the meta device, materialised, then ``init_weights`` calls every module's
``reset_parameters(param_seed(seed, name))``, which draws the LOGICAL full tensor and keeps
this rank's slice: the same function at any tp degree (``build_vision_tower``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpcore.kernels.host_checked import copy_to
from mpcore.kernels.quick_gelu import quick_gelu
from mpcore.kernels.swiglu import swiglu
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.norm import LayerNorm, RMSNorm, matmul_dtype
from mpcore.models.common.tower import TowerBase
from mpcore.models.common.vision_attention import Segments, VisionAttention, rotary_tables
from mpcore.models.common.vision_plan import VisionPlan, plan_vision
from mpcore.models.qwen2_vl.vision_config import VisionConfig
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ParallelState, ProcessGroup


class PatchEmbed(nn.Module):
    """``[N, C*T*P*P] -> [N, hidden]``: the Conv3d of transformers (stride = kernel, no bias)
    as ``x @ W.view(hidden, -1).T``. The weight keeps the Conv3d layout ``[hidden, C, T, P, P]``
    (the HF tensor loads as is); replicated over tp."""

    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                 cfg.patch_size)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, tuple(self.weight.shape), lambda full: full, normal_init(0.02),
                    seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight.view(self.weight.shape[0], -1))


def _norm(cfg: VisionConfig, dim: int, dtype) -> nn.Module:
    """LayerNorm (qwen2_vl) or RMSNorm (qwen2_5_vl), as transformers computes them."""
    if cfg.arch == "qwen2_vl":
        return LayerNorm(dim, cfg.norm_eps, dtype=dtype)
    return RMSNorm(dim, cfg.norm_eps, dtype=dtype)


class QuickGeluMLP(nn.Module):
    """Qwen2-VL: ``w2(quick_gelu(w1(x)))`` with biases; w1 column-, w2 row-parallel (tp)."""

    def __init__(self, cfg: VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        self.w1 = ColumnParallelLinear(hid, inter, bias=True, group=tp_group, dtype=dtype)
        self.w2 = RowParallelLinear(inter, hid, bias=True, group=tp_group, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)  # (N, I/tp)
        return self.w2(quick_gelu(a))  # one fused pass each way on CUDA, only a saved


class GatedMLP(nn.Module):
    """Qwen2.5-VL: ``w2(silu(gate(x)) * up(x))`` with biases; gate/up fused in the
    column-parallel ``w13`` (rank r holds ``[gate_r; up_r]``), w2 row-parallel (tp)."""

    def __init__(self, cfg: VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        self.w13 = ColumnParallelLinear(hid, 2 * inter, bias=True, group=tp_group,
                                        partition_sizes=[inter, inter], dtype=dtype)
        self.w2 = RowParallelLinear(inter, hid, bias=True, group=tp_group, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))  # (N, 2I/tp) -> (N, I/tp) -> (N, hidden)


class VisionBlock(nn.Module):
    """Pre-norm residual block: attention over the given segments, then the MLP."""

    def __init__(self, cfg: VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.attention_norm = _norm(cfg, cfg.hidden_size, dtype)
        self.attention = VisionAttention(cfg, tp_group=tp_group, dtype=dtype)
        self.ffn_norm = _norm(cfg, cfg.hidden_size, dtype)
        mlp = QuickGeluMLP if cfg.arch == "qwen2_vl" else GatedMLP
        self.feed_forward = mlp(cfg, tp_group, dtype=dtype)

    def forward(self, h, cos, sin, segments: Segments):
        dtype = matmul_dtype(h)  # the norms write what the projections compute in
        h = h + self.attention(self.attention_norm(h, dtype), cos, sin, segments)
        return h + self.feed_forward(self.ffn_norm(h, dtype))


class PatchMerger(nn.Module):
    """``[N, hidden] -> [N / m^2, out_hidden]``: norm, each ``m^2`` consecutive rows as one
    ``hidden * m^2`` row, then ``w2(gelu(w1(.)))`` (exact erf GELU; w1 column-, w2
    row-parallel over tp)."""

    def __init__(self, cfg: VisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        self.w1 = ColumnParallelLinear(self.width, self.width, bias=True, group=tp_group,
                                       dtype=dtype)
        self.w2 = RowParallelLinear(self.width, cfg.out_hidden_size, bias=True,
                                    group=tp_group, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h, matmul_dtype(h)).reshape(-1, self.width)  # (N / m^2, hidden * m^2)
        return self.w2(F.gelu(self.w1(x)))


class VisionTower(TowerBase):
    """The vision tower (module docstring). ``state_or_tp_group``: a ``ParallelState`` (its tp
    group is used), a tp ``ProcessGroup``, or None (one process). Build it with
    :func:`build_vision_tower` or load it with ``mpcore.models.qwen2_vl.vision_hf``."""

    def __init__(self, cfg: VisionConfig,
                 state_or_tp_group: ParallelState | ProcessGroup | None = None, *,
                 activation_checkpointing: bool = False, attention_kernel: str = "auto",
                 dtype=None):
        super().__init__(cfg, state_or_tp_group, activation_checkpointing, attention_kernel)
        group = self.tp_group
        self.patch_embed = PatchEmbed(cfg, dtype=dtype)
        self.layers = nn.ModuleList(VisionBlock(cfg, group, dtype=dtype)
                                    for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, group, dtype=dtype)
        for layer in self.layers:
            layer.attention.kernel = attention_kernel

    def plan(self, grid_thw) -> VisionPlan:
        """Host-side plan of ``grid_thw`` (checks it; ``mpcore.models.common.vision_plan``)."""
        return plan_vision(self.cfg, grid_thw)

    def _check_pixels(self, pixel_values: torch.Tensor, plan: VisionPlan) -> None:
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(
                f"pixel_values must be [num_patches, {cfg.patch_dim}] (in_channels "
                f"{cfg.in_channels} * temporal_patch_size {cfg.temporal_patch_size} * "
                f"patch_size {cfg.patch_size}^2), got shape {tuple(pixel_values.shape)}; pass "
                f"the processor's flattened patches")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point, got {pixel_values.dtype}")
        if pixel_values.shape[0] != plan.num_patches:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} rows but grid_thw "
                f"{[list(g) for g in plan.grid]} implies sum(t*h*w) = {plan.num_patches} "
                f"patches; pass the image_grid_thw that came with these pixel_values")

    def forward(self, pixel_values: torch.Tensor, grid_thw,
                plan: VisionPlan | None = None) -> torch.Tensor:
        """Merged image embeddings, one row per language-model placeholder token.

        Args:
            pixel_values: ``[N, patch_dim]`` float, the processor's patches of all images in
                ``grid_thw`` order (cast to the weights' dtype).
            grid_thw: int64 ``[I, 3]`` tensor or nested list of ``(t, h, w)`` in patches; h and
                w divisible by ``spatial_merge_size``. Read on the host (a CPU-GPU sync when it
                lives on the GPU).
            plan: ``self.plan(grid_thw)`` made in advance (e.g. in the data loader), or None.
        Returns ``[N / merge^2, out_hidden_size]`` on pixel_values' device, replicated over
        the tp group, rows in the input's order (image, frame, unit). Every check raises
        ``ValueError`` before any compute.
        """
        plan = self.plan(grid_thw) if plan is None else plan
        self._check_pixels(pixel_values, plan)
        device, cfg = pixel_values.device, self.cfg
        h = self.patch_embed(pixel_values)  # (N, hidden)
        if plan.row_order is not None:
            h = h.index_select(0, copy_to(plan.row_order, device))
        cos, sin = rotary_tables(copy_to(plan.positions, device), cfg.head_dim, cfg.rope_theta)
        frames = Segments(plan.frame_cu, plan.max_frame, device)
        windows = (Segments(plan.window_cu, plan.max_window, device)
                   if plan.window_cu is not None else frames)
        for i, layer in enumerate(self.layers):
            segments = frames if i in cfg.fullatt_block_indexes else windows
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, segments, use_reentrant=False)
            else:
                h = layer(h, cos, sin, segments)
        out = self.merger(h)  # (N / m^2, out_hidden)
        if plan.unit_inverse is not None:
            out = out.index_select(0, copy_to(plan.unit_inverse, device))
        return out


def build_vision_tower(cfg: VisionConfig,
                       state: ParallelState | ProcessGroup | None = None, *,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0, activation_checkpointing: bool = False) -> VisionTower:
    """Create the tower on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``).

    Raises ``ValueError`` when tp does not divide the heads, the MLP width or the merger width.
    """
    with torch.device("meta"):
        tower = VisionTower(cfg, state, activation_checkpointing=activation_checkpointing,
                            dtype=dtype)
    tower.to_empty(device=device)
    init_weights(tower, seed)
    return tower
