"""Hugging Face safetensors checkpoints <-> tensor-parallel shards of ``models.Transformer``.

One table, :func:`shard_map`, says for every local parameter of tp rank r which pieces of which
HF tensors it holds, concatenated along dim 0:

    tok_embeddings.weight             model.embed_tokens.weight rows of vocab shard r (zero-padded)
    output.weight                     lm_head.weight, same rows (untied only)
    norm.weight                       model.norm.weight
    layers.i.attention_norm.weight    model.layers.i.input_layernorm.weight
    layers.i.ffn_norm.weight          model.layers.i.post_attention_layernorm.weight
    layers.i.attention.wqkv.{weight,bias}  q_proj rows q_r ; k_proj rows kv_r ; v_proj rows kv_r
    layers.i.attention.wo.weight      o_proj.weight columns of shard r
    layers.i.attention.{q,k}_norm.weight   self_attn.{q,k}_norm.weight (Qwen3)
    layers.i.feed_forward.w13.weight  mlp.gate_proj rows r ; mlp.up_proj rows r
    layers.i.feed_forward.w2.weight   mlp.down_proj.weight columns of shard r

Loading reads each piece with safetensors ``get_slice`` from the file that holds it (single file
or a sharded ``model.safetensors.index.json``): a rank never reads more than its shards (norms
and replicated kv heads whole). Export runs the table backwards: the tp group of global rank 0
all-gathers each parameter, rank 0 writes ``config.json`` + ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from kernels.fp8_linear import check_fp8
from models.attention import qkv_rows
from models.config import ModelConfig
from models.hf_config import config_from_hf, hf_config_dict
from models.transformer import Transformer
from parallel.collectives import all_gather
from parallel.state import ParallelState, ProcessGroup


class Piece(NamedTuple):
    """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of HF tensor ``name`` of ``shape``.
    Rows past ``shape[0]`` are zero padding (the padded vocab)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int


def _whole(name: str, shape: tuple[int, ...]) -> list[Piece]:
    return [Piece(name, shape, 0, 0, shape[0])]


