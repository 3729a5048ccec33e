"""Pipeline parallelism on ``torch.distributed.pipelining``: stage split, micro-batch store and
the step.

Layout: the model's layers are cut into ``pp * virtual`` stages of consecutive layers
(``split_layers``); pp rank r holds the stages ``pp_schedule.stage_indices`` names. The first
stage holds the embedding (and a VL model's tower), the last the final norm and the fused
loss head. Between stages travels one tensor per micro-batch, the residual stream
``[C, hidden]`` (``[C / tp, hidden]`` rows per rank under sequence parallelism) padded with zero
rows to a capacity ``C`` that every stage of the step agrees on, because torch's stages
exchange fixed shapes while packed micro-batches (and a cp rank's share of them) differ in
length; a stage reads the first ``L`` rows of what it receives and pads what it sends.

The micro-batch store (``MicroBatches``): torch hands the first stage the step's inputs and every
later stage only what the stage before sent, but every stage needs its micro-batch's attention
metadata and the last stage its labels. So the step's per-micro-batch inputs (this rank's,
after the cp split: ids, positions, ``doc_id``, labels shifted by ``LabelShifter`` on the
global stream, ...) are handed to every stage module before the step, and a stage takes the
k-th entry on its k-th forward: torch's schedules run each stage's forwards in micro-batch
order. That order is checked, not trusted: the first stage is called with the micro-batch
index itself, and the loss function gets it as ``target`` and compares it with the index the
last stage used (``PipelineStageModule.check_target``), so labels can only ever meet the
hidden states of their own micro-batch.

The loss is the global mean of DESIGN.md (``mpcore.parallel.loss``): the last stage returns,
per micro-batch, ``grad_scale * (sum of per-token losses) / N`` with N the valid labels of
every micro-batch on every dp x cp rank (counted once, before the step), and the schedule runs
with ``scale_grads=False`` (torch would divide by the micro-batch count). The step's loss is
the sum of those shares over micro-batches, then over the pp group (only the ranks holding the
last stage have any) and over dp x cp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mpcore.parallel.pp_schedule import (
    SPLIT_BACKWARD,
    check_microbatches,
    check_virtual,
    placement,
    schedule_class,
    stage_indices,
)
from mpcore.parallel.state import ParallelState, group_size

# A forward-only schedule per placement (pp_schedule) that takes any micro-batch count. None
# for the V placement: torch's V schedules fail forward-only (ZBVZeroBubble's eval asks its
# stages for a backward input they never made) and no other torch schedule places stages so.
EVAL_SCHEDULES = {"single": "GPipe", "loop": "LoopedBFS", "v": None}


def split_layers(num_layers: int, num_stages: int,
                 counts: Sequence[int] | None = None) -> list[range]:
    """The global layer indices of each of ``num_stages`` stages: ``counts`` (layers per stage,
    in order) when given, else as even as possible with the extra layers on the earliest stages
    (the last stage also runs the loss head). ``ValueError`` naming the numbers when there are
    more stages than layers or ``counts`` does not cover every layer exactly once."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of stages must be a positive integer, got {num_stages!r}")
    if counts is None:
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} pipeline stages (pp x virtual) but the model has "
                             f"only {num_layers} layers; every stage needs a layer: lower pp "
                             f"or virtual to at most {num_layers} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (s < extra) for s in range(num_stages)]
    counts = list(counts)
    if len(counts) != num_stages or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"the stage split {counts} must give {num_stages} stages (pp x "
                         f"virtual) a positive number of layers each")
    if sum(counts) != num_layers:
        raise ValueError(f"the stage split {counts} covers {sum(counts)} layers but the model "
                         f"has {num_layers}; give counts that add up to {num_layers}")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts, strict=True)]


@dataclasses.dataclass
class MicroBatches:
    """One step's micro-batches as this rank's stages read them (module docstring).

    ``inputs``: per micro-batch, the model's forward keyword arguments for this rank (local
    tensors after the cp split: ``input_ids [L]``, ``labels [L]``, ...). ``count``: N, the
    valid labels of the whole step over dp x cp (int64 scalar, ``global_valid_count``).
    ``grad_scale``: what the loss is multiplied by before backward (dp * cp under DDP / FSDP,
    which average over their ranks; 1 when gradients are summed). ``capacity``: the rows (per
    rank: L / tp under SP) the residual stream is padded to between stages
    (``Pipeline.micro_batches`` sets it)."""

    inputs: list[dict]
    count: torch.Tensor
    capacity: int
    grad_scale: float = 1.0
    counting: bool = False
    """A counting pass (``Pipeline.step``): stages record their statistics, no loss needed."""
    output: str = "loss"
    """The pipeline's output (``Pipeline(output=...)``): ``loss`` or ``logprobs`` (scoring)."""
    temperature: float = 1.0
    """Divides the logits (scoring)."""
    tokens: int = 0
    """The longest micro-batch's local token count: the width of the scores (scoring)."""
    statistic: torch.Tensor | None = None
    """The step's global statistic from the counting pass (summed over micro-batches, stages
    and dp x cp), e.g. a MoE model's expert loads and router rows; None without one."""

    def __len__(self) -> int:
        return len(self.inputs)


