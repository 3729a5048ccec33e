"""Pipeline pieces in one process: the layer split and its refusals, schedule names, stage
placement, micro-batch counts torch refuses, the theoretical bubble, the micro-batch store's
order checks, and stages whose weights are the whole model's."""

from __future__ import annotations

import pytest
import torch

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.decoder import build_model
from mpcore.models.common.stage import DecoderStage, build_stages
from mpcore.parallel.pp import (
    MicroBatches,
    Pipeline,
    PipelineStageModule,
    capacity_for,
    split_layers,
)
from mpcore.parallel.pp_schedule import (
    SCHEDULES,
    check_microbatches,
    check_schedule,
    check_virtual,
    stage_indices,
    theoretical_bubble,
)
from mpcore.parallel.state import ParallelState

CFG = ModelConfig(vocab_size=53, hidden_size=32, num_layers=5, num_heads=4, num_kv_heads=2,
                  intermediate_size=48, tie_embeddings=False)


def test_even_split_gives_extra_layers_to_the_first_stages():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]


def test_user_split():
    assert split_layers(5, 3, [1, 3, 1]) == [range(0, 1), range(1, 4), range(4, 5)]


@pytest.mark.parametrize("args, match", [
    ((3, 4, None), "4 pipeline stages .* only 3 layers"),
    ((5, 2, [2, 2]), r"covers 4 layers but the model has 5"),
    ((5, 2, [5, 0]), "positive number of layers"),
    ((5, 3, [2, 3]), "must give 3 stages"),
    ((5, 0, None), "positive integer"),
])
def test_split_refusals_name_the_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        split_layers(*args)


def test_unknown_schedule_lists_the_names():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'OneFOneB'") as err:
        check_schedule("OneFOneB")
    for name in SCHEDULES:
        assert name in str(err.value)


def test_virtual_stages_per_schedule():
    with pytest.raises(ValueError, match="one stage per rank"):
        check_virtual("1F1B", 2)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        check_virtual("ZBVZeroBubble", 3)
    assert check_virtual("Interleaved1F1B", 3) == 3


def test_stage_placement():
    assert stage_indices("1F1B", 4, 2, 1) == [2]
    assert stage_indices("Interleaved1F1B", 2, 1, 3) == [1, 3, 5]
    assert stage_indices("ZBVZeroBubble", 4, 0, 2) == [0, 7]  # first and last on rank 0
    assert stage_indices("ZBVZeroBubble", 4, 3, 2) == [3, 4]


def test_microbatch_counts_torch_cannot_run_are_refused():
    with pytest.raises(ValueError, match="1F1B needs at least 4 micro-batches at pp=4"):
        check_microbatches("1F1B", 4, 3)
    with pytest.raises(ValueError, match="5 micro-batches make 2 rounds"):
        check_microbatches("Interleaved1F1B", 2, 5)
    check_microbatches("Interleaved1F1B", 2, 6)
    check_microbatches("GPipe", 4, 3)  # GPipe runs any count
    with pytest.raises(ValueError, match="positive integer"):
        check_microbatches("GPipe", 2, 0)


def test_theoretical_bubble_formulas():
    assert theoretical_bubble("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("GPipe", 1, 8) == 0.0
    assert theoretical_bubble("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    # ZB-H1: idle (p-1)/v against 3 m busy
    assert theoretical_bubble("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(1.5 / 25.5)
    assert theoretical_bubble("ZBVZeroBubble", 4, 8, 2) == 0.0
    assert theoretical_bubble("Interleaved1F1B", 4, 8, 2) < theoretical_bubble("1F1B", 4, 8)


def test_capacity_rounds_up():
    assert capacity_for([10, 70, 3]) == 128
    assert capacity_for([64]) == 64


class _Stage(PipelineStageModule):
    def rows(self, inputs):
        return 1


def test_store_order_is_checked():
    stage = _Stage()
    stage.begin(MicroBatches([{}, {}], torch.tensor(1), 64))
    assert stage.next_index(torch.tensor([0])) == 0
    with pytest.raises(RuntimeError, match="out of order"):
        stage.next_index(torch.tensor([0]))
    stage.begin(MicroBatches([{}, {}], torch.tensor(1), 64))
    stage.next_index()
    with pytest.raises(RuntimeError, match="met the outputs of micro-batch 0"):
        stage.check_target(torch.tensor([1]))
    stage.next_index()
    with pytest.raises(RuntimeError, match="3 forwards in a step of 2"):
        stage.next_index()


def test_stage_weights_are_the_whole_models():
    whole = dict(build_model(CFG, ParallelState(), seed=3).named_parameters())
    got = {}
    for keep in split_layers(5, 2):
        stage = DecoderStage(build_model(CFG, ParallelState(), seed=3, keep_layers=keep))
        got.update((n.removeprefix("model."), p) for n, p in stage.named_parameters())
    assert sorted(got) == sorted(whole)
    for name, p in whole.items():
        assert torch.equal(got[name], p), name


def test_stage_holds_embedding_first_and_head_last():
    first, last = (build_model(CFG, ParallelState(), keep_layers=k) for k in split_layers(5, 2))
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert [i for i, _ in last.layer_items()] == [3, 4]


def test_bad_keep_layers_refused():
    with pytest.raises(ValueError, match=r"inside \[0, 5\)"):
        build_model(CFG, ParallelState(), keep_layers=range(3, 7))


def test_tied_head_copies_the_embedding_to_the_last_stage():
    tied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    first = build_stages(build_model, tied, ParallelState(pp=2, pp_rank=0), schedule="1F1B",
                         seed=4)[0]
    last = build_stages(build_model, tied, ParallelState(pp=2, pp_rank=1), schedule="1F1B",
                        seed=4)[0]
    assert torch.equal(first.decoder.tok_embeddings.weight, last.decoder.tok_embeddings.weight)
    assert first.tied_parameters() and last.tied_parameters()  # summed over the two ends
    # a V schedule puts both ends on rank 0: one module, nothing to sum
    v = build_stages(build_model, tied, ParallelState(pp=2, pp_rank=0),
                     schedule="ZBVZeroBubble", virtual=2)
    assert v[0].decoder.tok_embeddings is v[1].decoder.tok_embeddings
    assert not v[0].tied_parameters() and not v[1].tied_parameters()


def test_forward_only_refused_under_a_v_schedule():
    state = ParallelState(pp=2, pp_rank=0)
    stages = build_stages(build_model, CFG, state, schedule="ZBVZeroBubble", virtual=2)
    pipe = Pipeline(stages, state, schedule="ZBVZeroBubble", num_microbatches=4, virtual=2)
    with pytest.raises(ValueError, match="cannot run a forward-only step"):
        pipe.evaluator(1)
    assert pipe.stage_ids == [0, 3]
