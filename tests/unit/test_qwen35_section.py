"""The qwen3_5 family's YAML section: the hybrid layers' keys (DeltaNet heads and widths,
layer_types, the conv, the rotary fraction) are the family's own, widths left out follow from
the shape; launch/configs/qwen35_0_8b.yaml is Qwen3.5-0.8B's text decoder (transformers'
parameter count on meta); ``model.gdn_kernel`` reaches the layers and is refused where a
family has no DeltaNet layers or the device cannot run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpcore import config as mpcore_config
from mpcore.build import build, resolve_device, resolve_model_config, setup
from mpcore.config import load_config
from mpcore.models.common.hybrid.kernels import GDN_KERNELS
from mpcore.models.registry import family_named

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "launch" / "configs"
RELEASED = json.loads((REPO / "tests" / "dist" / "qwen35_0p8b_config.json").read_text())


def test_hybrid_keys_are_the_family_s_and_widths_follow_the_shape():
    _, tiny = resolve_model_config(load_config(CONFIGS / "qwen35_tiny.yaml"))
    assert (tiny.linear_num_key_heads, tiny.linear_num_value_heads, tiny.linear_key_head_dim,
            tiny.linear_value_head_dim) == (2, 4, 32, 32)  # num_heads / 2, num_heads, head_dim
    types = "[full_attention,linear_attention,linear_attention,full_attention]"
    _, cfg = resolve_model_config(load_config(CONFIGS / "qwen35_tiny.yaml", [
        "model.linear_num_key_heads=1", "model.linear_value_head_dim=16",
        f"model.layer_types={types}", "model.linear_conv_kernel_dim=3"]))
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (1, 4, 32, 16, 3)
    assert cfg.layer_types == ("full_attention", "linear_attention", "linear_attention",
                               "full_attention")
    with pytest.raises(ValueError, match=r"linear_num_key_heads is set but the llama family takes "
                                         r"none; set model.family to one of \['qwen3_5', 'qwen3_5_moe'\]"):
        load_config(None, ["model.family=llama", "model.linear_num_key_heads=2"])
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        resolve_model_config(load_config(CONFIGS / "qwen35_tiny.yaml",
                                         ["model.layer_types=[full_attention]"]))


def test_qwen35_0_8b_yaml_is_the_released_text_decoder():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    _, ours = resolve_model_config(load_config(CONFIGS / "qwen35_0_8b.yaml"))
    family = family_named("qwen3_5")
    released = family.config_from_hf({**RELEASED["text_config"],
                                      "architectures": ["Qwen3_5ForCausalLM"]})
    assert ours == released
    text = {k: v for k, v in RELEASED["text_config"].items()
            if k not in ("attn_output_gate", "mtp_num_hidden_layers")}
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).parameters())
    assert family.num_params(ours)["total"] == theirs  # tied: no separate head


def test_gdn_kernel_choice_reaches_the_layers_and_bad_uses_are_refused(tmp_path):
    assert mpcore_config.GDN_KERNELS == GDN_KERNELS
    overrides = [f"logging.run_dir={tmp_path / 'run'}", "data.cache_dir=" + str(tmp_path),
                 "training.device=cpu", "model.gdn_kernel=reference"]
    cfg = load_config(CONFIGS / "qwen35_tiny.yaml", overrides)
    run = build(cfg, setup(cfg), resolve_device(cfg))
    kernels = {m.gdn_kernel for m in run.model.modules() if hasattr(m, "gdn_kernel")}
    assert kernels == {"reference"}
    with pytest.raises(ValueError, match="model.gdn_kernel=fla is set but the llama family has "
                                         "no Gated DeltaNet layers"):
        load_config(None, ["model.gdn_kernel=fla"])
    with pytest.raises(ValueError, match="gdn_kernel must be one of"):
        load_config(CONFIGS / "qwen35_tiny.yaml", ["model.gdn_kernel=triton"])
    with pytest.raises(ValueError, match="gdn_kernel='fla' needs a CUDA device"):
        cfg = load_config(CONFIGS / "qwen35_tiny.yaml", [*overrides[:-1], "model.gdn_kernel=fla"])
        build(cfg, setup(cfg), resolve_device(cfg))
