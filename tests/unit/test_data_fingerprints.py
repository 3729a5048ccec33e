"""The data a run reads is fingerprinted by content: an image-text dataset re-prepared at the
same path with other images refuses to resume (it resumed silently before), and the prepared
default text corpus is checked by content before a fresh run trains on it (a damaged cache is
rebuilt, with a line saying so)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpcore.config import load_config
from mpcore.data import prepare_default, prepare_vl_dataset
from mpcore.data.vl_default import DEFAULT_SETTINGS
from mpcore.train import train

REPO = Path(__file__).resolve().parents[2]
VL_TINY = REPO / "launch" / "configs" / "vl_tiny.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


def _vl_dataset(folder: Path, model: Path, seed: int) -> Path:
    """16 caption samples on 56x56 noise images drawn from ``seed``, prepared at ``folder``
    (replacing what is there): the same manifest and sizes for every seed, other pixels."""
    rng = np.random.default_rng(seed)
    src = folder.parent / f"src-{seed}"
    src.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(16):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(src / f"{i}.png")
        lines.append({"image": f"{i}.png", "caption": f"picture number {i} of a noisy test set, "
                                                      f"with a caption long enough to pack"})
    manifest = src / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return prepare_vl_dataset(manifest, folder, model, DEFAULT_SETTINGS, overwrite=True,
                              progress=False)


def vl_tiny(run_dir: Path, cache: Path, *overrides: str):
    return load_config(str(VL_TINY), [
        "model.vocab_size=516", "model.hidden_size=32", "model.num_heads=4",
        "model.num_kv_heads=1", "model.intermediate_size=64", "model.mrope_section=[2,1,1]",
        "model.vision.hidden_size=32", "model.vision.num_heads=2",
        "model.vision.intermediate_size=64", f"data.cache_dir={cache}",
        "data.default_vocab_size=512", "data.micro_batch=1", "training.device=cpu",
        "schedule.total_steps=8", f"logging.run_dir={run_dir}", "checkpoint.every=2",
        *overrides])


@pytest.mark.slow
def test_vl_dataset_reprepared_with_other_images_refuses_to_resume(tmp_path, cache):
    folder = tmp_path / "vl" / "set"
    _vl_dataset(folder, cache / "default_v512.model", seed=0)
    run_dir = tmp_path / "run"
    args = [f"data.vl_paths=[{folder}]"]
    assert train(vl_tiny(run_dir, cache, *args, "training.max_steps=2")).step == 2
    moved = tmp_path / "moved" / "set"
    shutil.copytree(folder, moved)  # the same content elsewhere: resumes, logged
    _vl_dataset(folder, cache / "default_v512.model", seed=1)  # same path, other images
    with pytest.raises(ValueError) as err:
        train(vl_tiny(run_dir, cache, *args, "training.max_steps=4"))
    message = str(err.value)
    assert f"cannot resume {run_dir / 'checkpoints' / 'step-2'}" in message
    assert "  data.vl_paths: [" in message and "checkpoint.accept_changes=[data.vl_paths]" in (
        message)
    result = train(vl_tiny(run_dir, cache, f"data.vl_paths=[{moved}]", "training.max_steps=3"))
    assert result.step == 3 and len(result.losses) == 1


def _text_tiny(run_dir: Path, cache: Path):
    return load_config(None, [
        "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
        "model.intermediate_size=64", f"data.cache_dir={cache}", "data.default_vocab_size=512",
        "data.seq_len=32", "data.micro_batch=2", "training.device=cpu", "training.max_steps=2",
        "checkpoint.every=0", f"logging.run_dir={run_dir}"])


@pytest.mark.slow  # two short trainings per case
@pytest.mark.parametrize("damage", ["flipped .bin", "truncated .idx", "other tokenizer"])
def test_damaged_text_cache_is_rebuilt_before_a_fresh_run(tmp_path, cache, caplog, damage):
    """The stamp matches, the files are there, but their bytes changed since they were prepared:
    the run rebuilds them (naming the file) and trains on the real corpus, the same losses as on
    an intact cache. Before, it trained on the damaged bytes (or failed far from the cause)."""
    reference = train(_text_tiny(tmp_path / "reference", cache)).losses
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    stem = copy / "default_v512"
    victim = {"flipped .bin": stem.with_suffix(".bin"), "truncated .idx": stem.with_suffix(".idx"),
              "other tokenizer": stem.with_suffix(".model")}[damage]
    original = victim.read_bytes()
    if damage == "flipped .bin":
        victim.write_bytes(original[:100] + bytes(b ^ 0x5A for b in original[100:4100])
                           + original[4100:])
    elif damage == "truncated .idx":
        victim.write_bytes(original[:-16])
    else:
        prepare_default(tmp_path / "other", 520)
        shutil.copy(tmp_path / "other" / "default_v520.model", victim)
    with caplog.at_level(logging.WARNING):
        losses = train(_text_tiny(tmp_path / "run", copy)).losses
    assert (f"the prepared default corpus in {copy} is damaged ({victim} does not match the "
            f"sha256 recorded when it was prepared); preparing it again") in caplog.text
    assert victim.read_bytes() == original and losses == reference
