"""A vision tower feeding the shared M-RoPE decoder: every vision-language family's model.

Layout, per rank: the L local tokens of this cp rank's share of one packed stream, with the
per-token tensors made on the GLOBAL stream by the family's inputs and split together by one
``ContextPlan`` (``mpcore.models.common.vl_split``): ``input_ids [L]``, ``position_ids [3, L]``,
``labels [L]``, ``vision_rows [L]`` (tower output row of each placeholder, -1 for text). The
micro-batch's vision input is the same on every cp rank: ``pixel_values [N, patch_dim]`` and
``grid_thw [I, 3]`` (images then videos, the rows of ``pixel_values`` in that order).

    h = text.tok_embeddings(input_ids)                 # (L or L/tp under SP, hidden)
    rows = visual.rows(pixel_values, grid_thw)         # [R, (1 + K) * hidden], over cp
    main, deep_0 .. deep_K-1 = rows.split(hidden)      # K = 0 without DeepStack
    h[slots] = main[vision_rows[slots]]                # slots: this rank's placeholders
    out = text.decode(h, ..., after_layer)             # after layer k < K: out[slots] += deep_k

The rows (and DeepStack features) travel through ``mpcore.models.common.vision_cp.vision_rows_for_rank``:
each cp rank gets exactly the rows of the placeholders it owns, the gradient of every row is
summed over the cp ranks that used it and, under sequence parallelism, over the tp ranks (each
fills the placeholders of its own token slice; the tower is replicated over tp). A rank without
a visual token runs the tower on a dummy window times zero and joins every collective. A family
gives its tower class and, where its decoder differs, its block class or its decoder class.
"""

from __future__ import annotations

import torch
from torch import nn

from mpcore.kernels import host_checked
from mpcore.models.common.decoder import Transformer, make_packing
from mpcore.models.common.vision_cp import MODES, vision_rows_for_rank
from mpcore.models.common.vl_split import check_grid
from mpcore.parallel.state import ParallelState


