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
from mpcore.data.hf_folder import TokenizerFolder, fingerprint_problem, has_tokenizer
from mpcore.data.sft_packing import SFTPackedDataset
from mpcore.io_errors import writing
from mpcore.kernels import host_checked
from mpcore.models import Family
from mpcore.parallel.labels import IGNORE_INDEX
from mpcore.parallel.state import ParallelState
from mpcore.vl_data import build_vl_loaders

VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid")


def dataset_sources(cfg: Config) -> tuple[Path, list[Path]]:
    """``(tokenizer path, dataset prefixes)`` of ``cfg.data``; the tokenizer defaults to
    ``model.init_from``'s folder; prepares the default corpus (serialised over ranks by a
    file lock) when no paths are given."""
    data = cfg.data
    if data.paths:
        return Path(data.tokenizer or cfg.model.init_from), [Path(p) for p in data.paths]
    if data.default_vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.default_vocab_size = {data.default_vocab_size} exceeds "
                         f"model.vocab_size = {cfg.model.vocab_size}; the default corpus's ids "
                         f"would not fit the model: lower data.default_vocab_size or raise "
                         f"model.vocab_size")
    with writing(data.cache_dir, "data.cache_dir"):
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
    tok = text_tokenizer(tokenizer_path)
    release = cfg.model.init_from if has_tokenizer(cfg.model.init_from) else None
    if release is not None and isinstance(tok, TokenizerFolder):
        check_same_tokenizer(tok.fingerprint, TokenizerFolder(release).fingerprint,
                             f"data.tokenizer {tok.folder}", release)
    packed, valid = [], []
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        check_dataset(ds, tok, tokenizer_path, release)
        ds.check_vocab(cfg.model.vocab_size)
        split = len(ds) - _held_out(ds, cfg.data.valid_fraction)
        packed.append(_packed(ds, tok, cfg, (0, split)))
        if split < len(ds):
            valid.append(_packed(ds, tok, cfg, (split, len(ds))))
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


def text_tokenizer(path: Path) -> Tokenizer | TokenizerFolder:
    """A SentencePiece ``.model`` or a tokenizer folder (its ``tokenizer.json``)."""
    return Tokenizer(path) if path.suffix == ".model" else TokenizerFolder(path)


def check_same_tokenizer(ours: dict, release_fp: dict, ours_name: str, release: str) -> None:
    """Refuse data of another tokenizer than ``model.init_from``'s (before the model exists)."""
    problem = fingerprint_problem(ours, release_fp, ours_name, f"model.init_from {release}")
    if problem:
        raise ValueError(f"{problem}: the checkpoint would read the data's ids as other tokens; "
                         f"prepare the data with the checkpoint's tokenizer: python "
                         f"launch/prepare_data.py --tokenizer {release} ...")


def check_dataset(ds: IndexedDataset, tok, tokenizer_path: Path, release: str | None) -> None:
    """The dataset was written by ``tok`` (vocabulary size; for a tokenizer folder, the
    fingerprint its ``.meta.json`` records) and, with a released checkpoint, by its tokenizer."""
    if ds.vocab_size != tok.vocab_size:
        raise ValueError(f"{ds.idx_path} was written for a vocabulary of {ds.vocab_size} but "
                         f"the tokenizer {tokenizer_path} has {tok.vocab_size}; set "
                         f"data.tokenizer to the one that wrote it, or re-tokenize with "
                         f"launch/prepare_data.py --tokenizer {tokenizer_path}")
    recorded = (ds.meta or {}).get("tokenizer")
    if recorded is None:  # SentencePiece data: no fingerprint, but the vocabulary must fit
        theirs = TokenizerFolder(release).vocab_size if release is not None else None
        if theirs is not None and theirs != ds.vocab_size:
            raise ValueError(f"{ds.idx_path} was written by a tokenizer of {ds.vocab_size} "
                             f"ids but model.init_from {release} has a tokenizer of {theirs}: "
                             f"the checkpoint would read the data's ids as other tokens; "
                             f"prepare the data with the checkpoint's tokenizer: python "
                             f"launch/prepare_data.py --tokenizer {release} ...")
        return
    if release is not None:
        check_same_tokenizer(recorded, TokenizerFolder(release).fingerprint,
                             f"{ds.idx_path} (prepared with {recorded.get('folder')})", release)
    if isinstance(tok, TokenizerFolder):
        problem = fingerprint_problem(recorded, tok.fingerprint, f"{ds.idx_path}'s tokenizer "
                                      f"({recorded.get('folder')})", f"data.tokenizer {tok.folder}")
        if problem:
            raise ValueError(f"{problem}; re-tokenize with launch/prepare_data.py --tokenizer "
                             f"{tok.folder}, or set data.tokenizer to the folder that wrote it")


def _packed(ds: IndexedDataset, tok, cfg: Config, docs: tuple[int, int]):
    """Chat data (with a loss mask) packs whole conversations; text packs a stream."""
    if ds.loss_mask is not None:
        pad = getattr(tok, "pad_fill_id", tok.eos_id)
        return SFTPackedDataset(ds, cfg.data.seq_len, pad, docs, cfg.data.sft_truncate)
    return PackedDataset(ds, cfg.data.seq_len, getattr(tok, "separator_id", tok.eos_id), docs)


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
    videos (``pixel_values_videos`` and ``video_grid_thw``, as transformers names them, and
    ``second_per_grid``, each video's seconds per temporal patch) passes them on too (prepared
    data carries them when its samples hold videos).
    """
    sp = cfg.parallel.sequence_parallel and state.tp > 1
    videos = {k: batch[k] for k in VIDEO_KEYS
              if k in batch and batch.get("video_grid_thw") is not None}
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
# the MTP stream's too: a VL model checks its placeholders like the main stream's, without a sync
HOST_KEPT = ("cu_seqlens", "input_ids", "vision_rows", "mtp_input_ids", "mtp_vision_rows")


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
