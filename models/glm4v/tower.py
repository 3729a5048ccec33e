"""The GLM-4V vision tower on tensor-parallel layers.

Layout, per tp rank (everything replicated over the tp group; no sequence parallelism). Rows
of ``pixel_values [N, patch_dim]`` come as the processor writes them: item by item (``grid_thw``
rows), frame by frame, then merge block by merge block (``m x m`` patches, row-major inside),
blocks row-major over the frame's ``(h / m, w / m)`` grid. Every frame is its own image (a
video of t frames is t images of ``h x w`` patches, as transformers' ``get_video_features``
runs it):

    h = post_conv_norm(patch_embed(pixel_values))       [N, hidden]  Conv3d as one matmul
    h = h + bicubic(pos_embed, frame grid)[rows]        learned S x S grid resampled per frame
    for block: h = h + attn(norm1(h)); h = h + mlp(norm2(h))    attention inside each frame
    h = downsample(post_norm(h))                        [N / m^2, out]  the m x m Conv2d as a matmul
    out = merger(h)                                     proj, LayerNorm, GELU, SwiGLU

The position resampling is transformers': each patch (i, j) of an ``H x W`` frame samples the
``S x S`` grid at normalised ``((j + 0.5) / W * 2 - 1, (i + 0.5) / H * 2 - 1)`` with
``F.grid_sample(mode="bicubic", align_corners=False, padding_mode="border")`` in fp32.

TP: the attention's wqkv and both SwiGLUs' w13 are column-parallel (tp shards the output),
wo and w2 row-parallel (all-reduce); the patch embedding, norms, position grid, downsample and
merger projection are replicated and see replicated inputs, so their gradients are whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpcore.kernels.host_checked import copy_to
from mpcore.kernels.swiglu import swiglu
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.norm import LayerNorm, RMSNorm
from mpcore.models.common.tower import TowerBase
from mpcore.models.common.vision_attention import Segments, VisionAttention, rotary_tables
from mpcore.models.common.vl_split import check_grid
from mpcore.models.glm4v.config import Glm4vVisionConfig
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mpcore.parallel.random import init_shard_, normal_init
from mpcore.parallel.state import ParallelState, ProcessGroup


class Replicated(nn.Module):
    """A weight (and optional bias) replicated over tp, normal(0.02) at init; ``forward`` is
    ``x @ weight.view(out, -1).T + bias`` (a Conv of stride = kernel on flattened patches)."""

    def __init__(self, shape: tuple[int, ...], bias: bool, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], dtype=dtype)) if bias else None

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.weight, tuple(self.weight.shape), lambda full: full, normal_init(0.02),
                    seed)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.reshape(self.weight.shape[0], -1), self.bias)


class SwiGLU(nn.Module):
    """``w2(silu(gate(x)) * up(x))``, no biases; gate/up fused in the column-parallel ``w13``
    (rank r holds ``[gate_r; up_r]``), w2 row-parallel (tp)."""

    def __init__(self, dim: int, inter: int, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.w13 = ColumnParallelLinear(dim, 2 * inter, group=tp_group,
                                        partition_sizes=[inter, inter], dtype=dtype)
        self.w2 = RowParallelLinear(inter, dim, group=tp_group, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))


class VisionBlock(nn.Module):
    """RMSNorm, attention inside each frame, RMSNorm, SwiGLU of width ``out_hidden_size``."""

    def __init__(self, cfg: Glm4vVisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attention = VisionAttention(cfg, tp_group=tp_group, dtype=dtype,
                                         qkv_bias=cfg.attention_bias, out_bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.feed_forward = SwiGLU(cfg.hidden_size, cfg.out_hidden_size, tp_group, dtype)

    def forward(self, h, cos, sin, segments: Segments):
        h = h + self.attention(self.attention_norm(h), cos, sin, segments)
        return h + self.feed_forward(self.ffn_norm(h))


class Merger(nn.Module):
    """``[N / m^2, out] -> [N / m^2, out]``: replicated ``proj``, LayerNorm, exact GELU, then
    the SwiGLU of width ``intermediate_size``."""

    def __init__(self, cfg: Glm4vVisionConfig, tp_group: ProcessGroup | None, dtype=None):
        super().__init__()
        dim = cfg.out_hidden_size
        self.proj = Replicated((dim, dim), bias=False, dtype=dtype)
        self.norm = LayerNorm(dim, 1e-5, dtype=dtype)
        self.mlp = SwiGLU(dim, cfg.intermediate_size, tp_group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(F.gelu(self.norm(self.proj(x))))


def frame_layout(grid: tuple[tuple[int, int, int], ...], m: int):
    """``(positions [N, 2], sizes [N, 2], frame_cu [F+1] int32)`` of items ``grid``: each row's
    (h, w) patch position in processor order (module docstring), its frame's (H, W), and the
    cumulative frame lengths (the attention segments)."""
    positions, sizes, lengths = [], [], []
    for t, h, w in grid:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        # (h, w) -> (h/m, m, w/m, m) -> blocks row-major, patches row-major inside a block
        hw = torch.stack([hh, ww], -1).view(h // m, m, w // m, m, 2).transpose(1, 2)
        positions.append(hw.reshape(-1, 2).repeat(t, 1))
        sizes.append(torch.tensor([h, w]).expand(t * h * w, 2))
        lengths += [h * w] * t
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    if not grid:
        return torch.zeros(0, 2, dtype=torch.int64), torch.ones(0, 2), cu.to(torch.int32)
    return torch.cat(positions), torch.cat(sizes), cu.to(torch.int32)


def resample_positions(weight: torch.Tensor, positions: torch.Tensor,
                       sizes: torch.Tensor) -> torch.Tensor:
    """The learned grid ``weight [S*S, hidden]`` sampled bicubically at each row's patch
    centre: ``positions, sizes [N, 2]`` (h, w) -> ``[N, hidden]`` in weight's dtype (module
    docstring; fp32 inside, as transformers)."""
    side = int(round(weight.shape[0] ** 0.5))
    assert side * side == weight.shape[0], weight.shape  # Glm4vVisionConfig makes it square
    grid = weight.float().view(side, side, -1).permute(2, 0, 1).unsqueeze(0)  # (1, C, S, S)
    sizes = sizes.to(torch.float32)
    norm_h = (positions[:, 0] + 0.5) / sizes[:, 0] * 2 - 1
    norm_w = (positions[:, 1] + 0.5) / sizes[:, 1] * 2 - 1
    where = torch.stack([norm_w, norm_h], dim=-1).view(1, -1, 1, 2)  # grid_sample wants (x, y)
    out = F.grid_sample(grid, where, mode="bicubic", align_corners=False, padding_mode="border")
    return out[0, :, :, 0].t().to(weight.dtype)  # (N, C)


class Glm4vVisionTower(TowerBase):
    """The GLM-4V vision tower (module docstring). ``state_or_tp_group``: a ``ParallelState``
    (its tp group), a tp ``ProcessGroup`` or None. Build it with :func:`build_vision_tower`."""

    def __init__(self, cfg: Glm4vVisionConfig,
                 state_or_tp_group: ParallelState | ProcessGroup | None = None, *,
                 activation_checkpointing: bool = False, attention_kernel: str = "auto",
                 dtype=None):
        super().__init__(cfg, state_or_tp_group, activation_checkpointing, attention_kernel)
        group = self.tp_group
        m = cfg.spatial_merge_size
        self.patch_embed = Replicated((cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size,
                                       cfg.patch_size, cfg.patch_size), bias=True, dtype=dtype)
        self.post_conv_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.pos_embed = nn.Parameter(torch.empty(cfg.grid_side ** 2, cfg.hidden_size,
                                                  dtype=dtype))
        self.layers = nn.ModuleList(VisionBlock(cfg, group, dtype) for _ in range(cfg.depth))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # Conv2d weight layout [out, hidden, m, m]; forward permutes it to the rows' (i, j, c).
        self.downsample = Replicated((cfg.out_hidden_size, cfg.hidden_size, m, m), bias=True,
                                     dtype=dtype)
        self.merger = Merger(cfg, group, dtype)
        for layer in self.layers:
            layer.attention.kernel = attention_kernel

    def reset_parameters(self, seed: int) -> None:
        init_shard_(self.pos_embed, tuple(self.pos_embed.shape), lambda full: full,
                    normal_init(0.02), seed)

    def _check(self, pixel_values: torch.Tensor, grid) -> None:
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must be [num_patches, {cfg.patch_dim}] (in_channels "
                             f"* temporal_patch_size * patch_size^2), got shape "
                             f"{tuple(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point, got {pixel_values.dtype}")
        patches = sum(t * h * w for t, h, w in grid)
        if pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw "
                             f"{[list(g) for g in grid]} implies sum(t*h*w) = {patches}; pass "
                             f"the grid_thw that came with these pixel_values")

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """``pixel_values [N, patch_dim]`` float, ``grid_thw`` int ``[I, 3]`` (tensor or nested
        list, read on the host) -> ``[N / m^2, out_hidden_size]``, one row per language-model
        placeholder, in input order, replicated over tp. Checks raise ``ValueError`` before
        any compute."""
        m = self.cfg.spatial_merge_size
        grid = check_grid(grid_thw, "grid_thw", m)
        self._check(pixel_values, grid)
        device = pixel_values.device
        positions, sizes, frame_cu = frame_layout(grid, m)
        positions, sizes = copy_to(positions, device), copy_to(sizes, device)
        x = pixel_values.to(self.patch_embed.weight.dtype)
        h = self.post_conv_norm(self.patch_embed(x))  # (N, hidden)
        h = h + resample_positions(self.pos_embed, positions, sizes).to(h.dtype)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        frames = Segments(frame_cu, int(frame_cu.diff().max()) if grid else 0, device)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, frames, use_reentrant=False)
            else:
                h = layer(h, cos, sin, frames)
        h = self.post_norm(h)
        # m^2 consecutive rows are one block, (i, j) row-major: as the Conv2d's (i, j, c).
        w = self.downsample.weight.permute(0, 2, 3, 1).reshape(self.cfg.out_hidden_size, -1)
        h = F.linear(h.reshape(-1, m * m * h.shape[-1]), w, self.downsample.bias)
        return self.merger(h)


def build_vision_tower(cfg: Glm4vVisionConfig,
                       state: ParallelState | ProcessGroup | None = None, *,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> Glm4vVisionTower:
    """Create the tower on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``)."""
    with torch.device("meta"):
        tower = Glm4vVisionTower(cfg, state, dtype=dtype)
    tower.to_empty(device=device)
    init_weights(tower, seed)
    return tower
