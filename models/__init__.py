"""Model families on TP/SP/CP layers, with Hugging Face import/export.

``mpcore.models.common`` holds the shared blocks; each family is a folder with one registry entry
(``mpcore.models.registry``): ``llama`` (Llama 3, Qwen2, Qwen3 by config), ``qwen2_vl`` (Qwen2-VL,
Qwen2.5-VL), ``qwen3_vl`` (Qwen3-VL), ``glm4v`` (GLM-4V / GLM-4.1V), ``qwen3_5`` (Qwen3.5
text), ``qwen3_5_vl`` (Qwen3.5 vision-language) and ``qwen3_moe`` (Qwen3-MoE). The names
below are the common surface; each family's own are in its package.
"""

if __name__ != "mpcore.models":  # reached by the bare name; mpcore/_names.py says why
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "mpcore" / "_names.py"))["bare_import"](
        __name__, __path__)
else:
    from mpcore.models.common.config import ModelConfig
    from mpcore.models.common.decoder import Transformer, build_model
    from mpcore.models.common.family import Family, describe_kernels
    from mpcore.models.common.hf_io import read_hf_config
    from mpcore.models.common.inputs import local_text_inputs
    from mpcore.models.llama import (
        config_from_hf,
        export_hf,
        hf_config_dict,
        load_hf_model,
        load_hf_weights,
    )
    from mpcore.models.qwen2_vl import (
        VisionConfig,
        VisionTower,
        VLConfig,
        VLModel,
        build_vl_model,
        export_hf_vl,
        hf_vl_config_dict,
        is_vl_config,
        load_hf_vl_model,
        load_hf_vl_weights,
        local_vl_inputs,
        vl_config_from_dict,
        vl_config_from_hf,
        vl_inputs,
    )
    from mpcore.models.registry import FAMILIES, family_named, family_of, family_of_hf

__all__ = [
    "FAMILIES",
    "Family",
    "ModelConfig",
    "Transformer",
    "VLConfig",
    "VLModel",
    "VisionConfig",
    "VisionTower",
    "build_model",
    "build_vl_model",
    "describe_kernels",
    "config_from_hf",
    "export_hf",
    "export_hf_vl",
    "family_named",
    "family_of",
    "family_of_hf",
    "hf_config_dict",
    "hf_vl_config_dict",
    "is_vl_config",
    "load_hf_model",
    "load_hf_vl_model",
    "load_hf_vl_weights",
    "load_hf_weights",
    "local_text_inputs",
    "local_vl_inputs",
    "read_hf_config",
    "vl_config_from_dict",
    "vl_config_from_hf",
    "vl_inputs",
]
