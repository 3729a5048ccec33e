"""Training a vision-language model: its config, data and micro-batch inputs.

A run trains a VL model when ``model.vision`` is set (a tower from scratch: ``VisionConfig``
fields) or ``model.init_from`` is a Qwen2-VL / Qwen2.5-VL checkpoint. Everything else is the
text path's: the same trainer, FSDP2/DDP over dp x cp, checkpoints (logical, via
``models.vl_hf.vl_shard_map``), the loss over the global count of valid targets.

Data (``data.vl_paths``: folders made by ``launch/prepare_vl_data.py``; empty: the shipped image
set, ``mpcore.data.prepare_vl_default``), each packed into budgets of ``data.seq_len`` tokens of
whole samples (an image never crosses a micro-batch), blended by ``data.weights`` with the text
datasets of ``data.paths`` (or, for the shipped default, the default text corpus); weights list
the VL datasets first, then the text ones. A micro-batch (``collate_vl``) is one packed stream
with ``loss_mask`` (targets) and the images' ``pixel_values`` / ``image_grid_thw``;
:func:`vl_local_inputs` makes the per-token tensors on the GLOBAL stream (M-RoPE positions,
vision rows, labels that never target a placeholder) and splits them with one ``ContextPlan``.

Token ids: the datasets' VL tokenizer (a SentencePiece model with the placeholder and vision
start/end ids after its vocab) names them; a checkpoint's config.json must agree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from models import (
    ModelConfig,
    VisionConfig,
    VLConfig,
    build_vl_model,
    is_vl_config,
    load_hf_vl_model,
    vl_config_from_hf,
)
from models.vl_inputs import IGNORE_INDEX, local_vl_inputs
from mpcore.backends import use_te
from mpcore.config import Config
from mpcore.data import (
    BlendedDataset,
    IndexedDataset,
    PackedDataset,
    TextAsVL,
    VLDataLoader,
    VLDataset,
    VLPackedDataset,
    VLTokenizer,
    prepare_vl_default,
)
from parallel.state import ParallelState

log = logging.getLogger(__name__)


def is_vl_run(cfg: Config) -> bool:
    """Whether ``cfg`` trains a vision-language model (module docstring)."""
    m = cfg.model
    return m.vision is not None or bool(m.init_from and is_vl_config(m.init_from))


def vl_sources(cfg: Config) -> tuple[list[Path], list[Path], VLTokenizer]:
    """``(VL dataset folders, text dataset prefixes, tokenizer)`` of ``cfg.data``; prepares the
    shipped default (with the default text corpus) when ``data.vl_paths`` is empty."""
    d = cfg.data
    if d.vl_paths:
        folders = [Path(p) for p in d.vl_paths]
        tok = VLDataset(folders[0]).tokenizer
        return folders, [Path(p) for p in d.paths], tok
    default = prepare_vl_default(d.cache_dir, d.default_vocab_size)
    text = [Path(p) for p in d.paths] if d.paths else [default.text_prefix]
    return [default.dataset], text, VLDataset(default.dataset).tokenizer


def _check_tokenizer(tok: VLTokenizer, other: VLTokenizer, where: Path) -> None:
    if tok.token_ids() != other.token_ids() or tok.vocab_size != other.vocab_size:
        raise ValueError(f"{where} was prepared with another VL tokenizer ({other.token_ids()}, "
                         f"vocab {other.vocab_size}) than the first dataset ({tok.token_ids()}, "
                         f"vocab {tok.vocab_size}); prepare every dataset with one tokenizer")


def build_vl_loaders(cfg: Config, state: ParallelState):
    """``(train loader, validation loader or None, summary, tokenizer)`` of a VL run (this dp
    rank's; validation holds out the last ``data.valid_fraction`` of each VL dataset's
    samples). Raises ``ValueError`` naming the folder and the fix for mismatched data."""
    from mpcore.batches import DataSummary  # batches imports this module

    d = cfg.data
    folders, text, tok = vl_sources(cfg)
    train, valid, patch_dim = [], [], None
    for folder in folders:
        ds = VLDataset(folder)
        _check_tokenizer(tok, ds.tokenizer, folder)
        if patch_dim is not None and ds.patch_dim != patch_dim:
            raise ValueError(f"{folder} has pixel rows of {ds.patch_dim} values, the first VL "
                             f"dataset {patch_dim}; prepare them with the same image settings")
        patch_dim = ds.patch_dim
        held = int(len(ds) * d.valid_fraction)
        train.append(VLPackedDataset(ds, d.seq_len, d.seed, tok.eos_id, d.vl_drop_long,
                                     samples=(0, len(ds) - held)))
        if held:
            valid.append(VLPackedDataset(ds, d.seq_len, d.seed, tok.eos_id, d.vl_drop_long,
                                         samples=(len(ds) - held, len(ds))))
    for prefix in text:
        ds = IndexedDataset(prefix)
        if ds.vocab_size != tok.text_vocab_size:
            raise ValueError(f"{ds.idx_path} was written for a vocabulary of {ds.vocab_size} "
                             f"but the VL tokenizer's SentencePiece model has "
                             f"{tok.text_vocab_size}; tokenize text with that model")
        train.append(TextAsVL(PackedDataset(ds, d.seq_len, tok.eos_id), patch_dim))
    weights = d.weights or [1.0] * len(train)
    if len(weights) != len(train):
        raise ValueError(f"data.weights has {len(weights)} entries for {len(train)} datasets "
                         f"({len(folders)} VL, then {len(text)} text); give one per dataset")
    samples = train[0] if len(train) == 1 else BlendedDataset(train, weights, d.seed)
    loader = VLDataLoader(samples, d.micro_batch, d.grad_accum, state.dp, state.dp_rank, d.seed)
    valid_loader = None
    if valid:
        held = valid[0] if len(valid) == 1 else BlendedDataset(valid, [1.0] * len(valid), d.seed)
        valid_loader = VLDataLoader(held, d.micro_batch, 1, state.dp, state.dp_rank, d.seed)
    dropped = sum(p.num_dropped for p in train if isinstance(p, VLPackedDataset))
    summary = DataSummary(sum(p.num_docs for p in train), sum(p.num_tokens for p in train),
                          loader.num_samples,
                          sum(p.num_docs for p in valid), sum(p.num_tokens for p in valid),
                          0 if valid_loader is None else valid_loader.num_samples)
    return loader, valid_loader, summary, tok, dropped


def vl_model_config(cfg: Config, tok: VLTokenizer | None) -> VLConfig:
    """The run's ``VLConfig``: from ``model.init_from``'s config.json (its token ids must be the
    data's), else from the model section and ``model.vision`` with the data's token ids."""
    m = cfg.model
    if m.init_from:
        vl = vl_config_from_hf(m.init_from)
        if tok is not None and tok.token_ids() != {k: getattr(vl, k) for k in tok.token_ids()}:
            raise ValueError(f"model.init_from {m.init_from} uses token ids "
                             f"{ {k: getattr(vl, k) for k in tok.token_ids()} } but the data was "
                             f"prepared with {tok.token_ids()}; prepare the data with the "
                             f"checkpoint's tokenizer")
        return vl
    if tok is None:
        raise ValueError("a VL model from scratch takes its token ids from the data's tokenizer")
    if m.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size = {m.vocab_size} is smaller than the VL tokenizer's "
                         f"{tok.vocab_size} ids (text vocab + 4 vision ids); raise it")
    vision = dict(m.vision)
    vision.setdefault("out_hidden_size", m.hidden_size)
    try:
        vision_cfg = VisionConfig(**vision)
    except TypeError as e:
        raise ValueError(f"model.vision: {e}; its keys are models.vision.VisionConfig's "
                         f"fields") from None
    text = ModelConfig(**m.shape_fields())
    return VLConfig(text=text, vision=vision_cfg, **tok.token_ids())


def vl_local_inputs(batch: dict[str, torch.Tensor], state: ParallelState, cfg: Config,
                    device: torch.device, vl_cfg: VLConfig) -> dict[str, torch.Tensor]:
    """``VLModel.forward`` keyword arguments of this cp rank for one VL micro-batch."""
    from mpcore.batches import to_device  # batches imports this module

    sp = cfg.parallel.sequence_parallel and state.tp > 1
    _, local = local_vl_inputs(state, batch["input_ids"], batch["cu_seqlens"], vl_cfg,
                               pixel_values=batch["pixel_values"],
                               image_grid_thw=batch["image_grid_thw"],
                               loss_mask=batch["loss_mask"], sequence_parallel=sp)
    if local["grid_thw"] is None or not local["grid_thw"].numel():
        local["pixel_values"] = None
        local["grid_thw"] = None
    grid_thw = local.pop("grid_thw")  # host metadata: the tower plans on the CPU
    return {**to_device(local, device, ignore_index=IGNORE_INDEX), "grid_thw": grid_thw}


def build_vl(cfg: Config, state: ParallelState, device: torch.device, loader=None):
    """``mpcore.build.build`` for a VL run: loaders first (data errors before the model), the
    ``VLModel`` (from ``model.init_from`` or from scratch), optionally a frozen tower, then the
    same wrapping, optimizer, grad norm and train state as the text path."""
    from mpcore.build import assemble, linear_kernels  # build imports this module
    from parallel.random import model_parallel_seed

    valid_loader = summary = tok = None
    if loader is None:
        loader, valid_loader, summary, tok, dropped = build_vl_loaders(cfg, state)
        if dropped and state.rank == 0:
            log.warning("data: %d VL samples longer than data.seq_len=%d were dropped "
                        "(data.vl_drop_long)", dropped, cfg.data.seq_len)
    vl_cfg = vl_model_config(cfg, tok)
    p = cfg.parallel
    cp_mode = p.cp_mode if state.cp > 1 else "none"
    try:
        vl_cfg.check_parallel(p.tp, p.cp, cp_mode)
    except ValueError as e:
        raise ValueError(f"model and parallel sections do not fit (parallel.tp={p.tp}, "
                         f"parallel.cp={p.cp}, parallel.cp_mode={p.cp_mode}): {e}") from None
    linear_backend, fp8 = linear_kernels(cfg, device)
    kwargs = dict(sequence_parallel=p.sequence_parallel and state.tp > 1, cp_mode=cp_mode,
                  activation_checkpointing=p.activation_checkpointing,
                  vision_cp=cfg.model.vision_cp, device=device, dtype=torch.float32,
                  attention_backend=cfg.model.attention_backend, fp8=fp8)
    tracker = model_parallel_seed(cfg.training.seed, state.tp_rank, device)
    if cfg.model.init_from:
        model, _ = load_hf_vl_model(cfg.model.init_from, state, **kwargs)
    else:
        model = build_vl_model(vl_cfg, state, seed=cfg.training.seed, **kwargs)
    if linear_backend == "te":  # the decoder's linears, as fp8 (the tower stays native)
        use_te(model.text.layers, cfg.model.fp8)
    if cfg.model.freeze_vision:
        freeze_vision(model)
    return assemble(cfg, vl_cfg, state, device, model, tracker, loader, valid_loader, summary)


def freeze_vision(model: nn.Module) -> int:
    """Stop training the vision tower (``model.freeze_vision``); returns its parameter count."""
    count = 0
    for p in model.visual.parameters():
        p.requires_grad_(False)
        count += p.numel()
    return count


def vl_section_fields() -> tuple[str, ...]:
    """Model-section keys that are not ``ModelConfig`` fields (excluded from shape_fields)."""
    return ("vision", "freeze_vision", "vision_cp")


__all__ = ["build_vl", "build_vl_loaders", "freeze_vision", "is_vl_run", "vl_local_inputs",
           "vl_model_config", "vl_section_fields", "vl_sources"]
