"""What a model family declares: one ``Family`` record per folder under ``models/``.

Nothing outside ``models/`` asks which family it has; it asks the family's record (found by
``models.registry``) for what differs: how the config is read (a HF ``config.json``, a checkpoint's
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
``hf_architectures`` / ``hf_model_types`` are the config.json names it reads; ``options`` names
the build keyword arguments beyond the decoder's (``vision_cp``) that our YAML model section
provides; ``modality`` is ``"text"`` or ``"image-text"``: which loaders feed it; ``host_inputs``
names forward arguments that stay on the host (planning metadata such as a tower's grids);
``section`` the family's YAML model keys, a frozen dataclass (``models.common.section``: the
shared ``DecoderSection``, or a subclass adding the family's nested sections, ``vision``,
``moe``; ``section_extras`` names those); a key of another family is refused, not ignored;
mpcore adds the run-level keys beside them; ``image_size_rule`` the
family's image resize rule where it is not Qwen2-VL's ``smart_resize`` (GLM-4V's);
``hf_image_processor`` the transformers image processor class an export names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.common.section import DecoderSection

MODALITIES = ("text", "image-text")


def _no_placeholders(cfg) -> tuple[int, ...]:
    del cfg
    return ()


def _no_vision(model):
    del model
    return None


@dataclass(frozen=True)
class Family:
    """One model family's entry in ``models.registry`` (module docstring)."""

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
    modality: str = "text"
    options: tuple[str, ...] = ()
    host_inputs: tuple[str, ...] = ()
    section: type = DecoderSection
    image_size_rule: Callable[..., tuple[int, int]] | None = None
    hf_image_processor: str | None = None

    def __post_init__(self):
        assert self.modality in MODALITIES, self.modality
        assert issubclass(self.section, DecoderSection), self.section

    @property
    def section_extras(self) -> tuple[str, ...]:
        """The YAML model keys beyond the shared decoder's (``vision``, ``moe``)."""
        shared = {f.name for f in dataclasses.fields(DecoderSection)}
        return tuple(f.name for f in dataclasses.fields(self.section) if f.name not in shared)
