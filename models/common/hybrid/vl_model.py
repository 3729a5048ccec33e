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

Multi-token prediction (``mpcore.models.common.hybrid.mtp``, when ``cfg.text.uses_mtp``): the
MTP block at position t reads the embedding of token t+1 AS THE DECODER EMBEDS IT, the tower's
row merged in when token t+1 is a placeholder (vLLM's ``Qwen3_5MTP.embed_input_ids``), at the
decoder's M-RoPE positions; ``mtp_input_ids``, ``mtp_vision_rows`` and ``mtp_labels`` (t+2,
placeholders ignored) are shifted on the GLOBAL stream (``qwen3_vl.inputs.mtp_targets``) and
split with the rest; both streams' rows come from one tower call.
"""

from __future__ import annotations

import torch

from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.decoder import init_weights, make_packing
from mpcore.models.common.hybrid.kernels import check_available
from mpcore.models.common.hybrid.model import Qwen35Transformer
from mpcore.models.common.hybrid.mtp import MtpOutput, check_mtp_inputs, decode_with_mtp
from mpcore.models.common.hybrid.vl_config import Qwen35VLConfig
from mpcore.models.common.qwen3_vl.vision import Qwen3VisionTower
from mpcore.models.common.vl_model import VisionLanguageModel
from mpcore.models.common.vl_split import check_grid
from mpcore.parallel.state import ParallelState


class Qwen35VLModel(VisionLanguageModel):
    """The model (module docstring); ``decoder_options`` may name ``gdn_kernel``
    (``mpcore.models.common.hybrid.kernels``). Build it with :func:`build_model`."""

    tower_cls = Qwen3VisionTower
    decoder_cls = Qwen35Transformer
    # Qwen3.5-0.8B's step is host-bound (its GPU work is small): one flash call per block
    # beats cuDNN's call per image size. On one H200 at 7083ec0 (bench_vl --family qwen3_5_vl,
    # 5 images of 5 sizes per step): 275.0 ms with flash, 307.6 ms with cuDNN. Where the GPU
    # bounds the step instead (a larger model), cuDNN was 2% faster (Qwen2-VL-2B): the cheaper
    # side of the bet.
    auto_vision_attention = "flash"

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                mtp_input_ids: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None,
                mtp_vision_rows: torch.Tensor | None = None, **kwargs):
        """``VisionLanguageModel.forward``; with the MTP inputs (``mtp_input_ids``,
        ``mtp_labels``, ``mtp_vision_rows [L]``: ``qwen3_vl.inputs.mtp_targets`` before the
        split) also the MTP head's output: ``MtpOutput(main, mtp)`` (module docstring)."""
        if mtp_input_ids is None:
            if mtp_labels is not None or mtp_vision_rows is not None:
                raise ValueError("mtp_labels / mtp_vision_rows given without mtp_input_ids; "
                                 "pass all three (the family's local_inputs makes them)")
            return super().forward(input_ids, position_ids, **kwargs)
        return self._forward_with_mtp(input_ids, position_ids, mtp_input_ids, mtp_labels,
                                      mtp_vision_rows, **kwargs)

    def _forward_with_mtp(self, input_ids, position_ids, mtp_input_ids, mtp_labels,
                          mtp_vision_rows, *, doc_id=None, positions_in_doc=None,
                          cu_seqlens=None, labels=None, output: str = "loss",
                          temperature: float = 1.0, pixel_values=None, grid_thw=None,
                          vision_rows=None) -> MtpOutput:
        num = input_ids.shape[0]
        check_mtp_inputs(self.text, num, output, mtp_input_ids=mtp_input_ids,
                         mtp_labels=mtp_labels, mtp_vision_rows=mtp_vision_rows)
        grids = check_grid(grid_thw, "grid_thw", self.cfg.vision.spatial_merge_size)
        packing = make_packing(num, doc_id, positions_in_doc, cu_seqlens)
        self.text.check_inputs(input_ids, position_ids, packing, labels, output)
        # One tower call gives the rows of both streams (token t and token t+1 at position t).
        streams = [(input_ids, vision_rows), (mtp_input_ids, mtp_vision_rows)]
        (h, h_next), _, _ = self.embed_streams(streams, pixel_values, grids)
        return decode_with_mtp(
            self.text, lambda: self.text.decode(h, position_ids, packing, labels, output,
                                                temperature),
            lambda: h_next, position_ids, packing, mtp_labels, output, temperature)


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
