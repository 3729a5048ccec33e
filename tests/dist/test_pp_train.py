"""Training at pp > 1 is the one-process run: ``parallel.pp=2`` (1F1B, and ZBV with two stages
per rank; and a qwen3_moe model with its load-balancing loss) on 2 ranks and pp=2 x dp=2 (FSDP2, and the summed ddp path) on 4 give the losses and
gradient norms of pp = 1, same seed and global batch, 6 steps with grad_clip active. Checkpoints
stay logical: a pp=2 checkpoint resumes at pp = 1 and at pp = 4 with the reference's next
losses, a pp = 1 checkpoint resumes at pp=2, and a pp=2 run resumed at pp=2 continues bit for bit.

The tp=1 reference runs in this process; each layout group in one gloo spawn.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch.distributed as dist

from mpcore.config import load_config
from mpcore.data import prepare_default, prepare_vl_default
from mpcore.launch import prepare_data
from mpcore.train import train
from tests.dist.harness import run_distributed
from tests.dist.test_sft_layouts import sft
from tests.dist.test_vl_train import tiny as vl_tiny
from tests.unit.release_tokenizers import ROWS, make_release

pytestmark = pytest.mark.slow  # several training runs per spawn

STEPS, SAVE_AT = 6, 3
TWO = {"pp2_1f1b": ["parallel.pp=2"],
       "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"]}
FOUR = {"pp2_dp2_fsdp": ["parallel.pp=2", "data.micro_batch=1"],
        "pp2_dp2_ddp": ["parallel.pp=2", "parallel.data_parallel=ddp", "data.micro_batch=1"]}


def tiny(tmp, run: str, *overrides: str):
    return load_config(None, [
        # 4 layers: two stages at pp=2, four with ZBV's two per rank; vocab 515 is padded
        "model.vocab_size=515", "model.hidden_size=64", "model.num_layers=4",
        "model.num_heads=4", "model.num_kv_heads=1", "model.intermediate_size=128",
        "model.tie_embeddings=false", f"data.cache_dir={tmp}/data", "data.default_vocab_size=512",
        "data.seq_len=64", "data.micro_batch=2", "data.grad_accum=2", "optimizer.lr=1e-2",
        "schedule.warmup_steps=2", f"training.max_steps={STEPS}", "training.device=cpu",
        f"logging.run_dir={tmp}/{run}", "logging.log_every=100",
        f"checkpoint.every={SAVE_AT}", "checkpoint.keep_last=5", *overrides])


def _resume(tmp: str, source: str, run: str, *overrides: str, rank: int):
    """Train ``run`` from ``source``'s step-SAVE_AT checkpoint to the end."""
    if rank == 0:
        shutil.copytree(f"{tmp}/{source}/checkpoints/step-{SAVE_AT}",
                        f"{tmp}/{run}/checkpoints/step-{SAVE_AT}")
    if dist.is_initialized():
        dist.barrier()
    return train(tiny(tmp, run, *overrides)).losses


MOE = ["model.family=qwen3_moe", "model.moe.num_experts=4", "model.moe.num_experts_per_tok=2",
       "model.moe.moe_intermediate_size=32", "model.moe.router_aux_loss_coef=0.05"]


TIED = ["model.tie_embeddings=true"]


def _two(rank, world, tmp):
    out = {"pp2_moe": train(tiny(tmp, "pp2_moe", "parallel.pp=2", *MOE)).losses}
    tied = train(tiny(tmp, "pp2_tied", "parallel.pp=2", *TIED))
    out["pp2_tied"] = (tied.losses, tied.grad_norms)
    for name, overrides in TWO.items():
        result = train(tiny(tmp, name, *overrides))
        out[name] = (result.losses, result.grad_norms)
    out["pp2_again"] = _resume(tmp, "pp2_1f1b", "pp2_again", *TWO["pp2_1f1b"], rank=rank)
    out["pp2_from_pp1"] = _resume(tmp, "ref", "pp2_from_pp1", *TWO["pp2_1f1b"], rank=rank)
    return out


