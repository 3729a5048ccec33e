"""VL conversations WITH videos (frame lists) prepared with a released VL checkpoint's folder, for
each VL family (tiny releases, ``vl_releases``, with a video_preprocessor_config.json): ids,
image and video rows, grids and the assistant mask equal transformers' processor + chat template
on the same messages (``vl_video_reference``: transformers' own code but for torchvision's
resize and normalise kernels, replaced by the torch calls torchvision makes; the kernel itself is
pinned by tests/unit/test_video_processing.py's recorded processor output), the video ids are
the release's own, and bad videos are refused by line with nothing written."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpcore.data import VLDataset
from mpcore.data.hf_folder import TokenizerFolder
from mpcore.data.vl_chat import prepare_vl_conversations
from mpcore.launch import prepare_vl_data
from mpcore.models import family_named
from mpcore.vl_release import release_image_settings, release_video_settings, release_vl_tokenizer
from tests.unit.test_vl_chat import assistant_mask, image, text, write_images, write_jsonl
from tests.unit.vl_releases import ARCHES, hf_processor, make_release
from tests.unit.vl_video_reference import processor_inputs, video_processor, write_video_config

# (name, frames, height, width): sizes that the bounds keep, shrink and grow; odd frame counts
CLIPS = {"walk": (3, 20, 30), "door": (4, 26, 18), "tiny": (2, 6, 10)}


def video(name: str, fps: float | None = None) -> dict:
    part = {"type": "video", "video": [f"{name}/{k}.png" for k in range(CLIPS[name][0])]}
    return part if fps is None else {**part, "fps": fps}


CONVERSATIONS = [
    [{"role": "user", "content": [video("walk"), text("What happens?")]},
     {"role": "assistant", "content": "A fox walks by."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": [text("Compare"), image("a.png"), text("with"),
                                  video("door", fps=2.0)]},
     {"role": "assistant", "content": "The door opens, 12345."},
     {"role": "user", "content": [text("And this:"), video("tiny", fps=0.5)]},
     {"role": "assistant", "content": "Too small to tell."}],
]


def conversations(arch: str) -> list:
    """``CONVERSATIONS``; for Qwen2.5-VL every video at 2 fps, the one rate whose positions
    prepared data keeps (its positions follow the video's time; others are refused)."""
    if arch != "qwen2_5_vl":
        return CONVERSATIONS
    return [[{**m, "content": [{**p, "fps": 2} if p["type"] == "video" else p
                               for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
            for messages in CONVERSATIONS]


def write_frames(folder: Path) -> None:
    rng = np.random.default_rng(11)
    for name, (n, h, w) in CLIPS.items():
        (folder / name).mkdir(exist_ok=True)
        for k in range(n):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{k}.png")


@pytest.fixture(scope="module", params=ARCHES)
def prepared(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    release = make_release(arch, tmp / "release")
    config = write_video_config(arch, release)
    write_images(tmp)
    write_frames(tmp)
    source = write_jsonl(tmp / "chat.jsonl", [{"messages": m} for m in conversations(arch)])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp / "data")]) == 0
    return arch, tmp, release, config, VLDataset(tmp / "data")


def check_sample(arch, sample, want, release) -> None:
    tok = TokenizerFolder(release)
    ids = want["input_ids"][0].tolist()
    if arch == "glm4v":  # GLM's template ends the last turn with no token: eos appended
        ids = ids + [tok.eos_id]
    assert sample.input_ids.tolist() == ids
    assert sample.loss_mask.astype(int).tolist() == assistant_mask(ids, tok.rust, arch)
    assert sample.video_grid_thw.tolist() == want["video_grid_thw"].tolist()
    assert torch.equal(torch.from_numpy(sample.pixel_values_videos.copy()),
                       want["pixel_values_videos"].float())
    if "pixel_values" in want:
        assert sample.grid_thw.tolist() == want["image_grid_thw"].tolist()
        torch.testing.assert_close(torch.from_numpy(sample.pixel_values.copy()),
                                   want["pixel_values"].float(), atol=1e-5, rtol=0)


def test_ids_rows_grids_and_mask_equal_the_release_processor(prepared):
    arch, tmp, release, config, ds = prepared
    processor = hf_processor(arch, release, video_processor(arch, config))
    assert ds.meta["num_videos"] == 3
    for i, messages in enumerate(conversations(arch)):
        want = processor_inputs(processor, messages, tmp)
        check_sample(arch, ds[i], want, release)
    recorded = ds.meta["video_settings"]
    assert (recorded["min_pixels"], recorded["max_pixels"]) == (
        config["size"]["shortest_edge"], config["size"]["longest_edge"])


def test_video_ids_are_the_releases_own(prepared):
    """Every id is inside the release's vocabulary; GLM-4V's video begin/end are the ids its
    config.json names (the tokens of its tokenizer), never ids appended after it."""
    arch, tmp, release, _, ds = prepared
    hf = json.loads((release / "config.json").read_text())
    vocab = TokenizerFolder(release).vocab_size
    ids = np.concatenate([ds[i].input_ids for i in range(len(CONVERSATIONS))])
    assert ids.max() < vocab
    if arch == "glm4v":
        rust = TokenizerFolder(release).rust
        assert hf["video_start_token_id"] == rust.token_to_id("<|begin_of_video|>")
        assert (ids == hf["video_start_token_id"]).sum() == 3
        assert (ids == hf["video_end_token_id"]).sum() == 3
        assert (ids == hf["video_token_id"]).sum() == 0  # replaced by the frames' runs
    else:
        assert (ids == hf["video_token_id"]).sum() == int(sum(
            ds[i].video_grid_thw.prod(1).sum() // 4 for i in range(len(CONVERSATIONS))))


def test_video_pixel_flags_override_the_release(prepared, tmp_path):
    arch, tmp, release, config, _ = prepared
    messages = conversations(arch)[0]
    source = write_jsonl(tmp / "one.jsonl", [{"messages": messages}])
    low = {**config, "size": {"shortest_edge": 16, "longest_edge": 256}}
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "small"), "--video-min-pixels", "16",
                                 "--video-max-pixels", "256"]) == 0
    sample = VLDataset(tmp_path / "small")[0]
    processor = hf_processor(arch, release, video_processor(arch, low))
    want = processor_inputs(processor, messages, tmp)
    check_sample(arch, sample, want, release)
    assert sample.video_grid_thw.prod() < VLDataset(tmp / "data")[0].video_grid_thw.prod()


@pytest.fixture(scope="module")
def qwen3_release(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_video")
    write_images(tmp)
    write_frames(tmp)
    release = make_release("qwen3_vl", tmp / "release")
    write_video_config("qwen3_vl", release)
    return tmp, release


GOOD = {"messages": CONVERSATIONS[0]}


@pytest.mark.parametrize("row, error", [
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "walk.mp4"}]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0 gives the video as one file \('walk.mp4'\); give its "
     r"frames instead"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": []}]},
                   {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0: a video must be a non-empty list of frame paths"),
    ({"messages": [{"role": "user", "content": [
        {"type": "video", "video": ["walk/0.png", "walk/9.png"]}]},
        {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: frame 1 of a video \(.*walk/9.png\) does not exist"),
    ({"messages": [{"role": "user", "content": [
        {"type": "video", "video": ["walk/0.png", "door/0.png"]}]},
        {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: frame 1 \(.*door/0.png\) is 26x18 but frame 0 is 20x30"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": ["walk/0.png"],
                                                 "fps": -1}]},
        {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0: fps must be a positive number"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": ["walk/0.png"],
                                                 "speed": 2}]},
        {"role": "assistant", "content": "ok"}]},
     r"chat.jsonl:2: message 0 part 0 is a video part with unknown key\(s\) \['speed'\]"),
])
def test_bad_videos_name_file_and_line_and_write_nothing(qwen3_release, row, error, capsys):
    tmp, release = qwen3_release
    source = write_jsonl(tmp / "chat.jsonl", [GOOD, row, GOOD])
    out = tmp / "out"
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(out)]) == 2
    assert re.search(error, capsys.readouterr().err)
    assert not out.exists() and not list(tmp.glob(".out.tmp-*"))


