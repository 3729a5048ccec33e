"""setup and build: process groups, device, model (fresh or from Hugging Face), data parallelism,
optimizer, data loader, checkpoint state. ``mpcore.train`` runs the loop on what this returns.

Data parallelism over the dp x cp group (``ParallelState.dp_cp_group``; CP ranks hold the same
weights and act as data-parallel ranks for them), only when that group has more than one rank:
    fsdp  FSDP2 ``fully_shard`` on every decoder layer, then the root, over a DeviceMesh of the
          dp_cp group: parameters become DTensors sharded on dim 0; gradients are
          reduce-scattered (averaged) every micro-batch. On CUDA parameters are gathered in
          bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``).
    ddp   ``DistributedDataParallel(process_group=dp_cp_group)``: gradients all-reduced
          (averaged) once per step (``no_sync`` for the other micro-batches).
Both average over W = dp * cp ranks, so the loop backpropagates ``W * loss_share`` (see
``parallel/loss.py``). TP is inside the model (its layers' collectives over the tp group).

``model.linear_backend=te``: the model is built with our layers (``fp8`` none), then
``use_te`` gives the decoder layers' linears TransformerEngine's GEMM and ``model.fp8``'s TE
recipe (``mpcore.parallel.te``); parameters, wrapping and checkpoints are the same as native.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mpcore.backends import resolve_linear_backend, use_te
from mpcore.batches import data_loaders
from mpcore.config import Config
from mpcore.data import DataLoader, DataSummary
from mpcore.logical import LogicalLayout
from mpcore.models import (
    Family,
    ModelConfig,
    family_named,
    family_of,
    family_of_hf,
    read_hf_config,
)
from mpcore.models.common.moe import MoeBlock, expert_param_names
from mpcore.optim import GradNorm, build_optimizer
from mpcore.parallel.pp import Pipeline
from mpcore.parallel.random import RNGTracker, model_parallel_seed
from mpcore.parallel.state import ParallelState
from mpcore.pipelined import build_pipeline, wrap_stages
from mpcore.train_state import TrainState
from mpcore.vl_data import check_tower


@dataclass
class Run:
    """Everything the loop needs; ``model`` is unwrapped, ``module`` is what runs forward."""

    cfg: Config
    model_cfg: ModelConfig
    state: ParallelState
    device: torch.device
    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    grad_norm: GradNorm
    loader: DataLoader
    train_state: TrainState
    tracker: RNGTracker
    valid_loader: DataLoader | None = None  # held-out documents (data.valid_fraction)
    data: DataSummary | None = None  # None when the caller passed its own loader
    family: Family | None = None  # the model's registry entry (mpcore.models.registry)
    pipeline: Pipeline | None = None  # pp > 1: runs the stages (``model`` is a StagedModel)


def resolve_device(cfg: Config) -> torch.device:
    """``training.device`` as a device; CUDA picks ``LOCAL_RANK`` (torchrun) or device 0."""
    kind = cfg.training.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("training.device=cuda but CUDA is not available; use training.device="
                         "cpu (or auto)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def setup(cfg: Config, source: str = "the config") -> ParallelState:
    """Check that ``cfg``'s layout fits the launched world and build the process groups."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, cp, pp = cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp
    if world % (tp * cp * pp):
        names = "tp / parallel.cp" + (" / parallel.pp" if pp > 1 else "")
        degrees = f"parallel.tp={tp} x parallel.cp={cp}" + (
            f" x parallel.pp={pp}" if pp > 1 else "")
        raise ValueError(
            f"{source}: {degrees} = {tp * cp * pp} ranks per model replica does not divide the "
            f"world size {world}; launch a multiple of {tp * cp * pp} processes (torchrun "
            f"--nproc-per-node {tp * cp * pp}) or set parallel.{names} so that their product "
            f"divides {world}")
    if cfg.parallel.ep > 1:
        return _expert_parallel_state(cfg, world, source)
    return ParallelState.build(tp, cp, pp=pp)


def _expert_parallel_state(cfg: Config, world: int, source: str) -> ParallelState:
    """The groups with ep > 1 (ep / edp added); the layout checks first, naming the fix."""
    p = cfg.parallel
    dp_cp = world // (p.tp * p.pp)
    if dp_cp % p.ep:
        pp = f" / pp {p.pp}" if p.pp > 1 else ""
        raise ValueError(f"{source}: parallel.ep={p.ep} must divide dp x cp = {dp_cp} (world "
                         f"{world} / tp {p.tp}{pp}); choose an ep that divides {dp_cp}")
    return ParallelState.build(p.tp, p.cp, ep=p.ep, pp=p.pp)


