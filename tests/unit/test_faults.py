"""Cluster faults on a real training process: SIGUSR1 (Slurm's warning before the time limit),
a full disk during a save, unreadable checkpoint files. Each test does the real thing (a signal,
a small filesystem, a file that cannot be read) and checks that the rerun resumes exactly."""

from __future__ import annotations

import errno
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

import pytest

from mpcore.checkpoint import CheckpointError, resume_newest, verify_checkpoint
from mpcore.io_errors import folder_bytes, human
from mpcore.processes import EXIT_PREEMPTED, EXIT_USER_ERROR
from mpcore.train import train
from tests.unit import test_checkpoint_safety as safety
from tests.unit.test_checkpoint_safety import ENV, REPO, STEPS, flip, overrides_for, rows, tiny

PRETRAIN = str(REPO / "launch" / "pretrain.py")
# The fixtures of test_checkpoint_safety: the prepared corpus, an 8-step base run, its copy.
data_dir, base, copy = safety.data_dir, safety.base, safety.copy


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def pretrain(overrides: list[str], *, signal_at: tuple[int, int] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """``launch/pretrain.py overrides`` as a process; with ``signal_at = (step, sig)``, send it
    ``sig`` once metrics.jsonl reaches ``step``."""
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("logging.run_dir=")))
    proc = subprocess.Popen([sys.executable, PRETRAIN, *overrides], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        if signal_at is not None:
            step, sig = signal_at
            while last_step(run_dir) < step and proc.poll() is None:
                time.sleep(0.01)
            proc.send_signal(sig)
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_sigusr1_saves_exits_75_and_resumes_bit_identical(tmp_path, data_dir):
    """What ``sbatch --signal=USR1@120`` does: SIGUSR1 to the training process. It saves at
    the next step boundary and exits 75; the rerun continues the uninterrupted curve exactly.
    The run is long (a step of this model takes milliseconds) so that the signal, sent once
    step 2 is logged, lands well before the last step even on a loaded machine."""
    steps = 60
    args = ["checkpoint.every=0", "model.num_layers=1", f"training.max_steps={steps}"]
    reference = pretrain(overrides_for(tmp_path / "reference", data_dir, *args))
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    stopped = pretrain(overrides_for(run_dir, data_dir, *args), signal_at=(2, signal.SIGUSR1))
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    step = last_step(run_dir)
    assert 2 <= step < steps, step
    assert f"SIGUSR1: stopped after step {step}; the last checkpoint is " in stopped.stderr
    assert (run_dir / "checkpoints" / f"step-{step}" / "manifest.json").is_file()
    assert f"preempted at step {step}" in stopped.stdout
    again = pretrain(overrides_for(run_dir, data_dir, *args))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step}'}" in again.stderr
    got, want = rows(run_dir), rows(tmp_path / "reference")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit for bit


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted at a fresh folder (root only); yields a function that (re)sizes it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()

    def size(num_bytes: int, remount: bool = False) -> Path:
        options = f"{'remount,' if remount else ''}size={num_bytes}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.strip()}")
        return mnt

    yield size
    subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_disk_full_during_a_save_says_so_and_the_rerun_resumes(tmp_path, data_dir,
                                                               small_disk):
    """A real filesystem that fills up: room for 1.5 checkpoints, so the second save fails.
    The error names the filesystem and what a save needs; the partial save is removed; the
    previous checkpoint verifies; with room again, the rerun continues the curve exactly."""
    args = ["checkpoint.every=2", "checkpoint.keep_last=2", "model.num_layers=1"]
    reference = tmp_path / "reference"
    done = pretrain(overrides_for(reference, data_dir, *args))
    assert done.returncode == 0, done.stderr[-3000:]
    size = folder_bytes(reference / "checkpoints" / "step-8")  # each save is the same size
    disk = small_disk(int(size * 1.5))
    root = disk / "ckpt"
    run_dir = tmp_path / "run"
    full = pretrain(overrides_for(run_dir, data_dir, *args, f"checkpoint.dir={root}"))
    assert full.returncode == EXIT_USER_ERROR, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert errors[0].startswith(f"error: no space left on {disk} (checkpoint.dir {root}) while "
                                f"saving step 4: one checkpoint takes about "), errors[0]
    assert (f"checkpoint.keep_last=2 the folder holds up to 3 of them during a save ("
            f"{human(3 * size)})") in errors[0]
    assert f"the newest checkpoint, {root / 'step-2'}, is intact" in errors[0]
    assert sorted(p.name for p in root.iterdir()) == [".lock", "latest", "step-2"]  # no tmp-step-4
    assert verify_checkpoint(root / "step-2") == []
    small_disk(size * 10, remount=True)
    (root / "tmp-step-6").mkdir()  # as a save killed mid-way leaves it
    (root / "tmp-step-6" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    again = pretrain(overrides_for(run_dir, data_dir, *args, f"checkpoint.dir={root}",
                                   "checkpoint.every=0"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"removed {root / 'tmp-step-6'}: a save that did not finish" in again.stderr
    assert not (root / "tmp-step-6").exists()
    assert f"resumed from {root / 'step-2'}" in again.stderr
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    print(errors[0])


# ---------------------------------------------------------------- verified means verified
def _rewrite_manifest(folder: Path, drop: str) -> None:
    """The manifest of ``folder`` without ``drop``'s entry (as a buggy or tampered save)."""
    body = json.loads((folder / "manifest.json").read_text())
    del body["files"][drop]
    (folder / "manifest.json").write_text(json.dumps(body))


@pytest.mark.slow  # behind the 8-step base run, or processes
def test_lost_manifest_is_damage_not_a_checkpoint_from_before_manifests(copy, data_dir, base,
                                                                        caplog):
    step8 = copy / "checkpoints" / "step-8"
    (step8 / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        result = train(tiny(copy, data_dir))
    assert result.losses == base[1][6:]  # resumed from step-6, the curve exactly
    assert (f"checkpoint {step8} cannot be used: no manifest.json, although meta.json records "
            f"that its save wrote one") in caplog.text
    assert (copy / "checkpoints" / "bad-step-8").is_dir() and "cannot be verified" not in (
        caplog.text)


@pytest.mark.slow  # behind the 8-step base run
@pytest.mark.parametrize("how", ["unlisted and damaged", "unlisted and gone"])
def test_a_file_loading_reads_must_be_in_the_manifest(copy, data_dir, base, caplog,
                                                      how):
    step8 = copy / "checkpoints" / "step-8"
    _rewrite_manifest(step8, "__0_0.distcp")
    if how == "unlisted and damaged":  # what loading would otherwise read unchecked
        flip(step8 / "__0_0.distcp")
        why = f"{step8 / '__0_0.distcp'} is in the folder but not in manifest.json"
    else:
        (step8 / "__0_0.distcp").unlink()
        why = f"{step8 / '__0_0.distcp'} is read by .metadata but not listed in manifest.json"
    with caplog.at_level(logging.WARNING):
        result = train(tiny(copy, data_dir))
    assert result.losses == base[1][6:]
    assert f"checkpoint {step8} cannot be used: {why}" in caplog.text


NO_DAC = """import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
assert libc.capget(ctypes.byref(header), data) == 0
data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
from mpcore.config import load_config
from mpcore.train import train
try:
    train(load_config(None, json.loads(sys.argv[1])))
except ValueError as e:
    print("ValueError:", e)
    sys.exit(2)
"""


@pytest.mark.slow  # behind the 8-step base run, or processes
def test_unreadable_file_stops_the_run_and_keeps_the_checkpoint(copy, data_dir, base,
                                                                tmp_path):
    """A real EACCES: a root-owned file with mode 000, read by a process without root's
    permission override (CAP_DAC_OVERRIDE dropped). The run retries, then stops naming the
    file; the checkpoint is NOT moved to bad-step-8 (on main it was, and the run silently fell
    back to step-6); with the permission back it resumes from step-8."""
    script = tmp_path / "no_dac.py"
    script.write_text(NO_DAC)
    victim = copy / "checkpoints" / "step-8" / "__0_0.distcp"
    victim.chmod(0)
    try:
        done = subprocess.run([sys.executable, str(script), json.dumps(
            overrides_for(copy, data_dir, "training.max_steps=10"))], cwd=REPO, env=ENV,
            capture_output=True, text=True, timeout=240)
    finally:
        victim.chmod(0o644)
    if "capset" in done.stderr or "AssertionError" in done.stderr:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here: {done.stderr[-300:]}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"ValueError: cannot read checkpoint {victim.parent} (after 3 attempts): {victim}: "
            f"PermissionError: Permission denied. A read error is not damage") in done.stdout
    assert sorted(p.name for p in (copy / "checkpoints").glob("*step-*")) == ["step-6", "step-8"]
    result = train(tiny(copy, data_dir, "training.max_steps=10", "schedule.total_steps=8"))
    assert result.step == 10 and len(result.losses) == 2  # resumed from step-8


@pytest.mark.slow  # behind the 8-step base run, or processes
def test_read_error_while_loading_stops_and_keeps_the_checkpoint(copy):
    """Injected (a load callable that raises EIO, as dcp.load does when the storage fails after
    the manifest verified): the run stops naming the file; nothing is moved to bad-step-N."""
    root = copy / "checkpoints"
    victim = root / "step-8" / "__0_0.distcp"

    def load(folder, meta):
        raise OSError(errno.EIO, "Input/output error", str(victim))

    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {root / 'step-8'} while "
                                              rf"loading it \({victim}: Input/output error\)"):
        resume_newest(root, load)
    assert sorted(p.name for p in root.glob("*step-*")) == ["step-6", "step-8"]


# ---------------------------------------------------------------- checkpoint.async_save
@pytest.mark.slow  # behind the 8-step base run, or processes
def test_async_saves_verify_rotate_and_resume_bit_identical(tmp_path, data_dir, base, caplog):
    """Background saves every 2 steps: the same curve as blocking saves, every checkpoint
    verifies with a full manifest, rotation keeps the newest two, and resuming from one
    written in the background continues the uninterrupted curve exactly."""
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="mpcore.train"):
        result = train(tiny(run_dir, data_dir, "checkpoint.async_save=true"))
    assert result.losses == base[1]
    assert "checkpoint step-2 staged in" in caplog.text and "writing it in the background" in (
        caplog.text)
    assert f"saved checkpoint {run_dir / 'checkpoints' / 'step-2'} (written in the background)" in (
        caplog.text)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("*step-*")) == ["step-6", "step-8"]
    for folder in ("step-6", "step-8"):
        assert verify_checkpoint(root / folder) == []
    shutil.rmtree(root / "step-8")  # resume from step-6, written in the background
    again = train(tiny(run_dir, data_dir, "checkpoint.async_save=true"))
    assert again.losses == base[1][6:]


