"""``model.init_from`` at pp = 2 for the vision-language families whose stages hold more than a
plain decoder: GLM-4V (its own decoder block, partial M-RoPE) and Qwen3.5-VL-MoE (hybrid
DeltaNet / attention layers with MoE blocks, fused experts, zero-centred norms). Each rank reads
its stage's slices of a tiny transformers-built release (``tests.unit.vl_releases``), and VL
chat SFT on conversations with images gives pp = 1's losses, 3 steps of 2 micro-batches, within
1e-5 rel; Qwen3.5-VL-MoE also at pp = 2 x dp = 2 with its experts split over ep = 2 (each rank
reads its experts only). A tensor read into the wrong stage, shape or ep rank, a load-time
conversion or expert layout the stage loader skips, or the tower's rows on the wrong stage would
move the first loss already."""

from __future__ import annotations

import math

import pytest

from mpcore.launch import prepare_vl_data
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.test_vl_sft_layouts import STEPS
from tests.dist.test_vl_sft_layouts import sft as layouts_sft
from tests.unit.test_vl_chat import CONVERSATIONS, write_images, write_jsonl
from tests.unit.vl_releases import make_qwen35_moe_release, make_release

SEQ_LEN = 192
RELEASES = {"glm4v": lambda folder: make_release("glm4v", folder),
            "qwen3_5_vl_moe": make_qwen35_moe_release}


def sft(tmp: str, run: str, *overrides: str):
    return layouts_sft(tmp, run, *overrides, seq_len=SEQ_LEN)


def _pp2(rank, world, tmp, overrides):
    return train(sft(tmp, "pp2", "parallel.pp=2", *overrides)).losses


# (family, ranks, the pp = 2 run's overrides); the reference takes dp x micro_batch samples
# per micro-batch, the same global batch
CASES = [("glm4v", 2, ()), ("qwen3_5_vl_moe", 2, ()),
         ("qwen3_5_vl_moe", 4, ("parallel.ep=2",))]


@pytest.mark.parametrize("family, world, overrides", CASES,
                         ids=["glm4v", "qwen3_5_vl_moe", "qwen3_5_vl_moe-dp2-ep2"])
def test_init_from_a_vl_release_at_pp2_matches_pp1(tmp_path, family, world, overrides):
    release = RELEASES[family](tmp_path / "release")
    write_images(tmp_path)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 10])
    assert prepare_vl_data.main(["--manifest", str(source), "--tokenizer", str(release),
                                 "--out", str(tmp_path / "data")]) == 0
    want = train(sft(str(tmp_path), "ref", f"data.micro_batch={world // 2}")).losses
    assert len(want) == STEPS and len(set(want)) == STEPS, want
    for got in run_distributed(_pp2, world, str(tmp_path), overrides, timeout=600):
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert math.isclose(a, b, rel_tol=1e-5), (family, step + 1, a, b)