def run_family(cfg: Config) -> Family:
    """The model family of ``cfg``: the family whose keys its model section holds
    (``model.family``, or what ``auto`` resolved to: ``mpcore.config.section_family``). A named
    family that disagrees with ``model.init_from``'s checkpoint is refused."""
    m = cfg.model
    family = family_named(m.resolved_family)
    found = family_of_hf(m.init_from) if m.init_from else None
    if found is not None and found is not family:
        raise ValueError(f"model.family={m.family} but model.init_from={m.init_from} is a "
                         f"{found.name} checkpoint; set model.family={found.name} (or auto)")
    return family


def _section_of(cfg: Config, model_cfg) -> Config:
    """``cfg`` with the model section's decoder fields those of a decoder-only checkpoint's
    config (a VL family's config is not the section's shape: the section stays)."""
    if not isinstance(model_cfg, ModelConfig):
        return cfg
    fields = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))


def resolved_section(cfg: Config) -> Config:
    """``cfg`` as the run resolves it before any data is read (``--print-config``)."""
    if not cfg.model.init_from:
        return cfg
    return _section_of(cfg, run_family(cfg).config_from_hf(read_hf_config(cfg.model.init_from)))


def resolve_model_config(cfg: Config, family: Family | None = None,
                         token_ids: dict | None = None) -> tuple[Config, object]:
    """The model's config (from ``model.init_from``'s config.json when set, else from the
    model section; ``token_ids``: the data tokenizer's special ids, which a checkpoint must
    share), checked against the parallel layout. Returns ``cfg`` with the model section made
    to match a decoder-only checkpoint, and the family's config."""
    m, family = cfg.model, family or run_family(cfg)
    if m.init_from:
        model_cfg = family.config_from_hf(read_hf_config(m.init_from))
        if getattr(m, "mtp_loss_weight", 0):  # a run-level key: the checkpoint has no say
            try:
                model_cfg = model_cfg.with_mtp_weight(m.mtp_loss_weight)
            except ValueError as e:
                raise ValueError(f"model.mtp_loss_weight with model.init_from={m.init_from}: "
                                 f"{e}") from None
        cfg = _section_of(cfg, model_cfg)
        theirs = {k: getattr(model_cfg, k, None) for k in token_ids or {}}
        if token_ids and theirs != token_ids:
            raise ValueError(f"model.init_from {m.init_from} uses token ids {theirs} but the "
                             f"data was prepared with {token_ids}; prepare the data with the "
                             f"checkpoint's tokenizer")
    else:
        try:
            model_cfg = family.config_from_section(m, token_ids)
        except KeyError as e:  # a release's own id names (GLM's image_start_token_id, ...)
            raise ValueError(f"the data names vision ids {sorted(token_ids or {})}, but a fresh "
                             f"{family.name} model takes {e} from its data; train from the "
                             f"release the data was prepared with (model.init_from), or "
                             f"prepare the data with a SentencePiece tokenizer") from None
    p = cfg.parallel
    try:
        model_cfg.check_parallel(p.tp, p.cp, p.cp_mode if p.cp > 1 else "none")
        family.check_experts(model_cfg, p.ep)
    except ValueError as e:
        raise ValueError(f"model and parallel sections do not fit (parallel.tp={p.tp}, "
                         f"parallel.cp={p.cp}, parallel.cp_mode={p.cp_mode}, parallel.ep="
                         f"{p.ep}, model.family {family.name}): {e}") from None
    return cfg, model_cfg


