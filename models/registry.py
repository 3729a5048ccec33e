"""The family registry: which ``mpcore.models.common.family.Family`` a config, checkpoint or name is.

The rest of mpcore asks here (and then the family's record), never "is this a VL model?":
    family_named("qwen2_vl")         by our name (YAML ``model.family``)
    family_of_hf(folder | dict)      by a HF config.json's ``architectures`` (or ``model_type``)
    family_of(cfg)                   by the type of a built family config
A new family is one folder under ``models/`` and one line in ``FAMILIES``.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from mpcore.models.common.family import Family
from mpcore.models.common.hf_io import read_hf_config
from mpcore.models.glm4v.family import FAMILY as GLM4V
from mpcore.models.llama.family import FAMILY as LLAMA
from mpcore.models.qwen2_vl.family import FAMILY as QWEN2_VL
from mpcore.models.qwen3_5.family import FAMILY as QWEN3_5
from mpcore.models.qwen3_5_moe.family import FAMILY as QWEN3_5_MOE
from mpcore.models.qwen3_5_vl.family import FAMILY as QWEN3_5_VL
from mpcore.models.qwen3_5_vl_moe.family import FAMILY as QWEN3_5_VL_MOE
from mpcore.models.qwen3_moe.family import FAMILY as QWEN3_MOE
from mpcore.models.qwen3_vl.family import FAMILY as QWEN3_VL
from mpcore.models.qwen3_vl_moe.family import FAMILY as QWEN3_VL_MOE

FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLAMA, QWEN2_VL, QWEN3_VL, GLM4V, QWEN3_5, QWEN3_5_VL, QWEN3_MOE,
                        QWEN3_VL_MOE, QWEN3_5_MOE, QWEN3_5_VL_MOE)}


def family_named(name: str) -> Family:
    """The family called ``name``; ``ValueError`` naming the closest ones otherwise."""
    if name in FAMILIES:
        return FAMILIES[name]
    close = difflib.get_close_matches(str(name), list(FAMILIES), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(f"unknown model family {name!r}{hint}; the families are {sorted(FAMILIES)}")


def family_of_hf(source: str | Path | dict) -> Family:
    """The family of a HF checkpoint (folder, config.json or its dict), by ``architectures``
    (a config made in memory without them: by ``model_type``). ``ValueError`` naming the
    architecture and every supported one otherwise."""
    hf = read_hf_config(source)
    archs = hf.get("architectures") or []
    for family in FAMILIES.values():
        if len(archs) == 1 and archs[0] in family.hf_architectures:
            return family
    if not archs:
        for family in FAMILIES.values():
            if hf.get("model_type") in family.hf_model_types:
                return family
    supported = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                     f"{supported}")


def family_of(cfg) -> Family:
    """The family whose config type ``cfg`` is."""
    for family in FAMILIES.values():
        if type(cfg) is family.config_type:
            return family
    raise TypeError(f"{type(cfg).__name__} is no family's config; the families' configs are "
                    f"{[f.config_type.__name__ for f in FAMILIES.values()]}")
