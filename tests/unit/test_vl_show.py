"""``launch/prepare_data.py --show FOLDER`` on prepared VL conversations (images and videos, tiny
releases): the lines are score.py's input schema and score.py's own reader (``read_input`` with
the release's ``checkpoint_spec``, which runs the family's placeholder check) accepts them,
giving back exactly the prepared ids, mask, rows and grids; ``--text`` marks the trained spans
and collapses placeholder runs; ``--limit`` counts samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mpcore.data import VLDataset
from mpcore.launch import prepare_data, prepare_vl_data
from mpcore.launch.score import checkpoint_spec
from mpcore.launch.score_io import read_input
from tests.unit.test_vl_chat import write_images, write_jsonl
from tests.unit.test_vl_chat_video import conversations, write_frames
from tests.unit.vl_releases import make_release
from tests.unit.vl_video_reference import write_video_config


@pytest.fixture(scope="module", params=["qwen3_vl", "glm4v", "qwen2_vl"])
def prepared(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"show_{arch}")
    release = make_release(arch, tmp / "release")
    write_video_config(arch, release)
    write_images(tmp)
    write_frames(tmp)
    rows = [{"messages": m} for m in conversations(arch)]
    rows.append({"messages": [{"role": "user", "content": "Only text."},
                              {"role": "assistant", "content": "Fine."}]})
    source = write_jsonl(tmp / "chat.jsonl", rows)
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp / "data")]) == 0
    return tmp, release, VLDataset(tmp / "data")


def test_show_lines_are_what_score_reads(prepared, capsys, tmp_path):
    tmp, release, ds = prepared
    assert prepare_data.main(["--show", str(tmp / "data"), "--limit", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(ds) == 3
    assert {"pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"} <= set(
        json.loads(lines[1]))
    assert set(json.loads(lines[2])) == {"input_ids", "loss_mask"}  # text only
    path = tmp_path / "score_input.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items = read_input(path, checkpoint_spec(release))
    for i, item in enumerate(items):
        sample = ds[i]
        assert item.input_ids == sample.input_ids.tolist()
        assert item.loss_mask == sample.loss_mask.astype(int).tolist()
        assert item.image_grid_thw == [tuple(g) for g in sample.grid_thw.tolist()]
        assert item.video_grid_thw == [tuple(g) for g in sample.video_grid_thw.tolist()]
        if len(sample.grid_thw):
            assert torch.equal(item.pixel_values, torch.from_numpy(sample.pixel_values.copy()))
        if len(sample.video_grid_thw):
            assert torch.equal(item.pixel_values_videos,
                               torch.from_numpy(sample.pixel_values_videos.copy()))


def test_show_text_marks_trained_spans_and_counts_placeholders(prepared, capsys):
    tmp, _, ds = prepared
    assert prepare_data.main(["--show", str(tmp / "data"), "--limit", "2", "--text"]) == 0
    texts = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert len(texts) == 2
    assert "[[A fox walks by." in texts[0] and "[[The door opens, 12345." in texts[1]
    tok = ds.tokenizer
    for text, i in zip(texts, range(2), strict=True):
        ids = ds[i].input_ids
        runs = [int(n) for n in __import__("re").findall(r"\|>\*(\d+)", text)]
        assert sum(runs) == int(np.isin(ids, list(tok.placeholder_ids)).sum())
        assert text.count("[[") == text.count("]]") == int(
            (np.diff(np.r_[0, ds[i].loss_mask.astype(int)]) == 1).sum())
