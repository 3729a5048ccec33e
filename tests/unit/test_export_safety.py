"""launch/export_hf.py never replaces what the user owns and never exports damaged bytes: an
existing file, a folder holding files (without --overwrite, or with files an export does not
write), a run folder and a checkpoint are refused before any work; the checkpoint's manifest
is verified, naming the damaged file; a killed export leaves no half-written folder and an
overwritten export whole. Each test fails on the code before these checks (which wrote into
any folder, file by file, and exported whatever the checkpoint's files held)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import mpcore.launch.export_hf
from mpcore.config import load_config
from mpcore.data import prepare_default
from mpcore.launch.export_hf import main
from mpcore.train import train

REPO = Path(mpcore.launch.export_hf.__file__).resolve().parents[1]  # children run the code tested here
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

# export_hf with the weights' write held until the file argv[1] appears (config.json is written
# by then): prints "writing" first.
SLOW = """import sys, time
from pathlib import Path
import mpcore.models.common.hf_io
real, go = mpcore.models.common.hf_io.save_file, Path(sys.argv[1])
def slow(*args, **kwargs):
    print("writing", flush=True)
    while not go.exists():
        time.sleep(0.05)
    return real(*args, **kwargs)
mpcore.models.common.hf_io.save_file = slow
from mpcore.launch.export_hf import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    prepare_default(data, 512)
    run = tmp_path_factory.mktemp("run") / "run"
    train(load_config(None, [
        "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
        f"data.cache_dir={data}", "data.default_vocab_size=512", "data.seq_len=32",
        "data.micro_batch=2", "training.max_steps=4", "training.device=cpu",
        f"logging.run_dir={run}", "checkpoint.every=2"]))
    return run


def export(checkpoint, output, *flags, capsys=None) -> tuple[int, str]:
    code = main(["--checkpoint", str(checkpoint), "--output", str(output), *flags])
    return code, (capsys.readouterr().err if capsys is not None else "")


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_outputs_that_are_not_an_export_folder_are_refused(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / "step-4"
    file = tmp_path / "model.bin"
    file.write_bytes(b"mine")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    before = listing(run_dir)
    cases = [
        (file, [], f"--output {file} is an existing file; an export is a folder"),
        (mine, [], f"--output {mine} already holds files (notes.txt); pass --overwrite"),
        (mine, ["--overwrite"], f"--output {mine} holds files an export does not write "
                                f"(notes.txt); --overwrite replaces the folder as a whole"),
        (ckpt, ["--overwrite"], f"--output {ckpt} is a checkpoint folder (it holds "
                                f"manifest.json, meta.json, .metadata)"),
        (run_dir / "checkpoints", ["--overwrite"], f"--output {run_dir / 'checkpoints'} is a "
                                                   f"checkpoint folder (it holds step-N folders)"),
        (ckpt / "hf", [], f"--output {ckpt / 'hf'} is inside {ckpt}: a checkpoint folder"),
        (run_dir, ["--overwrite"], f"--output {run_dir} is a run folder (it holds "
                                   f"metrics.jsonl, config.yaml)"),
    ]
    for output, flags, message in cases:
        code, err = export(ckpt, output, *flags, capsys=capsys)
        assert code == 2 and err.startswith(f"error: {message}"), err
    assert listing(run_dir) == before
    assert file.read_bytes() == b"mine" and listing(mine) == {"notes.txt": b"my notes"}
    assert not (ckpt / "hf").exists()


def test_damaged_checkpoint_is_refused_naming_the_file(run_dir, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", root)
    shard = root / "step-4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    shard.write_bytes(bytes(data))
    for source in (root / "step-4", root):  # the folder, or the root whose latest it is
        code, err = export(source, tmp_path / "hf", capsys=capsys)
        assert code == 2, err
        assert err.startswith(f"error: checkpoint {root / 'step-4'} is damaged, so it is not "
                              f"exported: {shard} does not match its sha256"), err
        assert f"export an older one (--checkpoint {root / 'step-2'})" in err
        assert not (tmp_path / "hf").exists()
    assert export(root / "step-2", tmp_path / "hf")[0] == 0  # the good one still exports


def _slow_export(tmp_path, checkpoint, output, *flags) -> tuple[subprocess.Popen, Path]:
    script, go = tmp_path / "slow.py", tmp_path / "go"
    script.write_text(SLOW)
    proc = subprocess.Popen([sys.executable, str(script), str(go), "--checkpoint",
                             str(checkpoint), "--output", str(output), *flags], cwd=REPO,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    line = proc.stdout.readline()
    watchdog.cancel()
    assert line.strip() == "writing", proc.stderr.read()[-3000:]
    return proc, go


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def test_killed_export_leaves_no_folder_or_the_previous_one(run_dir, tmp_path):
    ckpt, out = run_dir / "checkpoints" / "step-4", tmp_path / "hf"
    proc, _ = _slow_export(tmp_path, ckpt, out)
    _kill(proc)
    assert not out.exists()  # not a folder with config.json and no weights
    assert [p.name for p in tmp_path.glob(".hf.tmp-*")] == [f".hf.tmp-{proc.pid}"]
    assert export(run_dir / "checkpoints" / "step-2", out)[0] == 0
    previous = listing(out)
    assert set(previous) == {"config.json", "model.safetensors", "tokenizer.model",
                             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    proc, _ = _slow_export(tmp_path, ckpt, out, "--overwrite")
    _kill(proc)
    assert listing(out) == previous  # the earlier export, whole
    assert export(ckpt, out, "--overwrite")[0] == 0
    now = listing(out)
    assert set(now) == set(previous) and now["model.safetensors"] != previous["model.safetensors"]
    assert not list(tmp_path.glob(".hf.old-*"))
