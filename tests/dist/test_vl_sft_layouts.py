"""VL chat SFT from a release is the same function at every layout: tp=2, cp=2 (ring, zigzag),
cp=2 (Ulysses, contiguous) and dp=2 (FSDP2) against one process, 3 steps from a tiny Qwen3-VL
release and a tiny Qwen2.5-VL release (made here; its video positions read each video's
seconds per temporal patch) on prepared conversations with images and videos (frame lists,
timestamps in Qwen3-VL's text), 2 micro-batches per step of unequal assistant-token counts, with an assistant span
crossing the cp split of the first micro-batch. A mask shifted after the split, a loss averaged
per micro-batch or per rank, or vision rows placed on the wrong rank would change the losses."""

from __future__ import annotations

import math

import pytest

from mpcore.config import load_config
from mpcore.launch import prepare_vl_data
from mpcore.models import family_named
from mpcore.parallel.state import ParallelState
from mpcore.train import train
from mpcore.vl_data import build_vl_loaders
from tests.dist.harness import run_distributed
from tests.unit.test_vl_chat import image, text, write_images, write_jsonl
from tests.unit.test_vl_chat_video import video, write_frames
from tests.unit.vl_releases import make_release
from tests.unit.vl_video_reference import write_video_config

pytestmark = pytest.mark.slow  # per release five training runs of 3 steps on 1 and 2 ranks

STEPS, SEQ_LEN = 3, 256
ANSWER = " ".join(["The fox walks to the door and waits there."] * 7)
CONVERSATIONS = [
    [{"role": "user", "content": [video("tiny"), text("What happens?")]},
     {"role": "assistant", "content": ANSWER}],
    [{"role": "user", "content": [image("a.png"), text("And here?")]},
     {"role": "assistant", "content": "A fox on a mat."}],
    [{"role": "user", "content": [text("Compare"), image("b.jpg"), video("walk"),
                                  video("door", fps=2.0)]},
     {"role": "assistant", "content": "The door opens, 12345."}],
    [{"role": "user", "content": "No picture."}, {"role": "assistant", "content": "Text only."}],
] * 2
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses",
                    "parallel.cp_layout=contiguous"],
    "dp2_fsdp": ["parallel.data_parallel=fsdp", "data.grad_accum=1"],
}


def sft(tmp: str, run: str, *overrides: str, seq_len: int = SEQ_LEN):
    """The SFT run from ``tmp``'s release and prepared data (``test_pp_init_from_vl`` too)."""
    return load_config(None, [
        f"model.init_from={tmp}/release", f"data.vl_paths=[{tmp}/data]",
        f"data.seq_len={seq_len}", "data.micro_batch=1", "data.grad_accum=2",
        f"training.max_steps={STEPS}", "training.device=cpu", f"logging.run_dir={tmp}/{run}",
        "checkpoint.every=0", "optimizer.lr=1e-3", "schedule.warmup_steps=1", *overrides])


def _layouts(rank, world, tmp):
    return {name: train(sft(tmp, name, *overrides)).losses
            for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def runs(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"vl_sft_layouts_{arch}")
    release = make_release(arch, tmp / "release")
    write_video_config(arch, release)
    write_images(tmp)
    write_frames(tmp)
    source = write_jsonl(tmp / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp / "data")]) == 0
    reference = train(sft(str(tmp), "ref")).losses
    by_rank = run_distributed(_layouts, 2, str(tmp), timeout=600)
    return tmp, reference, by_rank, arch


def test_an_assistant_span_crosses_the_cp_split(runs):
    tmp, _, _, arch = runs
    family = family_named("qwen3_vl" if arch == "qwen3_vl" else "qwen2_vl")
    loader = build_vl_loaders(sft(str(tmp), "x"), ParallelState(), family)[0]
    steps = [loader.next_step() for _ in range(STEPS)]
    half = SEQ_LEN // 2  # the contiguous cp=2 split of one budget (Ulysses here)
    masks = [b["loss_mask"].reshape(-1) for step in steps for b in step]
    assert any(bool(m[half - 1]) and bool(m[half]) for m in masks)
    assert int(masks[0].sum()) != int(masks[1].sum())
    assert all(any(b.get("video_grid_thw") is not None for b in step) for step in steps)
    seconds = {s for step in steps for b in step if "second_per_grid" in b
               for s in b["second_per_grid"].tolist()}
    assert {2 / 24, 1.0} <= seconds  # no fps given (24), and 2 fps


def test_every_vl_sft_layout_matches_one_process(runs):
    _, reference, by_rank, _ = runs
    assert len(reference) == STEPS and reference[-1] < reference[0], reference
    for name in LAYOUTS:
        assert by_rank[0][name] == by_rank[1][name], name
        for step, (got, want) in enumerate(zip(by_rank[0][name], reference, strict=True)):
            assert math.isclose(got, want, rel_tol=1e-5), (name, step + 1, got, want)
