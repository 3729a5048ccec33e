"""Training in one process: the default command, resume (bit-identical), a crash mid-save,
SIGTERM, non-finite steps, bad inputs, export to Hugging Face format."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mpcore.build import build, resolve_device, setup
from mpcore.checkpoint import latest_checkpoint
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.data.tokenizer import Tokenizer
from mpcore.metrics import KEYS
from mpcore.models import load_hf_model
from mpcore.parallel.state import ParallelState
from mpcore.train import Trainer, TrainingDiverged, train

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


def tiny(tmp, data_dir, run="run", *overrides):
    return load_config(None, [
        "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=128",
        f"data.cache_dir={data_dir}", "data.default_vocab_size=512", "data.seq_len=64",
        "data.micro_batch=2", "data.grad_accum=2", "optimizer.lr=1e-2",
        "schedule.warmup_steps=2", f"training.max_steps={STEPS}", "training.device=cpu",
        f"logging.run_dir={tmp}/{run}", "logging.log_every=100", "checkpoint.every=0", *overrides])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
    """8 steps in one go: the reference for resumed runs."""
    return train(tiny(tmp_path_factory.mktemp("straight"), data_dir)).losses


def test_resume_is_bit_identical(tmp_path, data_dir, straight):
    first = train(tiny(tmp_path, data_dir, "run", "checkpoint.every=4", "training.max_steps=4",
                       f"schedule.total_steps={STEPS}"))
    assert first.losses == straight[:4]
    second = train(tiny(tmp_path, data_dir, "run", "checkpoint.every=4",
                        f"schedule.total_steps={STEPS}"))
    assert second.losses == straight[4:]  # exact: same data, weights, optimizer, RNG
    assert straight[-1] < straight[0] - 0.1


def test_crash_between_write_and_rename_keeps_previous(tmp_path, data_dir, straight):
    def crash(stage, path):
        if stage == "written" and path.name == "tmp-step-4":
            raise KeyboardInterrupt("killed mid-save")

    cfg = tiny(tmp_path, data_dir, "run", "checkpoint.every=2")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, checkpoint_hook=crash)
    root = cfg.checkpoint_dir
    assert (root / "tmp-step-4" / ".metadata").is_file()  # complete data, never renamed
    assert (root / "latest").read_text().strip() == "step-2"
    assert latest_checkpoint(root) == root / "step-2"
    (root / "latest").write_text("step-99\n")  # a stale pointer falls back to the newest
    assert latest_checkpoint(root) == root / "step-2"
    resumed = train(cfg)
    assert resumed.losses == straight[2:]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-6", "step-8"]


def fit_with_sigterm_in_step_3(cfg):
    """``fit`` of a fresh run of ``cfg`` that gets SIGTERM while step 3 reads its data."""
    run = build(cfg, setup(cfg), resolve_device(cfg))
    next_step = run.loader.next_step

    def next_step_then_sigterm():
        if run.loader.consumed == 2 * 4:  # during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return next_step()

    run.loader.next_step = next_step_then_sigterm
    return Trainer(run).fit()


def test_sigterm_saves_and_stops(tmp_path, data_dir, straight):
    cfg = tiny(tmp_path, data_dir)
    result = fit_with_sigterm_in_step_3(cfg)
    assert (result.status, result.step) == ("preempted", 3)
    assert latest_checkpoint(cfg.checkpoint_dir).name == "step-3"
    assert train(cfg).losses == straight[3:]


def poisonable(cfg):
    """(run, trainer, poison) for ``cfg``: while ``poison["on"]``, the final norm's output is
    NaN, so the step's loss and gradients are."""
    run = build(cfg, setup(cfg), resolve_device(cfg))
    poison = {"on": False}
    run.model.norm.register_forward_hook(
        lambda module, args, out: out * float("nan") if poison["on"] else out)
    return run, Trainer(run), poison


