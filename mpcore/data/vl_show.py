"""What trains in a prepared VL dataset folder, as ``launch/prepare_data.py --show`` prints it.

    show_vl(folder, limit, text, out)

One JSON line per sample, in score.py's input schema (launch/score_io.py), so a line can be
scored as it is: ``input_ids``, ``loss_mask``, and when the sample has them ``pixel_values`` with
``image_grid_thw`` (its images' rows and grids) and ``pixel_values_videos`` with
``video_grid_thw`` (its videos'). Rows are float32 values written as JSON numbers (each reads
back to the same float32). With ``text``: ``{"text": ...}``, the sample decoded with the
folder's own tokenizer copy, trained spans between ``[[`` and ``]]`` and each run of a
placeholder id written once with its length (``<|image_pad|>*64``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from mpcore.data.vl_dataset import VLDataset


def is_vl_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder holding a meta.json (a prepared VL dataset's layout)."""
    return Path(path).is_dir() and (Path(path) / "meta.json").is_file()


def _row(sample) -> dict:
    row = {"input_ids": sample.input_ids.tolist(),
           "loss_mask": sample.loss_mask.astype(np.int64).tolist()}
    if len(sample.grid_thw):
        row["pixel_values"] = sample.pixel_values.astype(np.float32).tolist()
        row["image_grid_thw"] = sample.grid_thw.tolist()
    if sample.video_grid_thw is not None and len(sample.video_grid_thw):
        row["pixel_values_videos"] = sample.pixel_values_videos.astype(np.float32).tolist()
        row["video_grid_thw"] = sample.video_grid_thw.tolist()
    return row


def _text(sample, tok) -> str:
    """The decoded sample (module docstring)."""
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    placeholders = set(tok.placeholder_ids)
    parts, k = [], 0
    while k < len(ids):  # runs of one mask value; inside, placeholder runs collapsed
        j = k
        while j < len(ids) and mask[j] == mask[k]:
            j += 1
        pieces, a = [], k
        while a < j:
            b = a
            if ids[a] in placeholders:
                while b < j and ids[b] == ids[a]:
                    b += 1
                pieces.append(f"{tok.decode([ids[a]])}*{b - a}")
            else:
                while b < j and ids[b] not in placeholders:
                    b += 1
                pieces.append(tok.decode(ids[a:b]))
            a = b
        piece = "".join(pieces)
        parts.append(f"[[{piece}]]" if mask[k] else piece)
        k = j
    return "".join(parts)


def show_vl(folder: str | Path, limit: int, text: bool, out=None) -> int:
    """Print the first ``limit`` samples of the prepared VL folder (module docstring) to
    ``out`` (None: the current ``sys.stdout``); returns how many. ``ValueError`` naming the
    folder when it is not one."""
    out = out or sys.stdout
    ds = VLDataset(folder)
    count = min(limit, len(ds))
    for i in range(count):
        sample = ds[i]
        row = {"text": _text(sample, ds.tokenizer)} if text else _row(sample)
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return count