def capacity_for(lengths: Sequence[int], multiple: int = 64) -> int:
    """Rows every stage pads the residual stream to: the longest local micro-batch, rounded up
    to ``multiple`` so that steps of slightly different lengths reuse the same stages (a new
    capacity builds new ones: ``Pipeline``)."""
    most = max(lengths)
    return max(multiple, -(-most // multiple) * multiple)


class PipelineStageModule(nn.Module):
    """Base of a model's stage module (``mpcore.models.common.stage``): holds the step's
    ``MicroBatches`` and tells each forward which micro-batch it runs.

    Subclasses implement ``rows(inputs)`` (the residual stream's local rows of a micro-batch),
    ``example_io(capacity, device, output, tokens)`` (example input and output tensors: shapes,
    dtypes and ``requires_grad`` of what the stage takes and gives; ``output``: the
    pipeline's, ``loss`` or ``logprobs`` of ``tokens`` local tokens) and ``forward(x)``: ``x`` is the micro-batch index (int64 ``[1]``) on the
    first stage and the previous stage's padded residual stream otherwise; the output is the
    padded residual stream, or on the last stage the micro-batch's loss share ``[1]``."""

    split_backward = False
    """Set by ``Pipeline`` for each step under a schedule of ``pp_schedule.SPLIT_BACKWARD``:
    the backward runs
    in two passes (input, then weight gradients), so no kernel may hand out gradients it
    computed in the forward."""

    statistic_size = 0
    """Length of the statistic of the whole step this stage's loss needs before the step
    (0: none). A stage that has one records a ``[statistic_size]`` fp32 tensor per forward of
    a counting pass (``record``); ``Pipeline.step`` sums them over micro-batches, stages and
    dp x cp into ``MicroBatches.statistic`` before the step (a MoE model's expert loads: the
    load-balancing loss of each micro-batch needs the whole step's)."""

    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters this stage holds a copy of whose other copy is on the other end of the
        pipeline (a tied head's embedding weight): ``Pipeline.step`` sums their gradients over
        ``state.pp_ends_group``. None by default."""
        return []

    def begin(self, batches: MicroBatches) -> None:
        self.batches, self.calls, self.last_index = batches, 0, -1
        self.recorded: torch.Tensor | None = None
        self.attached: torch.Tensor | None = None

    def attach(self, h: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor:
        """``attach_loss(h, loss)``, and ``loss`` counted in the step's reported loss
        (``Pipeline.step`` adds what every stage attached)."""
        if loss is None:
            return h
        value = loss.detach().float().reshape(())
        self.attached = value if self.attached is None else self.attached + value
        return attach_loss(h, loss)

    def record(self, value: torch.Tensor) -> None:
        """Add one forward's statistic (counting pass)."""
        value = value.detach().float()
        self.recorded = value if self.recorded is None else self.recorded + value

    def next_index(self, x: torch.Tensor | None = None) -> int:
        """The micro-batch of this forward (module docstring of ``mpcore.parallel.pp``); ``x``:
        the first stage's input, the index itself, which must agree."""
        index = self.calls
        if index >= len(self.batches):
            raise RuntimeError(f"stage ran {index + 1} forwards in a step of "
                               f"{len(self.batches)} micro-batches")
        if x is not None and int(x.reshape(-1)[0]) != index:
            raise RuntimeError(f"the first stage's forward {index} was given micro-batch "
                               f"{int(x.reshape(-1)[0])}: the schedule ran micro-batches out of "
                               f"order, so the micro-batch store would mix them up")
        self.calls, self.last_index = index + 1, index
        return index

    def check_target(self, target: torch.Tensor) -> None:
        """The loss function's check that the last stage's forward ran micro-batch ``target``."""
        if int(target.reshape(-1)[0]) != self.last_index:
            raise RuntimeError(f"the loss of micro-batch {int(target.reshape(-1)[0])} met the "
                               f"outputs of micro-batch {self.last_index}: the labels would "
                               f"belong to another micro-batch")


class Pipeline:
    """This rank's stages under one of torch's schedules (``mpcore.parallel.pp_schedule``).

    ``modules``: this rank's ``PipelineStageModule``s in ``stage_indices`` order (global stage
    ``stage_ids[k]`` of ``pp * virtual``). ``step(batches)`` runs forward and backward of every
    micro-batch (gradients accumulate in the modules' parameters) and returns the step's loss,
    the global mean, on every rank. Collective over the world (pp p2p, and the loss over pp and
    dp x cp). Torch's stages are built per capacity and kept."""

    def __init__(self, modules: list[PipelineStageModule], state: ParallelState, *,
                 schedule: str, num_microbatches: int, virtual: int = 1,
                 device: torch.device | str = "cpu", output: str = "loss"):
        check_virtual(schedule, virtual)
        check_microbatches(schedule, state.pp, num_microbatches)
        self.stage_ids = stage_indices(schedule, state.pp, state.pp_rank, virtual)
        if len(modules) != len(self.stage_ids):
            raise ValueError(f"pp rank {state.pp_rank} holds stages {self.stage_ids} under "
                             f"{schedule} but got {len(modules)} stage modules")
        self.modules, self.state, self.schedule_name = modules, state, schedule
        self.num_microbatches, self.num_stages = num_microbatches, state.pp * virtual
        self.device = torch.device(device)
        self.virtual = virtual
        if output not in ("loss", "logprobs"):
            raise ValueError(f"output must be 'loss' or 'logprobs', got {output!r}")
        self.output = output
        self._built: dict[tuple[int, int], object] = {}
        self._evaluators: dict[int, Pipeline] = {}
        self.last_statistic: torch.Tensor | None = None  # the last step's (counting pass)

    def evaluator(self, num_microbatches: int) -> Pipeline:
        """The same stages, placed the same way, for forward-only steps of
        ``num_microbatches`` (validation, a counting pass): a separate set of torch stages,
        built once per count, so a forward-only step never sets up the training stages
        without their backward; under the placement's schedule that runs any count
        (``EVAL_SCHEDULES``: a forward-only step has no backward to interleave)."""
        if EVAL_SCHEDULES[placement(self.schedule_name)] is None:
            raise ValueError(f"torch's V schedules ({self.schedule_name}) cannot run a "
                             f"forward-only step; validate with another schedule "
                             f"(1F1B, Interleaved1F1B, ...) or without validation")
        if num_microbatches not in self._evaluators:
            self._evaluators[num_microbatches] = Pipeline(
                self.modules, self.state, schedule=EVAL_SCHEDULES[placement(self.schedule_name)],
                num_microbatches=num_microbatches, virtual=self.virtual, device=self.device)
        return self._evaluators[num_microbatches]

    def _schedule(self, batches: MicroBatches):
        capacity = batches.capacity
        key = (capacity, batches.tokens if self.output == "logprobs" else 0)
        if key not in self._built:
            # Static shapes (examples of what each stage takes and gives): torch infers
            # nothing, so no forward runs outside the schedule's (an inference forward would
            # take a micro-batch from the store).
            stages = []
            for m, s in zip(self.modules, self.stage_ids, strict=True):
                example_in, example_out = m.example_io(capacity, self.device, self.output,
                                                       batches.tokens)
                stages.append(PipelineStage(m, s, self.num_stages, self.device,
                                            input_args=example_in, output_args=example_out,
                                            group=self.state.pp_group))
            last = [m for m, s in zip(self.modules, self.stage_ids, strict=True)
                    if s == self.num_stages - 1]

            def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                last[0].check_target(target)
                return output.sum()

            cls = schedule_class(self.schedule_name)
            one = placement(self.schedule_name) == "single"
            self._built[key] = cls(stages[0] if one else stages, self.num_microbatches,
                                        loss_fn=loss_fn if self.output == "loss" else None,
                                        scale_grads=False)
        return self._built[key]

    def micro_batches(self, inputs: list[dict], count: torch.Tensor,
                      grad_scale: float = 1.0) -> MicroBatches:
        """The step's store: ``inputs`` per micro-batch (this rank's forward keyword
        arguments), ``count`` N (``global_valid_count`` of their labels over dp x cp) and the
        capacity every stage pads to (the same on every rank of the pp group, which sees the
        same micro-batches)."""
        rows = [self.modules[0].rows(i) for i in inputs]
        tokens = max(i["input_ids"].shape[0] for i in inputs)
        return MicroBatches(inputs, count, capacity_for(rows), grad_scale, output=self.output,
                            tokens=tokens)

    def _count(self, batches: MicroBatches) -> torch.Tensor:
        """The step's statistic (``PipelineStageModule.statistic_size``): a forward-only pass
        of every micro-batch (one extra forward each: the price of an exact gradient, since
        micro-batch 1's loss depends on micro-batch 2's statistics), each stage's records
        summed, then over the pp group and dp x cp. Collective over the world."""
        counting = dataclasses.replace(batches, counting=True)
        with torch.no_grad():
            self.evaluator(len(batches)).step(counting, backward=False)
        size = max(m.statistic_size for m in self.modules)
        total = torch.zeros(size, dtype=torch.float32, device=self.device)
        for m in self.modules:
            if m.recorded is not None:
                total += m.recorded
        for group in (self.state.pp_group, self.state.dp_cp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total

    def step(self, batches: MicroBatches, *, backward: bool = True) -> torch.Tensor:
        """Run the step (forward only when ``backward`` is False) and return its loss (fp32
        scalar, the same on every rank; ``grad_scale`` divided out)."""
        if len(batches) != self.num_microbatches:
            raise ValueError(f"the pipeline was built for {self.num_microbatches} micro-batches "
                             f"per step, got {len(batches)}")
        if max(m.statistic_size for m in self.modules) and backward:
            batches = dataclasses.replace(batches, statistic=self._count(batches))
            self.last_statistic = batches.statistic
        if self.output != "loss":
            raise ValueError("a scoring pipeline (output='logprobs') runs scores(), not step()")
        for m in self.modules:
            m.begin(batches)
            # Set per step: an evaluator (another schedule) runs the same modules.
            m.split_backward = self.schedule_name in SPLIT_BACKWARD
        schedule = self._schedule(batches)
        index = torch.arange(len(batches), device=self.device)
        losses: list[torch.Tensor] = []
        run = schedule.step if backward else schedule.eval
        run(index, target=index.clone(), losses=losses)
        total = torch.stack([x.detach().float().sum() for x in losses]).sum() if losses else (
            torch.zeros((), device=self.device))
        for m in self.modules:  # loss terms of stages that do not end the pipeline
            if m.attached is not None:
                total = total + m.attached
        if backward:
            self._sum_tied()
        total = total / batches.grad_scale
        for group in (self.state.pp_group, self.state.dp_cp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total


    @torch.no_grad()
    def _sum_tied(self) -> None:
        """Sum the gradients of parameters held on both ends of the pipeline (a tied head):
        both copies then get the same update and stay equal. Collective over the ends."""
        tied = [p for m in self.modules for p in m.tied_parameters()]
        if self.state.pp_rank not in (0, self.state.pp - 1) or self.state.pp == 1:
            return
        for param in tied:
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: the shard
            dist.all_reduce(local, group=self.state.pp_ends_group)

    @torch.no_grad()
    def scores(self, batches: MicroBatches) -> torch.Tensor:
        """Forward only, one micro-batch: its per-token ``(logprobs, entropy)`` as fp32
        ``[2, L]`` (L local tokens, replicated over tp), on every rank of the pp group
        (broadcast from the last stage's rank). Needs ``output="logprobs"``. The stage shapes
        are static per capacity, so the scores travel at the micro-batch's own width only
        after the last stage: the last stage's output is ``[2, tokens]``."""
        if self.output != "logprobs" or len(batches) != 1 or self.num_microbatches != 1:
            raise ValueError("scores() runs one micro-batch through a Pipeline built with "
                             "output='logprobs' and num_microbatches=1")
        for m in self.modules:
            m.begin(batches)
            m.split_backward = False
        out = self._schedule(batches).eval(torch.zeros(1, dtype=torch.long,
                                                                device=self.device))
        last_rank = [r for r in range(self.state.pp) if self.num_stages - 1 in
                     stage_indices(self.schedule_name, self.state.pp, r, self.virtual)][0]
        if self.state.pp_rank != last_rank:
            out = torch.empty(2, batches.tokens, dtype=torch.float32, device=self.device)
        if group_size(self.state.pp_group) > 1:
            dist.broadcast(out, src=dist.get_global_rank(self.state.pp_group, last_rank),
                           group=self.state.pp_group)
        return out


class AttachLoss(torch.autograd.Function):
    """``attach_loss(h, loss)``: forward ``h`` unchanged; backward passes ``h``'s gradient
    through and gives ``loss`` the gradient 1, so a term of the step's loss computed on a
    stage that does not end the pipeline (a MoE layer's load-balancing share) is
    backpropagated with that stage's backward (Megatron's aux-loss scaler)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        # A new tensor, not a view: the zero-bubble schedules detach stage outputs in place.
        return h.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def attach_loss(h: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor:
    """``AttachLoss``; ``h`` as it is when ``loss`` is None."""
    return h if loss is None else AttachLoss.apply(h, loss)
