"""Each registered family's tiny transformers checkpoint, for the registry-driven suite.

``TINY[name]`` declares, for the family ``mpcore.models.registry.FAMILIES[name]``, how to write
a tiny random transformers checkpoint of it (reusing the hand-written builders of tests/dist),
which transformers auto class loads it, and, for an image-text family, the ids that wrap an
image's placeholder run. tests/dist/test_family_suite.py fails for a registered family missing
here, so a new family gets HF round trip, score.py and layout coverage by adding one entry.

Every tiny vision tower here has patch 2 x 2, temporal patch 2 and 3 channels (rows of
``PATCH_DIM`` = 24 pixels) and merges 2 x 2 patches into one placeholder token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mpcore.models.registry import family_named
from tests.dist import (
    hf_glm4v_tiny,
    hf_moe_tiny,
    hf_qwen3_vl_moe_tiny,
    hf_qwen3_vl_tiny,
    hf_qwen35_vl_moe_tiny,
    hf_qwen35_vl_tiny,
    hf_tiny,
    hf_vl_tiny,
    qwen35_moe_tiny,
    qwen35_tiny,
)

PATCH_DIM = 3 * 2 * 2 * 2
EAGER = {"experts_implementation": "eager"}  # transformers' grouped expert GEMM is not exact


@dataclass(frozen=True)
class Tiny:
    """One family's tiny checkpoint: ``save(folder, seed)`` writes it with ``save_pretrained``
    (fresh random float32 weights from ``seed``); ``auto`` is the transformers auto class that
    loads it (with ``load_options``); ``image`` the ``(start, placeholder, end)`` ids around
    an image of an image-text family (None for text); ``text_ids`` bounds the random text ids
    (below every special id of the family's vocab)."""

    save: Callable[[Path, int], None]
    auto: str = "AutoModelForCausalLM"
    image: tuple[int, int, int] | None = None
    load_options: dict = field(default_factory=dict)
    text_ids: int = 90


def hf_classes(name: str) -> tuple[type, type]:
    """transformers' ``(config class, model class)`` of family ``name``: the first architecture
    its registry record reads (``hf_architectures``) and that model class's own config class."""
    import transformers

    model_cls = getattr(transformers, family_named(name).hf_architectures[0])
    return model_cls.config_class, model_cls


def _vl(save, image, **kw) -> Tiny:
    return Tiny(save, "AutoModelForImageTextToText", image, **kw)


# DeltaNet heads split over tp x cp = 4 (the builders' default 2 key heads stop at 2).
_GDN_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)
_QWEN_VL = (hf_qwen3_vl_tiny.START, hf_qwen3_vl_tiny.IMAGE, hf_qwen3_vl_tiny.END)

TINY: dict[str, Tiny] = {
    "llama": Tiny(lambda folder, seed: hf_tiny.save_hf_model("llama", seed, folder)),
    "qwen2_vl": _vl(lambda folder, seed: hf_vl_tiny.save_hf_vl_model("qwen2_vl", seed, folder),
                    (hf_vl_tiny.START, hf_vl_tiny.IMAGE, hf_vl_tiny.END)),
    "qwen3_vl": _vl(lambda folder, seed: hf_qwen3_vl_tiny.save_hf_model(seed, folder), _QWEN_VL),
    "glm4v": _vl(lambda folder, seed: hf_glm4v_tiny.save_hf_model(seed, folder),
                 (hf_glm4v_tiny.I_START, hf_glm4v_tiny.IMAGE, hf_glm4v_tiny.I_END)),
    "qwen3_5": Tiny(lambda folder, seed: qwen35_tiny.make_hf_model(
        seed, **_GDN_HEADS).save_pretrained(folder)),
    "qwen3_5_vl": _vl(lambda folder, seed: hf_qwen35_vl_tiny.save_hf_model(seed, folder),
                      _QWEN_VL),
    "qwen3_moe": Tiny(lambda folder, seed: hf_moe_tiny.save_hf_model(seed, folder),
                      load_options=EAGER),
    "qwen3_vl_moe": _vl(lambda folder, seed: hf_qwen3_vl_moe_tiny.save_hf_model(seed, folder),
                        _QWEN_VL, load_options=EAGER),
    "qwen3_5_moe": Tiny(lambda folder, seed: qwen35_moe_tiny.save_hf_model(
        seed, folder, **_GDN_HEADS), load_options=EAGER),
    "qwen3_5_vl_moe": _vl(lambda folder, seed: hf_qwen35_vl_moe_tiny.save_hf_model(seed, folder),
                          _QWEN_VL, load_options=EAGER),
}