def _four(rank, world, tmp):
    out = {}
    for name, overrides in FOUR.items():
        result = train(tiny(tmp, name, *overrides))
        out[name] = (result.losses, result.grad_norms)
    # pp=4 (one layer a stage; GPipe: two micro-batches for four stages) from pp=2's checkpoint
    out["pp4_from_pp2"] = _resume(tmp, "pp2_1f1b", "pp4_from_pp2", "parallel.pp=4",
                                  "parallel.pp_schedule=GPipe", rank=rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_train")
    prepare_default(tmp / "data", 512)
    ref = train(tiny(tmp, "ref"))
    ref_moe = train(tiny(tmp, "ref_moe", *MOE)).losses
    two = run_distributed(_two, 2, str(tmp), timeout=600)
    four = run_distributed(_four, 4, str(tmp), timeout=600)
    two[0]["ref_moe"] = ref_moe
    tied = train(tiny(tmp, "ref_tied", *TIED))
    two[0]["ref_tied"] = (tied.losses, tied.grad_norms)
    return tmp, (ref.losses, ref.grad_norms), two, four


def _close(got, want, tol, what):
    assert len(got) == len(want), (what, got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=tol), (what, step + 1, a, b)


def test_pipelined_training_matches_pp1(runs):
    _, (losses, norms), two, four = runs
    assert losses[-1] < losses[0] - 0.1 and norms[0] > 1.0  # learning; clipping is active
    for by_rank, names in ((two, TWO), (four, FOUR)):
        for name in names:
            assert all(r[name] == by_rank[0][name] for r in by_rank), name  # global values
            got_losses, got_norms = by_rank[0][name]
            _close(got_losses, losses, 1e-5, name)
            # step 1: identical weights, the global norm to fp32 rounding; later Adam's
            # near-sign updates amplify rounding in the gradients (as test_train_layouts)
            _close(got_norms[:1], norms[:1], 1e-6, name)
            _close(got_norms, norms, 1e-4, name)


def test_pp2_checkpoint_resumes_bit_for_bit_at_pp2(runs):
    _, _, two, _ = runs
    assert two[0]["pp2_again"] == two[0]["pp2_1f1b"][0][SAVE_AT:]


def test_pp1_checkpoint_resumes_at_pp2(runs):
    _, (losses, _), two, _ = runs
    _close(two[0]["pp2_from_pp1"], losses[SAVE_AT:], 1e-5, "pp2_from_pp1")


def test_pp2_checkpoint_resumes_at_pp1(runs):
    tmp, (losses, _), _, _ = runs
    saved = tmp / "pp2_1f1b" / "checkpoints"
    assert (saved / "latest").read_text().strip() == f"step-{STEPS}"
    folder = tmp / "pp1_from_pp2" / "checkpoints"
    shutil.copytree(saved / f"step-{SAVE_AT}", folder / f"step-{SAVE_AT}")
    result = train(tiny(tmp, "pp1_from_pp2"))
    assert result.step == STEPS
    _close(result.losses, losses[SAVE_AT:], 1e-5, "pp1_from_pp2")


def test_pp_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="parallel.pp_schedule must be one of"):
        tiny(tmp_path, "x", "parallel.pp_schedule=Zigzag")
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        tiny(tmp_path, "x", "parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_virtual=3")


def test_moe_training_at_pp2_matches_pp1(runs):
    """qwen3_moe with a weighted load-balancing loss (a global statistic across stages); the
    logged MoE metrics (aux and z loss, expert loads) of the last step are pp = 1's."""
    tmp, _, two, _ = runs
    _close(two[0]["pp2_moe"], two[0]["ref_moe"], 1e-5, "pp2_moe")
    rows = [json.loads((tmp / run / "metrics.jsonl").read_text().splitlines()[-1])
            for run in ("pp2_moe", "ref_moe")]
    assert rows[0]["step"] == rows[1]["step"] == STEPS
    _close([rows[0]["aux_loss"], rows[0]["z_loss"] + 1.0],
           [rows[1]["aux_loss"], rows[1]["z_loss"] + 1.0], 1e-5, "moe metrics")
    assert rows[0]["expert_load"] == rows[1]["expert_load"]


