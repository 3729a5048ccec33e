"""Hugging Face safetensors I/O shared by every family: pieces, lazy slice reads, export.

A family describes its parameters with a table (``shard_map(cfg, tp, rank)``): for every local
parameter of tp rank r, which pieces (:class:`Piece`: rows or columns of one HF tensor) it holds,
concatenated along one dim. This module runs any such table:

- loading reads each piece with safetensors ``get_slice`` from the file that holds it (single
  file or a sharded ``model.safetensors.index.json``), so a rank never reads more than its shards
  (norms and replicated kv heads whole);
- export runs the table backwards: the tp group of global rank 0 all-gathers each parameter and
  rank 0 writes ``config.json`` + ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mpcore.parallel.collectives import all_gather
from mpcore.parallel.state import ParallelState, ProcessGroup


def read_hf_config(source: str | Path | dict) -> dict:
    """The raw dict of ``config.json`` (``source``: a checkpoint folder, the file, or a dict)."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}; pass a Hugging Face checkpoint folder")
    return _read_json(path, "config.json")


def _read_json(path: Path, what: str) -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file and the error otherwise."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); repair or download the {what} "
                         f"again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not the object a {what} "
                         f"is; repair or download it again")
    return value


def check_architecture(hf: dict, arch: str, model_type: str, name: str) -> None:
    """Raise ``ValueError`` naming the fix unless the config.json dict ``hf`` is ``arch``
    (``architectures == [arch]``, or no architectures and ``model_type``); ``name``: the
    family's name in the message."""
    archs = hf.get("architectures") or []
    if archs != [arch] and not (not archs and hf.get("model_type") == model_type):
        raise ValueError(f"architecture {archs or hf.get('model_type')!r} is not {name} "
                         f"({arch}); load it with its own family (mpcore.models.registry."
                         f"family_of_hf)")


class Piece(NamedTuple):
    """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of HF tensor ``name`` of ``shape``.
    Rows past ``shape[0]`` are zero padding (the padded vocab)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int


def whole(name: str, shape: tuple[int, ...]) -> list[Piece]:
    return [Piece(name, shape, 0, 0, shape[0])]


def chunk(name: str, shape: tuple[int, ...], dim: int, tp: int, rank: int) -> Piece:
    size = -(-shape[dim] // tp)  # ceil: only the vocab is not divisible, and is padded
    return Piece(name, shape, dim, rank * size, (rank + 1) * size)


def part_rows(name: str, shape: tuple[int, ...], tp: int, rank: int, part: int = 0,
          parts: int = 1) -> Piece:
    """Rows of tp rank ``rank`` inside logical part ``part`` of ``parts`` equal row parts."""
    size = shape[0] // parts
    local = size // tp
    start = part * size + rank * local
    return Piece(name, shape, 0, start, start + local)


def column_pieces(name: str, shape: tuple[int, int], tp: int, rank: int) -> list[Piece]:
    """Columns (dim 1) of tp rank ``rank``: its equal share."""
    local = shape[1] // tp
    return [Piece(name, shape, 1, rank * local, (rank + 1) * local)]


def column_linear(out: dict, ours: str, hf: list[str], width_in: int, width_out: int, tp: int,
            rank: int) -> None:
    """``out[ours.weight/bias]``: a column-parallel layer (with bias) fused from the ``hf``
    tensors of ``width_out`` rows each; tp rank ``rank``'s rows of each."""
    for kind in ("weight", "bias"):
        tail = (width_in,) if kind == "weight" else ()
        out[f"{ours}.{kind}"] = [part_rows(f"{name}.{kind}", (width_out, *tail), tp, rank)
                                 for name in hf]


def row_linear(out: dict, ours: str, hf: str, width_in: int, width_out: int, tp: int,
         rank: int) -> None:
    """``out[ours.weight/bias]``: a row-parallel layer (columns of tp rank ``rank``; the bias
    whole, added once after the reduction)."""
    out[f"{ours}.weight"] = column_pieces(f"{hf}.weight", (width_out, width_in), tp, rank)
    out[f"{ours}.bias"] = whole(f"{hf}.bias", (width_out,))


