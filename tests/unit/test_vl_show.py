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
from transformers import AutoModelForImageTextToText

from mpcore.data import VLDataset
from mpcore.launch import prepare_data, prepare_vl_data
from mpcore.launch.score import checkpoint_spec, score_items
from mpcore.launch.score_io import read_input
from mpcore.models import family_of_hf
from mpcore.parallel.state import ParallelState
from tests.unit.test_vl_chat import write_images, write_jsonl
from tests.unit.test_vl_chat_video import CONVERSATIONS, write_frames
from tests.unit.vl_releases import hf_processor, make_release
from tests.unit.vl_video_reference import processor_inputs, video_processor, write_video_config


@pytest.fixture(scope="module", params=["qwen3_vl", "glm4v", "qwen2_vl"])
def prepared(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"show_{arch}")
    release = make_release(arch, tmp / "release")
    write_video_config(arch, release)
    write_images(tmp)
    write_frames(tmp)
    rows = [{"messages": m} for m in CONVERSATIONS]
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
            assert item.second_per_grid == sample.video_seconds.tolist()


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


@pytest.mark.slow
def test_qwen2_5_vl_show_lines_score_as_transformers(tmp_path, capsys):
    """A Qwen2.5-VL model places a video by its time: the --show lines of conversations with
    videos at 24 (none given), 2 and 0.5 fps, scored by score.py's functions, give transformers'
    log-probs on the processor's outputs (float64) within 1e-4 wherever the target is text;
    without their second_per_grid_ts (1 s per patch) they would not."""
    release = make_release("qwen2_5_vl", tmp_path / "release")
    config = write_video_config("qwen2_5_vl", release)
    write_images(tmp_path)
    write_frames(tmp_path)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "data")]) == 0
    capsys.readouterr()
    assert prepare_data.main(["--show", str(tmp_path / "data"), "--limit", "10"]) == 0
    path = tmp_path / "in.jsonl"
    path.write_text(capsys.readouterr().out)
    items = read_input(path, checkpoint_spec(release))
    for item in items:
        item.loss_mask = None  # score every position, not only the trained ones
    state = ParallelState()
    model, _ = family_of_hf(release).load_hf(release, state)
    ours = score_items(model.eval(), state, items)
    for item in items:
        item.second_per_grid = []
    unaware = score_items(model, state, items)
    hf = AutoModelForImageTextToText.from_pretrained(release, dtype=torch.float64).eval()
    processor = hf_processor("qwen2_5_vl", release, video_processor("qwen2_5_vl", config))
    placeholders = torch.tensor([hf.config.image_token_id, hf.config.video_token_id])
    gaps = []
    for messages, got, blind in zip(CONVERSATIONS, ours, unaware, strict=True):
        inputs = processor_inputs(processor, messages, tmp_path)
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].double()
        with torch.no_grad():
            logits = hf(**inputs).logits[0]
        ids = inputs["input_ids"][0]
        want = logits[:-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
        text = ~torch.isin(ids[1:], placeholders)
        got = torch.tensor(got["logprobs"], dtype=torch.float64)
        assert float((got - want)[text].abs().max()) <= 1e-4
        gaps.append(float((torch.tensor(blind["logprobs"]) - want)[text].abs().max()))
    assert max(gaps) > 1e-3, gaps


@pytest.mark.parametrize("value, error", [
    ([1.0, 2.0], r"second_per_grid_ts must be a list of 1 positive numbers"),
    ([0], r"second_per_grid_ts must be a list of 1 positive numbers"),
    (None, r"second_per_grid_ts without videos"),
])
def test_bad_second_per_grid_ts_is_refused_by_line(prepared, value, error, tmp_path):
    tmp, release, ds = prepared
    sample = ds[0]
    row = {"input_ids": sample.input_ids.tolist(),
           "pixel_values_videos": sample.pixel_values_videos.tolist(),
           "video_grid_thw": sample.video_grid_thw.tolist(), "second_per_grid_ts": value}
    if value is None:
        row = {"input_ids": [1, 2], "second_per_grid_ts": [1.0]}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"in.jsonl:1: " + error):
        read_input(path, checkpoint_spec(release))
