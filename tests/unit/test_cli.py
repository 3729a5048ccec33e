"""pretrain.py's command line: --help lists every key with its default and docstring,
--print-config trains nothing, misnamed config files and YAML syntax errors are named; the
cross-section checks of the config; the tensorboard extra."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpcore.cli import config_help, field_docs, parse_args
from mpcore.config import DataSection, load_config, to_dict, valid_keys
from mpcore.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "launch" / "pretrain.py"
TINY = REPO / "launch" / "configs" / "tiny.yaml"


def _pretrain(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(PRETRAIN), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_lists_every_key_with_default_and_docstring(tmp_path):
    text = config_help()
    for key in valid_keys():
        assert f"  {key} = " in text, key
    assert "  data.valid_fraction = 0.0\n" in text
    assert "  parallel.init_timeout_s = 300.0\n" in text
    assert "  data.paths = []\n" in text and "  model.head_dim = null\n" in text
    doc = " ".join(field_docs(DataSection)["seq_len"].split())
    assert doc == "Tokens per packed sample." and doc in text
    out = _pretrain("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "training.eval_every = 0" in out.stdout and "Exit codes" in out.stdout
    assert not (tmp_path / "runs").exists()


def test_print_config_prints_the_resolved_config_and_trains_nothing(tmp_path):
    out = _pretrain("--print-config", "optimizer.lr=1e-4", "training.max_steps=7", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == to_dict(load_config(TINY, ["optimizer.lr=1e-4",
                                                                     "training.max_steps=7"]))
    assert not (tmp_path / "runs").exists()  # no data prepared, no run folder


def test_config_path_without_yaml_suffix_is_named(tmp_path):
    (tmp_path / "my_config").write_text("training:\n  max_steps: 3\n")
    with pytest.raises(ValueError, match=r"'my_config' is not a config file: the first argument "
                                         r"is read as a config only when it ends in \.yaml or "
                                         r"\.yml \(rename it, e.g. my_config\.yaml\)"):
        parse_args(["my_config", "optimizer.lr=1"], TINY)
    with pytest.raises(ValueError, match=r"'lr' is not an override section.key=value"):
        parse_args([str(TINY), "optimizer.lr=1", "lr"], TINY)
    with pytest.raises(ValueError, match=r"unknown option '--lr'"):
        parse_args(["--lr"], TINY)
    args = parse_args([str(TINY), "optimizer.lr=1", "--print-config"], TINY)
    assert (args.config, args.overrides, args.print_config) == (TINY, ["optimizer.lr=1"], True)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  max_steps: 3\n   seed: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:3:\d+: YAML syntax error: .*; fix the file"):
        load_config(bad)
    bad.write_text("data:\n  paths: [a, b\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:\d+:\d+: YAML syntax error"):
        load_config(bad)


def test_cross_section_checks():
    with pytest.raises(ValueError, match=r"data\.seq_len=9000 exceeds model\."
                                         r"max_position_embeddings=8192: .*lower data\.seq_len "
                                         r"to <= 8192 or raise model\.max_position_embeddings"):
        load_config(None, ["data.seq_len=9000"])
    load_config(None, ["data.seq_len=9000", "model.max_position_embeddings=9000"])
    with pytest.raises(ValueError, match=r"training\.eval_every=5 needs held-out documents; set "
                                         r"data\.valid_fraction"):
        load_config(None, ["training.eval_every=5"])
    with pytest.raises(ValueError, match=r"data\.valid_fraction must be in \[0, 1\), got 1\.0"):
        load_config(None, ["data.valid_fraction=1"])
    with pytest.raises(ValueError, match=r"parallel\.init_timeout_s must be > 0"):
        load_config(None, ["parallel.init_timeout_s=0"])
    cfg = load_config(None, ["data.valid_fraction=0.1", "training.eval_every=5"])
    assert dataclasses.asdict(cfg)["training"]["eval_batches"] == 4


def test_tensorboard_is_an_extra(tmp_path):
    extras = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    assert re.search(r'^tensorboard = \["tensorboard>=[\d.]+"\]$', extras, re.M)
    MetricsWriter(tmp_path, True, tensorboard=False).log(
        {"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 1.0, "tokens_per_s": 1.0,
         "tflops": 1.0, "mfu": None, "mem_gib": 1.0})
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here: the missing-package message cannot show")
    with pytest.raises(ValueError, match=r'needs the tensorboard package .*pip install -e '
                                         r'"\.\[tensorboard\]"'):
        MetricsWriter(tmp_path, True, tensorboard=True)


@pytest.mark.slow
def test_init_from_a_file_is_named_before_any_work(tmp_path):
    """model.init_from pointing at config.json (or the weights) instead of their folder: one
    message that says so, exit 2, no data prepared and no run folder. Before, a config.json
    was read as if it were the folder and the weights then failed far from the cause."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for target in (hf / "config.json", hf / "model.safetensors"):
        target.touch()
        out = _pretrain(f"model.init_from={target}", f"logging.run_dir={tmp_path / 'run'}",
                        cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith(f"error: model.init_from={target} is a file, not a folder; "
                                     f"pass the Hugging Face checkpoint folder"), out.stderr
        assert f"(here perhaps {hf})" in out.stderr
        assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_tokenizer_without_paths_is_refused_not_ignored(tmp_path):
    """data.tokenizer alone used to be ignored (the default corpus trains its own tokenizer):
    a run would train and export with another vocabulary than the user named."""
    out = _pretrain(f"data.tokenizer={tmp_path / 'mine.model'}",
                    f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith(f"error: data.tokenizer={tmp_path / 'mine.model'} is set but "
                            f"data.paths is empty"), out.stderr
    assert "python launch/prepare_data.py --input launch/data/default_corpus.jsonl" in first
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="a VL run uses the tokenizer its datasets were "
                                         "prepared with"):
        load_config(None, ["data.tokenizer=t.model", "data.vl_paths=[vl]"])
    assert load_config(None, ["data.tokenizer=t.model", "data.paths=[x]"]).data.tokenizer
