"""launch/score.py never destroys what the user owns: --output that is the input (by path,
symlink or hard link) refuses before the model loads; a killed run leaves the previous output
file whole; a second run on the same output refuses while the first holds it; a blank line
or non-UTF-8 input names its line; --help describes every option. Each test fails on the code
before these checks (which overwrote the input, truncated the output at the start of the
write, let two runs write one file, and skipped blank lines, shifting every later output)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mpcore.launch.score
from mpcore.launch.score import main
from mpcore.models import ModelConfig, build_model, export_hf
from mpcore.parallel.state import ParallelState

REPO = Path(mpcore.launch.score.__file__).resolve().parents[1]  # children run the code tested here
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
VOCAB = 64

# score.py with json.dumps slowed at the third output row (the real write path; the file is
# open for writing by then): it prints "writing" and waits until the file argv[1] appears.
SLOW = """import json, sys, time
from pathlib import Path
real, count, go = json.dumps, [0], Path(sys.argv[1])
def slow(obj, *args, **kwargs):
    if isinstance(obj, dict) and "logprobs" in obj:
        count[0] += 1
        if count[0] == 3:
            print("writing", flush=True)
            while not go.exists():
                time.sleep(0.05)
    return real(obj, *args, **kwargs)
json.dumps = slow
from mpcore.launch.score import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, intermediate_size=64)
    state = ParallelState()
    export_hf(build_model(cfg, state, seed=3), cfg, state, folder)
    return folder


def write_input(path: Path, n: int = 6, blank_at: int | None = None) -> Path:
    lines = [json.dumps({"input_ids": [(7 * i + j) % VOCAB for j in range(5 + i)]})
             for i in range(n)]
    if blank_at is not None:
        lines.insert(blank_at, "")
    path.write_text("".join(x + "\n" for x in lines))
    return path


def score(checkpoint, input_path, output, capsys=None) -> tuple[int, str]:
    code = main(["--hf-checkpoint", str(checkpoint), "--input", str(input_path),
                 "--output", str(output)])
    return code, (capsys.readouterr().err if capsys is not None else "")


