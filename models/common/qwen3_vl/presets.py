"""Qwen3-VL shapes: the 2B checkpoint's config.json, a tiny from-scratch model, and the reader
of a YAML ``model`` section (decoder fields + ``vision`` fields + the data's token ids).

``QWEN3_VL_2B`` is the config.json of Qwen/Qwen3-VL-2B-Instruct in the 4.57-era form (the
shape only; ``config_from_hf`` reads it). ``TINY`` is a ``model`` section that trains on CPU:
patch 14 so that the image set shipped in launch/data, prepared with the Qwen2-VL processor's
1176-wide rows, feeds it as is (the released checkpoints use patch 16 and their own processor).
"""

from __future__ import annotations

import dataclasses
import difflib

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.qwen3_vl.config import Qwen3VisionConfig, Qwen3VLConfig

QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_theta": 5000000, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True}},
    "vision_config": {
        "model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
        "num_heads": 16, "out_hidden_size": 2048, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}

TINY = {
    "vocab_size": 2052, "hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_embeddings": True, "max_position_embeddings": 4096, "mrope_section": [4, 2, 2],
    "vision": {"depth": 3, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128,
               "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1],
               "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2},
}
"""A ``model`` section (YAML-ready): decoder fields of ``ModelConfig`` and ``vision`` fields of
``Qwen3VisionConfig`` (``out_hidden_size`` defaults to ``hidden_size``)."""


def _build(cls, fields: dict, where: str):
    known = [f.name for f in dataclasses.fields(cls)]
    for key in fields:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {known}"
            raise ValueError(f"{where}.{key} is not a field of {cls.__name__}{hint}")
    return cls(**fields)


def config_from_section(model: dict, token_ids: dict[str, int]) -> Qwen3VLConfig:
    """The ``Qwen3VLConfig`` of a YAML ``model`` section (``TINY``'s keys) and the data
    tokenizer's four ids (``image_token_id``, ...). The Qwen3-VL switches (qk_norm, no qkv
    bias, interleaved M-RoPE) are the family's own and need not be given. Unknown keys raise
    ``ValueError`` naming the closest field."""
    text = {k: v for k, v in model.items() if k != "vision"}
    text.setdefault("qk_norm", True)
    text.setdefault("mrope_interleaved", True)
    if isinstance(text.get("mrope_section"), list):
        text["mrope_section"] = tuple(text["mrope_section"])
    return Qwen3VLConfig(text=_build(ModelConfig, text, "model"),
                         vision=vision_from_section(model.get("vision"), text.get("hidden_size")),
                         **token_ids)


def vision_from_section(vision: dict | None, hidden_size: int) -> Qwen3VisionConfig:
    """The ``Qwen3VisionConfig`` of a YAML ``model.vision`` mapping (``out_hidden_size``
    defaults to the decoder's ``hidden_size``); unknown keys raise ``ValueError`` naming the
    closest field."""
    vision = dict(vision or {})
    vision.setdefault("out_hidden_size", hidden_size)
    vision["deepstack_visual_indexes"] = tuple(vision.get("deepstack_visual_indexes", ()))
    return _build(Qwen3VisionConfig, vision, "model.vision")
