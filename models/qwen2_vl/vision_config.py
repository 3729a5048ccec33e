"""Vision tower configuration (Qwen2-VL and Qwen2.5-VL), and its Hugging Face ``vision_config``.

One frozen dataclass, validated on construction. ``arch`` picks the block type:

    qwen2_vl    LayerNorm blocks, fc1 -> quick_gelu -> fc2 MLP, every block attends per frame,
                LayerNorm in the patch merger
    qwen2_5_vl  RMSNorm blocks, gated SiLU MLP with biases, window attention except in the
                blocks of ``fullatt_block_indexes``, RMSNorm in the patch merger

Hugging Face names differ per arch: the tower width is ``embed_dim`` in Qwen2-VL and
``hidden_size`` in Qwen2.5-VL; the merger's output width (the language model's hidden size) is
``hidden_size`` in Qwen2-VL and ``out_hidden_size`` in Qwen2.5-VL; Qwen2-VL's MLP width is
``embed_dim * mlp_ratio``. ``vision_config_from_hf`` reads both the transformers 5.x dict
(``rope_parameters.rope_theta``) and the 4.x one (plain keys, ``in_chans``);
``hf_vision_config_dict`` writes the 5.x one.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpcore.models.common.section import section_of
from mpcore.models.common.vision_geometry import VisionGeometry, check_tp_widths

ARCHS = ("qwen2_vl", "qwen2_5_vl")
ACTIVATIONS = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu"}
MODEL_TYPES = {"qwen2_vl": "qwen2_vl_vision", "qwen2_5_vl": "qwen2_5_vl_vision"}

# vision_config keys that do not change the tower's function (metadata, or used elsewhere).
_IGNORED = {"model_type", "initializer_range", "tokens_per_second", "torch_dtype", "dtype",
            "transformers_version", "architectures", "_name_or_path", "attn_implementation",
            "_attn_implementation", "output_attentions", "output_hidden_states", "return_dict",
            "spatial_patch_size", "rope_parameters", "rope_theta", "rope_scaling", "head_dim",
            "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder",
            "problem_type", "tie_word_embeddings", "use_cache"}


@dataclass(frozen=True)
class VisionConfig(VisionGeometry):
    """Shape and variant of a Qwen2-VL / Qwen2.5-VL vision tower."""

    arch: str
    """``"qwen2_vl"`` (LayerNorm blocks, quick_gelu MLP, per-frame attention) or
    ``"qwen2_5_vl"`` (RMSNorm blocks, gated SiLU MLP, window attention; module docstring)."""
    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Tower width (HF Qwen2-VL ``embed_dim``, Qwen2.5-VL ``hidden_size``)."""
    num_heads: int
    """Attention heads; ``hidden_size / num_heads`` (the head dim) must be a multiple of 4."""
    intermediate_size: int
    """MLP width (Qwen2-VL: ``embed_dim * mlp_ratio``)."""
    out_hidden_size: int
    """Width of the merger's output, the language model's hidden size (HF Qwen2-VL
    ``vision_config.hidden_size``, Qwen2.5-VL ``out_hidden_size``)."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 14
    """Spatial side of one patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames in one patch."""
    spatial_merge_size: int = 2
    """The merger concatenates ``spatial_merge_size ** 2`` neighbouring patches into one
    language-model token."""
    window_size: int = 112
    """Qwen2.5-VL: side of an attention window in pixels (``window_size // spatial_merge_size
    // patch_size`` merged units). Ignored by qwen2_vl."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Qwen2.5-VL: blocks that attend over whole frames instead of windows. Must be empty for
    qwen2_vl (all its blocks attend per frame)."""
    norm_eps: float = 1e-6
    """Epsilon of every LayerNorm / RMSNorm (transformers hard-codes 1e-6)."""
    hidden_act: str = ""
    """MLP activation: ``"quick_gelu"`` (qwen2_vl) or ``"silu"`` (qwen2_5_vl, gated); empty
    means the arch's own."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary embedding."""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"VisionConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                     "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                     "window_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VisionConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"VisionConfig.hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}; pick num_heads dividing it")
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"head dim hidden_size / num_heads = {self.hidden_size} / "
                             f"{self.num_heads} must be a multiple of 4 (the 2-D rotary "
                             f"embedding gives a quarter of it to each of h and w, twice)")
        if not self.hidden_act:
            object.__setattr__(self, "hidden_act", ACTIVATIONS[self.arch])
        if self.hidden_act != ACTIVATIONS[self.arch]:
            raise ValueError(f"{self.arch} uses hidden_act={ACTIVATIONS[self.arch]!r}, got "
                             f"{self.hidden_act!r}; other activations are not implemented")
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        if self.arch == "qwen2_vl" and self.fullatt_block_indexes:
            raise ValueError("fullatt_block_indexes is a qwen2_5_vl feature (qwen2_vl blocks all "
                             "attend per frame); leave it empty")
        for i in self.fullatt_block_indexes:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.depth:
                raise ValueError(f"fullatt_block_indexes entry {i!r} is not a block index in "
                                 f"[0, depth={self.depth})")
        if self.arch == "qwen2_5_vl" and self.window_units < 1:
            raise ValueError(f"window_size {self.window_size} is smaller than one merged unit "
                             f"(spatial_merge_size * patch_size = "
                             f"{self.spatial_merge_size * self.patch_size} pixels); raise it")
        if not self.norm_eps > 0:
            raise ValueError(f"VisionConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"VisionConfig.rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def window_units(self) -> int:
        """Side of a Qwen2.5-VL attention window in merged units."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def check_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` naming the fix when tp does not divide the sharded widths:
        attention heads, the MLP width and the merger's width (``hidden_size * merge_unit``)."""
        check_tp_widths(tp, (("num_heads", self.num_heads),
                            ("intermediate_size", self.intermediate_size),
                            ("hidden_size * spatial_merge_size**2 (the merger width)",
                             self.hidden_size * self.merge_unit)))


VisionSection = section_of(VisionConfig, "VisionSection")
"""The YAML ``model.vision`` keys of the qwen2_vl family: ``VisionConfig``'s fields."""


def _rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "axial"))
    if kind not in ("axial", "default"):
        raise ValueError(f"vision_config rope_parameters.rope_type={kind!r} is not supported "
                         f"(only the axial 2-D rotary embedding)")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


