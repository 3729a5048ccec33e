"""Our YAML model section of the Qwen3.5 hybrid decoder, and its config from a section or a
checkpoint's meta.json (the qwen3_5 family's; the qwen3_5_vl and MoE families build their
decoder with ``decoder_from_fields``)."""

from __future__ import annotations

import dataclasses

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.section import DecoderSection, section_of


def config_from_dict(d: dict) -> Qwen35Config:
    """``Qwen35Config`` of ``dataclasses.asdict(cfg)`` (a checkpoint's meta.json)."""
    d = dict(d)
    if d.get("layer_types") is not None:
        d["layer_types"] = tuple(d["layer_types"])
    return Qwen35Config(**d)


DERIVED = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim")
"""The DeltaNet widths a YAML section may leave out (null): they then follow from the shape
fields (``decoder_from_fields``)."""

Qwen35Section = section_of(Qwen35Config, "Qwen35Section", skip=ModelConfig,
                           bases=(DecoderSection,), defaults=dict.fromkeys(DERIVED),
                           module=__name__)
"""Our YAML model section of the qwen3_5 family: the decoder's keys plus ``Qwen35Config``'s
own (``layer_types`` / ``full_attention_interval``, ``partial_rotary_factor``, the DeltaNet
heads and widths, ``linear_conv_kernel_dim``)."""


def hybrid_fields(section) -> dict:
    """The ``Qwen35Config`` keyword arguments of a section's own keys (``Qwen35Section``'s
    beyond the decoder's) that are given (not null)."""
    own = set(dataclasses.fields(Qwen35Section)) - set(dataclasses.fields(DecoderSection))
    return {f.name: getattr(section, f.name) for f in own
            if getattr(section, f.name, None) is not None}


def config_from_section(section, token_ids: dict | None) -> Qwen35Config:
    """The decoder of our YAML model section (``Qwen35Section``): the shape fields and the
    hybrid layers' keys; DeltaNet widths left null follow from the shape fields
    (``decoder_from_fields``)."""
    del token_ids
    return decoder_from_fields({**section.shape_fields(), **hybrid_fields(section)}, "qwen3_5")


def decoder_from_fields(fields: dict, family: str, mrope: bool = False) -> Qwen35Config:
    """The ``Qwen35Config`` of a YAML model section's fields. Each DeltaNet width not among
    them follows from the shape: ``num_heads`` value heads and ``num_heads / 2`` key heads,
    ``head_dim`` wide (the conv of 4 taps, every 4th layer full attention and a quarter of
    each head rotated are ``Qwen35Config``'s defaults). ``mrope``: the section's M-RoPE
    sections are the decoder's (the vision-language family, interleaved), else they are
    refused like the other keys the ``family`` has no use for."""
    fields = dict(fields)
    refused = [("qkv_bias", "attention biases"), ("rope_scaling", "RoPE scaling")]
    if mrope:
        fields["mrope_interleaved"] = fields.get("mrope_section") is not None
    else:
        refused.append(("mrope_section", "M-RoPE sections"))
    for key, why in refused:
        if fields.pop(key):
            raise ValueError(f"model.{key} is set but the {family} family has no {why}; "
                             f"remove it")
    if fields.get("layer_types") is not None:
        fields["layer_types"] = tuple(fields["layer_types"])
    shape = Qwen35Config(**{k: v for k, v in fields.items() if k not in DERIVED})
    derived = {"linear_num_key_heads": max(1, shape.num_heads // 2),
               "linear_num_value_heads": shape.num_heads,
               "linear_key_head_dim": shape.head_dim, "linear_value_head_dim": shape.head_dim}
    return Qwen35Config(**{**derived, **fields})
