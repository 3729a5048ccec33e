"""Qwen3.5's multi-token-prediction (MTP) block, trained beside the decoder on TP/SP/CP.

The released checkpoints' ``mtp.*`` tensors (what vLLM's and SGLang's ``qwen3_5_mtp.py`` run for
speculative decoding). At position t, with ``h_t`` the decoder's final hidden state (after its
final norm: what the head reads) and ``e_{t+1}`` the SHARED embedding of token t+1:

    x_t    = fc([pre_fc_norm_embedding(e_{t+1}) | pre_fc_norm_hidden(h_t)])    2H -> H
    y_t    = layers.0(x_t)                 one full-attention Qwen3.5 block, positions of t
    loss_t = CE(head(norm(y_t)), token t+2)   the shared vocab-parallel head (tied or not)

All four norms are zero-centred RMSNorms. The concatenation puts the embedding first, the hidden
state second (vLLM's ``Qwen3_5MultiTokenPredictor``); ``mtp.fc.weight [H, 2H]`` reads its first
H columns from the embedding. The MTP loss reaches the decoder through ``h_t`` (not detached).

Inputs: ``mtp_input_ids[t] = input_ids[t+1]`` and ``mtp_labels[t] = input_ids[t+2]`` within
t's document (ignored otherwise) are ``LabelShifter.mtp`` at depth 1 on the GLOBAL stream, made
BEFORE the cp split and split with the ids and labels by the same plan (:func:`local_inputs`).
The block attends with the decoder's plan (same documents, same positions), ring or Ulysses.

Layout (one tp rank, one cp rank): as the decoder, ``[L, H]`` or ``[L / tp, H]`` under sequence
parallelism. ``fc`` is column-parallel over tp with its output gathered (``[L, H]``, vLLM's
``gather_output``); under SP each rank then keeps its own tokens. The loss goes through the
fused head (``mpcore.parallel.head``), never building logits.

Model outputs with MTP inputs: :class:`MtpOutput` ``(main, mtp)``, each what ``output`` asks
of ``Transformer.forward``. The step's total is ``main / N + mtp_loss_weight * mtp / N_mtp``,
each a global mean over its own valid targets (``mpcore.train``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpcore.models.common.decoder import Transformer, make_packing
from mpcore.models.common.hf_io import Piece, chunk, whole
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.layers import Qwen35Block
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.common.norm import RMSNorm, matmul_dtype
from mpcore.parallel.attention import AttentionPlan
from mpcore.parallel.collectives import copy_to_tp, sp_all_gather, sp_scatter
from mpcore.parallel.context import ContextPlan
from mpcore.parallel.head import head_forward
from mpcore.parallel.labels import LabelShifter
from mpcore.parallel.layers import ColumnParallelLinear
from mpcore.parallel.state import ParallelState

MTP_KEYS = ("mtp_input_ids", "mtp_labels", "mtp_vision_rows")
"""The per-token MTP inputs (``mtp_vision_rows``: a vision-language model's)."""


class MtpOutput(NamedTuple):
    """The decoder's output and the MTP head's, each as ``output`` asks (module docstring)."""

    main: Any
    mtp: Any


def layer_config(cfg: Qwen35Config) -> Qwen35Config:
    """The config of the MTP block's decoder layer: one full-attention layer of ``cfg``."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=("full_attention",))


class MtpBlock(nn.Module):
    """``mtp.*`` (module docstring); group: tp. Parameters: ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``norm`` ``[H]``; ``fc.weight [H / tp, 2H]``; ``layers.0`` a
    ``Qwen35Block`` (full attention)."""

    def __init__(self, cfg: Qwen35Config, state: ParallelState, *, sequence_parallel: bool,
                 fp8: str = "none", dtype=None):
        super().__init__()
        hid = cfg.hidden_size
        self.tp_group, self.sequence_parallel = state.tp_group, sequence_parallel
        # Under SP every rank normalises other tokens: the norms' gradients sum over tp.
        norm = dict(group=state.tp_group, sum_grad_over_tp=sequence_parallel,
                    zero_centred=True, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(hid, cfg.rms_norm_eps, **norm)
        self.pre_fc_norm_hidden = RMSNorm(hid, cfg.rms_norm_eps, **norm)
        self.fc = ColumnParallelLinear(2 * hid, hid, group=state.tp_group, gather_output=True,
                                       sequence_parallel=sequence_parallel, dtype=dtype)
        self.layers = nn.ModuleList([Qwen35Block(layer_config(cfg), state,
                                                 sequence_parallel=sequence_parallel, fp8=fp8,
                                                 dtype=dtype, index=0)])
        self.norm = RMSNorm(hid, cfg.rms_norm_eps, **norm)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """``hidden [L(/tp), H]`` (the decoder's final-norm output), ``embedded [L(/tp), H]``
        (the shared embedding of ``mtp_input_ids``), ``cos, sin [L, rotary_dim]`` -> the
        normalised MTP hidden state ``[L(/tp), H]``."""
        dtype = matmul_dtype(hidden)
        x = torch.cat([self.pre_fc_norm_embedding(embedded, dtype),
                       self.pre_fc_norm_hidden(hidden, dtype)], dim=-1)  # (L(/tp), 2H)
        x = self.fc(x)  # (L, H), replicated over tp
        if self.sequence_parallel:
            x = sp_scatter(x, self.tp_group)  # (L/tp, H): this rank's tokens
        h, delta = self.layers[0](x, None, cos, sin, plan)
        return self.norm(h + delta, dtype)


def forward_with_mtp(model: Transformer, input_ids, position_ids, *, mtp_input_ids,
                     mtp_labels=None, doc_id=None, positions_in_doc=None, cu_seqlens=None,
                     labels=None, output: str = "loss", temperature: float = 1.0) -> MtpOutput:
    """``Transformer.forward`` of ``model`` (a decoder with ``model.mtp``) plus the MTP head.

    ``mtp_input_ids [L]`` int, ``mtp_labels [L]`` int64 or -100 (:func:`local_inputs`), split
    like ``input_ids``. ``output``: ``loss``, ``loss_sum`` or ``logprobs`` (not ``logits``).
    Returns ``MtpOutput(main, mtp)``, replicated over tp."""
    check_mtp_inputs(model, input_ids.shape[0], output, mtp_input_ids=mtp_input_ids,
                     mtp_labels=mtp_labels)
    packing = make_packing(input_ids.shape[0], doc_id, positions_in_doc, cu_seqlens)
    return decode_with_mtp(
        model, lambda: Transformer.forward(model, input_ids, position_ids, doc_id=doc_id,
                                           positions_in_doc=positions_in_doc,
                                           cu_seqlens=cu_seqlens, labels=labels, output=output,
                                           temperature=temperature),
        lambda: model.tok_embeddings(mtp_input_ids), position_ids, packing, mtp_labels,
        output, temperature)


def check_mtp_inputs(model: Transformer, num: int, output: str, **named) -> None:
    """``ValueError`` naming the fix when ``model`` has no MTP block, ``output`` is
    ``logits``, or a per-token MTP input of ``named`` is not ``[num]``."""
    if getattr(model, "mtp", None) is None:
        raise ValueError("mtp_input_ids given but this model has no MTP block; build it with "
                         "model.mtp_loss_weight > 0 (and a checkpoint or model section with "
                         "mtp_num_hidden_layers=1), or drop the mtp_* inputs")
    if output == "logits":
        raise ValueError("output='logits' is not offered with MTP inputs; use 'loss', "
                         "'loss_sum' or 'logprobs' (the fused head never builds logits)")
    for name, t in named.items():
        if t is not None and tuple(t.shape) != (num,):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {num} "
                             f"tokens; make it with LabelShifter.mtp before the split and "
                             f"split it with the same plan (hybrid.mtp.local_inputs)")


def decode_with_mtp(model: Transformer, main: Callable[[], Any],
                    embed: Callable[[], torch.Tensor], position_ids, packing, mtp_labels,
                    output: str, temperature: float) -> MtpOutput:
    """``MtpOutput(main(), mtp)``: ``main()`` runs the decoder ``model`` once (its final norm's
    output is caught on the way), then ``embed()`` gives the MTP block's next-token embeddings
    ``[L(/tp), H]`` (the shared embedding of ``mtp_input_ids``; a vision-language model's with
    the tower rows merged) and the block and the shared head run at the decoder's positions
    ``position_ids`` (``[L]``, or ``[3, L]`` M-RoPE) and attention plan of ``packing``."""
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        out = main()
    finally:
        hook.remove()
    hidden = seen[-1]  # (L(/tp), H): the final norm's output, before the head's gather
    plan = AttentionPlan(packing.doc_id, packing.positions_in_doc, packing.cu_seqlens,
                         mode=model.cp_mode, group=model.cp_group,
                         backend=model.attention_backend)
    embedded = embed()  # (L(/tp), H)
    cos, sin = model.rope(position_ids, embedded.dtype)
    if model.activation_checkpointing and torch.is_grad_enabled():
        y = checkpoint(model.mtp, hidden, embedded, cos, sin, plan, use_reentrant=False)
    else:
        y = model.mtp(hidden, embedded, cos, sin, plan)
    y = sp_all_gather(y, model.tp_group) if model.sequence_parallel else copy_to_tp(
        y, model.tp_group)  # (L, H)
    mtp = head_forward(y, model.head_weight(), mtp_labels, output=output,
                       vocab_size=model.cfg.vocab_size, group=model.tp_group,
                       temperature=temperature)
    return MtpOutput(out, mtp)


def local_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 cfg: Qwen35Config | None = None, *, loss_mask: torch.Tensor | None = None,
                 mtp: bool | None = None, **kwargs) -> tuple[ContextPlan, dict]:
    """``mpcore.models.common.inputs.local_text_inputs`` plus, when ``mtp`` (default:
    ``cfg.uses_mtp``), ``mtp_input_ids`` and ``mtp_labels [L]``: ``LabelShifter.mtp`` at
    depth 1 on the GLOBAL stream (same ``loss_mask``), split with the ids and labels by the
    same plan (padding: id 0, label -100)."""
    if mtp is None:
        mtp = cfg is not None and cfg.uses_mtp
    extra = None
    if mtp:
        (target,) = LabelShifter().mtp(input_ids, cu_seqlens, loss_mask, depth=1)
        extra = {"mtp_input_ids": target.input_ids, "mtp_labels": target.labels}
    return local_text_inputs(state, input_ids, cu_seqlens, cfg, loss_mask=loss_mask,
                             extra=extra, **kwargs)


def shard_map(cfg: Qwen35Config, tp: int, rank: int, layer_map) -> dict[str, list[Piece]]:
    """Our ``mtp.*`` parameter -> the release's ``mtp.*`` pieces of tp rank ``rank``:
    ``fc.weight`` rows of rank r (dim 0), the three norms whole, ``layers.0.*`` as the
    decoder's layer 0 (``layer_map``: the family's ``shard_map(cfg, tp, rank, prefix)``)."""
    hid = cfg.hidden_size
    out = {"mtp.fc.weight": [chunk("mtp.fc.weight", (hid, 2 * hid), 0, tp, rank)]}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        out[f"mtp.{name}.weight"] = whole(f"mtp.{name}.weight", (hid,))
    layer = layer_map(layer_config(cfg), tp, rank, "mtp.")
    for ours, pieces in layer.items():
        if ours.startswith("layers.0.") or ours == "norm.weight":  # norm.weight: mtp.norm
            out["mtp." + ours] = pieces
    return out
