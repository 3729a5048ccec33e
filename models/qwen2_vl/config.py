"""Vision-language model configuration (Qwen2-VL / Qwen2.5-VL), and its Hugging Face config.json.

A ``VLConfig`` is a text decoder (``ModelConfig`` with ``mrope_section``: Qwen2 with QKV biases),
a vision tower (``mpcore.models.qwen2_vl.VisionConfig``) and the special token ids that tie them: the
image and video placeholders (one per merged patch, replaced by the tower's output rows; never
targets) and the vision start/end tokens (ordinary text tokens around each placeholder run).

``config.json`` comes in two forms: transformers 5.x nests the decoder under ``text_config`` and
keeps the M-RoPE sections in ``rope_parameters``; 4.x has the decoder keys at the top level and
``rope_scaling = {"type": "mrope", "mrope_section": [...]}``. Both are read; 5.x is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_config import config_from_hf, hf_config_dict
from mpcore.models.common.hf_io import read_hf_config
from mpcore.models.common.section import VLSection
from mpcore.models.qwen2_vl.vision_config import (
    VisionConfig,
    VisionSection,
    hf_vision_config_dict,
    vision_config_from_hf,
)

VL_ARCHS = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
            "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class VLConfig:
    """A decoder with M-RoPE, a vision tower and the token ids between them."""

    text: ModelConfig
    """The language decoder; ``mrope_section`` must be set."""
    vision: VisionConfig
    """The vision tower; its ``out_hidden_size`` is the decoder's ``hidden_size``."""
    image_token_id: int
    """Placeholder id of one merged image patch (never a target)."""
    video_token_id: int
    """Placeholder id of one merged video patch (never a target)."""
    vision_start_token_id: int
    """Text token before each placeholder run."""
    vision_end_token_id: int
    """Text token after each placeholder run."""
    tokens_per_second: float = 1.0
    """Qwen2.5-VL videos: temporal position step per second of video (Qwen2-VL: 1 per frame
    group, with ``second_per_grid`` 1)."""

    def __post_init__(self):
        if self.text.mrope_section is None:
            raise ValueError("a vision-language decoder needs mrope_section (M-RoPE); set "
                             "text.mrope_section, e.g. (16, 24, 24) for head_dim 128")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision.out_hidden_size {self.vision.out_hidden_size} must equal "
                             f"text.hidden_size {self.text.hidden_size}: the merger's rows "
                             f"replace token embeddings")
        ids = [getattr(self, k) for k in TOKEN_KEYS]
        for key, value in zip(TOKEN_KEYS, ids, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < self.text.vocab_size):
                raise ValueError(f"{key} = {value!r} must be a token id in [0, vocab_size = "
                                 f"{self.text.vocab_size})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"the special ids {dict(zip(TOKEN_KEYS, ids, strict=True))} must "
                             f"be distinct")
        if not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second must be > 0, got {self.tokens_per_second!r}")

    @property
    def placeholder_ids(self) -> tuple[int, int]:
        """``(image_token_id, video_token_id)``: ids whose rows come from the vision tower."""
        return self.image_token_id, self.video_token_id

    @property
    def arch(self) -> str:
        """``"qwen2_vl"`` or ``"qwen2_5_vl"`` (the vision tower's variant)."""
        return self.vision.arch

    def check_parallel(self, tp: int, cp: int = 1, cp_mode: str = "none") -> None:
        """Raise ``ValueError`` naming the fix when this config cannot run at ``tp`` x ``cp``."""
        self.text.check_parallel(tp, cp, cp_mode)
        self.vision.check_parallel(tp)


@dataclass(frozen=True)
class Qwen2VLSection(VLSection):
    """Our YAML model section of the qwen2_vl family: the decoder's keys and ``vision``."""

    vision: VisionSection | None = None
    """A vision tower trained from scratch: ``VisionConfig``'s fields (arch, depth,
    hidden_size, num_heads, intermediate_size, patch_size, ...; out_hidden_size defaults to
    hidden_size); needs mrope_section. Null: a decoder-only model, unless init_from is a
    Qwen2-VL / Qwen2.5-VL checkpoint."""