def test_async_save_auto_stages_on_a_gpu_only_where_the_node_has_memory_for_it(tmp_path,
                                                                               data_dir):
    """checkpoint.async_save: auto is on for a GPU run whose node's pinned copies (12 bytes per
    parameter, 1/world per rank, times the node's ranks) fit in a quarter of its memory; off
    on a CPU, off when they do not fit (the reason names the override); true/false as given;
    YAML booleans are read; anything else is refused naming the choices."""
    import torch

    from mpcore.checkpoint_async import background_saves

    gpu, cpu, gib = torch.device("cuda"), torch.device("cpu"), 2**30
    # 1.24 B parameters on one rank: 13.9 GiB of staged copies.
    assert background_saves("auto", gpu, 1_240_000_000, 1, 1, 128 * gib)[0]
    off, why = background_saves("auto", gpu, 1_240_000_000, 1, 1, 48 * gib)
    assert not off and "13.9 GiB of its 48 GiB" in why and "async_save=true" in why
    # 8 ranks of one node share 8 B parameters: 89 GiB on a 512 GiB node (on), 256 GiB (off).
    assert background_saves("auto", gpu, 8_000_000_000, 8, 8, 512 * gib)[0]
    assert not background_saves("auto", gpu, 8_000_000_000, 8, 8, 256 * gib)[0]
    # ...but spread over 4 nodes of 8 (world 32), each node holds a quarter of it.
    assert background_saves("auto", gpu, 8_000_000_000, 32, 8, 256 * gib)[0]
    assert not background_saves("auto", cpu, 1000, 1, 1, 128 * gib)[0]
    assert not background_saves("auto", gpu, 1000, 1, 1, None)[0]
    assert background_saves("true", cpu, 10**12, 1, 1, gib)[0]
    assert not background_saves("false", gpu, 1000, 1, 1, 128 * gib)[0]
    for given, want in ((True, "true"), ("off", "false"), ("AUTO", "auto")):
        cfg = tiny(tmp_path, data_dir, f"checkpoint.async_save={given}")
        assert cfg.checkpoint.async_save == want
    with pytest.raises(ValueError, match=r"checkpoint.async_save must be one of "
                                         r"\['auto', 'true', 'false'\], got 'sometimes'"):
        tiny(tmp_path, data_dir, "checkpoint.async_save=sometimes")


