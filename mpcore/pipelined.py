"""Training at pp > 1: this rank's pipeline stages, their data parallelism, and one step.

    build_pipeline   the family's stages (``Family.stages``) for ``parallel.pp_*``, seen as one
                     model under the logical names (``StagedModel``), and the ``Pipeline`` that
                     runs ``data.grad_accum`` micro-batches per step through them; with
                     ``model.init_from`` each rank reads its parameters' slices of the
                     checkpoint (``load_stages``)
    wrap_stages      data parallelism over dp x cp: FSDP2 on every stage (each decoder layer,
                     then the stage), or for ``ddp`` none: ``pipeline_step`` all-reduces (sums)
                     the gradients once after the step (no overlap with the backward)
    pipeline_step    the step's loss (the global mean) with the gradients accumulated

The loss and its normalisation are ``mpcore.parallel.pp``'s: N counted once over dp x cp, each
micro-batch's share ``grad_scale * sum / N`` with ``grad_scale`` = dp * cp under FSDP2 (which
averages) and 1 when the gradients are summed here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mpcore.config import Config
from mpcore.models import Family
from mpcore.models.common.hf_check import check_tensor_names
from mpcore.models.common.hf_io import Checkpoint
from mpcore.models.common.moe import expert_param_names
from mpcore.models.common.moe_hf import read_expert_piece
from mpcore.models.common.stage import StagedModel
from mpcore.parallel.loss import global_valid_count
from mpcore.parallel.pp import EVAL_SCHEDULES, Pipeline
from mpcore.parallel.pp_schedule import check_microbatches, placement
from mpcore.parallel.state import ParallelState, group_size


def check_pipeline(cfg: Config, model_cfg, family: Family) -> None:
    """``ValueError`` naming the fix for what pp > 1 does not run (yet): a family without stages, the MTP loss, forward-only steps under a V schedule (validation,
    a MoE model's counting pass), micro-batch counts the schedule refuses."""
    p = cfg.parallel
    if family.pipeline_stages is None:
        raise ValueError(f"parallel.pp={p.pp}: the {family.name} family cannot be cut into "
                         f"pipeline stages yet; set parallel.pp=1")
    if cfg.model.freeze_vision:
        raise ValueError(f"parallel.pp={p.pp} with model.freeze_vision is not supported yet; "
                         f"set model.freeze_vision=false or parallel.pp=1")
    if getattr(model_cfg, "uses_mtp", False):
        raise ValueError(f"parallel.pp={p.pp}: the MTP loss is not supported with pipeline "
                         f"parallelism yet; set parallel.pp=1 or model.mtp_loss_weight=0")
    no_eval = EVAL_SCHEDULES[placement(p.pp_schedule)] is None
    if no_eval and hasattr(model_cfg, "moe_layers"):
        raise ValueError(f"parallel.pp_schedule={p.pp_schedule}: a MoE model's step starts "
                         f"with a forward-only counting pass (the step's expert loads), which "
                         f"torch's V schedules cannot run; pick another schedule such as "
                         f"Interleaved1F1B")
    if cfg.training.eval_every and cfg.data.valid_fraction and no_eval:
        raise ValueError(f"parallel.pp_schedule={p.pp_schedule} cannot run validation's "
                         f"forward-only steps (torch's V schedules fail there); set "
                         f"training.eval_every=0, or pick another schedule such as "
                         f"Interleaved1F1B")
    try:
        check_microbatches(p.pp_schedule, p.pp, cfg.data.grad_accum)
    except ValueError as e:
        raise ValueError(f"data.grad_accum={cfg.data.grad_accum} is the number of micro-batches "
                         f"per step at parallel.pp={p.pp}: {e}") from None


def build_pipeline(cfg: Config, model_cfg, state: ParallelState, family: Family,
                   device: torch.device, **options) -> tuple[StagedModel, Pipeline]:
    """This rank's stages (initialised from ``training.seed``, the whole model's values) and
    the pipeline over them; ``options``: the family's build keyword arguments."""
    check_pipeline(cfg, model_cfg, family)
    p = cfg.parallel
    stages = family.stages(model_cfg, state, schedule=p.pp_schedule, virtual=p.virtual_stages,
                           split=p.pp_split, seed=cfg.training.seed, device=device, **options)
    pipeline = Pipeline(stages, state, schedule=p.pp_schedule,
                        num_microbatches=cfg.data.grad_accum, virtual=p.virtual_stages,
                        device=device)
    model = StagedModel(stages)
    if cfg.model.init_from:
        load_stages(model, cfg.model.init_from, family, model_cfg, state)
    return model, pipeline


@torch.no_grad()
def load_stages(model: StagedModel, folder, family: Family, model_cfg,
                state: ParallelState) -> None:
    """Read this rank's parameters from the Hugging Face checkpoint ``folder``: each its pieces
    of the family's shard map (the table every family's loader and exporter use), expert
    tensors this ep rank's experts in either expert layout (``moe_hf.read_expert_piece``).
    The checkpoint's tensor names are checked first, as ``Family.load`` does."""
    check_tensor_names(folder, family, model_cfg)
    ckpt = Checkpoint(Path(folder))
    table = family.shard_map(model_cfg, state.tp, state.tp_rank)
    experts, pending = expert_param_names(model), {}
    for name, param in model.named_parameters():
        pieces = table[name]
        if name in experts:  # the released per-expert layout or a fused one, this ep rank's
            local = read_expert_piece(ckpt, pieces[0], state.ep, state.ep_rank, pending)
        else:
            local = torch.cat([ckpt.read(piece) for piece in pieces], dim=pieces[0].dim)
        if local.shape != param.shape:
            raise AssertionError((name, tuple(local.shape), tuple(param.shape)))
        param.copy_(local.to(param.dtype))


def wrap_stages(model: StagedModel, cfg: Config, state: ParallelState,
                mesh_kwargs: dict | None) -> None:
    """FSDP2 over dp x cp on every stage when ``mesh_kwargs`` (``fully_shard``'s mesh and
    mixed precision) is given; nothing otherwise (module docstring)."""
    if mesh_kwargs is None:
        return
    from torch.distributed.fsdp import fully_shard

    for stage in model.stages:
        for unit in stage.model.fsdp_units():
            fully_shard(unit, **mesh_kwargs)
        fully_shard(stage, **mesh_kwargs)


def _sum_grads(model: nn.Module, state: ParallelState) -> None:
    """SUM all-reduce of every gradient over dp x cp (the ``ddp`` path; one call per tensor)."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=state.dp_cp_group)


def pipeline_step(pipeline: Pipeline, model: StagedModel, state: ParallelState,
                  inputs: list[dict], autocast, fsdp: bool) -> torch.Tensor:
    """Forward and backward of the step's micro-batches (``inputs``: this rank's forward
    keyword arguments of each) through the pipeline; returns the global mean loss (fp32 scalar,
    every rank). Collective over the world."""
    count = global_valid_count([i["labels"] for i in inputs], state.dp_cp_group)
    scale = state.dp_cp if fsdp else 1  # FSDP2 averages over dp x cp; the ddp path sums
    with autocast:
        loss = pipeline.step(pipeline.micro_batches(inputs, count, grad_scale=scale))
    if not fsdp and state.dp_cp > 1:
        _sum_grads(model, state)
    return loss


@torch.no_grad()
def pipeline_eval(pipeline: Pipeline, state: ParallelState, inputs: list[dict],
                  autocast) -> torch.Tensor:
    """The global mean loss of ``inputs`` (forward only). Collective over the world."""
    count = global_valid_count([i["labels"] for i in inputs], state.dp_cp_group)
    with autocast:
        return pipeline.step(pipeline.micro_batches(inputs, count), backward=False)


class PipelinedScorer:
    """A model at pp > 1 as score.py calls one: ``scorer(**inputs, output="logprobs",
    temperature=t)`` -> ``(logprobs [L], entropy [L])`` fp32 of this rank's L local tokens, on
    every rank of the replica (one micro-batch through the stages; ``Pipeline.scores``).
    ``cfg`` and ``sequence_parallel`` are the model's, for the family's inputs."""

    def __init__(self, model: StagedModel, state: ParallelState, device: torch.device):
        self.model, self.cfg = model, model.cfg
        self.sequence_parallel = model.stages[0].model.sequence_parallel
        self.pipeline = Pipeline(list(model.stages), state, schedule="GPipe",
                                 num_microbatches=1, device=device, output="logprobs")

    def __call__(self, *, output: str, temperature: float = 1.0, **inputs):
        if output != "logprobs":
            raise ValueError(f"a pipelined model scores log-probs only, got output={output!r}")
        count = torch.ones((), dtype=torch.int64)  # unused: no loss is formed
        batches = dataclasses.replace(self.pipeline.micro_batches([inputs], count),
                                      temperature=temperature)
        scores = self.pipeline.scores(batches)
        return scores[0], scores[1]


def load_for_scoring(folder, family: Family, cfg, state: ParallelState, device: torch.device,
                     **options) -> PipelinedScorer:
    """This pp rank's stage of the checkpoint ``folder`` (placed as GPipe places them: stage s
    on pp rank s) for score.py, in eval mode. ``options``: the family's build arguments."""
    if family.pipeline_stages is None:
        raise ValueError(f"the {family.name} family cannot be cut into pipeline stages yet; "
                         f"score it with --pp 1")
    stages = family.stages(cfg, state, schedule="GPipe", device=device, **options)
    model = StagedModel(stages)
    load_stages(model, folder, family, cfg, state)
    for stage in stages:
        stage.eval()
    return PipelinedScorer(model, state, device)


class PipelineMoeStep:
    """The last pipelined step's MoE metrics, as ``mpcore.moe_step.MoeStep.metrics`` gives them
    at pp = 1: the global unweighted aux and z losses (each stage's layers' shares, summed over
    stages and dp x cp), tokens per expert (the counting pass's loads) and dropped tokens.
    ``metrics()`` is collective over pp and dp x cp: call it where the trainer logs."""

    def __init__(self, pipeline: Pipeline, state: ParallelState):
        self.state = state
        terms = [t for m in pipeline.modules if (t := getattr(m, "moe_terms", None)) is not None]
        self.terms = torch.stack(terms).sum(0) if terms else torch.zeros(3, device=pipeline.device)
        self.counts = pipeline.last_statistic[:-1]

    def metrics(self) -> dict:
        total = self.terms.clone()
        for group in (self.state.pp_group, self.state.dp_cp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        aux, z, dropped = total.tolist()
        return {"aux_loss": aux, "z_loss": z,
                "expert_load": [int(c) for c in self.counts.tolist()],
                "dropped_tokens": int(dropped)}