class VisionLanguageModel(nn.Module):
    """The model (module docstring); a family subclasses it naming ``tower_cls`` (and
    ``decoder_layer``). ``vision_cp``: split (default) or replicate the tower's work over cp;
    ``vision_attention``: the tower's attention kernel on CUDA
    (``mpcore.models.common.vision_attention``); ``decoder_options``: further ``Transformer``
    keyword arguments (kernel choices)."""

    tower_cls: type[nn.Module]
    """The family's tower: ``(vision_cfg, state, *, activation_checkpointing, attention_kernel,
    dtype)``; ``layers`` (its blocks) and ``forward(pixel_values, grid_thw)`` -> rows, or
    ``rows(...)`` -> ``[R, (1 + K) * hidden]`` with K DeepStack features beside each row."""
    decoder_layer: type[nn.Module] | None = None
    """The family's decoder block class (None: ``DecoderLayer``)."""
    decoder_cls: type[Transformer] = Transformer
    """The family's decoder: ``Transformer`` or a subclass that chooses its own blocks (then
    ``decoder_layer`` stays None)."""
    auto_vision_attention: str = "cudnn"
    """The tower's attention kernel on CUDA under ``vision_attention="auto"``: cuDNN (one dense
    call per distinct segment length) unless the family's measured step says flash (one varlen
    call per block), ``mpcore.models.common.vision_attention.segment_attention``."""

    def __init__(self, cfg, state: ParallelState, *, sequence_parallel: bool = False,
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
        if self.decoder_layer is not None:
            decoder_options["layer"] = self.decoder_layer
        self.text = self.decoder_cls(cfg.text, state, sequence_parallel=sequence_parallel,
                                     cp_mode=cp_mode,
                                     activation_checkpointing=activation_checkpointing,
                                     dtype=dtype, **decoder_options)
        # A pipeline stage (``keep_layers``) holds the tower only when it is the first.
        keep = decoder_options.get("keep_layers")
        self.visual = self.tower_cls(cfg.vision, state,
                                     activation_checkpointing=activation_checkpointing,
                                     attention_kernel=self.vision_kernel(vision_attention),
                                     dtype=dtype) if keep is None or keep.start == 0 else None

    @classmethod
    def vision_kernel(cls, vision_attention: str) -> str:
        """The tower's attention kernel that ``vision_attention`` names for this family
        (``auto``: ``auto_vision_attention``)."""
        return cls.auto_vision_attention if vision_attention == "auto" else vision_attention

    @property
    def sequence_parallel(self) -> bool:
        return self.text.sequence_parallel

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one: decoder layers, vision blocks, then the tower
        (its embeddings and mergers), so a frozen tower is its own all-frozen units."""
        if self.visual is None:  # a later pipeline stage
            return list(self.text.layers)
        return [*self.text.layers, *self.visual.layers, self.visual]

    def _check_vision(self, input_ids, vision_rows, pixel_values, grids
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(vision_rows, host_rows)``: ``vision_rows`` as int64 (all -1 when None) and its
        values on the host when they are known there without a device sync (None otherwise);
        raises ``ValueError`` before any compute when it disagrees with the placeholders or
        the vision input.

        The token checks read the host copies that ``mpcore.batches.to_device`` keeps of
        ``input_ids`` and ``vision_rows`` (``mpcore.kernels.host_checked``): no CPU-GPU sync, so the
        host can queue this step while the device still runs the previous one. Tensors made
        on the device are checked there, with one sync."""
        num = input_ids.shape[0]
        host_ids = host_checked.host_copy(input_ids)
        host_rows = None if vision_rows is None else host_checked.host_copy(vision_rows)
        if vision_rows is None:
            vision_rows = torch.full((num,), -1, dtype=torch.int64, device=input_ids.device)
            host_rows = torch.full((num,), -1, dtype=torch.int64)
        if tuple(vision_rows.shape) != (num,) or vision_rows.dtype != torch.int64:
            raise ValueError(f"vision_rows must be int64 [{num}] (one entry per local token), "
                             f"got {vision_rows.dtype} {tuple(vision_rows.shape)}; make it with "
                             f"the family's inputs and split it with the ids")
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
        on_host = host_ids is not None and host_rows is not None
        ids, rows = (host_ids, host_rows) if on_host else (input_ids, vision_rows)
        placeholder = torch.isin(ids, torch.tensor(self.cfg.placeholder_ids, device=ids.device))
        # A placeholder without a row (or a text token with one) would silently embed the
        # wrong thing. On the device: one CPU-GPU sync.
        bad, top = torch.stack([(placeholder != (rows >= 0)).sum(),
                                rows.max() if num else rows.new_zeros(())]).tolist()
        if bad:
            raise ValueError(f"{bad} local tokens disagree between input_ids (image/video "
                             f"placeholder ids) and vision_rows (>= 0); split vision_rows with "
                             f"the same plan as input_ids")
        if top >= patches // merge ** 2:
            raise ValueError(f"vision_rows refers to row {top} but the vision input has "
                             f"{patches // merge ** 2} merged rows; pass the micro-batch's "
                             f"whole pixel_values and grid_thw on every cp rank")
        return vision_rows, host_rows if on_host else None

    def embed_streams(self, streams: list[tuple[torch.Tensor, torch.Tensor | None]],
                      pixel_values, grids: list[tuple[int, int, int]]):
        """Embed each ``(input_ids [L], vision_rows [L] or None)`` of ``streams`` with the
        tower's rows merged at its placeholders, the rows of every stream from ONE tower call
        (``vision_rows_for_rank``: rows shared by several streams get their gradients summed).
        Returns ``(h per stream [L(/tp), hidden], slots per stream, deep)``: ``slots`` the local
        placeholder positions, ``deep`` the DeepStack rows of the FIRST stream's slots."""
        embedded, slots, needed = [], [], []
        for ids, rows in streams:
            rows, host_rows = self._check_vision(ids, rows, pixel_values, grids)
            h = self.text.tok_embeddings(ids)  # (L or L/tp, hidden)
            if self.sequence_parallel:  # this tp rank's token slice, as the reduce-scatter left it
                rows = rows.chunk(self.tp)[self.tp_rank]
                host_rows = None if host_rows is None else host_rows.chunk(self.tp)[self.tp_rank]
            # Local positions of placeholders. Their count is data: found on the host when the
            # rows are known there, else by the device's nonzero (a CPU-GPU sync).
            if host_rows is not None:
                where = host_checked.copy_to((host_rows >= 0).nonzero().view(-1), rows.device)
            else:
                where = (rows >= 0).nonzero().view(-1)
            embedded.append(h)
            slots.append(where)
            needed.append(rows.index_select(0, where))
        if pixel_values is None:
            pixel_values = embedded[0].new_zeros(0, self.cfg.vision.patch_dim)
        tower = getattr(self.visual, "rows", self.visual)  # rows with DeepStack features beside
        rows, zero = vision_rows_for_rank(
            tower, pixel_values, grids, torch.cat(needed),
            merge=self.cfg.vision.spatial_merge_size,
            mode=self.vision_cp, cp_group=self.cp_group,
            sum_grad_group=self.tp_group if self.sequence_parallel else None)
        out, deep = [], None
        for h, where, part in zip(embedded, slots, rows.split([n.numel() for n in needed]),
                                  strict=True):
            main, *features = part.split(self.cfg.text.hidden_size, dim=1)  # (n, hidden) each
            deep = features if deep is None else deep
            out.append(h.index_copy(0, where, main.to(h.dtype)) + zero.to(h.dtype))
        return out, slots, deep

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
        h, packing, deepstack, _ = self.embed(
            input_ids, position_ids, doc_id=doc_id, positions_in_doc=positions_in_doc,
            cu_seqlens=cu_seqlens, labels=labels, output=output, pixel_values=pixel_values,
            grid_thw=grid_thw, vision_rows=vision_rows)
        return self.text.decode(h, position_ids, packing, labels, output, temperature,
                                after_layer=deepstack)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
              doc_id: torch.Tensor | None = None,
              positions_in_doc: torch.Tensor | None = None,
              cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
              output: str = "loss", pixel_values: torch.Tensor | None = None, grid_thw=None,
              vision_rows: torch.Tensor | None = None):
        """``(h, packing, after_layer, deep_layers)``: the inputs checked, the embedded tokens
        ``h [L(/tp), hidden]`` with the tower's rows at the visual positions, the attention
        metadata, the DeepStack hook for ``Transformer.decode`` (None without DeepStack) and
        the number of layers it adds to (a pipeline's first stage must hold them)."""
        grids = check_grid(grid_thw, "grid_thw", self.cfg.vision.spatial_merge_size)
        packing = make_packing(input_ids.shape[0], doc_id, positions_in_doc, cu_seqlens)
        self.text.check_inputs(input_ids, position_ids, packing, labels, output)
        (h,), (slots,), deep = self.embed_streams([(input_ids, vision_rows)], pixel_values,
                                                   grids)

        def deepstack(i: int, out: torch.Tensor) -> torch.Tensor:
            # DeepStack: feature i joins the visual positions after decoder layer i.
            return out.index_add(0, slots, deep[i].to(out.dtype)) if i < len(deep) else out

        return h, packing, deepstack if deep else None, len(deep)
