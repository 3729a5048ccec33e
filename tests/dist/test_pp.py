"""Pipeline parallelism equals one process (gloo, fp32, CPU): every schedule torch provides at
pp = 2 and at pp = 4, the Qwen3.5 hybrid decoder interleaved, pp x tp (SP), pp x cp (ring),
pp x tp x cp on 8 ranks, pp x dp, uneven and user-given stage splits, Qwen3-MoE with experts
split inside a stage (ep over dp, over cp with ring attention, and over cp with dp on 8 ranks).

Each case runs two optimizer steps (SGD) of four packed micro-batches of different lengths and
document counts, with loss-mask holes; per step the loss on every rank, every logical gradient
(on the rank holding it, summed over dp x cp, gathered over tp) and the global gradient norm
must equal the one-process model's, same seed (``tests.dist.pp_cases``). A label reaching the
wrong micro-batch, a loss normalised per micro-batch or per stage, a layer left out or run twice
would each move the loss or a gradient by far more than the 1e-5 allowed.
"""

from __future__ import annotations

import pytest

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.hybrid.hf import config_from_hf
from mpcore.models.common.moe_config import config_from_hf as config_from_moe_hf
from mpcore.parallel.pp_schedule import SCHEDULES
from tests.dist import pp_cases
from tests.dist.harness import run_distributed
from tests.dist.hf_moe_tiny import CONFIG as MOE_CONFIG
from tests.dist.qwen35_tiny import HF_CONFIG

LLAMA = ModelConfig(vocab_size=53, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=48, tie_embeddings=False)


def _case(schedule: str, pp: int = 2, virtual: int = 1, **kw) -> dict:
    return dict(dict(family="llama", cfg=LLAMA, pp=pp, schedule=schedule, virtual=virtual,
                     num_microbatches=4, steps=2), **kw)


def _check(case: dict, world: int) -> None:
    ranks = run_distributed(pp_cases.pipelined, world, case)
    pp_cases.check_against(pp_cases.reference(case), ranks)


def test_1f1b_pp2_equals_one_process():
    _check(_case("1F1B"), 2)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "1F1B"])
def test_every_schedule_pp2_equals_one_process(schedule):
    virtual = 1 if SCHEDULES[schedule][1] == "single" else 2
    _check(_case(schedule, virtual=virtual), 2)


def test_1f1b_pp4_equals_one_process():
    _check(_case("1F1B", pp=4), 4)


def test_uneven_and_user_splits():
    five = ModelConfig(**{**LLAMA.__dict__, "num_layers": 5})
    _check(_case("1F1B", cfg=five), 2)  # even split of 5: [3, 2]
    _check(_case("GPipe", split=[3, 1]), 2)
    _check(_case("Interleaved1F1B", cfg=five, virtual=2, split=[1, 2, 1, 1]), 2)


def test_qwen35_hybrid_interleaved():
    cfg = config_from_hf(dict(HF_CONFIG, architectures=["Qwen3_5ForCausalLM"]))
    case = dict(family="qwen3_5", cfg=cfg, pp=2, schedule="Interleaved1F1B", virtual=2,
                num_microbatches=4, steps=2, options=dict(gdn_kernel="reference"))
    _check(case, 2)


def test_pp2_tp2_sequence_parallel():
    _check(_case("1F1B", tp=2, sp=True), 4)


def test_pp2_cp2_ring():
    _check(_case("Interleaved1F1B", virtual=2, cp=2, cp_mode="ring"), 4)


@pytest.mark.parametrize("schedule, tp, cp, mode", [
    ("ZBVZeroBubble", 2, 1, "none"), ("InterleavedZeroBubble", 1, 2, "ulysses"),
    ("Interleaved1F1B", 2, 1, "none")])
def test_interleaved_and_zero_bubble_with_tp_or_cp(schedule, tp, cp, mode):
    """Two stages per rank with tp = 2 (SP) or cp = 2 (Ulysses) on 4 ranks."""
    _check(_case(schedule, virtual=2, tp=tp, cp=cp, cp_mode=mode, sp=tp > 1), 4)


@pytest.mark.slow  # 4 ranks each
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "1F1B"])
def test_every_schedule_pp4_equals_one_process(schedule):
    """pp = 4 (8 layers: two per stage, or one with two stages per rank), 8 micro-batches
    (what every schedule here can run at pp = 4), for each schedule but 1F1B (above)."""
    virtual = 1 if SCHEDULES[schedule][1] == "single" else 2
    eight = ModelConfig(**{**LLAMA.__dict__, "num_layers": 8})
    _check(_case(schedule, pp=4, virtual=virtual, cfg=eight, num_microbatches=8), 4)


