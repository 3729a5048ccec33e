"""Qwen3.5 vision-language configuration and its HF ``config.json`` (transformers
``Qwen3_5ForConditionalGeneration``).

The model is Qwen3-VL's with two pieces swapped: the decoder is Qwen3.5's hybrid one
(``mpcore.models.qwen3_5.Qwen35Config``: Gated DeltaNet beside gated full attention, partial rotary)
with interleaved M-RoPE over the ROTATED dims (``mrope_section`` sums to ``rotary_dim / 2``;
transformers' default ``[11, 11, 10]`` for the released ``head_dim`` 256 at a quarter rotated),
and the tower is Qwen3-VL's without DeepStack (``mpcore.models.qwen3_vl.Qwen3VisionConfig`` with
``deepstack_visual_indexes = ()``; transformers deletes the DeepStack mergers and the key).

``config.json``: ``text_config`` is read by the text family's reader
(``mpcore.models.common.hybrid.hf.config_from_hf``), its ``rope_parameters`` (or v4 ``rope_scaling``) giving
the M-RoPE section; ``vision_config`` by Qwen3-VL's; 5.x is written. Every check raises
``ValueError`` naming the field, before any compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.hf_io import check_architecture, read_hf_config
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.hf import config_from_hf as text_config_from_hf
from mpcore.models.common.hybrid.hf import hf_config_dict as text_hf_config_dict
from mpcore.models.common.hybrid.hf import text_fields
from mpcore.models.common.hybrid.section import config_from_dict as text_config_from_dict
from mpcore.models.common.qwen3_vl.config import (
    TOKEN_KEYS,
    Qwen3VLConfig,
    interleaved_mrope,
    vision_and_tokens_from_dict,
    vision_config_dict,
    vision_config_from_hf,
)

ARCH = "Qwen3_5ForConditionalGeneration"
MODEL_TYPE = "qwen3_5"
DEFAULT_MROPE = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default


@dataclass(frozen=True)
class Qwen35VLConfig(Qwen3VLConfig):
    """A Qwen3.5 decoder with interleaved M-RoPE, a Qwen3-VL tower without DeepStack and the
    ids between them (the fields of ``Qwen3VLConfig``)."""

    def __post_init__(self):
        if not isinstance(self.text, Qwen35Config):
            raise TypeError(f"Qwen35VLConfig.text must be a Qwen35Config, got "
                            f"{type(self.text).__name__}")
        if self.vision.deepstack_visual_indexes:
            raise ValueError(f"deepstack_visual_indexes = "
                             f"{list(self.vision.deepstack_visual_indexes)}: the Qwen3.5 tower "
                             f"has no DeepStack mergers; leave it empty (a tower with them is "
                             f"Qwen3-VL's, model.family qwen3_vl)")
        super().__post_init__()


    # Multi-token prediction is the decoder's (``mpcore.models.common.hybrid.mtp``): the run
    # and the trainer ask the model's config, whatever its family.
    @property
    def mtp_num_hidden_layers(self) -> int:
        return self.text.mtp_num_hidden_layers

    @property
    def mtp_loss_weight(self) -> float:
        return self.text.mtp_loss_weight

    @property
    def uses_mtp(self) -> bool:
        return self.text.uses_mtp

    def with_mtp_weight(self, weight: float) -> Qwen35VLConfig:
        """This config with the decoder's ``mtp_loss_weight`` set (its checks)."""
        return dataclasses.replace(self, text=self.text.with_mtp_weight(weight))


def _mrope_section(text: dict) -> tuple[int, ...]:
    found = interleaved_mrope(text, "Qwen3.5")
    return DEFAULT_MROPE if found is None else tuple(found[1]["mrope_section"])


def config_from_hf(source: str | Path | dict) -> Qwen35VLConfig:
    """``Qwen35VLConfig`` of a ``Qwen3_5ForConditionalGeneration`` config.json (folder, file or
    dict). Another architecture (a Qwen3-VL or text-only Qwen3.5 checkpoint) raises
    ``ValueError`` naming it."""
    hf = read_hf_config(source)
    check_architecture(hf, ARCH, MODEL_TYPE, "Qwen3.5 vision-language")
    return from_hf_parts(hf, text_config_from_hf, Qwen35VLConfig)


def from_hf_parts(hf: dict, read_text, config_type: type):
    """``config_type(text, vision, token ids)`` of a Qwen3.5 VL config.json dict whose
    architecture was checked: ``read_text(hf)`` (a Qwen3.5 text family's reader) with the
    interleaved M-RoPE section, the tower without DeepStack, the four ids."""
    missing = [k for k in TOKEN_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a Qwen3.5 VL checkpoint names its "
                         f"placeholder and vision start/end token ids")
    section = _mrope_section(text_fields(hf))
    try:
        text = dataclasses.replace(read_text(hf), mrope_section=section,
                                   mrope_interleaved=True)
    except ValueError as e:
        raise ValueError(f"text_config mrope_section {list(section)}: {e}") from None
    vision = dict(hf.get("vision_config") or {})
    if vision.get("deepstack_visual_indexes"):
        raise ValueError(f"vision_config.deepstack_visual_indexes = "
                         f"{vision['deepstack_visual_indexes']}: the Qwen3.5 tower has no "
                         f"DeepStack (a Qwen3-VL checkpoint? its architecture is "
                         f"Qwen3VLForConditionalGeneration)")
    vision["deepstack_visual_indexes"] = ()  # Qwen3-VL's reader would default it to 3 blocks
    return config_type(text=text, vision=vision_config_from_hf(vision),
                       **{k: int(hf[k]) for k in TOKEN_KEYS})


def hf_config_dict(cfg: Qwen35VLConfig, text_hf_dict=text_hf_config_dict, arch: str = ARCH,
                   model_type: str = MODEL_TYPE) -> dict:
    """The transformers 5.x ``config.json`` dict of ``cfg`` (nested text and vision configs);
    ``text_hf_dict``: the text family's writer (the MoE family passes its own, with its
    ``arch`` and ``model_type``)."""
    text = text_hf_dict(dataclasses.replace(cfg.text, mrope_section=None,
                                            mrope_interleaved=False))
    del text["architectures"]
    text["rope_parameters"].update(mrope_section=list(cfg.text.mrope_section),
                                   mrope_interleaved=True)
    return {"architectures": [arch], "model_type": model_type, "text_config": text,
            "vision_config": vision_config_dict(cfg.vision, f"{model_type}_vision",
                                                deepstack=False),
            "tie_word_embeddings": cfg.text.tie_embeddings,
            **{k: getattr(cfg, k) for k in TOKEN_KEYS}}


def config_from_dict(d: dict, text_from_dict=text_config_from_dict,
                     config_type: type = Qwen35VLConfig) -> Qwen35VLConfig:
    """The ``config_type`` of ``dataclasses.asdict(cfg)`` (e.g. a checkpoint's meta.json);
    ``text_from_dict``: the text family's reader of its part."""
    vision, rest = vision_and_tokens_from_dict(d)
    return config_type(text=text_from_dict(d["text"]), vision=vision, **rest)
