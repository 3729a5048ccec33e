"""From the config's datasets to this rank's model inputs.

1. :func:`build_loaders`: the datasets of ``cfg.data`` (or the default corpus, prepared on first
   use), checked against the model's vocabulary, packed into ``seq_len`` samples, blended by
   weight, and a resumable loader of this dp rank's micro-batches. With
   ``data.valid_fraction = f`` the last ``ceil(f * documents)`` documents of every dataset are
   packed apart (``PackedDataset(docs=...)``) into the validation loader and never trained on.
   :func:`data_loaders` picks them, or the image-text ones (``mpcore.vl_data``), by the model
   family's modality.
2. :func:`local_inputs`: one micro-batch, a packed stream of ``T = micro_batch * seq_len``
   tokens (``input_ids [T]``, ``cu_seqlens [D+1]``, ``position_ids [T]``), becomes the model's
   keyword arguments for this cp rank through its family's ``local_inputs``. Labels are shifted
   ONCE on the GLOBAL stream (``LabelShifter``), then a ``ContextPlan`` splits ids, labels and
   positions (and, for a VL family, M-RoPE rows and vision rows) together: each
   cp rank gets ``L`` tokens (padded so ``L`` is a multiple of tp under sequence parallelism)
   and their attention metadata (``doc_id [L]``, ``positions_in_doc [L]``, local ``cu_seqlens``).
   Every tp rank of a cp rank builds the same inputs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mpcore.config import Config
from mpcore.data import (
    BlendedDataset,
    DataLoader,
    DataSummary,
    IndexedDataset,
    PackedDataset,
    Tokenizer,
    prepare_default,
)
from mpcore.kernels import host_checked
from mpcore.models import Family
from mpcore.parallel.labels import IGNORE_INDEX
from mpcore.parallel.state import ParallelState
from mpcore.vl_data import build_vl_loaders

VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


def dataset_sources(cfg: Config) -> tuple[Path, list[Path]]:
    """``(tokenizer path, dataset prefixes)`` of ``cfg.data``; prepares the default corpus
    (serialised over ranks by a file lock) when no paths are given."""
    data = cfg.data
    if data.paths:
        return Path(data.tokenizer), [Path(p) for p in data.paths]
    if data.default_vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.default_vocab_size = {data.default_vocab_size} exceeds "
                         f"model.vocab_size = {cfg.model.vocab_size}; the default corpus's ids "
                         f"would not fit the model: lower data.default_vocab_size or raise "
                         f"model.vocab_size")
    tokenizer, prefix = prepare_default(data.cache_dir, data.default_vocab_size)
    return tokenizer, [prefix]


def _held_out(ds: IndexedDataset, fraction: float) -> int:
    """Number of documents at the end of ``ds`` held out for validation."""
    if not fraction:
        return 0
    held = math.ceil(fraction * len(ds))
    if held >= len(ds):
        raise ValueError(f"data.valid_fraction={fraction} holds out all {len(ds)} documents of "
                         f"{ds.idx_path}; lower it so that documents remain to train on")
    return held


def build_loader(cfg: Config, state: ParallelState) -> DataLoader:
    """This dp rank's training loader (:func:`build_loaders`' first result)."""
    return build_loaders(cfg, state)[0]


def build_loaders(cfg: Config, state: ParallelState
                  ) -> tuple[DataLoader, DataLoader | None, DataSummary]:
    """This dp rank's loaders (``DataLoader`` of ``mpcore.data``) over the blended datasets:
    training, validation (None when ``data.valid_fraction`` is 0; one micro-batch per step)
    and a :class:`DataSummary`.

    Raises ``ValueError`` naming the file and the fix for a missing tokenizer or dataset, a
    dataset written by another tokenizer, or a token id >= ``model.vocab_size``.
    """
    tokenizer_path, prefixes = dataset_sources(cfg)
    tok = Tokenizer(tokenizer_path)
    packed, valid = [], []
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        if ds.vocab_size != tok.vocab_size:
            raise ValueError(f"{ds.idx_path} was written for a vocabulary of {ds.vocab_size} but "
                             f"the tokenizer {tokenizer_path} has {tok.vocab_size}; set "
                             f"data.tokenizer to the model that wrote it, or re-tokenize with "
                             f"launch/prepare_data.py --tokenizer {tokenizer_path}")
        ds.check_vocab(cfg.model.vocab_size)
        split = len(ds) - _held_out(ds, cfg.data.valid_fraction)
        packed.append(PackedDataset(ds, cfg.data.seq_len, tok.eos_id, docs=(0, split)))
        if split < len(ds):
            valid.append(PackedDataset(ds, cfg.data.seq_len, tok.eos_id, docs=(split, len(ds))))
    d = cfg.data
    train = DataLoader(_blend(packed, d.weights, d.seed), d.micro_batch, d.grad_accum,
                       state.dp, state.dp_rank, d.seed)
    summary = DataSummary(sum(p.num_docs for p in packed), sum(p.num_tokens for p in packed),
                          train.num_samples)
    if not valid:
        return train, None, summary
    samples = _blend(valid, d.weights, d.seed)
    if len(samples) < d.micro_batch * state.dp:
        raise ValueError(f"data.valid_fraction={d.valid_fraction} holds out {len(samples)} "
                         f"samples of seq_len={d.seq_len}, fewer than one validation batch "
                         f"(micro_batch {d.micro_batch} x dp {state.dp}); raise "
                         f"data.valid_fraction")
    valid_loader = DataLoader(samples, d.micro_batch, 1, state.dp, state.dp_rank, d.seed)
    summary = DataSummary(summary.num_docs, summary.num_tokens, summary.num_samples,
                          sum(p.num_docs for p in valid), sum(p.num_tokens for p in valid),
                          len(samples))
    return train, valid_loader, summary


def _blend(packed: list[PackedDataset], weights: list[float], seed: int):
    if len(packed) == 1:
        return packed[0]
    return BlendedDataset(packed, weights or [1.0] * len(packed), seed)


def data_loaders(cfg: Config, state: ParallelState, family: Family):
    """``(train loader, validation loader or None, summary, token ids or None)`` of the data the
    family trains on (its ``modality``): text datasets, or image-text ones blended with text
    (``mpcore.vl_data``), whose tokenizer names the special ids the model takes."""
    if family.modality == "image-text":
        loader, valid, summary, tok = build_vl_loaders(cfg, state, family)
        return loader, valid, summary, tok.token_ids()
    if cfg.data.vl_paths:
        raise ValueError(f"data.vl_paths {cfg.data.vl_paths} holds image-text data but the model "
                         f"has no vision tower (family {family.name}); choose a vision-language "
                         f"family (model.family, model.vision or a VL model.init_from), or "
                         f"train a text model on data.paths")
    return (*build_loaders(cfg, state), None)


def local_inputs(batch: dict[str, torch.Tensor], state: ParallelState, cfg: Config,
                 device: torch.device, family: Family, model_cfg) -> dict[str, torch.Tensor]:
    """Model keyword arguments of this cp rank for one global micro-batch ``batch``.

    The family's ``local_inputs`` shifts labels on the GLOBAL stream and splits every
    per-token tensor with one ``ContextPlan`` (module docstring); the results go to
    ``device`` (``to_device``) except the family's host-side planning inputs. A batch with
    videos (``pixel_values_videos`` and ``video_grid_thw``, as transformers names them) passes
    them on too (prepared data carries them when its samples hold videos).
    """
    sp = cfg.parallel.sequence_parallel and state.tp > 1
    videos = {k: batch[k] for k in VIDEO_KEYS if batch.get("video_grid_thw") is not None}
    _, local = family.local_inputs(
        state, batch["input_ids"], batch["cu_seqlens"], model_cfg,
        loss_mask=batch.get("loss_mask"), sequence_parallel=sp, layout=cfg.parallel.cp_layout,
        pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
        **videos)
    return place(local, family, device)


def place(local: dict[str, torch.Tensor | None], family: Family,
          device: torch.device) -> dict[str, torch.Tensor | None]:
    """A family's ``local_inputs`` on ``device`` (``to_device``), except the inputs it plans
    on the host (``family.host_inputs``), which stay as they are."""
    host = {k: local.pop(k) for k in family.host_inputs}
    return {**to_device(local, device, IGNORE_INDEX), **host}


# Inputs whose values (not only their ranges) the model reads on the host: the attention plan
# reads cu_seqlens; a VL model matches input_ids' placeholders against vision_rows and finds
# the placeholders' positions (mpcore.kernels.host_checked.host_copy).
HOST_KEPT = ("cu_seqlens", "input_ids", "vision_rows")


def to_device(inputs: dict[str, torch.Tensor | None], device: torch.device,
              ignore_index: int) -> dict[str, torch.Tensor | None]:
    """Model inputs (host tensors) on ``device``, pinned and copied asynchronously on CUDA.

    Integer tensors go through ``mpcore.kernels.host_checked``: their ranges are taken here, on the
    host (``labels`` without ``ignore_index``), and the host tensors of ``HOST_KEPT`` are kept
    too, so the embedding, the loss head, RoPE's position limit, the attention plan and a VL
    model's placeholder checks run without a device sync. Floating and bool tensors are moved
    as they are; a tensor already on a device (pixels a loader placed there) goes with
    ``.to``; None stays None."""
    pin = device.type == "cuda"
    out = {}
    for key, value in inputs.items():
        if value is None or value.device.type != "cpu":  # absent, or not a host tensor
            out[key] = None if value is None else value.to(device)
            continue
        value = value.pin_memory() if pin else value
        if value.is_floating_point() or value.dtype == torch.bool:
            out[key] = value.to(device, non_blocking=pin)
        else:
            out[key] = host_checked.to_device(
                value, device, ignore=ignore_index if key in ("labels", "mtp_labels") else None,
                non_blocking=pin, keep_host=key in HOST_KEPT)
    return out