def _chunk(name: str, shape: tuple[int, ...], dim: int, tp: int, rank: int) -> Piece:
    size = -(-shape[dim] // tp)  # ceil: only the vocab is not divisible, and is padded
    return Piece(name, shape, dim, rank * size, (rank + 1) * size)


def shard_map(cfg: ModelConfig, tp: int, rank: int) -> dict[str, list[Piece]]:
    """Our parameter name -> the HF pieces of tp rank ``rank``'s shard (module docstring)."""
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    vocab = (cfg.vocab_size, hid)
    out = {"tok_embeddings.weight": [_chunk("model.embed_tokens.weight", vocab, 0, tp, rank)],
           "norm.weight": _whole("model.norm.weight", (hid,))}
    if not cfg.tie_embeddings:
        out["output.weight"] = [_chunk("lm_head.weight", vocab, 0, tp, rank)]
    q, kv = qkv_rows(cfg, tp, rank)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        att = hf + "self_attn."
        out[ours + "attention_norm.weight"] = _whole(hf + "input_layernorm.weight", (hid,))
        out[ours + "ffn_norm.weight"] = _whole(hf + "post_attention_layernorm.weight", (hid,))
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            tail = (hid,) if kind == "weight" else ()
            out[ours + f"attention.wqkv.{kind}"] = [
                Piece(att + f"q_proj.{kind}", (cfg.q_size, *tail), 0, q.start, q.stop),
                Piece(att + f"k_proj.{kind}", (cfg.kv_size, *tail), 0, kv.start, kv.stop),
                Piece(att + f"v_proj.{kind}", (cfg.kv_size, *tail), 0, kv.start, kv.stop)]
        out[ours + "attention.wo.weight"] = [
            _chunk(att + "o_proj.weight", (hid, cfg.q_size), 1, tp, rank)]
        if cfg.qk_norm:
            out[ours + "attention.q_norm.weight"] = _whole(att + "q_norm.weight", (d,))
            out[ours + "attention.k_norm.weight"] = _whole(att + "k_norm.weight", (d,))
        mlp = hf + "mlp."
        out[ours + "feed_forward.w13.weight"] = [
            _chunk(mlp + "gate_proj.weight", (inter, hid), 0, tp, rank),
            _chunk(mlp + "up_proj.weight", (inter, hid), 0, tp, rank)]
        out[ours + "feed_forward.w2.weight"] = [
            _chunk(mlp + "down_proj.weight", (hid, inter), 1, tp, rank)]
    return out


def _safe_open(path: Path):
    """``safe_open(path)``; a truncated or corrupt file raises ``ValueError`` naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}): it is truncated or "
                         f"corrupt; download or export it again") from None


class _Checkpoint:
    """Lazy ``safe_open`` handles of one checkpoint folder, by tensor name."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / "model.safetensors").is_file():
            with _safe_open(folder / "model.safetensors") as f:
                self.files = {name: folder / "model.safetensors" for name in f.keys()}
        else:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")
        self.folder, self._open = folder, {}

    def read(self, piece: Piece) -> torch.Tensor:
        """The piece's slice; rows past the tensor's end come back as zeros."""
        if piece.name not in self.files:
            raise ValueError(f"tensor {piece.name} is missing from the checkpoint {self.folder}")
        path = self.files[piece.name]
        if path not in self._open:
            self._open[path] = _safe_open(path)
        view = self._open[path].get_slice(piece.name)
        shape = tuple(view.get_shape())
        if shape != piece.shape:
            raise ValueError(f"tensor {piece.name} has shape {shape} in the checkpoint but the "
                             f"config implies {piece.shape}; check config.json against the "
                             f"weights")
        stop = min(piece.stop, shape[piece.dim])
        start = min(piece.start, stop)
        part = view[start:stop] if piece.dim == 0 else view[:, start:stop]
        if stop - start < piece.stop - piece.start:  # padded vocab rows
            pad = piece.stop - piece.start - (stop - start)
            part = torch.cat([part, part.new_zeros(pad, *shape[1:])])
        return part


@torch.no_grad()
def load_hf_weights(model: Transformer, folder: str | Path, state: ParallelState) -> None:
    """Fill every parameter of ``model`` with this tp rank's shard of the checkpoint's tensors.

    Raises ``ValueError`` naming a missing tensor, or a tensor whose shape disagrees with the
    model's config (both shapes in the message), before copying it.
    """
    fill_from_table(model, _Checkpoint(Path(folder)),
                    shard_map(model.cfg, state.tp, state.tp_rank))


@torch.no_grad()
def fill_from_table(model: nn.Module, ckpt: _Checkpoint, table: dict[str, list[Piece]]) -> None:
    """Copy into each parameter of ``model`` its pieces (``table``) read from ``ckpt``."""
    params = dict(model.named_parameters())
    if set(params) != set(table):
        raise AssertionError(f"shard map and model disagree: {sorted(set(params) ^ set(table))}")
    for name, pieces in table.items():
        param = params[name]
        local = torch.cat([ckpt.read(p) for p in pieces], dim=pieces[0].dim)
        assert local.shape == param.shape, (name, local.shape, param.shape)
        param.copy_(local.to(param.dtype))


def load_hf_model(folder: str | Path, state: ParallelState, *, sequence_parallel: bool = False,
                  cp_mode: str = "none", activation_checkpointing: bool = False,
                  attention_backend: str = "auto", fp8: str = "none",
                  device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Transformer, ModelConfig]:
    """Build the model of a Hugging Face checkpoint folder for ``state`` and load its shards.

    Same keyword arguments as ``build_model`` (no seed: nothing is drawn). Returns
    ``(model, cfg)``.
    """
    check_fp8(fp8, device)
    cfg = config_from_hf(folder)
    with torch.device("meta"):
        model = Transformer(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                            activation_checkpointing=activation_checkpointing,
                            attention_backend=attention_backend, fp8=fp8, dtype=dtype)
    model.to_empty(device=device)
    model.rope.reset_parameters()
    load_hf_weights(model, folder, state)
    return model, cfg


@torch.no_grad()
def export_hf(model: Transformer, cfg: ModelConfig, state: ParallelState,
              out_dir: str | Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` to ``out_dir`` (HF format).

    Collective over the world: call it on every rank. Only the tp group of global rank 0
    gathers (over ``state.tp_group``); rank 0 writes; a barrier then lets every rank read it.
    ``progress(done, total)`` is called after each parameter is gathered.
    """
    hf_dict = hf_config_dict(cfg)  # raises before any communication on bad configs
    write_hf(model, state, out_dir, hf_dict,
             [shard_map(cfg, state.tp, rank) for rank in range(state.tp)], progress)


@torch.no_grad()
def write_hf(model: nn.Module, state: ParallelState, out_dir: str | Path, hf_dict: dict,
             maps: list[dict[str, list[Piece]]], progress=None) -> None:
    """Gather every parameter of ``model`` into its full HF tensors (``maps[r]``: tp rank r's
    shard map) on the tp group of global rank 0; rank 0 writes ``config.json`` (``hf_dict``)
    and ``model.safetensors``; then a barrier. Collective over the world."""
    if state.cp_rank == 0 and state.dp_rank == 0:
        full = gather_full(dict(model.named_parameters()), maps, state.tp_group, progress)
        if state.rank == 0:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(hf_dict, indent=2) + "\n")
            save_file({k: v.contiguous() for k, v in full.items()}, out / "model.safetensors",
                      metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()


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
