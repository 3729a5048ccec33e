"""Qwen3.5-MoE vision-language configuration and its HF ``config.json`` (transformers
``Qwen3_5MoeForConditionalGeneration``).

``Qwen35VLMoeConfig`` is ``Qwen35VLConfig`` (``mpcore.models.common.hybrid.vl_config``: Qwen3-VL's tower
without DeepStack, interleaved M-RoPE over the rotated dims) with ``text`` a
``Qwen35MoeConfig`` (``mpcore.models.common.hybrid.moe_config``: top-k always renormalised, every layer
sparse, ``intermediate_size`` the shared expert's width). ``config.json`` nests the MoE keys in
``text_config`` (model types ``qwen3_5_moe`` / ``qwen3_5_moe_text`` / ``qwen3_5_moe_vision``):
the text part is read by the Qwen3.5-MoE text reader (its defaults where a key is absent), the
rest as for Qwen3.5 VL; 5.x is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpcore.models.common.hf_io import check_architecture, read_hf_config
from mpcore.models.common.hybrid import vl_config as dense
from mpcore.models.common.hybrid.moe_config import Qwen35MoeConfig
from mpcore.models.common.hybrid.moe_config import config_from_dict as text_config_from_dict
from mpcore.models.common.hybrid.moe_hf import config_from_hf as text_config_from_hf
from mpcore.models.common.hybrid.moe_hf import hf_config_dict as text_hf_config_dict
from mpcore.models.common.hybrid.vl_config import Qwen35VLConfig

ARCH, MODEL_TYPE = "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"


@dataclass(frozen=True)
class Qwen35VLMoeConfig(Qwen35VLConfig):
    """``Qwen35VLConfig`` whose ``text`` is a ``Qwen35MoeConfig``."""

    def __post_init__(self):
        if not isinstance(self.text, Qwen35MoeConfig):
            raise TypeError(f"Qwen35VLMoeConfig.text must be a Qwen35MoeConfig, got "
                            f"{type(self.text).__name__} (a dense decoder is model.family "
                            f"qwen3_5_vl)")
        super().__post_init__()


def config_from_hf(source: str | Path | dict) -> Qwen35VLMoeConfig:
    """``Qwen35VLMoeConfig`` of a ``Qwen3_5MoeForConditionalGeneration`` config.json (folder,
    file or dict); another architecture (the dense Qwen3.5 VL, the text-only Qwen3.5-MoE)
    raises ``ValueError`` naming it."""
    hf = read_hf_config(source)
    check_architecture(hf, ARCH, MODEL_TYPE, "Qwen3.5-MoE vision-language")
    return dense.from_hf_parts(hf, text_config_from_hf, Qwen35VLMoeConfig)


def hf_config_dict(cfg: Qwen35VLMoeConfig) -> dict:
    """The transformers 5.x ``config.json`` dict of ``cfg``."""
    return dense.hf_config_dict(cfg, text_hf_config_dict, ARCH, MODEL_TYPE)


def config_from_dict(d: dict) -> Qwen35VLMoeConfig:
    """The ``Qwen35VLMoeConfig`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    return dense.config_from_dict(d, text_config_from_dict, Qwen35VLMoeConfig)
