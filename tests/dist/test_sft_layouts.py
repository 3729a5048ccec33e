"""Chat SFT from a release is the same function at every layout: tp=2, cp=2 (ring and
Ulysses), dp=2 (FSDP2), tp=2 x cp=2 (ring, Ulysses), cp=4 (ring, Ulysses; zigzag) and
cp=2 x dp=2 (ring, DDP) against one process, 4 steps from a tiny Qwen3 checkpoint with a ChatML
tokenizer (made here), 2 micro-batches per step of unequal assistant-token counts, with an
assistant span crossing the cp split of the first micro-batch. A mask shifted after the split
or a loss averaged per micro-batch or per rank would change the losses."""

from __future__ import annotations

import json
import math

import pytest

from mpcore.config import load_config
from mpcore.data.hf_folder import TokenizerFolder
from mpcore.data.indexed import IndexedDataset
from mpcore.data.loader import DataLoader
from mpcore.data.sft_packing import SFTPackedDataset
from mpcore.launch import prepare_data
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.unit.release_tokenizers import ROWS, make_release

pytestmark = pytest.mark.slow  # ten training runs of 4 steps on 2 and 4 ranks

STEPS, SEQ_LEN = 4, 160
# A long assistant answer, so that one crosses the middle of a sample (the cp=2 split).
LONG = {"prompt": "Describe the fox.",
        "completion": " ".join(["The quick brown fox jumps over the lazy dog."] * 8)}
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses",
                    "parallel.cp_layout=contiguous"],
    "dp2_fsdp": ["parallel.data_parallel=fsdp", "data.grad_accum=1"],
}
LAYOUTS_4 = {
    "tp2_cp2_ring": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_mode=ring"],
    "cp4_ulysses": ["parallel.cp=4", "parallel.cp_mode=ulysses"],
    "tp2_cp2_ulysses": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_mode=ulysses"],
    "cp4_ring": ["parallel.cp=4", "parallel.cp_mode=ring"],
    "cp2_dp2_ring_ddp": ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.data_parallel=ddp",
                         "data.grad_accum=1"],
}


def sft(tmp: str, run: str, *overrides: str):
    return load_config(None, [
        f"model.init_from={tmp}/release", f"data.paths=[{tmp}/sft]", f"data.seq_len={SEQ_LEN}",
        "data.micro_batch=1", "data.grad_accum=2", f"training.max_steps={STEPS}",
        "training.device=cpu", f"logging.run_dir={tmp}/{run}", "checkpoint.every=0",
        "optimizer.lr=1e-3", "schedule.warmup_steps=1", *overrides])


def _layouts(rank, world, tmp):
    layouts = LAYOUTS if world == 2 else LAYOUTS_4
    return {name: train(sft(tmp, name, *overrides)).losses for name, overrides in layouts.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_layouts")
    make_release(tmp / "release")
    source = tmp / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [LONG, *ROWS, LONG, *ROWS]))
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp / "sft"), "--tokenizer", str(tmp / "release")]) == 0
    reference = train(sft(str(tmp), "ref")).losses
    by_rank = run_distributed(_layouts, 2, str(tmp), timeout=500)
    four = run_distributed(_layouts, 4, str(tmp), timeout=500)
    return tmp, reference, [{**a, **b} for a, b in zip(by_rank, four, strict=False)]


def test_an_assistant_span_crosses_the_cp_split(runs):
    tmp, _, _ = runs
    ds = IndexedDataset(tmp / "sft")
    samples = SFTPackedDataset(ds, SEQ_LEN, TokenizerFolder(tmp / "release").pad_fill_id)
    first = DataLoader(samples, 1, 2, 1, 0, sft(str(tmp), "x").data.seed).next_step()
    mask = first[0]["loss_mask"]
    half = SEQ_LEN // 2  # the contiguous cp=2 split of one sample (Ulysses here)
    assert bool(mask[half - 1]) and bool(mask[half])
    assert int(first[0]["loss_mask"].sum()) != int(first[1]["loss_mask"].sum())


def test_every_sft_layout_matches_one_process(runs):
    _, reference, by_rank = runs
    assert len(reference) == STEPS and reference[-1] < reference[0], reference
    for name in [*LAYOUTS, *LAYOUTS_4]:
        assert by_rank[0][name] == by_rank[1][name], name
        for step, (got, want) in enumerate(zip(by_rank[0][name], reference, strict=True)):
            assert math.isclose(got, want, rel_tol=1e-5), (name, step + 1, got, want)
