"""Vision-language model (Qwen2-VL / Qwen2.5-VL): a vision tower feeding an M-RoPE decoder.

Layout, per rank: the L local tokens of this cp rank's share of one packed stream, with the
per-token tensors made on the GLOBAL stream by ``models.qwen2_vl.inputs.vl_inputs`` and split together
by one ``ContextPlan``: ``input_ids [L]``, ``position_ids [3, L]``, ``labels [L]``,
``vision_rows [L]`` (tower output row of each placeholder, -1 for text). The micro-batch's vision
input is the same on every cp rank: ``pixel_values [N, patch_dim]`` and ``grid_thw [I, 3]``
(images then videos, the rows of ``pixel_values`` in that order).

    h = text.tok_embeddings(input_ids)                # (L or L/tp under SP, hidden)
    rows = visual(pixel_values, grid_thw)             # work spread over cp (models.common.vision_cp)
    h[placeholders] = rows[vision_rows[placeholders]] # this rank's placeholders only
    out = text.decode(h, position_ids, ...)           # loss | logprobs + entropy | logits

Under sequence parallelism the embedding is reduce-scattered first, so each tp rank fills the
placeholders of its own token slice; the rows' gradient is then summed over tp before it
reaches the tower (which is replicated over tp). Outputs are those of ``Transformer.forward``.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.decoder import Transformer, init_weights, make_packing
from models.common.vision_cp import MODES, vision_rows_for_rank
from models.common.vl_split import check_grid
from models.qwen2_vl.config import VLConfig
from models.qwen2_vl.tower import VisionTower
from parallel.state import ParallelState


class VLModel(nn.Module):
    """The vision-language model (module docstring). Build it with :func:`build_vl_model`.
    ``vision_attention``: the tower's attention kernel on CUDA (``models.common.vision_attention``);
    ``decoder_options``: further ``Transformer`` keyword arguments (kernel choices)."""

    def __init__(self, cfg: VLConfig, state: ParallelState, *, sequence_parallel: bool = False,
                 cp_mode: str = "none", activation_checkpointing: bool = False,
                 vision_cp: str = "split", vision_attention: str = "auto", dtype=None,
                 **decoder_options):
        super().__init__()
        cfg.check_parallel(state.tp, state.cp, cp_mode)
        if vision_cp not in MODES:
            raise ValueError(f"vision_cp must be one of {MODES}, got {vision_cp!r}")
        self.cfg, self.vision_cp = cfg, vision_cp
        self.tp, self.tp_rank, self.tp_group = state.tp, state.tp_rank, state.tp_group
        self.cp_group = state.cp_group
        self.text = Transformer(cfg.text, state, sequence_parallel=sequence_parallel,
                                cp_mode=cp_mode, activation_checkpointing=activation_checkpointing,
                                dtype=dtype, **decoder_options)
        self.visual = VisionTower(cfg.vision, state,
                                  activation_checkpointing=activation_checkpointing,
                                  attention_kernel=vision_attention, dtype=dtype)

    @property
    def sequence_parallel(self) -> bool:
        return self.text.sequence_parallel

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one: decoder layers, vision blocks, then the tower
        (its patch embedding and merger), so a frozen tower is its own all-frozen units."""
        return [*self.text.layers, *self.visual.layers, self.visual]

    def _check_vision(self, input_ids, vision_rows, pixel_values, grids) -> torch.Tensor:
        """``vision_rows`` as int64 (all -1 when None); raises ``ValueError`` before any compute
        when it disagrees with the placeholders or the vision input."""
        num = input_ids.shape[0]
        if vision_rows is None:
            vision_rows = torch.full((num,), -1, dtype=torch.int64, device=input_ids.device)
        if tuple(vision_rows.shape) != (num,) or vision_rows.dtype != torch.int64:
            raise ValueError(f"vision_rows must be int64 [{num}] (one entry per local token), "
                             f"got {vision_rows.dtype} {tuple(vision_rows.shape)}; make it with "
                             f"models.qwen2_vl.inputs.vl_inputs and split it with the ids")
        merge = self.cfg.vision.spatial_merge_size
        patches = sum(t * h * w for t, h, w in grids)
        width = self.cfg.vision.patch_dim
        if pixel_values is not None and (pixel_values.dim() != 2 or pixel_values.shape[1] != width
                                         or pixel_values.shape[0] != patches):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)} but grid_thw "
                             f"implies [{patches}, {width}] (rows: sum of t*h*w; width: "
                             f"in_channels * temporal_patch_size * patch_size^2)")
        if pixel_values is None and grids:
            raise ValueError("grid_thw is given without pixel_values; pass both or neither")
        placeholder = torch.isin(input_ids, torch.tensor(self.cfg.placeholder_ids,
                                                         device=input_ids.device))
        # One CPU-GPU sync: a placeholder without a row (or a text token with one) would
        # silently embed the wrong thing.
        bad, top = torch.stack([(placeholder != (vision_rows >= 0)).sum(),
                                vision_rows.max() if num else vision_rows.new_zeros(())]).tolist()
        if bad:
            raise ValueError(f"{bad} local tokens disagree between input_ids (image/video "
                             f"placeholder ids) and vision_rows (>= 0); split vision_rows with "
                             f"the same plan as input_ids")
        if top >= patches // merge ** 2:
            raise ValueError(f"vision_rows refers to row {top} but the vision input has "
                             f"{patches // merge ** 2} merged rows; pass the micro-batch's "
                             f"whole pixel_values and grid_thw on every cp rank")
        return vision_rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                doc_id: torch.Tensor | None = None,
                positions_in_doc: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output: str = "loss", temperature: float = 1.0,
                pixel_values: torch.Tensor | None = None, grid_thw=None,
                vision_rows: torch.Tensor | None = None):
        """Per-token outputs of the L local tokens; arguments as ``Transformer.forward`` plus
        ``pixel_values [N, patch_dim]``, ``grid_thw [I, 3]`` (the whole micro-batch, the same on
        every cp rank) and ``vision_rows [L]`` (module docstring). Collective over the tp and
        cp groups: every rank calls it, also with no image."""
        grids = check_grid(grid_thw, "grid_thw", self.cfg.vision.spatial_merge_size)
        packing = make_packing(input_ids.shape[0], doc_id, positions_in_doc, cu_seqlens)
        self.text.check_inputs(input_ids, position_ids, packing, labels, output)
        vision_rows = self._check_vision(input_ids, vision_rows, pixel_values, grids)
        h = self.text.tok_embeddings(input_ids)  # (L or L/tp, hidden)
        if self.sequence_parallel:  # this tp rank's token slice, as the reduce-scatter left it
            vision_rows = vision_rows.chunk(self.tp)[self.tp_rank]
        # Local positions of placeholders; nonzero is a CPU-GPU sync (its size is data).
        slots = (vision_rows >= 0).nonzero().view(-1)
        if pixel_values is None:
            pixel_values = h.new_zeros(0, self.cfg.vision.patch_dim)
        rows, zero = vision_rows_for_rank(
            self.visual, pixel_values, grids, vision_rows.index_select(0, slots),
            merge=self.cfg.vision.spatial_merge_size,
            mode=self.vision_cp, cp_group=self.cp_group,
            sum_grad_group=self.tp_group if self.sequence_parallel else None)
        h = h.index_copy(0, slots, rows.to(h.dtype)) + zero.to(h.dtype)
        return self.text.decode(h, position_ids, packing, labels, output, temperature)


def build_vl_model(cfg: VLConfig, state: ParallelState, *, sequence_parallel: bool = False,
                   cp_mode: str = "none", activation_checkpointing: bool = False,
                   vision_cp: str = "split", device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0,
                   **decoder_options) -> VLModel:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``).
    ``decoder_options``: further keyword arguments of ``Transformer`` (kernel choices)."""
    with torch.device("meta"):
        model = VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                        activation_checkpointing=activation_checkpointing, vision_cp=vision_cp,
                        dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
