"""A released-format checkpoint whose tensors do not match its config.json is refused by name
before anything loads (issue 39): extra tensors, layers past num_hidden_layers, missing ones,
a config.json that is not JSON, an index naming an absent shard, a NaN in a weight; and the
tensors a family knowingly skips (Qwen3.5's mtp.*) are listed once in the log.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpcore.models import family_of_hf, read_hf_config
from mpcore.models.common.hf_check import check_tensor_names
from mpcore.parallel.state import ParallelState
from tests.dist import hf_tiny, qwen35_tiny


def _check(folder: Path) -> None:
    family = family_of_hf(folder)
    check_tensor_names(folder, family, family.config_from_hf(read_hf_config(folder)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    hf_tiny.save_hf_model("llama", 0, folder)
    return folder


def _copy(src: Path, dst: Path, edit=None, config=None) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_the_released_checkpoint_passes(llama):
    _check(llama)


def test_a_tensor_the_model_has_no_place_for_is_refused_by_name(llama, tmp_path):
    def extra(t):
        t["model.layers.1.mlp.foo.weight"] = torch.randn(4, 4)
    folder = _copy(llama, tmp_path / "extra", extra)
    with pytest.raises(ValueError, match=r"1 tensors the llama model has no place for "
                                         r"\(model\.layers\.1\.mlp\.foo\.weight\)"):
        _check(folder)


def test_weights_of_more_layers_than_config_json_says_are_refused(llama, tmp_path):
    folder = _copy(llama, tmp_path / "short", config={"num_hidden_layers": 1})
    with pytest.raises(ValueError, match=r"no place for .*model\.layers\.1\.input_layernorm"):
        _check(folder)


def test_a_missing_tensor_is_refused_by_name(llama, tmp_path):
    folder = _copy(llama, tmp_path / "missing",
                   lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"1 tensors it needs are missing "
                                         r"\(model\.layers\.0\.self_attn\.k_proj\.weight\)"):
        _check(folder)


def test_knowingly_skipped_tensors_are_listed_once(tmp_path, caplog):
    src = tmp_path / "q35"
    qwen35_tiny.make_hf_model(0).save_pretrained(src)
    hidden = read_hf_config(src)["hidden_size"]
    folder = _copy(src, tmp_path / "mtp", lambda t: t.update({
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    with caplog.at_level(logging.INFO, logger="mpcore.models.common.hf_check"):
        _check(folder)
    lines = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert len(lines) == 1 and "mtp.* (2)" in lines[0] and "inv_freq" in lines[0], lines


def test_a_config_json_that_is_not_json_names_the_file(llama, tmp_path):
    folder = _copy(llama, tmp_path / "badjson")
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n}")
    with pytest.raises(ValueError, match=r"badjson/config\.json is not valid JSON"):
        family_of_hf(folder)


def test_an_index_naming_an_absent_shard_names_it(llama, tmp_path):
    folder = _copy(llama, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:3]}, folder / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:3]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in names[3:]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"names shards that are not in .*: "
                                         r"model-00002-of-00002\.safetensors"):
        _check(folder)


def test_a_nan_in_a_weight_is_named_on_load(llama, tmp_path):
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    folder = _copy(llama, tmp_path / "nan", poison)
    family = family_of_hf(folder)
    _check(folder)  # the names are right; the values are not
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight in "
                                         r".* holds NaN values"):
        family.load_hf(folder, ParallelState())