def test_non_finite_steps_are_skipped_then_stop(tmp_path, data_dir):
    cfg = tiny(tmp_path, data_dir, "run", "checkpoint.every=1", "training.max_bad_steps=2")
    run, trainer, poison = poisonable(cfg)
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    poison["on"] = True
    loss, norm = trainer.train_step()
    assert math.isnan(loss) and (trainer.bad_steps, trainer.consecutive_bad) == (1, 1)
    assert all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    poison["on"] = False
    loss, _ = trainer.train_step()
    assert math.isfinite(loss) and trainer.consecutive_bad == 0
    assert not all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    trainer.save()
    poison["on"] = True
    with pytest.raises(TrainingDiverged, match="training.max_bad_steps=2"):
        trainer.fit()
    assert trainer.step == 5 and trainer.bad_steps == 3
    # Skipped steps never touched the weights, and no periodic save ran inside the streak.
    good = Trainer(build(cfg, setup(cfg), resolve_device(cfg)))
    assert good.resume().name == "step-3" and good.step == 3  # none saved in the streak
    assert all(torch.isfinite(p).all() for p in good.run.model.parameters())


def test_bad_inputs_name_file_value_and_fix(tmp_path, data_dir):
    prefix, model = data_dir / "default_v512", data_dir / "default_v512.model"
    cfg = tiny(tmp_path, data_dir, "run", f"data.paths=[{prefix}]", f"data.tokenizer={model}",
               "model.vocab_size=300")
    with pytest.raises(ValueError, match=r"default_v512\.bin holds token id \d+, but the model's "
                                         r"vocab_size is 300.*set model.vocab_size >= 512"):
        train(cfg)
    cfg = tiny(tmp_path, data_dir, "run", f"data.paths=[{prefix}]",
               f"data.tokenizer={tmp_path}/nope.model")
    with pytest.raises(ValueError, match=r"nope\.model does not exist; create it with: python "
                                         r"launch/prepare_data.py"):
        train(cfg)
    cfg = tiny(tmp_path, data_dir, "run", f"data.paths=[{tmp_path}/missing]",
               f"data.tokenizer={model}")
    with pytest.raises(ValueError, match=r"missing\.idx does not exist; create it with"):
        train(cfg)
    cfg = tiny(tmp_path, data_dir, "run", "parallel.tp=2")
    with pytest.raises(ValueError, match=r"my\.yaml: parallel.tp=2 x parallel.cp=1 = 2 ranks per "
                                         r"model replica does not divide the world size 1; "
                                         r"launch a multiple of 2 processes"):
        train(cfg, source="my.yaml")


def test_export_hf_roundtrip(tmp_path, data_dir):
    cfg = tiny(tmp_path, data_dir, "run", "checkpoint.every=2", "training.max_steps=2",
               "model.tie_embeddings=false")
    train(cfg)
    from mpcore.launch.export_hf import main

    umask = os.umask(0o077)  # a private umask: the export still gets normal modes
    try:
        assert main(["--checkpoint", str(cfg.checkpoint_dir / "step-2"),
                     "--output", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (
        data_dir / "default_v512.model").read_bytes()
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "tokenizer.model": 0o644,
        "tokenizer.json": 0o644, "tokenizer_config.json": 0o644,
        "special_tokens_map.json": 0o644}
    import transformers

    text = "Exported: the same ids, 42 of them?\n  indented"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = Tokenizer(data_dir / "default_v512.model")
    assert hf_tok(text)["input_ids"] == ours.encode(text)
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "hf")  # the tokenizer's ids
    assert (hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id) == (
        ours.bos_id, ours.eos_id, ours.eos_id)
    assert hf_tok.eos_token_id == hf_cfg.eos_token_id < hf_cfg.vocab_size
    exported, _ = load_hf_model(tmp_path / "hf", ParallelState())
    trained = build(cfg, setup(cfg), resolve_device(cfg))
    Trainer(trained).resume()
    for name, param in trained.model.named_parameters():
        assert torch.equal(param, dict(exported.named_parameters())[name]), name


