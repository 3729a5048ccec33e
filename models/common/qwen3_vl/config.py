"""Qwen3-VL configuration (text decoder, vision tower, token ids) and its HF ``config.json``.

The decoder is Qwen3 (q/k RMSNorm before RoPE, no qkv bias, explicit ``head_dim``) with
interleaved M-RoPE (``mrope_section`` + ``mrope_interleaved``, ``mpcore.models.common.rope``). The tower
(``Qwen3VisionConfig``) has LayerNorm blocks with a GELU-tanh MLP, a learned square grid of
position embeddings (``num_position_embeddings`` = side^2) resampled to each image, and
DeepStack mergers for the blocks of ``deepstack_visual_indexes``: the merged features of block
``deepstack_visual_indexes[k]`` are added to the visual positions after decoder layer k.

``config.json`` comes in two forms: the 4.57-era one keeps the M-RoPE keys in
``text_config.rope_scaling`` (``rope_theta`` beside it), transformers 5.x in
``text_config.rope_parameters``. Both are read; 5.x is written. Every check raises
``ValueError`` naming the field, before any compute.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_config import config_from_hf as text_config_from_hf
from mpcore.models.common.hf_config import hf_config_dict as text_hf_config_dict
from mpcore.models.common.hf_io import check_architecture, read_hf_config
from mpcore.models.common.section import VLSection, section_of
from mpcore.models.common.vision_geometry import VisionGeometry, check_tp_widths

ARCH = "Qwen3VLForConditionalGeneration"
MODEL_TYPE = "qwen3_vl"
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
ACTIVATION = "gelu_pytorch_tanh"
# vision_config keys that do not change the tower's function (metadata).
_VISION_IGNORED = {"model_type", "initializer_range", "torch_dtype", "dtype", "architectures",
                   "transformers_version", "_name_or_path", "output_attentions",
                   "output_hidden_states", "return_dict", "id2label", "label2id",
                   "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
                   "attn_implementation", "_attn_implementation", "rope_parameters",
                   "rope_scaling", "rope_theta", "tie_word_embeddings", "use_cache"}


def _positive(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionGeometry):
    """Shape of a Qwen3-VL vision tower."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Tower width."""
    num_heads: int
    """Attention heads; the head dim ``hidden_size / num_heads`` must be a multiple of 4."""
    intermediate_size: int
    """MLP width (fc1 -> gelu_pytorch_tanh -> fc2, with biases)."""
    out_hidden_size: int
    """Width of the mergers' outputs: the decoder's hidden size."""
    num_position_embeddings: int
    """Rows of the learned position table: a square grid, ``side ** 2``."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """Blocks whose outputs pass a DeepStack merger each; feature k is added after decoder
    layer k."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 16
    """Spatial side of one patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames in one patch."""
    spatial_merge_size: int = 2
    """Each merger concatenates ``spatial_merge_size ** 2`` neighbouring patches into one row."""
    hidden_act: str = ACTIVATION
    """MLP activation; only ``gelu_pytorch_tanh`` (the released checkpoints') is implemented."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary embedding."""
    norm_eps: float = 1e-6
    """Epsilon of every LayerNorm (transformers hard-codes 1e-6)."""

    def __post_init__(self):
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                     "num_position_embeddings", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size"):
            _positive("Qwen3VisionConfig", name, getattr(self, name))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision head dim hidden_size / num_heads = {self.hidden_size} / "
                             f"{self.num_heads} must be an integer multiple of 4 (the 2-D "
                             f"rotary embedding gives a quarter of it to each of h and w, twice)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings = {self.num_position_embeddings} is not a "
                             f"perfect square; the learned position grid is side x side (e.g. "
                             f"2304 = 48^2)")
        indexes = tuple(self.deepstack_visual_indexes)
        object.__setattr__(self, "deepstack_visual_indexes", indexes)
        for i in indexes:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.depth:
                raise ValueError(f"deepstack_visual_indexes entry {i!r} is not a vision block "
                                 f"index in [0, depth = {self.depth}); lower it or raise depth")
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"deepstack_visual_indexes {list(indexes)} has repeated blocks")
        if self.hidden_act != ACTIVATION:
            raise ValueError(f"vision hidden_act={self.hidden_act!r} is not implemented (only "
                             f"{ACTIVATION!r})")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(f"vision rope_theta and norm_eps must be > 0, got "
                             f"{self.rope_theta!r}, {self.norm_eps!r}")

    arch = "qwen3_vl"  # for mpcore.models.common.vision_plan.plan_vision: per-frame attention, no windows

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    def check_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` naming the fix when tp does not divide a sharded width."""
        check_tp_widths(tp, (("num_heads", self.num_heads),
                            ("intermediate_size", self.intermediate_size),
                            ("hidden_size * spatial_merge_size**2 (the merger width)",
                             self.hidden_size * self.merge_unit)))


Qwen3VisionSection = section_of(Qwen3VisionConfig, "Qwen3VisionSection")
"""The YAML ``model.vision`` keys of the qwen3_vl family: ``Qwen3VisionConfig``'s fields."""


@dataclass(frozen=True)
class Qwen3VLSection(VLSection):
    """Our YAML model section of the qwen3_vl family: the decoder's keys (the family needs
    ``qk_norm`` and ``mrope_interleaved`` true) and ``vision``."""

    vision: Qwen3VisionSection | None = None
    """The tower trained from scratch: ``Qwen3VisionConfig``'s fields (depth, hidden_size,
    num_heads, intermediate_size, num_position_embeddings, deepstack_visual_indexes, ...;
    out_hidden_size defaults to hidden_size); needs mrope_section."""


@dataclass(frozen=True)
class Qwen3VLConfig:
    """A Qwen3 decoder with interleaved M-RoPE, a Qwen3-VL tower and the ids between them."""

    text: ModelConfig
    """The decoder: ``qk_norm``, no ``qkv_bias``, ``mrope_section`` with
    ``mrope_interleaved``."""
    vision: Qwen3VisionConfig
    """The tower; ``out_hidden_size`` equals ``text.hidden_size``."""
    image_token_id: int
    """Placeholder id of one merged image patch (never a target)."""
    video_token_id: int
    """Placeholder id of one merged video patch (never a target)."""
    vision_start_token_id: int
    """Text token before each placeholder run (one run per image, per video frame)."""
    vision_end_token_id: int
    """Text token after each placeholder run."""

    def __post_init__(self):
        text = self.text
        if text.mrope_section is None or not text.mrope_interleaved:
            raise ValueError("a Qwen3-VL decoder needs interleaved M-RoPE: set "
                             "text.mrope_section (e.g. (24, 20, 20) for head_dim 128) and "
                             "text.mrope_interleaved = True")
        if not text.qk_norm or text.qkv_bias:
            raise ValueError("a Qwen3-VL decoder has q/k RMSNorm and no qkv bias: set "
                             "text.qk_norm = True and text.qkv_bias = False")
        if self.vision.out_hidden_size != text.hidden_size:
            raise ValueError(f"vision.out_hidden_size {self.vision.out_hidden_size} must equal "
                             f"text.hidden_size {text.hidden_size}: merged rows replace token "
                             f"embeddings")
        if len(self.vision.deepstack_visual_indexes) > text.num_layers:
            raise ValueError(f"{len(self.vision.deepstack_visual_indexes)} DeepStack features "
                             f"but only {text.num_layers} decoder layers to add them to; drop "
                             f"deepstack_visual_indexes entries")
        ids = [getattr(self, k) for k in TOKEN_KEYS]
        for key, value in zip(TOKEN_KEYS, ids, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < text.vocab_size):
                raise ValueError(f"{key} = {value!r} must be a token id in [0, vocab_size = "
                                 f"{text.vocab_size})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"the special ids {dict(zip(TOKEN_KEYS, ids, strict=True))} must "
                             f"be distinct")

    @property
    def placeholder_ids(self) -> tuple[int, int]:
        """``(image_token_id, video_token_id)``: ids whose rows come from the tower."""
        return self.image_token_id, self.video_token_id

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    def check_parallel(self, tp: int, cp: int = 1, cp_mode: str = "none") -> None:
        """Raise ``ValueError`` naming the fix when this config cannot run at ``tp`` x ``cp``."""
        self.text.check_parallel(tp, cp, cp_mode)
        self.vision.check_parallel(tp)


def config_from_dict(d: dict) -> Qwen3VLConfig:
    """The ``Qwen3VLConfig`` of ``dataclasses.asdict(cfg)`` (e.g. a checkpoint's meta.json)."""
    text = dict(d["text"])
    if text.get("mrope_section") is not None:
        text["mrope_section"] = tuple(text["mrope_section"])
    vision, rest = vision_and_tokens_from_dict(d)
    return Qwen3VLConfig(text=ModelConfig(**text), vision=vision, **rest)


def vision_and_tokens_from_dict(d: dict) -> tuple[Qwen3VisionConfig, dict]:
    """``(Qwen3VisionConfig, the other fields)`` of ``dataclasses.asdict(cfg)`` of a config with
    this tower (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 VL): all but ``text`` and ``vision``."""
    vision = dict(d["vision"])
    vision["deepstack_visual_indexes"] = tuple(vision.get("deepstack_visual_indexes") or ())
    rest = {k: v for k, v in d.items() if k not in ("text", "vision")}
    return Qwen3VisionConfig(**vision), rest


def _mrope(text: dict) -> tuple[list[int], float]:
    """``(mrope_section, rope_theta)`` from either form; the M-RoPE keys are removed from
    ``text`` so the Qwen3 reader sees plain RoPE."""
    found = interleaved_mrope(text, "Qwen3-VL")
    if found is None:
        raise ValueError("config.json has no mrope_section (text_config.rope_parameters or "
                         "text_config.rope_scaling); a Qwen3-VL decoder uses M-RoPE")
    key, rope = found
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"text_config.{key}.rope_type = {kind!r} is not supported "
                         f"(only default M-RoPE)")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return list(rope["mrope_section"]), theta


def interleaved_mrope(text: dict, family: str) -> tuple[str, dict] | None:
    """``(key, the rope dict)`` of a config.json text config's M-RoPE (``rope_parameters``, or
    the older ``rope_scaling``), ``None`` without one. ``ValueError`` when it is not
    interleaved: ``family``'s (Qwen3-VL's, Qwen3.5's) M-RoPE always is in transformers."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            if rope.get("mrope_interleaved", True) is not True:
                raise ValueError(f"text_config.{key}.mrope_interleaved = "
                                 f"{rope['mrope_interleaved']!r}: {family}'s M-RoPE is "
                                 f"interleaved (transformers always interleaves it)")
            return key, rope
    return None


def _text_config(hf: dict) -> ModelConfig:
    text = dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else {
        k: v for k, v in hf.items() if k != "vision_config"}
    if "tie_word_embeddings" in hf:  # the outer key wins (5.x moves it out of text_config)
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    section, _ = _mrope(text)
    text["architectures"] = ["Qwen3ForCausalLM"]
    cfg = text_config_from_hf(text)
    try:
        return dataclasses.replace(cfg, mrope_section=tuple(section), mrope_interleaved=True)
    except ValueError as e:
        raise ValueError(f"text_config mrope_section {section}: {e}") from None


def vision_config_from_hf(d: dict) -> Qwen3VisionConfig:
    """The tower of a ``vision_config`` dict (transformers' defaults where a key is absent,
    three DeepStack blocks included); keys the tower does not implement raise ``ValueError``."""
    d = dict(d)
    num_heads = d.pop("num_heads", d.pop("num_attention_heads", 16))
    depth = d.pop("depth", d.pop("num_hidden_layers", 27))
    d.pop("num_attention_heads", None)
    d.pop("num_hidden_layers", None)
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(d.get(key), (list, tuple)):
            raise ValueError(f"vision_config {key}={d[key]!r}: only an integer (square) patch "
                             f"size is supported")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config rope_parameters.rope_type={rope['rope_type']!r} is "
                         f"not supported (only the axial 2-D rotary embedding)")
    fields = {f.name for f in dataclasses.fields(Qwen3VisionConfig)} - {"rope_theta",
                                                                        "norm_eps"}
    kwargs = {k: d.pop(k) for k in list(d) if k in fields}
    kwargs.setdefault("hidden_size", 1152)
    kwargs.setdefault("intermediate_size", 4304)
    kwargs.setdefault("out_hidden_size", 3584)
    kwargs.setdefault("num_position_embeddings", 2304)
    kwargs.setdefault("deepstack_visual_indexes", (8, 16, 24))
    kwargs["deepstack_visual_indexes"] = tuple(kwargs["deepstack_visual_indexes"])
    unknown = sorted(set(d) - _VISION_IGNORED)
    if unknown:
        raise ValueError(f"vision_config has keys {unknown} that this tower does not implement; "
                         f"remove them if they are metadata")
    return Qwen3VisionConfig(depth=depth, num_heads=num_heads,
                             rope_theta=float(rope.get("rope_theta", 10000.0)), **kwargs)


def config_from_hf(source: str | Path | dict) -> Qwen3VLConfig:
    """``Qwen3VLConfig`` of a Qwen3-VL checkpoint's config.json (folder, file or dict), in the
    4.57-era or the 5.x form. Another architecture raises ``ValueError`` naming it."""
    hf = read_hf_config(source)
    check_architecture(hf, ARCH, MODEL_TYPE, "Qwen3-VL")
    missing = [k for k in TOKEN_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a Qwen3-VL checkpoint names its "
                         f"placeholder and vision start/end token ids")
    return Qwen3VLConfig(text=_text_config(hf),
                         vision=vision_config_from_hf(hf.get("vision_config") or {}),
                         **{k: int(hf[k]) for k in TOKEN_KEYS})


def hf_config_dict(cfg: Qwen3VLConfig) -> dict:
    """The transformers 5.x ``config.json`` dict of ``cfg`` (nested text and vision configs)."""
    t = cfg.text
    plain = text_hf_config_dict(dataclasses.replace(t, mrope_section=None,
                                                    mrope_interleaved=False))
    text = {k: plain[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "hidden_act",
                                  "max_position_embeddings", "rms_norm_eps")}
    text.update(model_type="qwen3_vl_text", attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                 "mrope_section": list(t.mrope_section),
                                 "mrope_interleaved": True})
    return {"architectures": [ARCH], "model_type": MODEL_TYPE, "text_config": text,
            "vision_config": vision_config_dict(cfg.vision, "qwen3_vl_vision"),
            "tie_word_embeddings": t.tie_embeddings,
            **{k: getattr(cfg, k) for k in TOKEN_KEYS}}


def vision_config_dict(v: Qwen3VisionConfig, model_type: str, deepstack: bool = True) -> dict:
    """The ``vision_config`` dict (5.x form) of tower ``v``; ``deepstack``: with the
    ``deepstack_visual_indexes`` key (Qwen3.5's tower config has none)."""
    out = {"model_type": model_type, "depth": v.depth, "hidden_size": v.hidden_size,
           "hidden_act": v.hidden_act, "intermediate_size": v.intermediate_size,
           "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
           "spatial_merge_size": v.spatial_merge_size,
           "temporal_patch_size": v.temporal_patch_size, "out_hidden_size": v.out_hidden_size,
           "num_position_embeddings": v.num_position_embeddings,
           "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    if deepstack:
        out["deepstack_visual_indexes"] = list(v.deepstack_visual_indexes)
    return out
