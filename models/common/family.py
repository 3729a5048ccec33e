"""What a model family declares: one ``Family`` record per folder under ``models/``.

Nothing outside ``models/`` asks which family it has; it asks the family's record (found by
``mpcore.models.registry``) for what differs: how the config is read (a HF ``config.json``, a checkpoint's
``meta.json``, our YAML model section), how the model is built on meta and materialised per
shard, loaded and exported, which HF pieces each tp rank holds, how a GLOBAL packed stream becomes
this rank's inputs, which modules FSDP2 shards (the model's ``fsdp_units()``), its parameter and
FLOP counts, and what data it trains on.

Signatures (``cfg`` is the family's own frozen config dataclass, ``config_type``):
    config_from_hf(hf: dict) -> cfg                 a config.json (both transformers forms)
    hf_config_dict(cfg) -> dict                     the config.json we write (transformers 5.x)
    config_from_dict(d: dict) -> cfg                ``dataclasses.asdict(cfg)`` back (meta.json)
    config_from_section(section, token_ids) -> cfg  our YAML ``model`` section (an instance of
                                                    ``section``); ``token_ids``: the data
                                                    tokenizer's special ids, or None
    build(cfg, state, *, seed, device, dtype, **options) -> model   fresh, same function at any tp
    load_hf(folder, state, *, device, dtype, **options) -> (model, cfg)
    export_hf(model, state, out_dir, progress=None)   collective over the world
    shard_map(cfg, tp, rank) -> {our name: [Piece]}   the logical (HF) form of every parameter
    local_inputs(state, input_ids, cu_seqlens, cfg, *, loss_mask, sequence_parallel, layout,
                 pixel_values, image_grid_thw) -> (ContextPlan, forward kwargs)
    num_params(cfg) -> {"total", "embedding", "head", ...};  flops_per_token(cfg, seq_len)
    decoder(model) -> the ``Transformer`` inside (TE linears, FP8 regions)
    vision(model) -> the vision tower, or None (``model.freeze_vision``)
    placeholder_ids(cfg) -> ids whose rows come from a tower (never targets; () for text)
    check_experts(cfg, ep)                          ``ValueError`` naming the fix when the
                                                    model's experts cannot split over ``ep``
                                                    ranks (a dense family: any ep > 1)
``hf_architectures`` / ``hf_model_types`` are the config.json names it reads; ``options`` names
the build keyword arguments beyond the decoder's (``vision_cp``) that our YAML model section
provides; ``modality`` is ``"text"`` or ``"image-text"``: which loaders feed it; ``host_inputs``
names forward arguments that stay on the host (planning metadata such as a tower's grids);
``section`` the family's YAML model keys, a frozen dataclass (``mpcore.models.common.section``: the
shared ``DecoderSection``, or a subclass adding the family's nested sections, ``vision``,
``moe``; ``section_extras`` names those); a key of another family is refused, not ignored;
mpcore adds the run-level keys beside them; ``image_processing`` (an image-text family's
:class:`ImageProcessing`) what its transformers image processor does with an image, which the
prepared data (``launch/prepare_vl_data.py``) and score.py's ``images`` form follow;
``image_size_rule`` / ``hf_image_processor`` read from it; its ``video`` (a
:class:`VideoProcessing`) what the family's video processor does with a video's frames.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpcore.models.common.hf_check import check_tensor_names, reported_while
from mpcore.models.common.section import DecoderSection

MODALITIES = ("text", "image-text")


@dataclass(frozen=True)
class ImageProcessing:
    """An image-text family's image processor, as transformers builds it by default: its class
    (``hf_class``), patch geometry, pixel bounds (``size = {"shortest_edge": min_pixels,
    "longest_edge": max_pixels}``), normalisation, and its resize rule (``size_rule``:
    ``(height, width, *, patch_size, merge_size, temporal_patch_size, min_pixels, max_pixels)
    -> (height, width)``; None: Qwen2-VL's ``smart_resize`` of ``mpcore.models.common.resize``).
    Patching (rows in merge-window order, the frame repeated ``temporal_patch_size`` times) is
    the same for every family here."""

    hf_class: str
    patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    temporal_patch_size: int = 2
    merge_size: int = 2
    size_rule: Callable[..., tuple[int, int]] | None = None
    video: VideoProcessing | None = None
    """The family's video processor (None: the family takes no videos from prepared data)."""


@dataclass(frozen=True)
class VideoProcessing:
    """An image-text family's transformers video processor, for a video given as its frames
    (``mpcore.data.videos``): its class (``hf_class``), pixel bounds of a frame (the
    processor's ``size``), normalisation, resize rule (``size_rule``: ``(num_frames, height,
    width, *, patch_size, merge_size, temporal_patch_size, min_pixels, max_pixels) ->
    (height, width)``; None: Qwen2-VL's ``smart_resize`` of one frame) and the video's place in
    the text (``layout``: ``(grid_thw, merge_size, frame_times, token_ids) -> [id or text,
    ...]``, what the family's transformers processor writes for it; ``frame_times``: seconds of
    each frame, padded to ``t * temporal_patch_size``; ``token_ids``: the data tokenizer's
    ``*_token_id`` ids). ``extra_ids``: ids after the tokenizer's that the layout writes
    (GLM-4V's video start / end, for a tokenizer made from scratch only). ``wrap``: the
    ``*_token_id`` names of the two tokens a release's chat template writes around its one
    video placeholder (Qwen: vision start / end; GLM-4V: its video begin / end), which the
    layout replaces together with the placeholder. The patch geometry is the image
    processor's."""

    hf_class: str
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    layout: Callable[..., list]
    size_rule: Callable[..., tuple[int, int]] | None = None
    extra_ids: int = 0
    wrap: tuple[str, str] = ("vision_start_token_id", "vision_end_token_id")


def _no_placeholders(cfg) -> tuple[int, ...]:
    del cfg
    return ()


def _no_vision(model):
    del model
    return None


def _no_experts(cfg, ep: int) -> None:
    """A dense family's ``check_experts``: expert parallelism has nothing to split."""
    del cfg
    if ep > 1:
        raise ValueError(f"ep={ep} but this model has no experts (a dense family); set ep to "
                         f"1, or train a family with MoE layers")


@dataclass(frozen=True)
class Family:
    """One model family's entry in ``mpcore.models.registry`` (module docstring)."""

    name: str
    config_type: type
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], Any]
    hf_config_dict: Callable[[Any], dict]
    config_from_dict: Callable[[dict], Any]
    config_from_section: Callable[[Any, dict | None], Any]
    build: Callable[..., Any]
    load_hf: Callable[..., tuple[Any, Any]]
    export_hf: Callable[..., None]
    shard_map: Callable[[Any, int, int], dict]
    local_inputs: Callable[..., tuple[Any, dict]]
    num_params: Callable[[Any], dict[str, int]]
    flops_per_token: Callable[[Any, int], float]
    decoder: Callable[[Any], Any]
    vision: Callable[[Any], Any] = _no_vision
    placeholder_ids: Callable[[Any], tuple[int, ...]] = _no_placeholders
    check_experts: Callable[[Any, int], None] = _no_experts
    modality: str = "text"
    options: tuple[str, ...] = ()
    host_inputs: tuple[str, ...] = ()
    section: type = DecoderSection
    image_processing: ImageProcessing | None = None
    pipeline_stages: Callable[..., list] | None = None
    """``mpcore.models.common.stage.build_stages`` (or the family's own of that signature) when
    the family can be cut into pipeline stages; None: pp = 1 only."""
    hf_skipped: tuple[str, ...] = ()
    """Glob patterns of checkpoint tensors the family knowingly does not read (listed once in
    the log; every other unread tensor is refused: ``mpcore.models.common.hf_check``)."""

    def __post_init__(self):
        assert self.modality in MODALITIES, self.modality
        assert issubclass(self.section, DecoderSection), self.section
        assert (self.image_processing is not None) == (self.modality == "image-text"), self.name

    def load(self, folder, state, cfg, **options) -> tuple[Any, Any]:
        """``load_hf(folder, state, **options)`` after the checkpoint's tensor names are checked
        against this family under ``cfg`` (its config.json's config, with any run-level field
        such as the MTP weight): the one way a run or score.py loads a checkpoint
        (``mpcore.models.common.hf_check``)."""
        check_tensor_names(folder, self, cfg)
        with reported_while(folder):  # the skipped tensors are in the check's one log line
            return self.load_hf(folder, state, **options)

    def stages(self, cfg, state, *, schedule: str, virtual: int = 1, split=None,
               **options) -> list:
        """This pp rank's pipeline stage modules (``mpcore.parallel.pp``), each built by
        ``build(cfg, state, keep_layers=..., **options)``; ``ValueError`` for a family that
        cannot be pipelined yet."""
        if self.pipeline_stages is None:
            raise ValueError(f"the {self.name} family cannot be cut into pipeline stages yet; "
                             f"train it with pp = 1")
        return self.pipeline_stages(self.build, cfg, state, schedule=schedule,
                                    virtual=virtual, split=split, decoder_of=self.decoder,
                                    **options)

    @property
    def section_extras(self) -> tuple[str, ...]:
        """The YAML model keys beyond the shared decoder's (``vision``, ``moe``)."""
        shared = {f.name for f in dataclasses.fields(DecoderSection)}
        return tuple(f.name for f in dataclasses.fields(self.section) if f.name not in shared)

    @property
    def image_size_rule(self) -> Callable[..., tuple[int, int]] | None:
        """The family's image resize rule (None: Qwen2-VL's ``smart_resize``, or a text
        family)."""
        return self.image_processing.size_rule if self.image_processing else None

    @property
    def hf_image_processor(self) -> str | None:
        """The transformers image processor class an export names (None for text)."""
        return self.image_processing.hf_class if self.image_processing else None


def describe_kernels(model: torch.nn.Module, device: torch.device | str,
                     dtype: torch.dtype) -> list[str]:
    """One line per distinct kernel choice that ``model``'s layers report for ``dtype``
    operands on ``device`` (layers with a ``describe_kernel(device, dtype)`` method, such as
    Qwen3.5's Gated DeltaNet): what score.py and pretrain log once at start-up."""
    lines = []
    for module in model.modules():
        describe = getattr(module, "describe_kernel", None)
        if describe is not None and (line := describe(device, dtype)) not in lines:
            lines.append(line)
    return lines