def vl_config_from_dict(d: dict) -> VLConfig:
    """The ``VLConfig`` of ``dataclasses.asdict(cfg)`` (e.g. a checkpoint's meta.json)."""
    vision = dict(d["vision"])
    vision["fullatt_block_indexes"] = tuple(vision.get("fullatt_block_indexes") or ())
    text = dict(d["text"])
    if text.get("mrope_section") is not None:
        text["mrope_section"] = tuple(text["mrope_section"])
    rest = {k: v for k, v in d.items() if k not in ("text", "vision")}
    return VLConfig(text=ModelConfig(**text), vision=VisionConfig(**vision), **rest)


def _text_dict(hf: dict) -> tuple[dict, list[int]]:
    """The decoder part of a VL config.json as a Qwen2 causal-LM dict, and its mrope_section."""
    text = dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else dict(hf)
    text.pop("vision_config", None)
    text.pop("text_config", None)
    if "tie_word_embeddings" in hf:  # the outer key wins (5.x moves it out of text_config)
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            section = list(rope["mrope_section"])
            theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
            text[key] = {"rope_type": "default", "rope_theta": theta}
            if key == "rope_scaling":
                text["rope_theta"] = theta
    if section is None:
        raise ValueError("config.json has no mrope_section (in text_config.rope_parameters or "
                         "rope_scaling); a Qwen2-VL decoder uses M-RoPE")
    text["architectures"] = ["Qwen2ForCausalLM"]
    text.setdefault("layer_types", None)
    return text, section


def vl_config_from_hf(source: str | Path | dict) -> VLConfig:
    """``VLConfig`` of a Qwen2-VL / Qwen2.5-VL checkpoint's config.json (folder, file or dict).

    Raises ``ValueError`` for another architecture (say which are supported, and that decoder
    checkpoints load with ``mpcore.models.load_hf_model``) or a feature outside this model.
    """
    hf = read_hf_config(source)
    arch = _arch(hf)
    if arch is None:
        archs = hf.get("architectures") or []
        raise ValueError(f"architecture {archs or hf.get('model_type')!r} is not a "
                         f"vision-language model; supported: {sorted(VL_ARCHS)} (decoder-only "
                         f"checkpoints load with mpcore.models.load_hf_model)")
    text_dict, section = _text_dict(hf)
    text = dataclasses.replace(config_from_hf(text_dict), mrope_section=tuple(section))
    vision = vision_config_from_hf(hf.get("vision_config") or {}, arch)
    missing = [k for k in TOKEN_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a VL checkpoint names its placeholder "
                         f"and vision start/end token ids")
    vision_hf = hf.get("vision_config") or {}
    return VLConfig(text=text, vision=vision, **{k: int(hf[k]) for k in TOKEN_KEYS},
                    tokens_per_second=float(vision_hf.get("tokens_per_second", 1.0)))


def _arch(hf: dict) -> str | None:
    """``"qwen2_vl"`` / ``"qwen2_5_vl"`` from ``architectures`` (or, when a config made in
    memory has none, ``model_type``); None for anything else."""
    archs = hf.get("architectures") or []
    if archs:
        return VL_ARCHS.get(archs[0]) if len(archs) == 1 else None
    return hf.get("model_type") if hf.get("model_type") in VL_ARCHS.values() else None


def is_vl_config(source: str | Path | dict) -> bool:
    """Whether a config.json (folder, file or dict) is a vision-language architecture."""
    return _arch(read_hf_config(source)) is not None


def hf_vl_config_dict(cfg: VLConfig) -> dict:
    """A transformers 5.x ``config.json`` dict of ``cfg`` (nested ``text_config``)."""
    arch = {v: k for k, v in VL_ARCHS.items()}[cfg.arch]
    text = hf_config_dict(dataclasses.replace(cfg.text, mrope_section=None))
    text.pop("architectures")
    text["model_type"] = f"{cfg.arch}_text"
    rope = {"rope_type": "default", "rope_theta": cfg.text.rope_theta,
            "mrope_section": list(cfg.text.mrope_section)}
    text.update(rope_parameters=rope, rope_scaling=None)
    vision = hf_vision_config_dict(cfg.vision)
    if cfg.arch == "qwen2_5_vl":
        tps = cfg.tokens_per_second
        vision["tokens_per_second"] = int(tps) if float(tps).is_integer() else tps
    return {"architectures": [arch], "model_type": cfg.arch, "text_config": text,
            "vision_config": vision, "tie_word_embeddings": cfg.text.tie_embeddings,
            **{k: getattr(cfg, k) for k in TOKEN_KEYS}}