def _wrap(model: nn.Module, cfg: Config, state: ParallelState, device: torch.device,
          pipelined: bool = False):
    """FSDP2 or DDP over the dp x cp group (module docstring); returns the forward module.
    Pipeline stages: ``mpcore.pipelined.wrap_stages`` (ddp: no wrapper)."""
    if state.dp_cp == 1:
        return model
    group = state.dp_cp_group
    if pipelined and cfg.parallel.data_parallel == "ddp":
        return model
    if cfg.parallel.data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    kwargs = {"mesh": mesh}
    if device.type == "cuda" and cfg.training.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if state.ep > 1:
        _shard_experts(model, state, device, kwargs)
    if pipelined:
        wrap_stages(model, cfg, state, kwargs)
        return model
    for unit in model.fsdp_units():  # decoder layers (and vision blocks), then the root
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _shard_experts(model: nn.Module, state: ParallelState, device: torch.device,
                   kwargs: dict) -> None:
    """FSDP2 over the expert-data-parallel group for each MoE block's experts (ep > 1): they
    differ between ep ranks, so they reduce over edp, not dp x cp. The trainer scales each
    share by dp x cp (what FSDP divides by elsewhere); here FSDP divides by that too, so the
    expert gradients are SUMS over edp like every other gradient's over dp x cp."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(state.edp_group, device.type)
    for block in model.modules():
        if isinstance(block, MoeBlock):
            fully_shard(block.experts, **{**kwargs, "mesh": mesh})
            block.experts.set_gradient_divide_factor(float(state.dp_cp))


def linear_kernels(cfg: Config, device: torch.device) -> tuple[str, str]:
    """``model.linear_backend`` resolved for ``device`` (``native`` or ``te``; raises
    ``ValueError`` when TE is named but missing), and the ``fp8`` that ``build_model`` gets:
    ``model.fp8`` for native, ``none`` for te (``use_te`` applies TE's recipe after the build)."""
    backend = resolve_linear_backend(cfg.model.linear_backend, device.type, cfg.model.fp8)
    return backend, cfg.model.fp8 if backend == "native" else "none"


def build(cfg: Config, state: ParallelState, device: torch.device,
          loader: DataLoader | None = None) -> Run:
    """Model, data parallelism, optimizer, loader (``loader`` overrides the config's data), for
    the run's model family (``run_family``): loaders first (data errors surface before a large
    model is built), then the model from ``model.init_from`` or fresh from ``training.seed``."""
    family = run_family(cfg)
    valid_loader = summary = token_ids = None
    if loader is None:
        # The data is checked against the model's vocabulary: init_from's, not the section's.
        loader, valid_loader, summary, token_ids = data_loaders(resolved_section(cfg), state,
                                                                family)
    cfg, model_cfg = resolve_model_config(cfg, family, token_ids)
    check_tower(summary, family, model_cfg)  # before a large model is built, or any batch
    p = cfg.parallel
    linear_backend, fp8 = linear_kernels(cfg, device)
    kwargs = dict(sequence_parallel=p.sequence_parallel and state.tp > 1,
                  cp_mode=p.cp_mode if state.cp > 1 else "none",
                  activation_checkpointing=p.activation_checkpointing,
                  attention_backend=cfg.model.attention_backend, fp8=fp8,
                  device=device, dtype=torch.float32,
                  **{name: getattr(cfg.model, name) for name in family.options})
    tracker = model_parallel_seed(cfg.training.seed, state.tp_rank, device)
    pipeline = None
    if state.pp > 1:
        model, pipeline = build_pipeline(cfg, model_cfg, state, family, **kwargs)
    elif cfg.model.init_from:
        # the checkpoint's mtp.* block, read when trained (a run-level weight, not in it)
        mtp = ({"mtp_loss_weight": model_cfg.mtp_loss_weight}
               if getattr(model_cfg, "uses_mtp", False) else {})
        try:
            model, _ = family.load(cfg.model.init_from, state, model_cfg, **kwargs, **mtp)
        except ValueError as e:
            raise ValueError(f"model.init_from={cfg.model.init_from}: {e}") from None
    else:
        model = family.build(model_cfg, state, seed=cfg.training.seed, **kwargs)
    decoders = model.decoders() if pipeline else [family.decoder(model)]
    for decoder in decoders:
        decoder.residual_dtype = cfg.model.residual_dtype
        if linear_backend == "te":  # the decoder's linears (a vision tower stays native)
            use_te(decoder.layers, cfg.model.fp8)
    if cfg.model.freeze_vision:
        freeze_vision(model, family)
    return assemble(cfg, model_cfg, state, device, model, tracker, loader, valid_loader,
                    summary, family, pipeline)


def freeze_vision(model: nn.Module, family: Family) -> int:
    """Stop training the vision tower (``model.freeze_vision``); returns its parameter count."""
    tower = family.vision(model)
    if tower is None:
        raise ValueError(f"model.freeze_vision=true but the {family.name} family has no vision "
                         f"tower; set it false")
    count = 0
    for param in tower.parameters():
        param.requires_grad_(False)
        count += param.numel()
    return count


def assemble(cfg: Config, model_cfg, state: ParallelState, device: torch.device,
             model: nn.Module, tracker: RNGTracker, loader, valid_loader=None,
             summary=None, family: Family | None = None,
             pipeline: Pipeline | None = None) -> Run:
    """The ``Run`` around a built ``model`` (decoder or VL, or at pp > 1 this rank's stages
    with their ``pipeline``): data-parallel wrapping, optimizer over the parameters that
    train, the true global grad norm (over tp x pp at pp > 1: every stage's weights), the
    checkpointed train state (of the parameters this rank holds, by logical name)."""
    layout = LogicalLayout(model_cfg, state.tp, state.tp_rank, ep=state.ep,
                           ep_rank=state.ep_rank, experts=expert_param_names(model),
                           holds=[n for n, _ in model.named_parameters()] if pipeline else None)
    module = _wrap(model, cfg, state, device, pipelined=pipeline is not None)
    names = {id(param): name for name, param in model.named_parameters()}
    optimizer = build_optimizer(model, cfg, device.type)
    fsdp = state.dp_cp > 1 and cfg.parallel.data_parallel == "fsdp"
    grad_norm = GradNorm(model, names, layout, state.tp_pp_group, fsdp, device,
                         skip=model.norm_duplicates() if pipeline else ())
    train_state = TrainState(model, optimizer, layout, state, tracker, device)
    return Run(cfg, model_cfg, state, device, model, module, optimizer, grad_norm, loader,
               train_state, tracker, valid_loader, summary, family or family_of(model_cfg),
               pipeline)