def test_background_saves_write_the_step_they_were_started_at_from_reused_buffers(
        tmp_path, data_dir):
    """A background save holds the tensors of the step that started it, though training goes
    on during the write; the next save reuses the staging buffers (no new host copy per save)
    only after waiting for that write."""
    import torch

    from mpcore.build import build, resolve_device, setup
    from mpcore.checkpoint import load_tensors, stored_tensors
    from mpcore.train import Trainer

    cfg = tiny(tmp_path / "run", data_dir, "checkpoint.async_save=true", "checkpoint.every=0")
    trainer = Trainer(build(cfg, setup(cfg), resolve_device(cfg)))
    trainer.train_step()
    want = {k: v.clone() for k, v in trainer.run.train_state.collect().items()}
    trainer.save(background=True)
    staged = {k: v.data_ptr() for k, v in trainer.async_saver.staging._buffers.items()}
    assert staged and all(k in want for k in staged)
    trainer.train_step()  # changes every parameter while the write may be in flight
    trainer.save(background=True)  # waits for step 1's write, then refills the same buffers
    assert {k: v.data_ptr() for k, v in trainer.async_saver.staging._buffers.items()} == staged
    trainer.async_saver.wait()
    folder = cfg.checkpoint_dir / "step-1"
    stored = stored_tensors(folder)
    got = load_tensors(folder, [k for k in stored if not k.startswith("rng/")], stored)
    now = trainer.run.train_state.collect()
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    # the saved step-1 tensors are not simply today's parameters
    assert any(not torch.equal(now[k], v) for k, v in got.items() if k.startswith("model/"))


