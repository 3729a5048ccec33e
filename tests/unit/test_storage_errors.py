"""Storage that refuses a write (read-only, no permission, full) is one line naming the path,
the cause and what to change, for every writer, and a run that cannot write its metrics or a
checkpoint stops with its last good checkpoint intact and says so (issue 39: each writer gave a
raw ``OSError: [Errno 30] Read-only file system`` or ``[Errno 28]`` traceback).

The read-only cases use a real read-only file system: a read-only bind mount in a user and
mount namespace (``unshare -rm``), because the tests may run as root, whom ``chmod`` does not
stop. Where the namespace cannot be made, that test is skipped. The full disk and the refused
checkpoint write are simulated in process: the lowest write call (``open`` of the metrics row,
of the checkpoint's meta.json) raises the ``OSError`` the kernel would.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpcore.atomic
import mpcore.metrics
import tests.unit.test_checkpoint_safety as safety
from mpcore.checkpoint import CheckpointError, verify_checkpoint
from mpcore.data import prepare_default
from mpcore.launch import export_hf
from mpcore.train import RunHalted, train
from tests.unit.test_checkpoint_safety import REPO, rows, tiny

data_dir = safety.data_dir
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
IMAGES = REPO / "launch" / "data" / "images"

# argv: READ_ONLY CASES.json. Makes READ_ONLY a read-only bind mount (we are root in a fresh
# user + mount namespace), runs each case's entry point in this process and prints
# {case: [exit code, stderr]} as JSON.
CHILD = """import contextlib, io, json, subprocess, sys, traceback
ro, cases = sys.argv[1], json.load(open(sys.argv[2]))
for cmd in (["mount", "--bind", ro, ro], ["mount", "-o", "remount,bind,ro", ro]):
    subprocess.run(cmd, check=True)
from mpcore.launch import export_hf, prepare_data, prepare_vl_data, pretrain, score
mains = {"pretrain": pretrain.main, "export_hf": export_hf.main, "score": score.main,
         "prepare_vl_data": prepare_vl_data.main, "prepare_data": prepare_data.main}