def _sft_pp2(rank, world, tmp):
    return train(sft(tmp, "pp2", "parallel.pp=2")).losses


def test_sft_from_a_release_at_pp2(tmp_path):
    """model.init_from at pp=2: each rank reads its stage's slices of a Qwen3 release (untied
    head); chat SFT gives pp=1's losses."""
    make_release(tmp_path / "release", tie=False)
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, *ROWS]))
    assert prepare_data.main(["--chat", "--input", str(source), "--output-prefix",
                              str(tmp_path / "sft"), "--tokenizer",
                              str(tmp_path / "release")]) == 0
    want = train(sft(str(tmp_path), "ref")).losses
    for got in run_distributed(_sft_pp2, 2, str(tmp_path), timeout=400):
        _close(got, want, 1e-5, "sft_pp2")


def _vl_pp2(rank, world, tmp):
    return train(vl_tiny(tmp, "vl_pp2", "parallel.pp=2")).losses


def test_vl_training_at_pp2_matches_pp1(tmp_path):
    """qwen2_vl (the tower on the first stage, its rows scattered into the first stage's
    embedding) on the shipped images blended with text, 2 micro-batches a step."""
    prepare_vl_default(tmp_path / "data", 512)
    want = train(vl_tiny(str(tmp_path), "vl_ref")).losses
    for got in run_distributed(_vl_pp2, 2, str(tmp_path), timeout=400):
        _close(got, want, 1e-5, "vl_pp2")


def test_tied_head_at_pp2_matches_pp1(runs):
    """A tied head: the two copies of the embedding (first and last stage) sum their gradients,
    and the gradient norm (grad_clip active) counts the weight once."""
    _, _, two, _ = runs
    (losses, norms), (want_losses, want_norms) = two[0]["pp2_tied"], two[0]["ref_tied"]
    _close(losses, want_losses, 1e-5, "pp2_tied")
    _close(norms[:1], want_norms[:1], 1e-6, "pp2_tied norm")
    _close(norms, want_norms, 1e-4, "pp2_tied norms")


def test_tied_pp2_checkpoint_resumes_at_pp1(runs):
    """Both ends saved the tied embedding under its one logical name; pp = 1 reads it back."""
    tmp, _, two, _ = runs
    folder = tmp / "pp1_from_pp2_tied" / "checkpoints"
    shutil.copytree(tmp / "pp2_tied" / "checkpoints" / f"step-{SAVE_AT}",
                    folder / f"step-{SAVE_AT}")
    result = train(tiny(tmp, "pp1_from_pp2_tied", *TIED))
    _close(result.losses, two[0]["ref_tied"][0][SAVE_AT:], 1e-5, "pp1_from_pp2_tied")


QWEN35_MOE = [f"model.{k}" for k in (
    "family=qwen3_5_moe", "num_heads=4", "num_kv_heads=2", "intermediate_size=32",
    "moe.num_experts=8", "moe.num_experts_per_tok=2", "moe.moe_intermediate_size=16",
    "moe.router_aux_loss_coef=0.1", "gdn_kernel=reference", "tie_embeddings=true")]


def _qwen35_moe_pp2(rank, world, tmp):
    return train(tiny(tmp, "q35moe_pp2", "parallel.pp=2", *QWEN35_MOE)).losses


def test_qwen35_moe_tied_at_pp2_matches_pp1(tmp_path):
    """Qwen3.5-MoE: hybrid DeltaNet / attention layers with MoE blocks and a shared expert on
    both stages, the load-balancing loss across them, a tied head."""
    prepare_default(tmp_path / "data", 512)
    want = train(tiny(str(tmp_path), "q35moe_ref", *QWEN35_MOE)).losses
    for got in run_distributed(_qwen35_moe_pp2, 2, str(tmp_path), timeout=400):
        _close(got, want, 1e-5, "qwen35_moe_pp2")


def test_pp2_checkpoint_resumes_at_pp4(runs):
    _, (losses, _), _, four = runs
    _close(four[0]["pp4_from_pp2"], losses[SAVE_AT:], 1e-5, "pp4_from_pp2")
