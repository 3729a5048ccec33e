"""A run folder's history is never cut back: a checkpoint dir that holds nothing while the run
folder shows an earlier run that saved checkpoints refuses, as ``checkpoint.resume=false``
does; a damaged line of ``metrics.jsonl`` is moved aside and named, never dropped unseen.
Each test fails on the code before these checks (which started over at step 0 and cut
``metrics.jsonl`` back, or dropped damaged lines with the rows' count as the only trace)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.train import train

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prepare_default(folder, 512)
    return folder


SMALL = ["model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
         "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
         "data.default_vocab_size=512", "data.seq_len=32", "data.micro_batch=2",
         "schedule.warmup_steps=2", f"training.max_steps={STEPS}", "training.device=cpu",
         "logging.log_every=1", "checkpoint.every=2"]


def overrides(run_dir, data_dir, *more) -> list[str]:
    return [*SMALL, f"data.cache_dir={data_dir}", f"logging.run_dir={run_dir}", *more]


def config(run_dir, data_dir, *more):
    return load_config(None, overrides(run_dir, data_dir, *more))


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir):
    """A finished run: 6 steps, saved every 2 into RUN/checkpoints."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    train(config(run_dir, data_dir))
    return run_dir


@pytest.fixture
def copy(base, tmp_path):
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}


def steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_empty_checkpoint_dir_elsewhere_refuses(copy, data_dir, tmp_path):
    """checkpoint.dir now points at an empty folder; the run's checkpoints are in RUN/checkpoints."""
    before = snapshot(copy)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"{empty} holds no checkpoint, but {copy} holds an "
                                         rf"earlier run: its checkpoints are in "
                                         rf"{copy / 'checkpoints'} .*checkpoint.overwrite=true"):
        train(config(copy, data_dir, f"checkpoint.dir={empty}"))
    assert snapshot(copy) == before  # metrics.jsonl and config.yaml untouched
    assert list(empty.iterdir()) in ([], [empty / ".lock"])


def test_checkpoint_dir_recorded_in_config_yaml(data_dir, tmp_path):
    """The earlier run wrote its checkpoints to A (config.yaml says so); now checkpoint.dir=B."""
    run_dir, a, b = tmp_path / "run", tmp_path / "A", tmp_path / "B"
    train(config(run_dir, data_dir, f"checkpoint.dir={a}", "training.max_steps=4"))
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=rf"its checkpoints are in {a} \(resume them with "
                                         rf"checkpoint.dir={a}\)"):
        train(config(run_dir, data_dir, f"checkpoint.dir={b}"))
    assert snapshot(run_dir) == before and steps(run_dir) == [1, 2, 3, 4]
    # Pointing checkpoint.dir back at them resumes, as the message says.
    assert train(config(run_dir, data_dir, f"checkpoint.dir={a}")).step == STEPS
    assert steps(run_dir) == list(range(1, STEPS + 1))


def test_checkpoints_gone_but_metrics_past_a_save_refuses(copy, data_dir):
    """The checkpoint folder was wiped (a scratch disk cleaned): the rows prove saves ran."""
    before = snapshot(copy)
    shutil.rmtree(copy / "checkpoints")
    with pytest.raises(ValueError, match=rf"metrics.jsonl has rows up to step {STEPS}, so a "
                                         r"checkpoint was saved at step 2 or later"):
        train(config(copy, data_dir))
    assert snapshot(copy) == before
    # Starting over in place is the user's explicit choice: a fresh metrics.jsonl.
    train(config(copy, data_dir, "checkpoint.resume=false", "checkpoint.overwrite=true",
                 "training.max_steps=2"))
    assert steps(copy) == [1, 2]


def test_killed_before_its_first_save_still_restarts(data_dir, tmp_path):
    """A run that died before any save has nothing to protect: the rerun starts at step 0."""
    run_dir = tmp_path / "run"
    train(config(run_dir, data_dir, "training.max_steps=1", "checkpoint.every=0"))
    assert steps(run_dir) == [1] and not (run_dir / "checkpoints").exists()
    train(config(run_dir, data_dir, "training.max_steps=2"))
    assert steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_pretrain_exit_code_and_message(copy, data_dir, tmp_path):
    shutil.rmtree(copy / "checkpoints")
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"),
                           *overrides(copy, data_dir)], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {copy / 'checkpoints'} holds no checkpoint, but")
    assert "Traceback" not in proc.stderr


def test_damaged_middle_line_is_kept_aside_and_named(copy, data_dir, caplog):
    path = copy / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"step": 3, "loss": 4.1\xff\x00garbage\n'  # damaged in place
    path.write_bytes(b"".join(lines))
    shutil.rmtree(copy / "checkpoints" / "step-6")  # resume from step 4: rows 5, 6 run again
    with caplog.at_level(logging.WARNING):
        train(config(copy, data_dir))
    aside = copy / "metrics.jsonl.corrupt-1"
    assert aside.read_bytes() == lines[2]
    assert f"{path}: line(s) 3 are not whole JSON rows" in caplog.text and str(aside) in caplog.text
    assert steps(copy) == [1, 2, 4, 5, 6]  # the rows after the damaged line stay


def test_torn_last_line_is_set_aside_and_the_file_ends_whole(copy, data_dir, caplog):
    path = copy / "metrics.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 7, "loss": 3.')  # a write cut short by a crash
    with caplog.at_level(logging.WARNING):
        train(config(copy, data_dir, "training.max_steps=7"))
    assert "the last line (7) was cut short" in caplog.text
    assert (copy / "metrics.jsonl.corrupt-1").read_bytes() == b'{"step": 7, "loss": 3.\n'
    assert steps(copy) == list(range(1, 8))  # step 7's row is whole, on a line of its own