@pytest.mark.parametrize("link", ["same path", "symlink", "hard link", "via a linked folder"])
def test_output_that_is_the_input_refuses(checkpoint, tmp_path, capsys, link):
    # A checkpoint without weights: the refusal must come before the model loads (a load
    # would fail on the missing model.safetensors with another message).
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(checkpoint / "config.json", config_only)
    data = write_input(tmp_path / "in.jsonl")
    before = data.read_bytes()
    if link == "same path":
        out = data
    elif link == "symlink":
        out = tmp_path / "out.jsonl"
        out.symlink_to(data)
    elif link == "hard link":
        out = tmp_path / "out.jsonl"
        os.link(data, out)
    else:
        (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
        out = tmp_path / "alias" / "in.jsonl"
    code, err = score(config_only, data, out, capsys)
    assert code == 2
    assert err.startswith(f"error: --output {out} is the input file {data} (the same file "
                          f"under another name or link)"), err
    assert data.read_bytes() == before


def _start_slow(tmp_path, checkpoint, data, out) -> tuple[subprocess.Popen, Path]:
    script, go = tmp_path / "slow.py", tmp_path / "go"
    script.write_text(SLOW)
    proc = subprocess.Popen([sys.executable, str(script), str(go), "--hf-checkpoint",
                             str(checkpoint), "--input", str(data), "--output", str(out)],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    line = proc.stdout.readline()
    watchdog.cancel()
    assert line.strip() == "writing", proc.stderr.read()[-3000:]
    return proc, go


def test_killed_while_writing_leaves_the_previous_output(checkpoint, tmp_path, capsys):
    data, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert score(checkpoint, data, out)[0] == 0
    previous = out.read_bytes()
    assert len(previous.splitlines()) == 6
    write_input(data, n=9)  # new input: the next run writes another file
    proc, _ = _start_slow(tmp_path, checkpoint, data, out)
    time.sleep(0.2)  # two rows written into the open file
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    assert out.read_bytes() == previous  # whole, and the old one
    assert [p.name for p in tmp_path.glob(".out.jsonl.tmp-*")] == [f".out.jsonl.tmp-{proc.pid}"]
    assert score(checkpoint, data, out)[0] == 0  # the rerun writes it and clears the leftover
    assert len(out.read_text().splitlines()) == 9
    assert not list(tmp_path.glob(".out.jsonl.tmp-*"))


def test_second_run_on_one_output_refuses(checkpoint, tmp_path, capsys):
    data, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    other = write_input(tmp_path / "other.jsonl", n=3)
    proc, go = _start_slow(tmp_path, checkpoint, data, out)
    try:
        code, err = score(checkpoint, other, out, capsys)
    finally:
        go.touch()  # let the first run finish its write
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert code == 2
    assert re.match(rf"error: --output {out} is being written by another score.py \(pid "
                    rf"{proc.pid} on host .*\); wait for it to finish", err), err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and [len(r["logprobs"]) for r in rows] == [4 + i for i in range(6)]
    # Once the holder is gone the output is free again.
    assert score(checkpoint, other, out)[0] == 0 and len(out.read_text().splitlines()) == 3


def test_blank_line_is_an_error_naming_it(checkpoint, tmp_path, capsys):
    data, out = write_input(tmp_path / "in.jsonl", blank_at=2), tmp_path / "out.jsonl"
    code, err = score(checkpoint, data, out, capsys)
    assert code == 2 and err.startswith(f"error: {data}:3: a blank line; output line i belongs "
                                        f"to input line i"), err
    assert not out.exists()


def test_non_utf8_input_names_file_and_line(checkpoint, tmp_path, capsys):
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3, 4], "x": "caf\xe9"}\n')
    code, err = score(checkpoint, data, out, capsys)
    assert code == 2 and err.startswith(f"error: {data}:2: not UTF-8 text (byte 31)"), err
    assert not out.exists()


def test_output_folder_is_refused(checkpoint, tmp_path, capsys):
    data = write_input(tmp_path / "in.jsonl")
    code, err = score(checkpoint, data, tmp_path, capsys)
    assert code == 2 and err.startswith(f"error: --output {tmp_path} is a folder"), err


def test_help_describes_every_option():
    out = subprocess.run([sys.executable, str(REPO / "launch" / "score.py"), "--help"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.split("options:", 1)[1]
    blocks = re.split(r"\n(?=  -)", text)
    options = {re.match(r"\s*(-[-\w]+)", b).group(1): b for b in blocks if b.strip()}
    want = ["--hf-checkpoint", "--tp", "--cp", "--cp-mode", "--dtype", "--sequence-parallel",
            "--temperature", "--input", "--output"]
    assert set(want) <= set(options), options.keys()
    for name in want:
        words = re.sub(r"^\s*-[-\w]+( [A-Z.{}_a-z,0-9]+)?", "", options[name]).split()
        assert len(words) >= 4, (name, options[name])  # a sentence, not just the flag
    assert "exit codes" in out.stdout


@pytest.mark.slow  # torchrun and two ranks: ~10 s of process start-up
def test_an_error_under_torchrun_is_printed_once(checkpoint, tmp_path):
    """Issue 39: every rank meets the same input error and each printed it. Now one rank,
    elected through the rendezvous store (as pretrain.py does), prints it; every rank exits 2."""
    data = write_input(tmp_path / "in.jsonl", blank_at=2)
    cmd = [sys.executable, "-m", "mpcore.torchrun", "--nproc-per-node", "2", "--standalone",
           str(REPO / "launch" / "score.py"), "--hf-checkpoint", str(checkpoint),
           "--input", str(data), "--output", str(tmp_path / "out.jsonl")]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and f"{data}:3: a blank line" in errors[0], done.stderr[-3000:]
    assert not (tmp_path / "out.jsonl").exists()