def test_a_video_in_an_assistant_turn_is_never_a_target(qwen3_release, tmp_path):
    """Qwen3-VL writes timestamps as text between frames: inside an assistant turn they are the
    processor's text, not the answer, so they and every token of the video's expansion stay
    out of the mask while the turn's own text trains."""
    tmp, release = qwen3_release
    messages = [{"role": "user", "content": "Show me."},
                {"role": "assistant", "content": [text("Here:"), video("walk"), text("done.")]}]
    source = write_jsonl(tmp / "answer.jsonl", [{"messages": messages}])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "data")]) == 0
    sample = VLDataset(tmp_path / "data")[0]
    processor = hf_processor("qwen3_vl", release,
                             video_processor("qwen3_vl", write_video_config("qwen3_vl", release)))
    want = processor_inputs(processor, messages, tmp)
    ids = want["input_ids"][0].tolist()
    assert sample.input_ids.tolist() == ids
    rust = TokenizerFolder(release).rust
    full = rust.decode(ids, skip_special_tokens=False)
    enc = rust.encode(full, add_special_tokens=False)
    assert enc.ids == ids
    (lo, hi), = [m.span() for m in re.finditer(
        r"(<[\d.]+ seconds><\|vision_start\|>(<\|video_pad\|>)+<\|vision_end\|>)+", full)]
    inside = np.array([lo <= a and b <= hi for a, b in enc.offsets])
    expected = np.array(assistant_mask(ids, rust, "qwen3_vl")) * ~inside
    assert inside.sum() > 20 and expected.sum() > 3
    assert sample.loss_mask.astype(int).tolist() == expected.tolist()