@pytest.mark.slow  # 8 ranks
def test_pp2_tp2_cp2_on_eight_ranks():
    """The whole model-parallel grid at once: pp = 2 x tp = 2 (SP) x cp = 2 (ring)."""
    _check(_case("Interleaved1F1B", virtual=2, tp=2, sp=True, cp=2, cp_mode="ring"), 8)


@pytest.mark.slow  # 4 ranks, 8 stages
def test_interleaved_pp4():
    eight = ModelConfig(**{**LLAMA.__dict__, "num_layers": 8})
    _check(_case("Interleaved1F1B", pp=4, virtual=2, cfg=eight, num_microbatches=8), 4)


def test_pp2_dp2():
    _check(_case("1F1B", dp=2), 4)  # each dp rank its own micro-batches


@pytest.mark.parametrize("schedule, virtual", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_forward_only_any_count(schedule, virtual):
    """Validation's path: 1 and 3 micro-batches (fewer than 1F1B's stages, not a multiple
    of pp) through the placement's forward-only schedule give the one-process loss."""
    case = _case(schedule, virtual=virtual)
    want = pp_cases.forward_only_reference(case)
    for got in run_distributed(pp_cases.forward_only, 2, case):
        assert got == pytest.approx(want, rel=1e-5), (got, want)



@pytest.mark.slow  # 20 s: a 2-rank and a 4-rank run
def test_qwen3_moe_with_global_aux_loss():
    """Experts in the sparse layers of both stages (layer 1 dense), ep=2 over dp=2 at pp=2 on 4
    ranks, and pp=2 alone: the load-balancing loss (a statistic of every micro-batch, stage
    and dp rank: each stage adds its own layers' share with the step's global loads from a
    counting pass) and its gradients equal one process's."""
    cfg = config_from_moe_hf(dict(MOE_CONFIG, num_hidden_layers=4,
                                  architectures=["Qwen3MoeForCausalLM"]))
    case = dict(family="qwen3_moe", cfg=cfg, pp=2, schedule="Interleaved1F1B", virtual=2,
                num_microbatches=4, steps=2)
    _check(case, 2)
    # the counting pass runs on an evaluator (LoopedBFS) over the same modules, between
    # steps of a two-pass backward
    _check(dict(case, schedule="InterleavedZeroBubble"), 2)
    _check(dict(case, schedule="1F1B", virtual=1, ep=2, dp=2), 4)


def _moe_case(**kw) -> dict:
    """Qwen3-MoE, 4 layers (layer 1 dense), 8 experts top-2, with its load-balancing loss."""
    cfg = config_from_moe_hf(dict(MOE_CONFIG, num_hidden_layers=4,
                                  architectures=["Qwen3MoeForCausalLM"]))
    return dict(dict(family="qwen3_moe", cfg=cfg, pp=2, schedule="1F1B", virtual=1,
                     num_microbatches=4, steps=2), **kw)


def test_qwen3_moe_pp2_cp2_ring_ep2():
    """Experts split over the cp ranks of each stage (ep = cp = 2, ring, edp of one) on 4
    ranks: each stage's all-to-all dispatch runs on a stage's own ep group, the routed tokens
    are each cp rank's zigzag chunks, and the load-balancing loss counts every cp rank's
    tokens once."""
    _check(_moe_case(schedule="Interleaved1F1B", virtual=2, cp=2, cp_mode="ring", ep=2), 4)


@pytest.mark.slow  # 8 ranks
def test_qwen3_moe_pp2_cp2_dp2_ep2_on_eight_ranks():
    """pp = 2 x dp = 2 x cp = 2 (ring) with ep = 2: an ep group is a stage's two cp ranks,
    and each expert's gradient sums over the two dp ranks holding it (edp)."""
    _check(_moe_case(cp=2, cp_mode="ring", dp=2, ep=2), 8)


@pytest.mark.parametrize("schedule, virtual", [("1F1B", 1), ("Interleaved1F1B", 2),
                                               ("ZBVZeroBubble", 2)])
def test_tied_head(schedule, virtual):
    """A tied head: the last stage's embedding copy and the first stage's sum their gradients
    over the two ends (or are one module when a V schedule puts both on rank 0); each holder's
    gradient is the one-process one, and the norm counts the weight once."""
    tied = ModelConfig(**{**LLAMA.__dict__, "tie_embeddings": True})
    _check(_case(schedule, virtual=virtual, cfg=tied), 2)