@pytest.mark.slow  # behind the 8-step base run, or processes
def test_kill_9_during_background_writes_resumes_the_same_curve(tmp_path, data_dir):
    """SIGKILL while a background write is in flight (just after its folder was made, plus up
    to 30 ms) or at a stage of its commit, again and again: nothing that looks whole is left
    half-written, and metrics.jsonl ends with the uninterrupted losses, each step once."""
    script = tmp_path / "child.py"
    script.write_text(safety.CHILD)
    args = ["checkpoint.every=1", "checkpoint.keep_last=2", "model.num_layers=1",
            "checkpoint.async_save=true"]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    assert safety._child(script, overrides_for(reference, data_dir, *args), None, 0.0) == 0
    seed = int.from_bytes(os.urandom(4), "little")
    rng, saved, kills = random.Random(seed), 0, []
    while len(kills) < 4 and saved < STEPS - 1:
        stage = rng.choice(("begin", "begin", "meta", "written", "renamed"))
        target = (min(STEPS - 1, saved + 1 + rng.randrange(2)), stage)
        code = safety._child(script, overrides_for(run_dir, data_dir, *args), target,
                             rng.uniform(0, 0.03))
        kills.append((target, code))
        assert code == -signal.SIGKILL, (seed, kills)
        for folder in (run_dir / "checkpoints").glob("step-*"):
            assert (folder / "manifest.json").is_file(), (seed, kills, folder)
        saved = max([int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*")],
                    default=0)
    assert safety._child(script, overrides_for(run_dir, data_dir, *args), None, 0.0) == 0
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), (seed, kills)
    assert [r["loss"] for r in got] == [r["loss"] for r in want], (seed, kills)
