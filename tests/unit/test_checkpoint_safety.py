"""Progress is never lost or corrupted silently: verified checkpoints with fallback, one run per
folder, resume that checks what it resumes, metrics that match the checkpoint, and no saves (or a
clean exit) inside a non-finite streak. Each test fails on the code before these checks."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpcore.build import build, resolve_device, setup
from mpcore.checkpoint import (
    CheckpointError,
    newest_finite,
    save_checkpoint,
    verify_checkpoint,
)
from mpcore.config import load_config, to_dict
from mpcore.data import prepare_default
from mpcore.resume_check import compare
from mpcore.rundir import rewrite_metrics
from mpcore.train import Trainer, TrainingDiverged, train

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
STEPS = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


TINY = [
    "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.intermediate_size=128", "data.default_vocab_size=512",
    "data.seq_len=64", "data.micro_batch=2", "data.grad_accum=2", "optimizer.lr=1e-2",
    "schedule.warmup_steps=2", f"training.max_steps={STEPS}", "training.device=cpu",
    "logging.log_every=1", "checkpoint.every=2"]


def overrides_for(run_dir, data_dir, *overrides) -> list[str]:
    return [*TINY, f"data.cache_dir={data_dir}", f"logging.run_dir={run_dir}", *overrides]


def tiny(run_dir, data_dir, *overrides):
    return load_config(None, overrides_for(run_dir, data_dir, *overrides))


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir):
    """8 steps saved every 2 (step-6 and step-8 kept): (run folder, losses)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    result = train(tiny(run_dir, data_dir))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-6", "step-8"]
    return run_dir, result.losses


