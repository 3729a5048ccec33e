"""score.py at pp > 1: log-probs and entropy of a packed stream through pipeline stages equal
transformers (float64, per document) within 1e-4 and the pp = 1 scores within 1e-5, at pp=2,
pp=2 x tp=2 (SP), pp=2 x cp=2 (ring), and with 2 data-parallel replicas (pp=2, dp=2) through
score.py's own path (score_items, gather_in_order)."""

from __future__ import annotations

import torch

from mpcore.launch.score import gather_in_order, score_items, score_stream
from mpcore.launch.score_io import ScoreItem
from mpcore.models import read_hf_config
from mpcore.models.registry import family_of_hf
from mpcore.parallel.state import ParallelState
from mpcore.pipelined import load_for_scoring
from tests.dist.harness import run_distributed
from tests.dist.hf_tiny import packed_docs, reference_scores, save_hf_model

LENGTHS = [7, 30, 2, 19]


def _score(rank, world, folder, pp, tp, cp, sp):
    state = ParallelState.build(tp=tp, cp=cp, pp=pp)
    family = family_of_hf(folder)
    cfg = family.config_from_hf(read_hf_config(folder))
    scorer = load_for_scoring(folder, family, cfg, state, torch.device("cpu"),
                              cp_mode="ring" if cp > 1 else "none", sequence_parallel=sp)
    ids, cu = packed_docs(LENGTHS, 5)
    return score_stream(scorer, state, ids, cu)


def _one(folder):
    family = family_of_hf(folder)
    model, _ = family.load(folder, ParallelState(), family.config_from_hf(read_hf_config(folder)))
    ids, cu = packed_docs(LENGTHS, 5)
    return score_stream(model.eval(), ParallelState(), ids, cu)


def _check(got, want, tol):
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b.double()).abs().max() <= tol, float((a - b).abs().max())


def test_pp_scores_equal_one_process_and_transformers(tmp_path):
    save_hf_model("llama", 3, tmp_path)
    ids, cu = packed_docs(LENGTHS, 5)
    truth = reference_scores(str(tmp_path), ids, cu)
    one = _one(str(tmp_path))
    _check(one, truth, 1e-4)
    for world, layout in ((2, (2, 1, 1, False)), (4, (2, 2, 1, True)), (4, (2, 1, 2, False))):
        for got in run_distributed(_score, world, str(tmp_path), *layout):
            _check(got, one, 1e-5)
            _check(got, truth, 1e-4)


def _replicas(rank, world, folder):
    state = ParallelState.build(pp=2)  # dp = 2: two replicas of two stages
    family = family_of_hf(folder)
    cfg = family.config_from_hf(read_hf_config(folder))
    scorer = load_for_scoring(folder, family, cfg, state, torch.device("cpu"))
    seqs = [packed_docs([n], n)[0].tolist() for n in (5, 17, 9)]
    items = [ScoreItem(input_ids=s) for s in seqs]
    mine = list(range(state.dp_rank, len(items), state.dp))
    results = score_items(scorer, state, [items[i] for i in mine])
    return gather_in_order(results, mine, state, len(items))


def test_pp_with_replicas_through_score_items(tmp_path):
    save_hf_model("llama", 3, tmp_path)
    ordered = run_distributed(_replicas, 4, str(tmp_path))[0]
    for n, result in zip((5, 17, 9), ordered, strict=True):
        ids = packed_docs([n], n)[0]
        want, want_ent = reference_scores(str(tmp_path), ids, torch.tensor([0, n]))
        assert len(result["logprobs"]) == n - 1
        assert torch.allclose(torch.tensor(result["logprobs"]).double(), want[:-1], atol=1e-4)
        assert torch.allclose(torch.tensor(result["entropy"]).double(), want_ent[:-1],
                              atol=1e-4)
