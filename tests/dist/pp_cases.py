"""Shared pieces of the pipeline tests: a step's packed micro-batches, the one-process reference
and one pipelined rank, both over several optimizer steps (SGD, so a wrong gradient shows in the
next step's loss too).

A case is a dict: ``family`` (registry name), ``cfg`` (the family config), ``pp``, ``tp``,
``cp``, ``cp_mode``, ``sp``, ``schedule``, ``virtual``, ``split``, ``num_microbatches``,
``steps``, ``dp`` (the reference runs every dp replica's micro-batches as one step). Micro-batches differ in length and document count (so the stages' capacity padding
is exercised), some documents have a loss mask with holes.

Gradients are compared in the logical (HF) form: each rank's gradient shards, summed over dp x cp
(as DDP / FSDP would, with ``grad_scale`` 1; expert weights at ep > 1 over the ranks holding the
same experts, edp) and gathered over ep and tp by the family's shard map.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.moe import expert_param_names
from mpcore.models.registry import family_named
from mpcore.moe_step import MoeStep
from mpcore.parallel.collectives import all_gather
from mpcore.parallel.loss import global_valid_count, loss_share
from mpcore.parallel.pp import Pipeline
from mpcore.parallel.state import ParallelState, group_size

LR = 0.5


def micro_batch(step: int, index: int, vocab: int, replica: int = 0) -> dict:
    """A packed micro-batch of data-parallel ``replica``: ids ``[T]``, ``cu_seqlens``,
    ``loss_mask [T]`` (seeded)."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * replica + index)
    lengths = [[7, 12, 3], [20, 5], [4, 9, 6, 2], [16], [3, 3, 11]][(step + index) % 5]
    total = sum(lengths)
    ids = torch.randint(0, vocab, (total,), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.rand(total, generator=gen) > 0.2
    return {"input_ids": ids, "cu_seqlens": cu, "loss_mask": mask}


def _inputs(family, cfg, state, mb: dict, sp: bool) -> dict:
    _, inputs = family.local_inputs(state, mb["input_ids"], mb["cu_seqlens"], cfg,
                                    loss_mask=mb["loss_mask"], sequence_parallel=sp)
    return inputs


def _full(family, cfg, state, named: dict) -> dict:
    maps = [family.shard_map(cfg, state.tp, r) for r in range(state.tp)]
    return gather_full(named, maps, state.tp_group)


def reference(case: dict) -> dict:
    """One process, whole model: per step the loss and the logical gradients."""
    family, cfg = family_named(case["family"]), case["cfg"]
    state = ParallelState()
    model = family.build(cfg, state, seed=0, **case.get("options", {}))
    out = {"loss": [], "grads": []}
    for step in range(case["steps"]):
        inputs = [_inputs(family, cfg, state, micro_batch(step, i, cfg.vocab_size, d), False)
                  for d in range(case.get("dp", 1)) for i in range(case["num_microbatches"])]
        count = global_valid_count([i["labels"] for i in inputs], None)
        # A MoE model: + the load-balancing share of each micro-batch, with the step's loads
        # from a counting forward (the trainer's one-process path, mpcore.moe_step).
        moe = MoeStep.start(model, inputs, state, lambda i: model(**i, output="loss"))
        loss = 0.0
        for i in inputs:
            loss = loss + loss_share(model(**i, output="loss"), i["labels"], count)
            if moe is not None:
                loss = loss + moe.share()
        loss.backward()
        named = {n: p.grad for n, p in model.named_parameters()}
        out["loss"].append(float(loss.detach()))
        out["grads"].append(_full(family, cfg, state, named))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return out


def pipelined(rank: int, world: int, case: dict) -> dict:
    """This rank's pipelined run of ``case``: per step the loss and the logical gradients of
    the parameters its stages hold (each summed over dp x cp, gathered over tp)."""
    family, cfg = family_named(case["family"]), case["cfg"]
    state = ParallelState.build(tp=case.get("tp", 1), cp=case.get("cp", 1), pp=case["pp"],
                                ep=case.get("ep", 1))
    sp = case.get("sp", False)
    options = dict(sequence_parallel=sp, cp_mode=case.get("cp_mode", "none"),
                   **case.get("options", {}))
    stages = family.stages(cfg, state, schedule=case["schedule"],
                           virtual=case.get("virtual", 1), split=case.get("split"), seed=0,
                           **options)
    pipe = Pipeline(stages, state, schedule=case["schedule"],
                    num_microbatches=case["num_microbatches"], virtual=case.get("virtual", 1))
    params = {n.removeprefix("model."): p for s in stages for n, p in s.named_parameters()}
    experts = [n.removeprefix("model.") for s in stages for n in expert_param_names(s)
               ] if state.ep > 1 else []
    out = {"loss": [], "grads": [], "rank": rank}
    for step in range(case["steps"]):
        inputs = [_inputs(family, cfg, state,
                          micro_batch(step, i, cfg.vocab_size, state.dp_rank), sp)
                  for i in range(case["num_microbatches"])]
        count = global_valid_count([i["labels"] for i in inputs], state.dp_cp_group)
        loss = pipe.step(pipe.micro_batches(inputs, count))
        for name, p in params.items():  # experts (ep > 1) reduce over the ranks holding them
            group = state.edp_group if name in experts else state.dp_cp_group
            if group_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
        out["loss"].append(float(loss.detach()))
        grads = {n: p.grad for n, p in params.items()}
        for name in experts:  # ep > 1: every expert, as the shard map describes them
            grads[name] = all_gather(grads[name], 0, state.ep_group)
        out["grads"].append(_full(family, cfg, state, grads))
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
                p.grad = None
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def grad_tol(name: str, tol: float) -> float:
    """``tol``, times 5 for the DeltaNet's ``A_log``, ``dt_bias`` and ``in_proj_a``: their
    gradient is one sum over every token of the decay gate's gradient (per head; for
    ``in_proj_a`` times the token's input), terms that nearly cancel, so the same terms summed
    in another order (here: one backward per micro-batch, accumulated, against one backward of
    the summed loss) move it by 1e-5 to 3e-5 relative (as in tests/dist/test_qwen35_dist.py;
    in_proj_a 3.1e-5 in test_qwen35_hybrid_interleaved on torch 2.13); a wrong gradient moves
    it by orders of magnitude more."""
    return 5 * tol if name.endswith(("A_log", "dt_bias", "in_proj_a.weight")) else tol


def check_against(ref: dict, ranks: list[dict], tol: float = 1e-5) -> None:
    """Every rank's loss equals the reference's each step; every logical gradient is held by
    some rank and each holder's equals the reference's; the global gradient norm (each tensor
    once) too."""
    for step, want in enumerate(ref["loss"]):
        for r in ranks:
            assert abs(r["loss"][step] - want) <= tol * abs(want), (r["rank"], step,
                                                                    r["loss"][step], want)
        seen: dict[str, torch.Tensor] = {}
        for r in ranks:
            for name, g in r["grads"][step].items():
                assert rel(g, ref["grads"][step][name]) <= grad_tol(name, tol), (r["rank"], step, name,
                                                                 rel(g, ref["grads"][step][name]))
                seen[name] = g
        assert sorted(seen) == sorted(ref["grads"][step]), sorted(
            set(ref["grads"][step]) ^ set(seen))
        norm = torch.stack([g.double().norm() for g in seen.values()]).norm()
        want_norm = torch.stack([g.double().norm() for g in ref["grads"][step].values()]).norm()
        assert abs(float(norm - want_norm)) <= tol * float(want_norm)


def forward_only(rank: int, world: int, case: dict) -> list[float]:
    """The pipelined forward-only loss (``Pipeline.evaluator``) of 1 and of 3 micro-batches,
    on this rank."""
    family, cfg = family_named(case["family"]), case["cfg"]
    state = ParallelState.build(pp=case["pp"])
    stages = family.stages(cfg, state, schedule=case["schedule"],
                           virtual=case.get("virtual", 1), seed=0)
    pipe = Pipeline(stages, state, schedule=case["schedule"],
                    num_microbatches=case["num_microbatches"], virtual=case.get("virtual", 1))
    out = []
    for num in (1, 3):
        inputs = [_inputs(family, cfg, state, micro_batch(0, i, cfg.vocab_size), False)
                  for i in range(num)]
        count = global_valid_count([i["labels"] for i in inputs], None)
        evaluator = pipe.evaluator(num)
        with torch.no_grad():
            out.append(float(evaluator.step(evaluator.micro_batches(inputs, count),
                                            backward=False)))
    return out


def forward_only_reference(case: dict) -> list[float]:
    family, cfg = family_named(case["family"]), case["cfg"]
    model = family.build(cfg, ParallelState(), seed=0)
    out = []
    for num in (1, 3):
        inputs = [_inputs(family, cfg, ParallelState(), micro_batch(0, i, cfg.vocab_size),
                          False) for i in range(num)]
        count = global_valid_count([i["labels"] for i in inputs], None)
        with torch.no_grad():
            out.append(float(sum(loss_share(model(**i, output="loss"), i["labels"], count)
                                 for i in inputs)))
    return out
