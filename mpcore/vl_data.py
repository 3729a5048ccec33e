"""The image-text loaders of a vision-language run (a family whose modality is image-text).

Data (``data.vl_paths``: folders made by ``launch/prepare_vl_data.py``; empty: the shipped image
set, ``mpcore.data.prepare_vl_default``), each packed into budgets of ``data.seq_len`` tokens of
whole samples (an image never crosses a micro-batch), blended by ``data.weights`` with the text
datasets of ``data.paths`` (or, for the shipped default, the default text corpus); weights list
the VL datasets first, then the text ones. A micro-batch (``collate_vl``) is one packed stream
with ``loss_mask`` (targets), the images' ``pixel_values`` / ``image_grid_thw`` and, when its
samples hold videos, ``pixel_values_videos`` / ``video_grid_thw`` (the family's input builder
places them: ``mpcore.batches.local_inputs``).

Token ids: the datasets' VL tokenizer names them: a SentencePiece model with the placeholder and
vision start/end ids after its vocab, or a released checkpoint's tokenizer with its own vision
ids (``mpcore.data.vl_release``: VL conversations); the model takes them from it (or, from a
checkpoint, must agree: ``mpcore.build``; released data must also be ``model.init_from``'s
tokenizer by content: :func:`check_release`).

Images: every VL dataset must have been prepared for the run's model family (its meta.json's
``image_settings.family``: that family's image processor, resize rule and patch size; the
shipped set is prepared per family, ``mpcore.data.vl_default.default_settings``); data of
another family's processor is refused, naming the prepare command that fits the run. Every VL
dataset must share one pixel geometry (patch, temporal patch, merge; ``DataSummary.
pixel_geometry``), which :func:`check_tower` compares with the model's vision tower when the run
starts, before any batch, so a tower of another patch size is refused with the fix rather than
failing at the first forward on a row width.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mpcore.config import Config
from mpcore.data import (
    BlendedDataset,
    DataSummary,
    IndexedDataset,
    PackedDataset,
    TextAsVL,
    VLDataLoader,
    VLDataset,
    VLPackedDataset,
    VLTokenizer,
    prepare_vl_default,
)
from mpcore.data.hf_folder import TokenizerFolder, fingerprint_problem, has_tokenizer
from mpcore.data.sft_packing import SFTPackedDataset
from mpcore.data.vl_default import default_settings
from mpcore.data.vl_release import ReleaseVLTokenizer
from mpcore.models.common.family import Family
from mpcore.parallel.state import ParallelState

log = logging.getLogger(__name__)


def vl_sources(cfg: Config, family: Family) -> tuple[list[Path], list[Path], VLTokenizer]:
    """``(VL dataset folders, text dataset prefixes, tokenizer)`` of ``cfg.data``; prepares the
    shipped default (with the default text corpus) for ``family``'s image processor when
    ``data.vl_paths`` is empty."""
    d = cfg.data
    if d.vl_paths:
        folders = [Path(p) for p in d.vl_paths]
        tok = VLDataset(folders[0]).tokenizer
        return folders, [Path(p) for p in d.paths], tok
    default = prepare_vl_default(d.cache_dir, d.default_vocab_size, default_settings(family))
    text = [Path(p) for p in d.paths] if d.paths else [default.text_prefix]
    return [default.dataset], text, VLDataset(default.dataset).tokenizer


def _check_tokenizer(tok: VLTokenizer, other: VLTokenizer, where: Path) -> None:
    if (tok.token_ids() != other.token_ids() or tok.vocab_size != other.vocab_size
            or getattr(tok, "fingerprint", None) != getattr(other, "fingerprint", None)):
        raise ValueError(f"{where} was prepared with another VL tokenizer ({other.token_ids()}, "
                         f"vocab {other.vocab_size}) than the first dataset ({tok.token_ids()}, "
                         f"vocab {tok.vocab_size}); prepare every dataset with one tokenizer")


def check_release(tok, init_from: str | None, where: Path) -> None:
    """Data prepared with a released tokenizer (``ReleaseVLTokenizer``) and a run from a
    release with a tokenizer.json: the same tokenizer by content, or ``ValueError`` naming
    both and the prepare command, before the model is built (the vision ids are compared
    with the release's config by ``mpcore.build``)."""
    if not isinstance(tok, ReleaseVLTokenizer) or not has_tokenizer(init_from):
        return
    problem = fingerprint_problem(tok.fingerprint, TokenizerFolder(init_from).fingerprint,
                                  f"{where} (prepared with {tok.to_json()['folder']})",
                                  f"model.init_from {init_from}")
    if problem:
        raise ValueError(f"{problem}; prepare the data with the checkpoint's tokenizer: python "
                         f"launch/prepare_vl_data.py --tokenizer {init_from} --manifest M.jsonl "
                         f"--out NEW_DIR")


def check_text(ds: IndexedDataset, tok) -> None:
    """A text dataset blended into a VL run was written by the VL data's tokenizer: the same
    vocabulary size, and for release-prepared VL data the same tokenizer by content (its
    ``.meta.json``); ``ValueError`` naming the file and the fix."""
    if ds.vocab_size != tok.text_vocab_size:
        raise ValueError(f"{ds.idx_path} was written for a vocabulary of {ds.vocab_size} but the "
                         f"VL tokenizer's text vocabulary has {tok.text_vocab_size}; tokenize "
                         f"text with the tokenizer the VL data was prepared with")
    if not isinstance(tok, ReleaseVLTokenizer):
        return
    recorded = (ds.meta or {}).get("tokenizer")
    problem = fingerprint_problem(recorded or {}, tok.fingerprint, f"{ds.idx_path}'s tokenizer",
                                  f"the VL data's ({tok.folder})")
    if recorded is None or problem:
        raise ValueError(f"{problem or f'{ds.idx_path} records no tokenizer'}; prepare the text "
                         f"with launch/prepare_data.py --tokenizer {tok.to_json()['folder']}")


def check_family(ds: VLDataset, family: Family) -> None:
    """``ValueError`` unless ``ds`` was prepared for ``family``'s image processor, naming the
    prepare command that would fit the run."""
    prepared = ds.settings.family
    if prepared == family.name:
        return
    manifest = ds.meta.get("manifest", "M.jsonl")
    raise ValueError(
        f"{ds.folder} was prepared for the {prepared} family's image processor, but this run "
        f"trains the {family.name} family, whose processor ({family.hf_image_processor}) gives "
        f"other rows and grids; prepare the data for it: python launch/prepare_vl_data.py "
        f"--family {family.name} --manifest {manifest} --tokenizer {ds.folder}/tokenizer.json "
        f"--out NEW_DIR, and list NEW_DIR in data.vl_paths")


def _shape(geometry: dict) -> dict:
    return {k: geometry[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                                     "patch_dim")}


def _describe(g: dict) -> str:
    return (f"patch {g['patch_size']} x temporal patch {g['temporal_patch_size']}, merge "
            f"{g['merge_size']} (rows of {g['patch_dim']} values)")


def check_tower(summary: DataSummary | None, family: Family, model_cfg) -> None:
    """``ValueError`` unless the model's vision tower (``model_cfg.vision``: ``patch_size``,
    ``temporal_patch_size``, ``spatial_merge_size``, ``patch_dim``) takes the pixel rows the
    VL data was prepared with (``summary.pixel_geometry``), naming both and the two fixes:
    prepare the data again for the tower, or give the tower the data's patch. Nothing to check
    for text data (or a caller's own loader: ``summary`` None). Host only, before any batch."""
    data = summary.pixel_geometry if summary is not None else None
    vision = getattr(model_cfg, "vision", None)
    if data is None or vision is None:
        return
    tower = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
             "merge_size": vision.spatial_merge_size, "patch_dim": vision.patch_dim}
    if tower == _shape(data):
        return
    source = data["source"]
    raise ValueError(
        f"the vision tower takes {_describe(tower)} but {source} was prepared with "
        f"{_describe(data)}; the rows would not fit the tower. Prepare the data for this "
        f"tower: python launch/prepare_vl_data.py --family {family.name} --patch-size "
        f"{tower['patch_size']} --temporal-patch-size {tower['temporal_patch_size']} "
        f"--merge-size {tower['merge_size']} --manifest M.jsonl --tokenizer "
        f"{source}/tokenizer.json --out NEW_DIR and list NEW_DIR in data.vl_paths; or, for a "
        f"model trained from scratch, set model.vision.patch_size={data['patch_size']} "
        f"(model.vision.temporal_patch_size={data['temporal_patch_size']}, "
        f"model.vision.spatial_merge_size={data['merge_size']}) to fit the data")