def vision_config_from_hf(d: dict, arch: str) -> VisionConfig:
    """``VisionConfig`` of an HF ``vision_config`` dict (transformers 5.x or 4.x) of ``arch``.

    Raises ``ValueError`` naming the key for an unknown key, an unsupported activation, rotary
    type or head dim, or a non-square patch.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    d = dict(d)
    # transformers' attribute_map: num_attention_heads / num_hidden_layers are aliases.
    num_heads = d.pop("num_heads", d.pop("num_attention_heads", 16))
    depth = d.pop("depth", d.pop("num_hidden_layers", 32))
    d.pop("num_attention_heads", None)
    d.pop("num_hidden_layers", None)
    if arch == "qwen2_vl":
        width = d.pop("embed_dim", 1280)
        ratio = d.pop("mlp_ratio", 4)
        if int(width * ratio) != width * ratio:
            raise ValueError(f"vision_config embed_dim * mlp_ratio = {width} * {ratio} is not "
                             f"an integer MLP width")
        sizes = dict(hidden_size=width, intermediate_size=int(width * ratio),
                     out_hidden_size=d.pop("hidden_size", 3584))
    else:
        sizes = dict(hidden_size=d.pop("hidden_size", 3584),
                     intermediate_size=d.pop("intermediate_size", 3420),
                     out_hidden_size=d.pop("out_hidden_size", 3584),
                     window_size=d.pop("window_size", 112),
                     fullatt_block_indexes=tuple(d.pop("fullatt_block_indexes", (7, 15, 23, 31))))
    theta = _rope_theta(d)
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim * num_heads != sizes["hidden_size"]:
        raise ValueError(f"vision_config head_dim={head_dim} differs from hidden / num_heads; a "
                         f"separate head dim is not supported")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(d.get(key), (list, tuple)):
            raise ValueError(f"vision_config {key}={d[key]!r}: only an integer (square) patch "
                             f"size is supported")
    act = d.pop("hidden_act", ACTIVATIONS[arch])
    if act != ACTIVATIONS[arch]:
        raise ValueError(f"vision_config hidden_act={act!r} is not supported for {arch} (only "
                         f"{ACTIVATIONS[arch]!r})")
    channels = d.pop("in_channels", d.pop("in_chans", 3))
    d.pop("in_chans", None)
    cfg = VisionConfig(
        arch=arch, depth=depth, num_heads=num_heads,
        in_channels=channels, patch_size=d.pop("patch_size", 14),
        temporal_patch_size=d.pop("temporal_patch_size", 2),
        spatial_merge_size=d.pop("spatial_merge_size", 2),
        hidden_act=act, rope_theta=theta, **sizes)
    unknown = sorted(set(d) - _IGNORED)
    if unknown:
        raise ValueError(f"vision_config has keys {unknown} that this tower does not implement; "
                         f"remove them if they are metadata")
    return cfg


def hf_vision_config_dict(cfg: VisionConfig) -> dict:
    """The transformers 5.x ``vision_config`` dict of ``cfg``.

    Raises ``ValueError`` for a qwen2_vl config whose MLP width is not an integer multiple of
    the tower width (transformers stores it as an integer ``mlp_ratio``).
    """
    out = {"model_type": MODEL_TYPES[cfg.arch], "depth": cfg.depth, "num_heads": cfg.num_heads,
           "hidden_act": cfg.hidden_act, "in_channels": cfg.in_channels,
           "patch_size": cfg.patch_size, "temporal_patch_size": cfg.temporal_patch_size,
           "spatial_merge_size": cfg.spatial_merge_size,
           "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta}}
    if cfg.arch == "qwen2_vl":
        if cfg.intermediate_size % cfg.hidden_size:
            raise ValueError(f"qwen2_vl intermediate_size {cfg.intermediate_size} is not a "
                             f"multiple of hidden_size {cfg.hidden_size}; transformers stores "
                             f"the MLP width as an integer mlp_ratio")
        out.update(embed_dim=cfg.hidden_size, mlp_ratio=cfg.intermediate_size // cfg.hidden_size,
                   hidden_size=cfg.out_hidden_size)
    else:
        out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   out_hidden_size=cfg.out_hidden_size, window_size=cfg.window_size,
                   fullatt_block_indexes=list(cfg.fullatt_block_indexes))
    return out
