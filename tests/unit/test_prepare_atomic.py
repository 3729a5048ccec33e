"""Prepared datasets are whole or absent: launch/prepare_data.py and launch/prepare_vl_data.py
SIGKILLed while they write, or (text) between publishing the ``.bin`` and the ``.idx``, leave
the previous dataset or none, never a new ``.bin`` read through an old ``.idx``. The real
scripts write the files; the child only pauses at a point (a slowed writer, or a pause right
after one ``os.replace``) so the kill lands there. The text "between" case fails on the code
before this change (it left the new tokens under the old index); the others guard what was
already whole (the writes go to temporary names first)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import mpcore.data.indexed
from mpcore.data import prepare_default
from mpcore.data.indexed import IndexedDataset
from mpcore.data.vl_dataset import VLDataset

REPO = Path(mpcore.data.indexed.__file__).resolve().parents[2]  # children run the code here
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
IMAGES = REPO / "launch" / "data" / "images"

# argv: GO STAGE SCRIPT ARGS...; STAGE "writing": pause after 20 documents were written;
# "between": pause right after the first os.replace onto a .bin (the .idx not yet replaced).
CHILD = """import os, runpy, sys, time
from pathlib import Path
go, stage, script = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def pause():
    print("paused", flush=True)
    while not go.exists():
        time.sleep(0.05)
real_replace = os.replace
def replace(src, dst, *args, **kwargs):
    real_replace(src, dst, *args, **kwargs)
    if stage == "between" and str(dst).endswith(".bin"):
        pause()
os.replace = replace
import mpcore.data.indexed as indexed
real_add, count = indexed.IndexedWriter.add, [0]
def add(self, ids):
    real_add(self, ids)
    count[0] += 1
    if stage == "writing" and count[0] == 20:
        pause()
indexed.IndexedWriter.add = add
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return prepare_default(tmp_path_factory.mktemp("data"), 512)[0]


def corpus(path: Path, seed: int, n: int = 60) -> Path:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "model", "token", "parallel", "ring"]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 12 + i % 7))})
                            + "\n" for i in range(n)))
    return path


def run_paused(tmp_path: Path, stage: str, script: Path, *args) -> int:
    """Run ``script`` in the child above, SIGKILL it at ``stage``; returns its pid."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(child), str(tmp_path / "go"), stage,
                             str(script), *map(str, args)], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert line.strip() == "paused", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()
        proc.stderr.close()
    return proc.pid


def prepare_text(tokenizer, source: Path, prefix: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "launch" / "prepare_data.py"), "--input",
                          str(source), "--output-prefix", str(prefix), "--tokenizer",
                          str(tokenizer)], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def docs(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["writing", "between"])
def test_killed_text_preparation(tokenizer, tmp_path, stage):
    prefix = tmp_path / "ds" / "corpus"
    prepare_text(tokenizer, corpus(tmp_path / "old.jsonl", 0), prefix)
    old = docs(prefix)
    new_source = corpus(tmp_path / "new.jsonl", 1, n=90)
    pid = run_paused(tmp_path, stage, REPO / "launch" / "prepare_data.py", "--input",
                     new_source, "--output-prefix", prefix, "--tokenizer", tokenizer)
    if stage == "writing":
        assert docs(prefix) == old  # the previous dataset, whole
    else:
        with pytest.raises(ValueError, match=r"corpus\.idx does not exist; create it with"):
            IndexedDataset(prefix)  # none: not the new tokens under the old index
    leftovers = sorted(p.name for p in prefix.parent.glob(".corpus.*"))
    assert all(name.endswith(f".tmp-{pid}") for name in leftovers), leftovers
    prepare_text(tokenizer, new_source, prefix)  # the rerun publishes the new one
    assert len(docs(prefix)) == 90 and docs(prefix) != old[:90]


def vl_manifest(path: Path, captions: list[str]) -> Path:
    images = sorted(IMAGES.glob("*.jpg"))[:2] + sorted(IMAGES.glob("*.png"))[:1]
    rows = [{"image": str(images[i % len(images)]), "caption": c} for i, c in enumerate(captions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_killed_vl_preparation_keeps_the_previous_folder(tokenizer, tmp_path):
    out = tmp_path / "vl"
    script = REPO / "launch" / "prepare_vl_data.py"
    settings = ["--max-pixels", str(28 * 28 * 4), "--tokenizer", tokenizer]
    first = vl_manifest(tmp_path / "a.jsonl", [f"a caption {i}" for i in range(4)])
    done = subprocess.run([sys.executable, str(script), "--manifest", str(first), "--out",
                           str(out), *map(str, settings)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    second = vl_manifest(tmp_path / "b.jsonl", [f"another caption {i}" for i in range(30)])
    run_paused(tmp_path, "writing", script, "--manifest", second, "--out", out, "--overwrite",
               *settings)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(VLDataset(out)) == 4
