"""Multi-token prediction's bad input, each refused with a ValueError that names the config key
or the checkpoint folder and the fix: a non-finite or negative weight (YAML section and a run
from a checkpoint), a positive weight on a checkpoint without MTP layers (text, MoE, VL), a
depth the trainer does not have (a checkpoint with 2 MTP layers loads and scores at weight 0,
is refused at > 0); and when MTP is off the ``mtp.*`` tensors are skipped in ONE log line."""

from __future__ import annotations

import json
import logging

import pytest
from safetensors.torch import load_file, save_file

from mpcore.build import resolve_model_config
from mpcore.config import load_config
from mpcore.models.common.hybrid.hf import load_hf
from mpcore.models.qwen3_5 import FAMILY
from mpcore.parallel.state import ParallelState
from tests.dist.qwen35_mtp_tiny import make_checkpoint
from tests.dist.qwen35_tiny import make_hf_model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad") / "ckpt"
    make_checkpoint(folder)
    return folder


@pytest.mark.parametrize("weight", ["nan", "inf", "-0.5"])
def test_bad_weights_name_the_key(release, weight):
    with pytest.raises(ValueError, match=r"^model\.mtp_loss_weight must be a finite number"):
        resolve_model_config(load_config(None, [
            "model.family=qwen3_5", "model.mtp_num_hidden_layers=1",
            f"model.mtp_loss_weight={weight}"]))
    with pytest.raises(ValueError, match=rf"^model\.mtp_loss_weight with model\.init_from="
                                         rf"{release}: .* finite number >= 0"):
        resolve_model_config(load_config(None, [f"model.init_from={release}",
                                                f"model.mtp_loss_weight={weight}"]))


def test_checkpoints_without_mtp_refuse_a_weight_naming_the_folder(tmp_path):
    from tests.dist.hf_qwen35_vl_tiny import save_hf_model as save_vl
    from tests.dist.qwen35_moe_tiny import save_hf_model as save_moe

    text, moe, vl = tmp_path / "text", tmp_path / "moe", tmp_path / "vl"
    make_hf_model(seed=1).save_pretrained(text)
    save_moe(1, moe)
    save_vl(1, vl)
    with pytest.raises(ValueError, match=rf"^model\.mtp_loss_weight with model\.init_from="
                                         rf"{text}: .*needs an MTP layer"):
        resolve_model_config(load_config(None, [f"model.init_from={text}",
                                                "model.mtp_loss_weight=0.5"]))
    from mpcore.models.registry import family_of_hf

    for folder in (text, moe, vl):
        family = family_of_hf(folder)
        with pytest.raises(ValueError, match=rf"^{folder}: .*needs an MTP layer .*set "
                                             rf"model\.mtp_loss_weight=0"):
            family.load_hf(folder, ParallelState(), mtp_loss_weight=0.5)


def test_a_deeper_checkpoint_loads_at_weight_zero_and_is_refused_above(release, tmp_path,
                                                                        caplog):
    deep = tmp_path / "deep"
    deep.mkdir()
    config = json.loads((release / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 2}))
    tensors = load_file(release / "model.safetensors")
    second = {k.replace("mtp.layers.0.", "mtp.layers.1."): v.clone() for k, v in tensors.items()
              if k.startswith("mtp.layers.0.")}
    save_file({**tensors, **second}, deep / "model.safetensors", metadata={"format": "pt"})
    cfg = FAMILY.config_from_hf(deep)
    assert cfg.mtp_num_hidden_layers == 2 and not cfg.uses_mtp
    with caplog.at_level(logging.INFO):
        model, _ = FAMILY.load(deep, ParallelState(), cfg, gdn_kernel="reference")
    assert model.mtp is None
    lines = [r.getMessage() for r in caplog.records if "mtp" in r.getMessage()]
    num = sum(1 for k in (*tensors, *second) if k.startswith("mtp."))
    assert len(lines) == 1 and f"mtp.* ({num})" in lines[0], lines  # one line, not per tensor
    with pytest.raises(ValueError, match=rf"^{deep}: model\.mtp_loss_weight=0.5 trains one "
                                         rf"MTP layer .*mtp_num_hidden_layers=2"):
        load_hf(deep, ParallelState(), mtp_loss_weight=0.5)
    from mpcore.launch.score import main

    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    args = ["--hf-checkpoint", str(deep), "--input", str(tmp_path / "in.jsonl")]
    assert main([*args, "--output", str(tmp_path / "main.jsonl")]) == 0
    assert main([*args, "--mtp", "--output", str(tmp_path / "mtp.jsonl")]) == 2