def test_qwen2_5_vl_videos_at_another_rate_are_refused_by_line(tmp_path, capsys):
    release = make_release("qwen2_5_vl", tmp_path / "release")
    write_video_config("qwen2_5_vl", release)
    write_frames(tmp_path)
    rows = [{"messages": conversations("qwen2_5_vl")[0]}, GOOD]  # 2 fps, then none given
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:2: a Qwen2.5-VL video's positions follow its time, 0.0833333 s" in err
    assert "chat.jsonl:1" not in err and '(\"fps\": 2)' in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("part", [image("a.png"), video("walk")], ids=["image", "video"])
def test_a_system_turn_the_template_cannot_render_is_refused(part, tmp_path, capsys):
    """GLM-4V's template writes a system turn's content as a string: an image or a video
    there is refused by line with the fix, nothing written."""
    release = make_release("glm4v", tmp_path / "release")
    write_images(tmp_path)
    write_frames(tmp_path)
    row = {"messages": [{"role": "system", "content": [text("Look:"), part]},
                        {"role": "user", "content": "What is it?"},
                        {"role": "assistant", "content": "A fox."}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, row])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:2: the chat template of" in err
    assert "cannot render images or videos in a system turn (message 0): move them to a user " \
           "turn" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_family_without_video_rules_refuses_videos_by_line(qwen3_release, tmp_path):
    """A family record whose processor has no video rules (none ships today: every VL family
    takes videos) gets no video settings, and a video line is refused by line."""
    tmp, release = qwen3_release
    family = family_named("qwen3_vl")
    still = replace(family, image_processing=replace(family.image_processing, video=None))
    settings = release_image_settings(release, still)
    assert release_video_settings(release, family, settings) is not None
    assert release_video_settings(release, still, settings) is None
    source = write_jsonl(tmp / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
        GOOD])
    with pytest.raises(ValueError, match=r"chat.jsonl:2: a video, but the qwen3_vl family takes "
                                         r"no videos \(its processor has no video rules\)"):
        prepare_vl_conversations(source, tmp_path / "out", release_vl_tokenizer(release, family),
                                 settings, progress=False, video=None)
    assert not (tmp_path / "out").exists()
