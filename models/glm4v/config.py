"""GLM-4V (GLM-4.1V) configuration: decoder, vision tower, token ids, and their config.json.

A ``Glm4vConfig`` is a text decoder (``ModelConfig``: qkv biases, GQA, partial rotary over the
first half of each head, contiguous M-RoPE sections, GPT-J adjacent-pair rotation; the four
sandwich norms per layer are the family's block, ``mpcore.models.glm4v.model``), a vision tower
(``Glm4vVisionConfig``) and the token ids between them. Images and videos share ONE placeholder
id (``image_token_id``): a placeholder inside a ``video_start ... video_end`` span is a video
frame, any other an image (the rule of transformers' processor, ``mm_token_type_ids``).
``video_token_id`` is an ordinary token to the model (transformers never scatters into it).

``config.json``: transformers 5.x keeps ``mrope_section`` and ``partial_rotary_factor`` in
``text_config.rope_parameters``; checkpoints released with 4.5x have ``rope_scaling =
{"type": "default", "mrope_section": ...}`` and a top-level ``partial_rotary_factor``. Both are
read (the defaults are transformers': section ``[8, 12, 12]``, factor 1); 5.x is written.
transformers sizes the text heads as ``hidden_size / num_attention_heads`` whatever
``head_dim`` says, so a different ``head_dim`` is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hf_io import check_architecture, read_hf_config
from mpcore.models.common.section import VLSection, section_of
from mpcore.models.common.vision_geometry import VisionGeometry, check_tp_widths

ARCH = "Glm4vForConditionalGeneration"
MODEL_TYPE = "glm4v"
TOKEN_KEYS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
              "video_start_token_id", "video_end_token_id")

# config.json keys that do not change the function (metadata, or used elsewhere).
_META = {"model_type", "initializer_range", "torch_dtype", "dtype", "transformers_version",
         "architectures", "_name_or_path", "attn_implementation", "_attn_implementation",
         "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
         "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "use_cache",
         "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
         "tie_word_embeddings", "base_config_key"}


@dataclass(frozen=True)
class Glm4vVisionConfig(VisionGeometry):
    """Shape of a GLM-4V vision tower (transformers' ``Glm4vVisionConfig`` names)."""

    depth: int
    """Transformer blocks."""
    hidden_size: int
    """Tower width."""
    num_heads: int
    """Attention heads; the head dim (``hidden_size / num_heads``) is a multiple of 4."""
    intermediate_size: int
    """Width of the merger's SwiGLU (transformers' ``context_dim``)."""
    out_hidden_size: int
    """The language model's hidden size: output of ``downsample`` and the merger, and (as in
    transformers) the width of every block's SwiGLU."""
    in_channels: int = 3
    """Image channels."""
    image_size: int = 336
    """Side in pixels of the learned position grid (``(image_size / patch_size)^2`` rows,
    resampled bicubically to each image's grid)."""
    patch_size: int = 14
    """Spatial side of one patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames in one patch."""
    spatial_merge_size: int = 2
    """``downsample`` merges ``m x m`` neighbouring patches into one language-model token."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the tower's RMSNorms (the merger's LayerNorm keeps torch's 1e-5)."""
    attention_bias: bool = False
    """Bias on the attention's qkv projection (the output projection has none)."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary embedding."""

    def __post_init__(self):
        for name in ("image_size", "patch_size"):  # transformers allows [h, w]: square only
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or value[0] != value[1]:
                    raise ValueError(f"vision {name}={list(value)}: the learned position grid "
                                     f"must be square (one int, or [n, n])")
                object.__setattr__(self, name, value[0])
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                     "in_channels", "image_size", "patch_size", "temporal_patch_size",
                     "spatial_merge_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Glm4vVisionConfig.{name} must be a positive integer, got "
                                 f"{value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads "
                             f"{self.num_heads} must be a whole head dim divisible by 4 (the 2-D "
                             f"rotary embedding gives a quarter of it to each of h and w, twice)")
        if self.image_size < self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is smaller than patch_size "
                             f"{self.patch_size}: the position grid would be empty")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("vision rms_norm_eps and rope_theta must be > 0")

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid: ``image_size // patch_size``."""
        return self.image_size // self.patch_size

    def check_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` naming the fix when tp does not divide a sharded width."""
        check_tp_widths(tp, (("num_heads", self.num_heads),
                            ("out_hidden_size (the blocks' MLP width)", self.out_hidden_size),
                            ("intermediate_size (the merger's MLP width)", self.intermediate_size)))


Glm4vVisionSection = section_of(Glm4vVisionConfig, "Glm4vVisionSection")
"""The YAML ``model.vision`` keys of the glm4v family: ``Glm4vVisionConfig``'s fields."""


@dataclass(frozen=True)
class Glm4vSection(VLSection):
    """Our YAML model section of the glm4v family: the decoder's keys (GLM's qkv biases and
    GPT-J rotation always on, ``rotary_dim`` half the head dim unless set) and ``vision``."""

    vision: Glm4vVisionSection | None = None
    """The tower trained from scratch: ``Glm4vVisionConfig``'s fields (depth, hidden_size,
    num_heads, intermediate_size, image_size, patch_size, ...; out_hidden_size defaults to
    hidden_size); needs mrope_section."""


@dataclass(frozen=True)
class Glm4vConfig:
    """The GLM-4V model: decoder, vision tower and the token ids between them."""

    text: ModelConfig
    """The decoder: qkv_bias, rope_style "gptj", mrope_section over rotary_dim / 2 pairs."""
    vision: Glm4vVisionConfig
    """The tower; its ``out_hidden_size`` is ``text.hidden_size``."""
    image_token_id: int
    """The placeholder of one merged patch, of an image or a video frame (never a target)."""
    video_token_id: int
    """transformers' config names it; an ordinary token to the model."""
    image_start_token_id: int
    """Text token before each image (and each video frame)."""
    image_end_token_id: int
    """Text token after each image (and each video frame)."""
    video_start_token_id: int
    """Opens a video: placeholders until ``video_end_token_id`` are video frames."""
    video_end_token_id: int
    """Closes a video."""

    def __post_init__(self):
        t = self.text
        if t.mrope_section is None or t.rope_style != "gptj" or not t.qkv_bias or t.qk_norm:
            raise ValueError("a GLM-4V decoder has mrope_section set, rope_style='gptj', "
                             "qkv_bias=True and qk_norm=False; build it with "
                             "mpcore.models.glm4v.text_config (or from config.json)")
        if t.head_dim * t.num_heads != t.hidden_size:
            raise ValueError(f"GLM-4V sizes heads as hidden_size / num_heads = "
                             f"{t.hidden_size} / {t.num_heads}; head_dim {t.head_dim} differs")
        if self.vision.out_hidden_size != t.hidden_size:
            raise ValueError(f"vision.out_hidden_size {self.vision.out_hidden_size} must equal "
                             f"text.hidden_size {t.hidden_size}: the merger's rows replace token "
                             f"embeddings")
        ids = [getattr(self, k) for k in TOKEN_KEYS]
        for key, value in zip(TOKEN_KEYS, ids, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < t.vocab_size):
                raise ValueError(f"{key} = {value!r} must be a token id in [0, vocab_size = "
                                 f"{t.vocab_size})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"the special ids {dict(zip(TOKEN_KEYS, ids, strict=True))} must "
                             f"be distinct")

    @property
    def placeholder_ids(self) -> tuple[int]:
        """``(image_token_id,)``: the one id whose rows come from the tower."""
        return (self.image_token_id,)

    def check_parallel(self, tp: int, cp: int = 1, cp_mode: str = "none") -> None:
        """Raise ``ValueError`` naming the fix when this config cannot run at ``tp`` x ``cp``."""
        self.text.check_parallel(tp, cp, cp_mode)
        self.vision.check_parallel(tp)


def text_config(**fields) -> ModelConfig:
    """A GLM-4V decoder ``ModelConfig``: ``fields`` plus GLM's switches (qkv biases, GPT-J
    rotation; ``rotary_dim`` defaults to half the head dim, as GLM-4.1V ships)."""
    fields = {"qkv_bias": True, "rope_style": "gptj", "rms_norm_eps": 1e-5, **fields}
    if fields.get("rotary_dim") is None:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
        fields["rotary_dim"] = head_dim // 2
    return ModelConfig(**fields)


def config_from_dict(d: dict) -> Glm4vConfig:
    """The ``Glm4vConfig`` of ``dataclasses.asdict(cfg)`` (e.g. a checkpoint's meta.json)."""
    text = dict(d["text"])
    if text.get("mrope_section") is not None:
        text["mrope_section"] = tuple(text["mrope_section"])
    rest = {k: v for k, v in d.items() if k not in ("text", "vision")}
    return Glm4vConfig(text=ModelConfig(**text), vision=Glm4vVisionConfig(**d["vision"]), **rest)


def _unknown(d: dict, known: set, where: str) -> None:
    extra = sorted(set(d) - known - _META)
    if extra:
        raise ValueError(f"{where} has keys {extra} that GLM-4V does not implement; remove them "
                         f"if they are metadata")


def vision_from_hf(d: dict) -> Glm4vVisionConfig:
    """``Glm4vVisionConfig`` of an HF ``vision_config`` dict (both transformers forms)."""
    d = dict(d)
    act = d.pop("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"vision_config hidden_act={act!r} is not supported (only 'silu')")
    rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "axial"))
    if kind not in ("axial", "default"):
        raise ValueError(f"vision_config rope_type={kind!r} is not supported (only axial)")
    theta = rope.get("rope_theta", d.pop("rope_theta", 10000.0))
    names = dict(depth=("depth", "num_hidden_layers"), num_heads=("num_heads",
                                                                  "num_attention_heads"))
    out = {}
    for ours, keys in names.items():
        for key in keys:
            if key in d:
                out.setdefault(ours, d.pop(key))
    known = {f.name for f in dataclasses.fields(Glm4vVisionConfig)}
    _unknown(d, known | {"head_dim"}, "vision_config")
    if d.get("head_dim") not in (None, d.get("hidden_size", 1536) // out.get("num_heads", 12)):
        raise ValueError(f"vision_config head_dim={d['head_dim']} differs from hidden_size / "
                         f"num_heads; a separate head dim is not supported")
    d = {k: v for k, v in d.items() if k in known}
    return Glm4vVisionConfig(**{"depth": 24, "hidden_size": 1536, "num_heads": 12,
                                "intermediate_size": 13696, "out_hidden_size": 4096,
                                **out, **d, "rope_theta": float(theta)})


def _text_from_hf(hf: dict) -> ModelConfig:
    text = dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else dict(hf)
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"text_config hidden_act={act!r} is not supported (only 'silu')")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"text_config rope type {kind!r} is not supported (only default "
                         f"M-RoPE)")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    section = tuple(rope.get("mrope_section", (8, 12, 12)))
    hidden, heads = text.get("hidden_size", 4096), text.get("num_attention_heads", 32)
    head_dim = hidden // heads
    if text.get("head_dim") not in (None, head_dim):
        raise ValueError(f"text_config head_dim={text['head_dim']} differs from hidden_size / "
                         f"num_attention_heads = {head_dim}, which transformers' GLM-4V uses")
    rotary = int(head_dim * factor)
    if rotary != 2 * sum(section):
        raise ValueError(f"text_config mrope_section {list(section)} (sum {sum(section)}) does "
                         f"not fit the rotary dims: head_dim {head_dim} * partial_rotary_factor "
                         f"{factor} = {rotary} rotates {rotary // 2} pairs")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text_config(
        vocab_size=text.get("vocab_size", 151552), hidden_size=hidden,
        num_layers=text.get("num_hidden_layers", 40), num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        intermediate_size=text.get("intermediate_size", 13696), rope_theta=float(theta),
        rms_norm_eps=text.get("rms_norm_eps", 1e-5), tie_embeddings=bool(tie),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        mrope_section=section, rotary_dim=rotary)


def config_from_hf(source: str | Path | dict) -> Glm4vConfig:
    """``Glm4vConfig`` of a GLM-4V checkpoint's config.json (folder, file or dict); ``ValueError``
    for another architecture or a feature outside this model, naming the key."""
    hf = read_hf_config(source)
    check_architecture(hf, ARCH, MODEL_TYPE, "GLM-4V")
    text = _text_from_hf(hf)
    defaults = dict(zip(TOKEN_KEYS, (151343, 151344, 151339, 151340, 151341, 151342),
                        strict=True))
    ids = {k: int(hf.get(k, defaults[k])) for k in TOKEN_KEYS}
    vision = vision_from_hf({"out_hidden_size": text.hidden_size, **(hf.get("vision_config")
                                                                       or {})})
    return Glm4vConfig(text=text, vision=vision, **ids)


def hf_config_dict(cfg: Glm4vConfig) -> dict:
    """The transformers 5.x ``config.json`` dict of ``cfg``."""
    t, v = cfg.text, cfg.vision
    rope = {"rope_type": "default", "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
            "partial_rotary_factor": t.rope_dim / t.head_dim}
    text = {"model_type": "glm4v_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
            "hidden_act": "silu", "max_position_embeddings": t.max_position_embeddings,
            "rms_norm_eps": t.rms_norm_eps, "rope_parameters": rope,
            "tie_word_embeddings": t.tie_embeddings}
    vision = {"model_type": "glm4v_vision", "depth": v.depth, "hidden_size": v.hidden_size,
              "num_heads": v.num_heads, "intermediate_size": v.intermediate_size,
              "out_hidden_size": v.out_hidden_size, "in_channels": v.in_channels,
              "image_size": v.image_size, "patch_size": v.patch_size,
              "temporal_patch_size": v.temporal_patch_size,
              "spatial_merge_size": v.spatial_merge_size, "rms_norm_eps": v.rms_norm_eps,
              "attention_bias": v.attention_bias, "hidden_act": "silu",
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    return {"architectures": [ARCH], "model_type": MODEL_TYPE, "text_config": text,
            "vision_config": vision, "tie_word_embeddings": t.tie_embeddings,
            **{k: getattr(cfg, k) for k in TOKEN_KEYS}}
