"""launch/plot_metrics.py: the SVG's curves are the rows of metrics.jsonl, point for point."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mpcore.launch.plot_metrics import main

REPO = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _write_run(folder: Path, steps: int, seed: float, valid_every: int = 0) -> list[dict]:
    folder.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 6.0 * math.exp(-step / (10 + seed)) + seed,
               "grad_norm": 1.0, "lr": 1e-3 * min(1.0, step / 5), "tokens_per_s": 1000 + 37 * (
                   step % 7) * seed, "tflops": 0.1, "mfu": 0.01, "mem_gib": 1.0}
        if valid_every and step % valid_every == 0:
            row["valid_loss"] = row["loss"] + 0.3
        rows.append(row)
    rows[3]["loss"] = float("nan")  # a non-finite step: left out of the loss curve
    text = "".join(json.dumps(r) + "\n" for r in rows)  # json writes NaN as the writer does
    (folder / "metrics.jsonl").write_text(text + '{"step": 99, "lo')  # a torn last line
    return rows


def _curves(svg: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(run, metric) -> the polyline's points mapped back to (step, value) via its panel."""
    out = {}
    for group in ET.parse(svg).getroot().iter(f"{SVG}g"):
        x0, x1 = map(float, group.get("data-x-range").split())
        y0, y1 = map(float, group.get("data-y-range").split())
        left, top, width, height = map(float, group.get("data-box").split())
        for line in group.iter(f"{SVG}polyline"):
            pts = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
            out[line.get("data-run"), line.get("data-metric")] = [
                (x0 + (px - left) / width * (x1 - x0), y0 + (top + height - py) / height * (y1 - y0))
                for px, py in pts]
    return out


def _assert_close(got, rows, key):
    want = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    assert len(got) == len(want), key
    scale = max(abs(v) for _, v in want) or 1.0
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert abs(gx - wx) < 1e-2 and abs(gy - wy) < 1e-4 * scale + 1e-9, (key, gx, wx, gy, wy)


def test_svg_polylines_are_the_rows(tmp_path, capsys):
    a = _write_run(tmp_path / "a", 40, 0.0, valid_every=10)
    b = _write_run(tmp_path / "b", 25, 1.0)
    out = tmp_path / "curves.svg"
    assert main([str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), "--out",
                 str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a' / 'metrics.jsonl'}:41: not a metrics row, skipped" in err
    curves = _curves(out)
    for name, rows in (("a", a), ("b", b)):
        _assert_close(curves[name, "loss"], rows, "loss")
        _assert_close(curves[name, "learning rate"], rows, "lr")
        _assert_close(curves[name, "tokens / s"], rows, "tokens_per_s")
    _assert_close(curves["a", "validation loss"], a, "valid_loss")
    assert len(curves["a", "loss"]) == 39 and len(curves["a", "validation loss"]) == 4
    assert ("b", "validation loss") not in curves  # run b has no validation rows
    text = out.read_text()
    assert text.count("<polyline") == 7 and ">a</text>" in text and ">b</text>" in text


def test_errors_leave_the_previous_picture(tmp_path):
    _write_run(tmp_path / "a", 10, 0.0)
    out = tmp_path / "curves.svg"
    out.write_text("previous picture")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    cases = [([str(tmp_path / "a"), str(tmp_path / "nope")], "nope does not exist; pass a run folder"),
             ([str(tmp_path / "a"), str(tmp_path / "empty")], "holds no metrics row yet")]
    for runs, message in cases:
        with pytest.raises(SystemExit, match=message):
            main([*runs, "--out", str(out)])
        assert out.read_text() == "previous picture"
    with pytest.raises(SystemExit, match=r"name an \.svg or a \.png file"):
        main([str(tmp_path / "a"), "--out", str(tmp_path / "curves.pdf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "curves.svg", "empty"]


def test_png_without_matplotlib_says_so(tmp_path):
    _write_run(tmp_path / "a", 10, 0.0)
    code = ("import sys; sys.modules['matplotlib'] = None; from mpcore.launch.plot_metrics import main; "
            f"main([{str(tmp_path / 'a')!r}, '--out', {str(tmp_path / 'c.png')!r}])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "c.png: a PNG needs matplotlib, which is not installed" in proc.stderr
    assert not (tmp_path / "c.png").exists()


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (only PNG output needs it)")
    _write_run(tmp_path / "a", 10, 0.0)
    assert main([str(tmp_path / "a"), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
