"""Plot the training curves of one or several runs: loss, validation loss, lr, throughput.

    python launch/plot_metrics.py RUN_DIR [RUN_DIR ...] --out curves.svg   (or curves.png)

Reads each run's ``metrics.jsonl`` (``RUN_DIR`` may also name the file itself) and draws four
panels against ``step``: ``loss``, ``valid_loss`` (validation steps only), ``lr`` and
``tokens_per_s``, one coloured line per run. SVG is written by hand (no plotting package
needed); PNG needs matplotlib and says so when it is missing. The output is written whole or
not at all (``mpcore.atomic``); nothing in the run folders is changed. A line that is not a
JSON object (a torn last line of a killed run, say) is skipped with a warning naming it, and
non-finite values are left out of their curve.

Each curve is an SVG ``<polyline>`` with ``data-run`` and ``data-metric`` attributes, inside a
panel ``<g>`` whose ``data-x-range`` / ``data-y-range`` give the values at its edges, so the
drawing can be checked against the rows (``tests/unit/test_plot_metrics.py`` does).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from mpcore import atomic

METRICS = (("loss", "loss"), ("valid_loss", "validation loss"), ("lr", "learning rate"),
           ("tokens_per_s", "tokens / s"))
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
           "#e377c2")
PANEL_W, PANEL_H, MARGIN_L, MARGIN_T, GAP = 420, 220, 70, 40, 40


def read_rows(run: Path) -> list[dict]:
    """The rows of ``run``'s ``metrics.jsonl`` (or of that file), in step order; SystemExit
    naming the file when it is missing or holds no row."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass a run folder (logging.run_dir, "
                         f"which holds metrics.jsonl) or the metrics.jsonl file")
    rows = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                if line.strip():
                    print(f"warning: {path}:{number}: not a metrics row, skipped", file=sys.stderr)
                continue
            rows[row["step"]] = row  # a step logged twice: the later row wins
    if not rows:
        raise SystemExit(f"error: {path} holds no metrics row yet; plot it after the first "
                         f"logged step (logging.log_every)")
    return [rows[step] for step in sorted(rows)]


def series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` of the rows that carry a finite ``key``."""
    out = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append((float(row["step"]), float(value)))
    return out


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:  # a flat curve: a band around it, so it is drawn mid-panel
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _label(value: float) -> str:
    return f"{value:.4g}"


def _panel(index: int, title: str, curves: list[tuple[str, str, list]]) -> list[str]:
    """SVG lines of one panel: frame, title, edge labels and one polyline per curve."""
    left = MARGIN_L + (index % 2) * (PANEL_W + MARGIN_L + GAP)
    top = MARGIN_T + (index // 2) * (PANEL_H + MARGIN_T + GAP)
    drawn = [(name, colour, pts) for name, colour, pts in curves if pts]
    out = [f'<text x="{left}" y="{top - 10}" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{PANEL_W}" height="{PANEL_H}" fill="none" '
           f'stroke="#999"/>']
    if not drawn:
        out.append(f'<text x="{left + 10}" y="{top + PANEL_H / 2}" fill="#666">no rows carry '
                   f'this value</text>')
        return out
    x0, x1 = _span([x for _, _, pts in drawn for x, _ in pts])
    y0, y1 = _span([y for _, _, pts in drawn for _, y in pts])
    out.append(f'<g data-x-range="{x0!r} {x1!r}" data-y-range="{y0!r} {y1!r}" '
               f'data-box="{left} {top} {PANEL_W} {PANEL_H}">')
    for name, colour, pts in drawn:
        coords = " ".join(
            f"{left + (x - x0) / (x1 - x0) * PANEL_W:.3f},"
            f"{top + PANEL_H - (y - y0) / (y1 - y0) * PANEL_H:.3f}" for x, y in pts)
        out.append(f'<polyline data-run="{escape(name)}" data-metric="{escape(title)}" '
                   f'fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>')
    out.append("</g>")
    for y, value in ((top + 4, y1), (top + PANEL_H, y0)):
        out.append(f'<text x="{left - 6}" y="{y}" text-anchor="end">{_label(value)}</text>')
    for x, value, anchor in ((left, x0, "start"), (left + PANEL_W, x1, "end")):
        out.append(f'<text x="{x}" y="{top + PANEL_H + 16}" text-anchor="{anchor}">'
                   f'{_label(value)}</text>')
    out.append(f'<text x="{left + PANEL_W / 2}" y="{top + PANEL_H + 16}" '
               f'text-anchor="middle" fill="#666">step</text>')
    return out


def render_svg(runs: dict[str, list[dict]]) -> str:
    """The SVG document of ``runs`` (name -> rows)."""
    width = 2 * (MARGIN_L + PANEL_W) + GAP + 20
    height = 2 * (MARGIN_T + PANEL_H + GAP) + 30 + 18 * len(runs)
    colours = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(runs)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for i, (key, title) in enumerate(METRICS):
        out += _panel(i, title, [(n, colours[n], series(rows, key)) for n, rows in runs.items()])
    legend_top = 2 * (MARGIN_T + PANEL_H + GAP) + 10
    for i, name in enumerate(runs):
        y = legend_top + 18 * i
        out.append(f'<line x1="{MARGIN_L}" y1="{y}" x2="{MARGIN_L + 24}" y2="{y}" '
                   f'stroke="{colours[name]}" stroke-width="3"/>')
        out.append(f'<text x="{MARGIN_L + 32}" y="{y + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_png(runs: dict[str, list[dict]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"error: {out}: a PNG needs matplotlib, which is not installed "
                         f"(pip install matplotlib); or pass --out with .svg, which needs "
                         f"nothing") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, METRICS, strict=True):
        for name, rows in runs.items():
            pts = series(rows, key)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes.flat[0].legend()
    fig.tight_layout()
    with atomic.atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def run_names(paths: list[Path]) -> list[str]:
    """Folder names, or whole paths where two runs share a name."""
    names = [(p.parent if p.name == "metrics.jsonl" else p).name or str(p) for p in paths]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folders (logging.run_dir) or their metrics.jsonl files")
    parser.add_argument("--out", required=True, type=Path,
                        help="the picture to write: FILE.svg (no dependency) or FILE.png "
                             "(needs matplotlib); replaced whole if it exists")
    args = parser.parse_args(argv)
    suffix = args.out.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise SystemExit(f"error: --out {args.out}: name an .svg or a .png file")
    if not args.out.parent.is_dir():
        raise SystemExit(f"error: --out {args.out}: the folder {args.out.parent} does not exist")
    runs = dict(zip(run_names(args.runs), (read_rows(p) for p in args.runs), strict=True))
    if suffix == ".svg":
        atomic.write_text(args.out, render_svg(runs))
    else:
        write_png(runs, args.out)
    total = sum(len(rows) for rows in runs.values())
    print(f"wrote {args.out}: {len(runs)} run(s), {total} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