@pytest.fixture
def copy(base, tmp_path):
    """A private copy of the base run folder."""
    shutil.copytree(base[0], tmp_path / "run")
    return tmp_path / "run"


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def flip(path: Path, offset: int = 64, length: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    end = min(len(data), offset + length)
    data[offset:end] = bytes(b ^ 0xFF for b in data[offset:end])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped distcp": lambda f: flip(f / "__0_0.distcp"),
    "truncated distcp": lambda f: truncate(f / "__0_0.distcp"),
    "truncated .metadata": lambda f: truncate(f / ".metadata"),
    "corrupt meta.json": lambda f: (f / "meta.json").write_text("{not json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_falls_back_to_older(copy, data_dir, base, damage, caplog):
    DAMAGE[damage](copy / "checkpoints" / "step-8")
    cfg = tiny(copy, data_dir, f"training.max_steps={STEPS}")
    with caplog.at_level(logging.WARNING):
        result = train(cfg)
    assert result.losses == base[1][6:]  # resumed from step-6, exactly the original curve
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert f"checkpoint {copy / 'checkpoints' / 'step-8'} cannot be used" in warned
    assert "resuming from the older" in warned and "step-6" in warned
    assert (copy / "checkpoints" / "bad-step-8").is_dir()  # kept for inspection, not loaded
    assert [r["step"] for r in rows(copy)] == list(range(1, STEPS + 1))


def test_verify_names_the_problem(copy):
    folder = copy / "checkpoints" / "step-8"
    assert verify_checkpoint(folder) == []
    flip(folder / "__0_0.distcp")
    assert "__0_0.distcp does not match its sha256" in verify_checkpoint(folder)[0]
    truncate(folder / ".metadata")
    assert any(".metadata has" in p and "truncated" in p for p in verify_checkpoint(folder))


def test_no_usable_checkpoint_refuses_instead_of_starting_over(copy, data_dir, base):
    root = copy / "checkpoints"
    flip(root / "step-8" / "__0_0.distcp")
    (root / "step-6" / ".metadata").unlink()  # as after a save that never finished
    (root / "step-6" / "manifest.json").unlink()
    (root / "latest").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(CheckpointError) as err:
        train(tiny(copy, data_dir))
    message = str(err.value)
    assert f"{root / 'step-8'}: " in message and "sha256" in message
    assert f"{root / 'step-6'}: no manifest.json" in message
    assert "checkpoint.overwrite=true" in message and "move these folders away" in message
    assert (root / "step-8").is_dir() and (root / "step-6").is_dir()  # nothing deleted
    # The fix that message names: start over in place.
    result = train(tiny(copy, data_dir, "checkpoint.resume=false", "checkpoint.overwrite=true"))
    assert result.losses == base[1]
    assert [r["step"] for r in rows(copy)] == list(range(1, STEPS + 1))


def test_damaged_latest_pointer_is_named(copy, data_dir, caplog):
    (copy / "checkpoints" / "latest").write_text("garbage\n")
    with caplog.at_level(logging.WARNING):
        result = train(tiny(copy, data_dir))
    assert result.status == "finished"
    assert f"checkpoint pointer {copy / 'checkpoints' / 'latest'} is damaged" in caplog.text


def test_resume_false_in_an_old_folder_refuses(copy, data_dir, base):
    with pytest.raises(ValueError, match=r"checkpoint.resume=false but .*checkpoints holds "
                                         r"checkpoints.*checkpoint.overwrite=true"):
        train(tiny(copy, data_dir, "checkpoint.resume=false"))
    assert (copy / "checkpoints" / "step-8").is_dir()
    assert len(rows(copy)) == STEPS
    result = train(tiny(copy, data_dir, "checkpoint.resume=false", "checkpoint.overwrite=true",
                        "training.max_steps=3", "schedule.total_steps=8", "checkpoint.every=0"))
    assert result.losses == base[1][:3]
    assert [r["step"] for r in rows(copy)] == [1, 2, 3]  # a fresh metrics.jsonl
    assert not list((copy / "checkpoints").glob("step-*"))


def test_second_run_on_a_folder_refuses(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mpcore.rundir import RunLock; "
         "lock = RunLock([sys.argv[1]]); print('locked', flush=True); time.sleep(120)",
         str(run_dir)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"is in use by another run \(pid {holder.pid} on "
                                             rf"host .*logging.run_dir="):
            train(tiny(run_dir, data_dir))
        assert not (run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: the folder is free again.
    assert train(tiny(run_dir, data_dir, "training.max_steps=1")).step == 1


def _permuted_copy(prefix: Path, out: Path, shuffle: bool) -> Path:
    """``prefix``'s dataset copied to ``out``; with ``shuffle``, the same size and documents
    but other tokens (what the index header and the sample count cannot tell apart)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(f"{prefix}.idx", f"{out}.idx")
    tokens = np.fromfile(f"{prefix}.bin", dtype="<u2")
    if shuffle:
        tokens = np.random.default_rng(0).permutation(tokens)
    tokens.tofile(f"{out}.bin")
    return out


def test_resume_refuses_changes_that_change_the_run(tmp_path, data_dir, caplog):
    prefix, model = data_dir / "default_v512", data_dir / "default_v512.model"
    same = _permuted_copy(prefix, tmp_path / "ds" / "a", shuffle=False)
    other = _permuted_copy(prefix, tmp_path / "ds" / "b", shuffle=True)
    moved = _permuted_copy(prefix, tmp_path / "moved" / "a", shuffle=False)
    run_dir = tmp_path / "run"
    data = [f"data.tokenizer={model}", "schedule.total_steps=8"]
    train(tiny(run_dir, data_dir, f"data.paths=[{same}]", *data, "training.max_steps=4"))
    with pytest.raises(ValueError) as err:
        train(tiny(run_dir, data_dir, f"data.paths=[{other}]", *data))
    message = str(err.value)
    assert f"cannot resume {run_dir / 'checkpoints' / 'step-4'}" in message
    assert "  data.paths: [" in message and " -> [" in message
    assert "checkpoint.accept_changes=[data.paths]" in message and "logging.run_dir" in message
    with pytest.raises(ValueError) as err:
        train(tiny(run_dir, data_dir, f"data.paths=[{same}]", *data, "data.micro_batch=4",
                   "schedule.warmup_steps=3", "training.seed=1", "schedule.total_steps=10"))
    for line in ("data.global_batch: 4 -> 8", "schedule.warmup_steps: 2 -> 3",
                 "training.seed: 0 -> 1", "schedule.total_steps: 8 -> 10"):
        assert f"  {line}" in str(err.value)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-4"  # untouched
    # Safe changes (moved data of the same content, intervals, keep_last, max_steps) resume.
    with caplog.at_level(logging.INFO):
        result = train(tiny(run_dir, data_dir, f"data.paths=[{moved}]", *data,
                            "logging.log_every=2", "checkpoint.every=3",
                            "checkpoint.keep_last=3", "training.max_steps=5"))
    assert result.step == 5 and len(result.losses) == 1
    for line in ("logging.log_every: 1 -> 2", "checkpoint.every: 2 -> 3",
                 "checkpoint.keep_last: 2 -> 3", "training.max_steps: 4 -> 5",
                 "data.paths (same content)"):
        assert line in caplog.text, line
    # An explicit acceptance resumes on the other data.
    result = train(tiny(run_dir, data_dir, f"data.paths=[{other}]", *data,
                        "checkpoint.accept_changes=[data.paths]", "training.max_steps=6"))
    assert result.step == 6


def test_compare_sorts_changes_into_refused_and_allowed():
    saved = load_config(None, [])
    meta = {"config": to_dict(saved), "layout": {"dp": 2}}
    now = load_config(None, ["model.hidden_size=256", "model.freeze_vision=true",
                             "model.vision_cp=replicate", "data.vl_drop_long=true",
                             "data.micro_batch=2", "data.grad_accum=4", "parallel.tp=2",
                             "logging.log_every=3", "training.max_steps=300"])
    refused, allowed = compare(meta, now, 1, None)
    assert {k for k, _, _ in refused} == {"model.hidden_size", "model.freeze_vision",
                                          "data.vl_drop_long"}  # global batch 4x1x2 = 2x4x1
    assert {k for k, _, _ in allowed} == {
        "model.vision_cp", "data.micro_batch", "data.grad_accum", "parallel.tp",
        "logging.log_every", "training.max_steps",
        "schedule.total_steps (follows training.max_steps)"}


def test_metrics_after_resume_hold_each_step_once(copy, data_dir, base):
    shutil.rmtree(copy / "checkpoints" / "step-8")  # killed after logging step 8, before saving
    result = train(tiny(copy, data_dir))
    assert result.losses == base[1][6:]
    records = rows(copy)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(base[1], abs=0, rel=0)


def test_rewrite_metrics_drops_later_and_torn_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    assert rewrite_metrics(path, 2) == 1  # step 3; the torn line is kept aside, not counted
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "metrics.jsonl.corrupt-1").read_text() == '{"step": 4, "lo\n'


def test_finished_run_says_so(copy, data_dir, caplog):
    with caplog.at_level(logging.WARNING):
        result = train(tiny(copy, data_dir))
    assert (result.status, result.step, result.losses) == ("finished", STEPS, [])
    assert "is finished: it resumed at step 8 and training.max_steps=8" in caplog.text
    assert "raise training.max_steps" in caplog.text and "logging.run_dir" in caplog.text


def _poisoned_trainer(cfg, from_step: int) -> Trainer:
    """A trainer whose loss is NaN from optimizer step ``from_step`` on."""
    run = build(cfg, setup(cfg), resolve_device(cfg))
    trainer = Trainer(run)
    run.model.norm.register_forward_hook(
        lambda module, args, out: out * float("nan") if trainer.step + 1 >= from_step else out)
    return trainer


def test_streak_keeps_the_good_checkpoint_and_fails_at_max_steps(tmp_path, data_dir):
    # The case: keep_last=2, a save every 2 steps, NaN from step 3 on, to max_steps.
    cfg = tiny(tmp_path / "run", data_dir, "checkpoint.keep_last=2", "training.max_bad_steps=50")
    trainer = _poisoned_trainer(cfg, from_step=3)
    with pytest.raises(TrainingDiverged, match=r"reached training.max_steps=8 during a non-finite"
                                               r" streak: steps 3-8 .*newest checkpoint saved "
                                               r"from a finite state is .*step-2"):
        trainer.fit()
    assert sorted(p.name for p in cfg.checkpoint_dir.glob("step-*")) == ["step-2"]
    # max_bad_steps in a row: the message names the checkpoint that really is intact.
    cfg = tiny(tmp_path / "run2", data_dir, "training.max_bad_steps=3")
    with pytest.raises(TrainingDiverged, match=r"stopped after 3 non-finite steps in a row: "
                                               r"steps 5-7 .*finite state is .*step-4"):
        _poisoned_trainer(cfg, from_step=5).fit()
    assert sorted(p.name for p in cfg.checkpoint_dir.glob("step-*")) == ["step-2", "step-4"]


def test_rotation_keeps_the_newest_finite_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    for step, bad in ((1, 0), (2, 1), (3, 2)):  # steps 2 and 3: saved on SIGTERM in a streak
        save_checkpoint(root, step, {"x": torch.randn(4)}, {"step": step, "consecutive_bad": bad},
                        keep_last=1, rank=0)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-1", "step-3"]
    assert newest_finite(root) == root / "step-1"  # what a streak's abort message names


def test_streak_exit_code(tmp_path, data_dir):
    """launch/pretrain.py exits non-zero (3) when the run ends inside a non-finite streak."""
    cache = tmp_path / "data"
    shutil.copytree(data_dir, cache)
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "pretrain.py"), "model.vocab_size=512",
         "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", f"data.cache_dir={cache}",
         "data.default_vocab_size=512", "data.seq_len=32", "data.micro_batch=1",
         "optimizer.lr=1e30", "optimizer.grad_clip=0", "training.max_steps=4",
         "training.max_bad_steps=50", "training.device=cpu", "checkpoint.every=1",
         f"logging.run_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "during a non-finite streak" in proc.stderr


CHILD = """import json, sys
from mpcore.config import load_config, to_dict
from mpcore.train import train

def hook(stage, path):
    print("save", stage, path.name, flush=True)

train(load_config(None, json.loads(sys.argv[1])), checkpoint_hook=hook)
"""
STAGES = ("begin", "meta", "written", "renamed", "latest")


def _child(script: Path, overrides: list[str], kill_at: tuple[int, str] | None,
           delay: float) -> int:
    """Run the training script; SIGKILL it ``delay`` s after it reports save stage
    ``kill_at = (step, stage)``. Returns its exit code."""
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(overrides)], cwd=REPO,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "save" and kill_at == (
                    int(parts[2].rsplit("-", 1)[1]), parts[1]):
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        return proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()


@pytest.mark.slow
def test_kill_9_during_saves_resumes_the_same_curve(tmp_path, data_dir):
    """A training process SIGKILLed at random points of its saves (after a random save stage,
    plus up to 30 ms), again and again: each rerun resumes, and metrics.jsonl ends up with the
    uninterrupted run's losses bit for bit, each step once."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = ["checkpoint.every=1", "checkpoint.keep_last=2", "model.num_layers=1"]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    assert _child(script, overrides_for(reference, data_dir, *args), None, 0.0) == 0
    seed = int.from_bytes(os.urandom(4), "little")
    rng, saved, kills = random.Random(seed), 0, []
    while len(kills) < 4 and saved < STEPS:
        target = (min(STEPS, saved + 1 + rng.randrange(2)), rng.choice(STAGES))
        code = _child(script, overrides_for(run_dir, data_dir, *args), target,
                      rng.uniform(0, 0.03))
        kills.append((target, code))
        assert code == -signal.SIGKILL, (seed, kills)
        # The step the next run resumes from (the kill may land after a later rename).
        saved = max([int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*")],
                    default=0)
    assert _child(script, overrides_for(run_dir, data_dir, *args), None, 0.0) == 0, (seed,
                                                                                    kills)
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), (seed, kills)
    assert [r["loss"] for r in got] == [r["loss"] for r in want], (seed, kills)



def test_checkpoint_from_before_manifests_still_resumes(copy, data_dir, base, caplog):
    """A whole step folder without manifest.json (what mpcore wrote before manifests) resumes,
    with a warning that its bytes cannot be verified: upgrading must not cost a run its
    progress. The run continues the uninterrupted curve exactly."""
    root = copy / "checkpoints"
    shutil.rmtree(root / "step-8")
    (root / "step-6" / "manifest.json").unlink()
    meta = json.loads((root / "step-6" / "meta.json").read_text())
    for key in ("manifest", "data_fingerprint"):  # what such an mpcore did not write
        del meta[key]
    (root / "step-6" / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text("step-6\n")
    with caplog.at_level(logging.WARNING):
        result = train(tiny(copy, data_dir))
    assert result.step == STEPS and result.losses == base[1][6:]
    assert "cannot be verified" in caplog.text and "step-6" in caplog.text
