"""A decoder's pipeline stage: a ``Transformer`` holding some of the layers, run on the step's
micro-batch store (``mpcore.parallel.pp``).

Layout, per rank: the micro-batch's L local tokens (``[L / tp]`` rows under sequence
parallelism), as ``Transformer.forward`` takes them; between stages the residual stream
``[C, hidden]`` padded with zero rows to the step's capacity C.

    first stage:  h = tok_embeddings(input_ids)             (the micro-batch index comes in)
    every stage:  h = layers[a:b](h)                        (global layer indices a..b-1)
    last stage:   share = grad_scale * sum(head(norm(h)) loss) / N     ([1])
    otherwise:    pad(h + delta) to C rows                  (the pending residual add is done
                                                             here: one tensor crosses)

Each stage's weights are the whole model's under the same names (layers keyed by global index),
initialised from the same per-name seeds, so a pipelined model is the one-process model cut
into pieces, and its checkpoint is the logical one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.models.common.decoder import LayerDict, Transformer, make_packing
from mpcore.models.common.moe_loss import aux_share, pool_layers, z_share
from mpcore.parallel.pp import PipelineStageModule, split_layers
from mpcore.parallel.pp_schedule import stage_indices
from mpcore.parallel.state import ParallelState


class DecoderStage(PipelineStageModule):
    """One stage of a model (module docstring). ``model``: the stage's model (built with
    ``keep_layers``); its parameters are this module's, under ``model.``. ``decoder_of``: the
    family's accessor of the ``Transformer`` inside (``Family.decoder``; a vision-language
    model's ``text``), whose layers the stage runs; a model with ``embed`` (the
    vision-language model) makes the first stage's input rows with it (tower included)."""

    def __init__(self, model: nn.Module, decoder_of: Callable[[nn.Module], Transformer] | None
                 = None):
        super().__init__()
        self.model = model
        self._decoder_of = decoder_of or (lambda m: m)
        self.tied_head = False  # holds one end's copy of a tied head's embedding (_tie_head)
        # A MoE decoder's blocks on this stage: the load-balancing share of each micro-batch
        # needs the step's expert loads over every layer (a counting pass, mpcore.parallel.pp).
        self.moe_blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
        if hasattr(model, "moe_cfg"):
            self.statistic_size = model.moe_cfg.num_experts + 1  # loads [E], rows

    def tied_parameters(self) -> list[nn.Parameter]:
        # Looked up each time: FSDP2 replaces the parameter objects when it shards them.
        return [self.decoder.tok_embeddings.weight] if self.tied_head else []

    @property
    def decoder(self) -> Transformer:
        return self._decoder_of(self.model)

    @property
    def is_first(self) -> bool:
        return self.decoder.is_first

    @property
    def is_last(self) -> bool:
        return self.decoder.is_last

    def rows(self, inputs: dict) -> int:
        """The residual stream's local rows of a micro-batch: L, or L / tp under SP."""
        num = inputs["input_ids"].shape[0]
        return num // self.decoder.tp if self.decoder.sequence_parallel else num

    def example_io(self, capacity: int, device, output: str = "loss", tokens: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """What this stage takes (the micro-batch index on the first stage, else the padded
        residual stream) and gives (on the last stage the loss share ``[1]`` fp32, or with
        ``output="logprobs"`` the ``(logprobs, entropy)`` ``[2, tokens]`` fp32), for
        torch's static stage shapes. The stream's dtype: the parameters', or the autocast dtype when
        the model keeps its residual stream in it (``Transformer.residual_dtype``)."""
        dtype = next(self.parameters()).dtype
        autocast = torch.is_autocast_enabled(torch.device(device).type)
        if self.decoder.residual_dtype == "autocast" and autocast:
            dtype = torch.get_autocast_dtype(torch.device(device).type)
        hidden = torch.zeros(capacity, self.decoder.cfg.hidden_size, dtype=dtype, device=device,
                             requires_grad=True)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        loss = torch.zeros(1, dtype=torch.float32, device=device, requires_grad=True)
        if output == "logprobs":
            loss = torch.zeros(2, tokens, dtype=torch.float32, device=device)
        return (index if self.is_first else hidden), (loss if self.is_last else hidden)

    def _begin_forward(self, inp: dict, x: torch.Tensor):
        """``(h, packing, after_layer)``: the stage's input rows, the micro-batch's attention
        metadata and (first stage of a model with DeepStack) the hook its layers take."""
        decoder = self.decoder
        if self.is_first and hasattr(self.model, "embed"):
            kwargs = {k: v for k, v in inp.items() if k != "moe_mask"}
            h, packing, after_layer, deep = self.model.embed(**kwargs, output="loss_sum")
            stop = max(i for i, _ in decoder.layer_items()) + 1  # first stage: from layer 0
            if deep > stop:
                raise ValueError(f"DeepStack adds visual features after the first {deep} "
                                 f"decoder layers, but the first pipeline stage holds only "
                                 f"{stop}; give it at least {deep} (parallel.pp_split)")
            return h, packing, after_layer
        packing = make_packing(inp["input_ids"].shape[0], inp.get("doc_id"),
                               inp.get("positions_in_doc"), inp.get("cu_seqlens"))
        if self.is_first:
            decoder.check_inputs(inp["input_ids"], inp["position_ids"], packing,
                                 inp.get("labels"), "loss_sum")
            return decoder.tok_embeddings(inp["input_ids"]), packing, None
        return x[:self.rows(inp)], packing, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = self.next_index(x if self.is_first else None)
        inp = self.batches.inputs[index]
        if hasattr(self.model, "set_moe_mask"):  # a MoE decoder: statistics of real tokens
            self.model.set_moe_mask(inp.get("moe_mask"), inp["input_ids"])
        h, packing, after_layer = self._begin_forward(inp, x)
        plan, cos, sin, h = self.decoder.layer_inputs(h, inp["position_ids"], packing)
        h, delta = self.decoder.run_layers(h, None, cos, sin, plan, after_layer)
        extra = self._moe_share()
        if self.is_last and self.batches.output == "logprobs":  # scoring
            logprobs, entropy = self.decoder.finish(h, delta, inp["labels"], "logprobs",
                                                  self.batches.temperature)
            return torch.stack([logprobs, entropy]).float()  # (2, L)
        if self.is_last:
            # "loss_sum": the fused head's gradients made in the forward (3 GEMMs, not 4),
            # which a two-pass backward cannot use (``split_backward``).
            out = "loss" if self.split_backward else "loss_sum"
            total = self.decoder.finish(h, delta, inp["labels"], out).sum()  # () fp32
            count = self.batches.count.to(total.device).clamp(min=1).to(total.dtype)
            share = total / count + (0.0 if extra is None else extra)
            return (share * self.batches.grad_scale).reshape(1)
        h = h if delta is None else h + delta
        h = F.pad(h, (0, 0, 0, self.batches.capacity - h.shape[0]))
        return self.attach(h, None if extra is None else extra * self.batches.grad_scale)

    def _moe_share(self) -> torch.Tensor | None:
        """This stage's MoE layers' share of the weighted load-balancing and z losses of the
        micro-batch just run (``mpcore.models.common.moe_loss``: a sum over layers, so each
        stage adds its own layers' with the step's global loads); in a counting pass, their
        statistics recorded instead. None for a dense stage or a forward-only step."""
        if not self.moe_blocks:
            return None
        stats = pool_layers(b.last_stats for b in self.moe_blocks)
        if self.batches.counting:
            self.record(torch.cat([stats.counts, stats.tokens.reshape(1)]))
            return None
        if self.batches.statistic is None:
            return None
        counts, rows = self.batches.statistic[:-1], self.batches.statistic[-1]
        cfg = self.model.moe_cfg
        aux, z = aux_share(stats, counts, rows), z_share(stats, rows)
        # The step's unweighted terms and dropped tokens, for the trainer's metrics.
        terms = torch.stack([aux.detach(), z.detach(),
                             torch.tensor(float(stats.dropped), device=aux.device)])
        self.moe_terms = terms if self.moe_terms is None else self.moe_terms + terms
        return cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z

    def begin(self, batches) -> None:
        super().begin(batches)
        self.moe_terms = None  # aux, z, dropped tokens of this step's MoE layers (_moe_share)


def build_stages(build: Callable[..., nn.Module], cfg, state: ParallelState, *,
                 schedule: str, virtual: int = 1, split: Sequence[int] | None = None,
                 decoder_of: Callable[[nn.Module], Transformer] | None = None,
                 text_cfg=None, **options) -> list[DecoderStage]:
    """This pp rank's stages of a family (``build(cfg, state, keep_layers=..., **options)``
    is its ``Family.build``; ``decoder_of`` its ``Family.decoder``, ``text_cfg`` its decoder's
    config when ``cfg`` is not), in the order ``pp_schedule.stage_indices`` gives. ``split``:
    layers per global stage (None: even); ``ValueError`` naming the numbers when it does not
    fit. A tied head: ``_tie_head``."""
    text_cfg = text_cfg or cfg  # the decoder's config (a VL config's ``text``)
    ranges = split_layers(text_cfg.num_layers, state.pp * virtual, split)
    ids = stage_indices(schedule, state.pp, state.pp_rank, virtual)
    stages = [DecoderStage(build(cfg, state, keep_layers=ranges[s], **options), decoder_of)
              for s in ids]
    if text_cfg.tie_embeddings and state.pp > 1:
        _tie_head(stages, ids, len(ranges))
    return stages


def _tie_head(stages: list[DecoderStage], ids: list[int], num_stages: int) -> None:
    """A tied head at pp > 1: the last stage's embedding copy (same name, same initial value)
    is the first stage's module when this rank holds both (a V schedule); otherwise each end
    marks its copy, whose gradients the pipeline sums over the two ends."""
    first = stages[ids.index(0)] if 0 in ids else None
    last = stages[ids.index(num_stages - 1)] if num_stages - 1 in ids else None
    if first is not None and last is not None:
        last.decoder.tok_embeddings = first.decoder.tok_embeddings
        return
    for stage in (first, last):
        if stage is not None:
            stage.tied_head = True


class StagedModel(nn.Module):
    """This rank's stages seen as one model under the whole model's parameter names (its
    ``tok_embeddings``, ``layers.<global index>``, ``norm``, ``output``, a VL model's
    ``text.*`` and ``visual.*``, where it holds them), for what reads parameters by logical
    name: the optimizer, checkpoints (``mpcore.logical``), the gradient norm. ``stages``: the
    ``DecoderStage``s, which the pipeline runs; they are not submodules here (each module is
    registered once, under its logical name). ``cfg``: the model config."""

    def __init__(self, stages: list[DecoderStage]):
        super().__init__()
        self.stages = tuple(stages)  # a tuple: not registered as submodules
        self.cfg = stages[0].model.cfg
        _merge_into(self, [s.model for s in stages])

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters the gradient norm must leave out here because another pp rank holds the
        same weight: the last stage's copy of a tied head's embedding (the first stage's
        counts)."""
        return [p for s in self.stages if s.is_last and not s.is_first
                for p in s.tied_parameters()]

    def decoders(self) -> list[Transformer]:
        return [s.decoder for s in self.stages]

    def fsdp_units(self) -> list[nn.Module]:
        return [unit for s in self.stages for unit in s.model.fsdp_units()]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its Pipeline (mpcore.parallel.pp), "
                           "not as one module")


def _merge_into(target: nn.Module, parts: list[nn.Module]) -> None:
    """Register under ``target`` the children of ``parts`` (the same model type cut into
    stages), by name: a child only one part has as it is, ``layers`` dicts as one dict in
    global order, a child several parts have (a VL model's ``text``) merged the same way."""
    names = dict.fromkeys(n for p in parts for n, c in p.named_children() if c is not None)
    for name in names:
        children = [c for p in parts if (c := getattr(p, name, None)) is not None]
        if name == "layers" and isinstance(children[0], LayerDict):
            items = [kv for c in children for kv in c.items()]
            target.add_module(name, LayerDict(dict(sorted(items, key=lambda kv: int(kv[0])))))
        elif len(children) == 1 or all(c is children[0] for c in children):
            target.add_module(name, children[0])
        elif any(True for _ in children[0].parameters()):
            holder = nn.Module()
            _merge_into(holder, children)
            target.add_module(name, holder)
        else:  # parameter-free (RoPE tables): any one of them
            target.add_module(name, children[0])


def build_vl_stages(build: Callable[..., nn.Module], cfg, state: ParallelState,
                    **kwargs) -> list[DecoderStage]:
    """``build_stages`` of a vision-language family: the layers are its decoder's
    (``cfg.text``); the first stage also holds the tower."""
    return build_stages(build, cfg, state, text_cfg=cfg.text, **kwargs)
