"""Qwen3-VL: a vision tower feeding an interleaved M-RoPE Qwen3 decoder, with DeepStack.

Layout, per rank: the L local tokens of this cp rank's share of one packed stream, the per-token
tensors made on the GLOBAL stream by ``models.qwen3_vl.inputs`` and split together by one
``ContextPlan``: ``input_ids [L]``, ``position_ids [3, L]``, ``labels [L]``, ``vision_rows
[L]`` (tower row of each placeholder, -1 for text). The vision input is the whole micro-batch's
on every cp rank: ``pixel_values [N, patch_dim]``, ``grid_thw [I, 3]`` (images, then videos).

    h = text.tok_embeddings(input_ids)                 # (L or L/tp under SP, hidden)
    rows = visual.rows(pixel_values, grid_thw)         # [R, (1 + K) * hidden], over cp
    main, deep_0 .. deep_K-1 = rows[vision_rows[slots]].split(hidden)
    h[slots] = main                                    # slots: this rank's placeholders
    out = text.decode(h, ..., after_layer)             # after layer k < K: out[slots] += deep_k

The merged rows and the DeepStack features travel as one tensor through
``models.common.vision_cp.vision_rows_for_rank``, so they share its guarantees: each cp rank gets
exactly the rows of the placeholders it owns, the gradient of every row is summed over the cp
ranks that used it (the all-gather's backward) and, under sequence parallelism, over the tp
ranks (each adds the rows of its own token slice at ``slots``; the tower is replicated over tp,
so ``copy_to_tp`` sums the row gradients there). A rank without a visual token runs the tower
on a dummy window times zero, adds nothing, and joins every collective.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.decoder import Transformer, init_weights, make_packing
from models.common.vision_cp import MODES, vision_rows_for_rank
from models.common.vl_split import check_grid
from models.qwen2_vl.model import VLModel
from models.qwen3_vl.config import Qwen3VLConfig
from models.qwen3_vl.vision import Qwen3VisionTower
from parallel.state import ParallelState


class Qwen3VLModel(nn.Module):
    """The model (module docstring). Build it with :func:`build_model`. ``vision_cp``: split
    (default) or replicate the tower's work over cp; ``vision_attention``: the tower's CUDA
    attention kernel; ``decoder_options``: further ``Transformer`` keyword arguments."""

    def __init__(self, cfg: Qwen3VLConfig, state: ParallelState, *,
                 sequence_parallel: bool = False, cp_mode: str = "none",
                 activation_checkpointing: bool = False, vision_cp: str = "split",
                 vision_attention: str = "auto", dtype=None, **decoder_options):
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
        self.visual = Qwen3VisionTower(cfg.vision, state,
                                       activation_checkpointing=activation_checkpointing,
                                       attention_kernel=vision_attention, dtype=dtype)

    @property
    def sequence_parallel(self) -> bool:
        return self.text.sequence_parallel

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one: decoder layers, vision blocks, then the tower
        (patch and position embeddings, merger and DeepStack mergers)."""
        return [*self.text.layers, *self.visual.layers, self.visual]

    # The same checks as Qwen2-VL's (they read only cfg.vision's merge size and patch width
    # and cfg.placeholder_ids, which this config has too).
    _check_vision = VLModel._check_vision

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                doc_id: torch.Tensor | None = None,
                positions_in_doc: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output: str = "loss", temperature: float = 1.0,
                pixel_values: torch.Tensor | None = None, grid_thw=None,
                vision_rows: torch.Tensor | None = None):
        """Per-token outputs of the L local tokens, as ``models.vl.VLModel.forward`` (same
        arguments; outputs of ``Transformer.forward``). Collective over the tp and cp groups:
        every rank calls it, also with no visual token."""
        merge = self.cfg.vision.spatial_merge_size
        grids = check_grid(grid_thw, "grid_thw", merge)
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
            self.visual.rows, pixel_values, grids, vision_rows.index_select(0, slots),
            merge=merge, mode=self.vision_cp, cp_group=self.cp_group,
            sum_grad_group=self.tp_group if self.sequence_parallel else None)
        main, *deep = rows.split(self.cfg.text.hidden_size, dim=1)  # (n, hidden) each
        h = h.index_copy(0, slots, main.to(h.dtype)) + zero.to(h.dtype)

        def deepstack(i: int, out: torch.Tensor) -> torch.Tensor:
            # DeepStack: feature i joins the visual positions after decoder layer i.
            return out.index_add(0, slots, deep[i].to(out.dtype)) if i < len(deep) else out

        return self.text.decode(h, position_ids, packing, labels, output, temperature,
                                after_layer=deepstack)


def build_model(cfg: Qwen3VLConfig, state: ParallelState, *, sequence_parallel: bool = False,
                cp_mode: str = "none", activation_checkpointing: bool = False,
                vision_cp: str = "split", device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                **decoder_options) -> Qwen3VLModel:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``)."""
    with torch.device("meta"):
        model = Qwen3VLModel(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                             activation_checkpointing=activation_checkpointing,
                             vision_cp=vision_cp, dtype=dtype, **decoder_options)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def num_params(cfg: Qwen3VLConfig) -> dict[str, int]:
    """Logical parameter counts: ``total`` (a tied matrix once), ``embedding``, ``head``
    (the embedding when tied) and ``vision`` (tower with its mergers, included in total)."""
    with torch.device("meta"):
        model = Qwen3VLModel(cfg, ParallelState())  # a world of one: logical shapes
    vision = sum(p.numel() for p in model.visual.parameters())
    embedding = model.text.tok_embeddings.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    head = embedding if cfg.text.tie_embeddings else model.text.output.weight.numel()
    return {"total": total, "embedding": embedding, "head": head, "vision": vision}


def flops_per_token(cfg: Qwen3VLConfig, seq_len: int) -> float:
    """Training FLOPs per token of the decoder (``mpcore.metrics``' convention: 6 per weight
    that multiplies activations, the head included, the input lookup not; plus ``12 * layers *
    heads * head_dim * seq`` of attention). The tower's and DeepStack's work depends on each
    batch's share of visual tokens and is left out (TFLOP/s and MFU are lower bounds)."""
    counts = num_params(cfg)
    dense = counts["total"] - counts["vision"]
    if not cfg.text.tie_embeddings:
        dense -= counts["embedding"]
    return 6.0 * dense + 12.0 * cfg.text.num_layers * cfg.text.q_size * seq_len
