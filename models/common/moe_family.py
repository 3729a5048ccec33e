"""A MoE family derived from its dense family: what every MoE variant adds, written once.

    moe_variant(dense, **own)       the variant's registry record: the dense family's record
                                    (decoder and vision accessors, placeholder ids, modality,
                                    options, host inputs, image processing) with the variant's
                                    own config, I/O, counts and section (``own``), its local
                                    inputs the dense ones plus ``moe_mask``, and
                                    ``check_experts`` on its MoE decoder config
    with_moe_mask(local_inputs)     a family's ``local_inputs`` plus ``moe_mask [L]``
    with_moe_fields(type, dense, moe)  a MoE decoder config: ``dense``'s fields plus ``moe``'s

So a variant folder holds only what differs: its config type (the dense decoder's fields plus
the MoE ones), its HF names (``mpcore.models.common.moe_hf``), its model (the dense model with
``MoeBlock`` feed-forwards) and a short ``family.py`` calling :func:`moe_variant`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mpcore.models.common.family import Family
from mpcore.models.common.moe_model import moe_mask


def with_moe_mask(local_inputs: Callable) -> Callable:
    """``local_inputs`` (a family's: ``(state, input_ids, cu_seqlens, cfg, **kwargs) -> (plan,
    inputs)``) that also returns ``moe_mask [L]`` bool: true at real tokens (not cp padding),
    the rows the routing statistics count."""

    def local_moe_inputs(state, input_ids, cu_seqlens, cfg=None, **kwargs):
        plan, inputs = local_inputs(state, input_ids, cu_seqlens, cfg, **kwargs)
        inputs["moe_mask"] = moe_mask(plan, state, input_ids.device)
        return plan, inputs

    local_moe_inputs.__doc__ = f"``{local_inputs.__qualname__}`` plus ``moe_mask [L]``."
    return local_moe_inputs


def check_experts(cfg, ep: int) -> None:
    """``check_experts(ep)`` of the MoE decoder config: ``cfg`` itself, or ``cfg.text`` of a
    vision-language config."""
    getattr(cfg, "text", cfg).check_experts(ep)


def with_moe_fields(config_type: type, dense, moe: dict, where: str):
    """``config_type`` (a MoE decoder config) of every field of the dense decoder config
    ``dense`` plus the MoE fields in ``moe``; ``ValueError`` naming ``where`` (the class whose
    fields the keys are) for an unknown key."""
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
    try:
        return config_type(**{**fields, **moe})
    except TypeError as e:
        raise ValueError(f"model section: {e}; the MoE keys are {where}'s fields") from None


def moe_variant(dense: Family, **own) -> Family:
    """The MoE variant of ``dense`` (module docstring). ``own``: the record's fields that the
    variant replaces (name, config type, architectures, config readers and writers, build,
    load, export, shard map, counts, section; any other ``Family`` field too)."""
    own.setdefault("local_inputs", with_moe_mask(dense.local_inputs))
    own.setdefault("check_experts", check_experts)
    return dataclasses.replace(dense, **own)