def build_vl_loaders(cfg: Config, state: ParallelState, family: Family):
    """``(train loader, validation loader or None, summary, tokenizer)`` of a VL run of
    ``family`` (this dp rank's; validation holds out the last ``data.valid_fraction`` of each
    VL dataset's samples). Raises ``ValueError`` naming the folder and the fix for mismatched
    data (another tokenizer, another family's image processor, other image settings), or a
    model vocabulary (from scratch) too small for the tokenizer's ids."""
    d = cfg.data
    folders, text, tok = vl_sources(cfg, family)
    check_release(tok, cfg.model.init_from, folders[0])
    if not cfg.model.init_from and cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the VL "
                         f"tokenizer's {tok.vocab_size} ids (text vocab + 4 vision ids); raise "
                         f"it")
    train, valid, geometry = [], [], None
    for folder in folders:
        ds = VLDataset(folder)
        _check_tokenizer(tok, ds.tokenizer, folder)
        check_family(ds, family)
        if geometry is not None and ds.geometry != _shape(geometry):
            raise ValueError(f"{folder} has pixel rows of {_describe(ds.geometry)}, the first VL "
                             f"dataset {_describe(geometry)}; prepare them with the same image "
                             f"settings")
        geometry = geometry or {**ds.geometry, "source": str(folder)}
        patch_dim = ds.patch_dim
        held = int(len(ds) * d.valid_fraction)
        train.append(VLPackedDataset(ds, d.seq_len, d.seed, tok.eos_id, d.vl_drop_long,
                                     samples=(0, len(ds) - held)))
        if held:
            valid.append(VLPackedDataset(ds, d.seq_len, d.seed, tok.eos_id, d.vl_drop_long,
                                         samples=(len(ds) - held, len(ds))))
    for prefix in text:
        ds = IndexedDataset(prefix)
        check_text(ds, tok)
        if ds.loss_mask is not None:  # chat data: whole conversations, their masks kept
            packed = SFTPackedDataset(ds, d.seq_len, getattr(tok, "pad_fill_id", tok.eos_id),
                                      truncate=d.sft_truncate)
        else:
            packed = PackedDataset(ds, d.seq_len, tok.eos_id)
        train.append(TextAsVL(packed, patch_dim))
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
                          0 if valid_loader is None else valid_loader.num_samples,
                          pixel_geometry=geometry)
    if dropped and state.rank == 0:
        log.warning("data: %d VL samples longer than data.seq_len=%d were dropped "
                    "(data.vl_drop_long)", dropped, d.seq_len)
    return loader, valid_loader, summary, tok