def _safe_open(path: Path):
    """``safe_open(path)``; a truncated or corrupt file raises ``ValueError`` naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}): it is truncated or "
                         f"corrupt; download or export it again") from None


class Checkpoint:
    """Lazy ``safe_open`` handles of one checkpoint folder, by tensor name."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map object; repair or download it "
                                 f"again")
            self.files = {name: folder / file for name, file in weight_map.items()}
            absent = sorted({p.name for p in self.files.values() if not p.is_file()})
            if absent:
                raise ValueError(f"{index} names shards that are not in {folder}: "
                                 f"{', '.join(absent)}; download them (or the whole checkpoint) "
                                 f"again")
        elif (folder / "model.safetensors").is_file():
            with _safe_open(folder / "model.safetensors") as f:
                self.files = {name: folder / "model.safetensors" for name in f.keys()}
        else:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")
        self.folder, self._open = folder, {}

    def _view(self, name: str):
        if name not in self.files:
            raise ValueError(f"tensor {name} is missing from the checkpoint {self.folder}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = _safe_open(path)
        return self._open[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (read from the file's header only)."""
        return tuple(self._view(name).get_shape())

    def read(self, piece: Piece) -> torch.Tensor:
        """The piece's slice; rows past the tensor's end come back as zeros."""
        view = self._view(piece.name)
        shape = tuple(view.get_shape())
        if shape != piece.shape:
            raise ValueError(f"tensor {piece.name} has shape {shape} in the checkpoint but the "
                             f"config implies {piece.shape}; check config.json against the "
                             f"weights")
        stop = min(piece.stop, shape[piece.dim])
        start = min(piece.start, stop)
        part = view[start:stop] if piece.dim == 0 else view[:, start:stop]
        if part.is_floating_point() and not bool(torch.isfinite(part).all()):
            bad = "NaN" if bool(torch.isnan(part).any()) else "inf"
            raise ValueError(f"tensor {piece.name} in {self.files[piece.name]} holds {bad} "
                             f"values: the checkpoint is damaged (or was saved from a diverged "
                             f"run); use an earlier or the original checkpoint")
        if stop - start < piece.stop - piece.start:  # padded vocab rows
            pad = piece.stop - piece.start - (stop - start)
            part = torch.cat([part, part.new_zeros(pad, *shape[1:])])
        return part


@torch.no_grad()
def fill_from_table(model: nn.Module, ckpt: Checkpoint, table: dict[str, list[Piece]]) -> None:
    """Copy into each parameter of ``model`` its pieces (``table``) read from ``ckpt``."""
    params = dict(model.named_parameters())
    if set(params) != set(table):
        raise AssertionError(f"shard map and model disagree: {sorted(set(params) ^ set(table))}")
    for name, pieces in table.items():
        param = params[name]
        local = torch.cat([ckpt.read(p) for p in pieces], dim=pieces[0].dim)
        assert local.shape == param.shape, (name, local.shape, param.shape)
        param.copy_(local.to(param.dtype))


@torch.no_grad()
def write_hf(model: nn.Module, state: ParallelState, out_dir: str | Path, hf_dict: dict,
             maps: list[dict[str, list[Piece]]], progress=None, *,
             local: dict[str, torch.Tensor] | None = None,
             extra: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
    """Gather every parameter of ``model`` (or only ``local``, by our name) into its full HF
    tensors (``maps[r]``: tp rank r's shard map) on the tp group of global rank 0, add
    ``extra()``'s full tensors (called on every rank, collective over the groups it uses: the
    MoE experts over ep, ``moe_hf.export_moe``); rank 0 writes ``config.json`` (``hf_dict``)
    and ``model.safetensors``; then a barrier. Collective over the world. The one writer of
    every family's export."""
    full: dict[str, torch.Tensor] = {}
    if state.cp_rank == 0 and state.dp_rank == 0:
        tensors = dict(model.named_parameters()) if local is None else local
        full = gather_full(tensors, maps, state.tp_group, progress)
    if extra is not None:
        full.update(extra())
    if state.rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_dict, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in full.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def export_by_table(model: nn.Module, state: ParallelState, out_dir: str | Path,
                    hf_config_dict: Callable[[Any], dict],
                    shard_map: Callable[[Any, int, int], dict[str, list[Piece]]],
                    progress=None, cfg=None) -> None:
    """A family's whole export when every parameter is in its shard map: ``hf_config_dict(cfg)``
    first (its checks raise before any communication), then :func:`write_hf` with every tp
    rank's ``shard_map(cfg, tp, r)``. ``cfg``: the model's (None: ``model.cfg``). Collective
    over the world; a barrier at the end."""
    cfg = model.cfg if cfg is None else cfg
    hf_dict = hf_config_dict(cfg)  # raises before any communication on bad configs
    write_hf(model, state, out_dir, hf_dict,
             [shard_map(cfg, state.tp, rank) for rank in range(state.tp)], progress)


@torch.no_grad()
def gather_full(local: dict[str, torch.Tensor], maps: list[dict[str, list[Piece]]],
                group: ProcessGroup | None, progress=None) -> dict[str, torch.Tensor]:
    """Full HF tensors (CPU, by HF name) from this tp rank's local tensors by our name (the
    parameters, or their gradients); ``maps[r]``: tp rank r's shard map. Collective over the
    tp ``group`` (tensors every rank holds whole are not gathered); ``progress(done, total)``
    after each tensor."""
    full: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(local.items()):
        tensor = tensor.detach()
        if all(m[name] == maps[0][name] for m in maps):  # replicated: every rank holds it all
            _scatter_back(tensor.cpu(), maps[0][name], full)
        else:
            shards = all_gather(tensor, 0, group).cpu().chunk(len(maps))
            for rank, shard in enumerate(shards):
                _scatter_back(shard, maps[rank][name], full)
        if progress is not None:
            progress(i + 1, len(local))
    return full


def _scatter_back(shard: torch.Tensor, pieces: list[Piece], full: dict) -> None:
    """Write the pieces of one rank's ``shard`` into the full HF tensors (padding dropped)."""
    dim = pieces[0].dim
    sizes = [p.stop - p.start for p in pieces]
    for piece, part in zip(pieces, shard.split(sizes, dim=dim), strict=True):
        target = full.setdefault(piece.name, part.new_empty(piece.shape))
        keep = min(piece.stop, piece.shape[dim]) - piece.start
        if keep > 0:
            target.narrow(dim, piece.start, keep).copy_(part.narrow(dim, 0, keep))