@pytest.mark.slow
def test_default_command_trains_and_resumes(tmp_path):
    """``torchrun launch/pretrain.py`` with nothing but a step count: the tiny model on the
    shipped corpus; the loss falls; a second launch resumes from the saved checkpoint."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                str(REPO / "launch" / "pretrain.py")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    common = ["schedule.warmup_steps=2", "logging.log_every=1", "training.device=cpu"]
    done = subprocess.run([*torchrun, "training.max_steps=3", *common], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(set(r) == set(KEYS)
                                                                for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.05, records
    assert records[0]["mfu"] is None and records[0]["tokens_per_s"] > 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["max_steps"] == 3
    again = subprocess.run([*torchrun, "training.max_steps=4", *common], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "done at step 4" in again.stdout
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    shutil.rmtree(tmp_path / "runs" / "data")


def test_startup_block_step_times_checkpoint_lines_and_validation(tmp_path, data_dir, caplog,
                                                                     capsys):
    cfg = tiny(tmp_path, data_dir, "run", "data.valid_fraction=0.1", "training.eval_every=2",
               "training.eval_batches=2", "training.max_steps=3", "logging.log_every=1",
               "checkpoint.every=2")
    with caplog.at_level(logging.INFO, logger="mpcore.train"):
        result = train(cfg, source="my.yaml")
    assert result.status == "done"
    logs = caplog.text
    for line in ("config: my.yaml", "world 1 = tp 1 x cp 1 x dp 1; data parallel: none",
                 "parameters: ", "tokens per step: 256 (micro_batch 2 x seq_len 64 x "
                 "grad_accum 2 x dp 1)", "held out: ", "(data.valid_fraction=0.1); validation "
                 "loss every 2 steps, 2 micro-batches", f"run dir: {tmp_path}/run",
                 f"checkpoints: {cfg.checkpoint_dir} (every 2 steps, keep 2)"):
        assert line in logs, (line, logs)
    assert re.search(r"dataset: [\d,]+ documents, [\d,]+ tokens, [\d,]+ samples; 3 steps = "
                     r"0\.\d\d epochs", logs), logs
    assert re.search(rf"saved checkpoint {cfg.checkpoint_dir}/step-2 \(\d+\.\d s\)", logs)
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    assert all(re.search(r"step_s \d+\.\d{3}  elapsed \d:\d\d:\d\d  eta \d:\d\d:\d\d$", s)
               for s in steps), steps
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [("valid_loss" in r) for r in rows] == [False, True, True]
    assert all(set(KEYS) <= set(r) for r in rows) and 4 < rows[1]["valid_loss"] < 8
    # The held-out documents are the last 10% of the corpus, packed apart from the training ones.
    run = build(cfg, setup(cfg), resolve_device(cfg))
    train_docs, valid_docs = run.loader.samples, run.valid_loader.samples
    assert train_docs.dataset is valid_docs.dataset
    assert train_docs.end_token == valid_docs.first_token
    assert run.data.valid_docs == valid_docs.num_docs == len(train_docs.dataset) - run.data.num_docs


def test_sigint_saves_at_the_step_boundary_and_says_where(tmp_path, data_dir, straight, caplog):
    cfg = tiny(tmp_path, data_dir)
    run = build(cfg, setup(cfg), resolve_device(cfg))
    next_step = run.loader.next_step
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under a shell's background job

    def next_step_then_ctrl_c():
        if run.loader.consumed == 2 * 4:  # during step 3
            os.kill(os.getpid(), signal.SIGINT)
        return next_step()

    run.loader.next_step = next_step_then_ctrl_c
    with caplog.at_level(logging.INFO, logger="mpcore.train"):
        result = Trainer(run).fit()
    assert (result.status, result.step) == ("preempted", 3)
    assert (f"SIGINT: stopped after step 3; the last checkpoint is {cfg.checkpoint_dir}/step-3"
            in caplog.text)
    assert signal.getsignal(signal.SIGINT) is before  # the trainer's handler is removed
    assert train(cfg).losses == straight[3:]


def test_init_from_a_truncated_safetensors_names_the_file(tmp_path, data_dir):
    cfg = tiny(tmp_path, data_dir, "run", "checkpoint.every=1", "training.max_steps=1")
    train(cfg)
    from mpcore.launch.export_hf import export

    export(cfg.checkpoint_dir, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file "
                                         r"\(.*\): it is truncated or corrupt; download or "
                                         r"export it again"):
        load_hf_model(tmp_path / "hf", ParallelState())