out = {}
for name, (script, argv) in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = mains[script](argv)
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    out[name] = [code, err.getvalue()]
print(json.dumps(out))
"""


def _namespaces_work(tmp_path: Path) -> str | None:
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {probe} {probe} && "
                           f"mount -o remount,bind,ro {probe} && ! touch {probe}/x"],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or "unshare failed")


@pytest.mark.slow  # one child process runs every writer (~15 s)
def test_every_writer_on_a_read_only_file_system_says_path_cause_and_fix(tmp_path, data_dir):
    try:
        why = _namespaces_work(tmp_path)
    except FileNotFoundError:
        why = "no unshare here"
    if why:
        pytest.skip(f"a read-only bind mount needs user namespaces: {why}")
    ro = tmp_path / "ro"
    old_run = ro / "old_run"
    safe = [str(x) for x in safety.overrides_for(old_run, data_dir, "training.max_steps=2")]
    train(tiny(old_run, data_dir, "training.max_steps=2"))  # an existing run, then read-only
    hf = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(old_run / "checkpoints"), "--output",
                           str(hf)]) == 0
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"image": str(IMAGES / "brick.png"),
                                                  "caption": "a brick"}) + "\n")
    (tmp_path / "text.txt").write_text("one paragraph.\n\nanother paragraph.\n")
    tokenizer = str(prepare_default(data_dir, 512)[0])

    def run(run_dir, *more):
        return ["pretrain", [*safe, f"logging.run_dir={run_dir}", *more]]

    cases = {  # name: ([script, argv], the path named, the setting named)
        "new run folder": (run(ro / "new_run"), ro / "new_run", "logging.run_dir"),
        "existing run, read-only": (run(old_run, "training.max_steps=4"), old_run,
                                    "logging.run_dir"),
        "checkpoint.dir": (run(tmp_path / "run_c", f"checkpoint.dir={ro / 'ckpt'}"),
                           ro / "ckpt", "checkpoint.dir"),
        "data.cache_dir": (run(tmp_path / "run_d", f"data.cache_dir={ro / 'cache'}"),
                           ro / "cache", "data.cache_dir"),
        "export": (["export_hf", ["--checkpoint", str(old_run / "checkpoints"), "--output",
                                  str(ro / "export")]], ro / "export", "--output"),
        "score output": (["score", ["--hf-checkpoint", str(hf), "--input",
                                    str(tmp_path / "in.jsonl"), "--output",
                                    str(ro / "scores" / "out.jsonl")]], ro / "scores",
                         "--output"),
        "prepare_vl_data --out": (["prepare_vl_data", [
            "--manifest", str(tmp_path / "m.jsonl"), "--tokenizer", tokenizer, "--out",
            str(ro / "vl")]], ro / "vl", "--out"),
        "prepare_data prefix": (["prepare_data", [
            "--input", str(tmp_path / "text.txt"), "--tokenizer", tokenizer,
            "--output-prefix", str(ro / "text" / "corpus")]], ro / "text", "--output-prefix"),
    }
    spec, script = tmp_path / "cases.json", tmp_path / "child.py"
    spec.write_text(json.dumps({name: case[0] for name, case in cases.items()},
                               default=str))
    script.write_text(CHILD)
    done = subprocess.run(["unshare", "-rm", sys.executable, str(script), str(ro), str(spec)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (_, path, setting) in cases.items():
        code, err = results[name]
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert code == 2 and "Traceback" not in err and len(errors) == 1, (name, code, err)
        assert errors[0].startswith(f"error: cannot write {path}"), (name, errors[0])
        assert (f"the file system at {ro} is read-only (EROFS); remount {ro} read-write, or "
                f"set {setting} to a folder elsewhere") in errors[0], (name, errors[0])
    assert sorted(p.name for p in ro.iterdir()) == ["old_run"]  # nothing else appeared


def _failing_open(real, match: str, code: int, nth: int = 1):
    """``open`` that raises ``OSError(code)`` on the ``nth`` open of a path containing
    ``match`` (as the kernel does when the disk fills up or turns read-only)."""
    seen = [0]

    def fake(file, *args, **kwargs):
        if match in str(file):
            seen[0] += 1
            if seen[0] == nth:
                raise OSError(code, os.strerror(code), str(file))
        return real(file, *args, **kwargs)
    return fake


@pytest.mark.slow  # two 8-step runs (~10 s each on a loaded 2-core machine)
@pytest.mark.parametrize(("where", "code"), [("metrics.jsonl", errno.ENOSPC),
                                             ("checkpoint", errno.EROFS)])
def test_a_run_that_cannot_write_stops_with_its_checkpoint_intact(tmp_path, data_dir,
                                                                  monkeypatch, where, code):
    """The disk fills while appending step 5's metrics row, or the checkpoint folder turns
    read-only at step 4's save: the run stops there, saves nothing more, says which
    checkpoint is intact; the rerun resumes from it and every step appears once."""
    run_dir = tmp_path / "run"
    if where == "metrics.jsonl":  # the 5th row
        monkeypatch.setattr(mpcore.metrics, "open", _failing_open(open, where, code, 5),
                            raising=False)
        want = (f"cannot write {run_dir / 'metrics.jsonl'}: no space left on ",
                "set logging.run_dir to a folder elsewhere",
                f"The run stopped after step 5 without saving (its metrics row is lost) and "
                f"the newest checkpoint, {run_dir / 'checkpoints' / 'step-4'}, is intact")
        error, intact = RunHalted, "step-4"
    else:  # meta.json of the second save
        monkeypatch.setattr(mpcore.atomic, "open", _failing_open(open, "tmp-step-4", code),
                            raising=False)
        want = (f"cannot write {run_dir / 'checkpoints' / 'tmp-step-4'}",
                "is read-only (EROFS)", "set checkpoint.dir to a folder elsewhere",
                f"saving step 4 in {run_dir / 'checkpoints'} failed, the partial save was "
                f"removed and the newest checkpoint, {run_dir / 'checkpoints' / 'step-2'}, is "
                f"intact")
        error, intact = CheckpointError, "step-2"
    with pytest.raises(error) as raised:
        train(tiny(run_dir, data_dir))
    assert isinstance(raised.value, ValueError)  # pretrain.py: one line, exit 2
    assert all(part in str(raised.value) for part in want), str(raised.value)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == (
        ["latest", "step-2", "step-4"] if intact == "step-4" else ["latest", "step-2"])
    assert verify_checkpoint(root / intact) == []
    monkeypatch.undo()
    result = train(tiny(run_dir, data_dir))
    assert result.status == "done"
    assert [r["step"] for r in rows(run_dir)] == list(range(1, safety.STEPS + 1))
