"""Decoder-only transformer (Llama 3 / Qwen2 / Qwen3 by config) on TP/SP/CP layers.

Layout, per rank: the L tokens of this cp rank's share of one packed stream (``ContextPlan``),
replicated over the tp group. The residual stream is ``[L, hidden]``, or ``[L / tp, hidden]``
under sequence parallelism (the embedding reduce-scatters tokens; every column-parallel layer
all-gathers them, every row-parallel layer reduce-scatters). Before the head the final hidden
is all-gathered back to ``[L, hidden]``, so the per-token outputs are ``[L]``, replicated over tp.

    h = tok_embeddings(ids)
    for layer: h = h + attention(attention_norm(h)); h = h + feed_forward(ffn_norm(h))
    out = head(norm(h))       # loss [L] | (logprobs [L], entropy [L]) | logits [L, V_pad / tp]

As computed: each residual add runs inside the norm that follows it (``RMSNorm.add``, one fused
kernel each way on CUDA), so a layer hands the next its output unadded, ``(h, delta)``; under
autocast the norms write bf16, which the projections and the head would cast them to anyway.
The values are those of the lines above to fp32 rounding (``mpcore.kernels.rmsnorm``); what goes is
the separate add, cast and gradient-accumulation passes over the fp32 residual stream.
``residual_dtype = "autocast"`` (``model.residual_dtype``) keeps that stream in the autocast
dtype instead (cast once after the embedding; RoPE's tables stay in the embedding's dtype).

Kernels: ``attention_backend`` (``mpcore.parallel.attention.backends``: auto, flash, sdpa_cudnn,
te_fused, reference) runs every layer's attention; ``fp8`` (``none`` or ``tensorwise``) runs the four
projections of every decoder layer (wqkv, wo, w13, w2) with FP8 GEMMs (``mpcore.kernels.fp8_linear``);
the embedding, the norms and the loss head stay in the autocast dtype.

Weights: built on the meta device, materialised on ``device``, then each module's
``reset_parameters(param_seed(seed, module_name))`` draws the LOGICAL full tensor and keeps this
rank's shard, so ``build_model`` gives the same function at any tp degree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpcore.kernels import host_checked
from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.attention import Attention
from mpcore.models.common.config import ModelConfig
from mpcore.models.common.mlp import FeedForward
from mpcore.models.common.norm import RMSNorm, matmul_dtype
from mpcore.models.common.rope import RotaryEmbedding
from mpcore.parallel.attention import AttentionPlan
from mpcore.parallel.attention.backends import check_name
from mpcore.parallel.collectives import copy_to_tp, sp_all_gather
from mpcore.parallel.head import OUTPUTS, OutputWeight, head_forward
from mpcore.parallel.labels import check_cu_seqlens
from mpcore.parallel.layers import VocabParallelEmbedding
from mpcore.parallel.random import param_seed
from mpcore.parallel.state import ParallelState


class Packing(NamedTuple):
    """Attention metadata of the L local tokens (``mpcore.parallel.context.RankLayout``)."""

    doc_id: torch.Tensor  # (L,) int64, document of each token (padding: its own segment)
    positions_in_doc: torch.Tensor  # (L,) int64, position inside the segment (causal mask)
    cu_seqlens: torch.Tensor | None  # (S+1,) int32, local segments, or None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, *, sequence_parallel: bool,
                 fp8: str = "none", dtype=None, index: int = 0):
        super().__init__()
        del index  # every layer of this decoder is the same block
        norm = dict(group=state.tp_group, sum_grad_over_tp=sequence_parallel and state.tp > 1,
                    dtype=dtype)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.attention = Attention(cfg, tp_group=state.tp_group,
                                   sequence_parallel=sequence_parallel, fp8=fp8, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.feed_forward = FeedForward(cfg, tp_group=state.tp_group,
                                        sequence_parallel=sequence_parallel, fp8=fp8,
                                        dtype=dtype)

    def forward(self, h, delta, cos, sin, plan: AttentionPlan):
        """``(h, delta) -> (h', delta')``: the residual stream and the previous layer's output
        not yet added to it (None before the first layer). Each residual add runs fused into
        the norm after it (``RMSNorm.add``); the norms write the autocast dtype that the
        projections compute in, so no separate casts (the module docstring has the math)."""
        dtype = matmul_dtype(h)
        if delta is None:
            x = self.attention_norm(h, dtype)
        else:
            h, x = self.attention_norm.add(h, delta, dtype)
        h, x = self.ffn_norm.add(h, self.attention(x, cos, sin, plan), dtype)
        return h, self.feed_forward(x)


class Transformer(nn.Module):
    """The decoder (module docstring). Build it with :func:`build_model`. ``layer``: the block
    class of a family whose layers differ (``DecoderLayer``'s constructor, plus ``index``, the
    layer's number, so a family may choose a mixer per layer, and its ``forward(h, delta, cos,
    sin, plan) -> (h, delta)``); None is ``DecoderLayer``."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, *,
                 sequence_parallel: bool = False, cp_mode: str = "none",
                 activation_checkpointing: bool = False, attention_backend: str = "auto",
                 fp8: str = "none", dtype=None, layer: Callable[..., nn.Module] | None = None,
                 keep_layers: range | None = None):
        super().__init__()
        cfg.check_parallel(state.tp, state.cp, cp_mode)
        self.attention_backend, self.fp8 = check_name(attention_backend), fp8
        if state.cp > 1 and cp_mode == "none":
            raise ValueError(f"cp = {state.cp} needs cp_mode 'ring' or 'ulysses', got 'none'")
        self.cfg, self.tp, self.tp_group = cfg, state.tp, state.tp_group
        self.cp_group, self.cp_mode = state.cp_group, cp_mode
        self.sequence_parallel = sequence_parallel and state.tp > 1
        self.activation_checkpointing = activation_checkpointing
        # "float32": the residual stream in the embedding's dtype, as transformers keeps it
        # under autocast; "autocast": cast to the autocast dtype after the embedding (as
        # Megatron-core and torchtitan keep it), half its memory and traffic (``decode``).
        self.residual_dtype = "float32"
        keep = check_keep_layers(keep_layers, cfg)
        self.is_first, self.is_last = keep.start == 0, keep.stop == cfg.num_layers
        # A tied head needs the embedding's weight: the last pipeline stage holds a copy (the
        # pipeline sums the two copies' gradients: mpcore.parallel.pp).
        self.tok_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, group=state.tp_group,
            sequence_parallel=self.sequence_parallel, dtype=dtype) if self.is_first or (
            cfg.tie_embeddings and self.is_last) else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                     cfg.mrope_section, cfg.mrope_interleaved,
                                     rotary_dim=cfg.rotary_dim)
        layer = layer or DecoderLayer  # a family's block: same constructor and forward
        made = {i: layer(cfg, state, sequence_parallel=self.sequence_parallel, fp8=fp8,
                         dtype=dtype, index=i) for i in keep}
        # A pipeline stage keys its layers by GLOBAL index, so parameter names (and
        # checkpoints) are those of the whole model; the whole model keeps its list.
        self.layers = nn.ModuleList(made.values()) if keep_layers is None else LayerDict(
            {str(i): m for i, m in made.items()})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, group=state.tp_group,
                            sum_grad_over_tp=self.sequence_parallel, dtype=dtype
                            ) if self.is_last else None
        self.output = None if cfg.tie_embeddings or not self.is_last else OutputWeight(
            cfg.vocab_size, cfg.hidden_size, group=state.tp_group, dtype=dtype)

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one (then the model itself): the decoder layers."""
        return [layer for _, layer in self.layer_items()]

    def head_weight(self) -> torch.Tensor:
        """``[V_pad / tp, hidden]``: the embedding's weight when tied, else ``output.weight``."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def check_inputs(self, input_ids, position_ids, packing: Packing, labels, output: str):
        """Raise ``ValueError`` before any compute when the per-token inputs disagree."""
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be a packed stream [L], got shape "
                             f"{tuple(input_ids.shape)}; pack padded batches with pack_padded")
        num = input_ids.shape[0]
        named = dict(doc_id=packing.doc_id, positions_in_doc=packing.positions_in_doc,
                     labels=labels)
        positions_shape = (num,) if self.cfg.mrope_section is None else (3, num)
        if tuple(position_ids.shape) != positions_shape:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but this model "
                             f"needs {positions_shape} for {num} tokens ([3, L] with M-RoPE); "
                             f"split every per-token tensor with the same plan")
        for name, t in named.items():
            if t is not None and tuple(t.shape) != (num,):
                raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {num} "
                                 f"tokens; split every per-token tensor with the same plan")
        if self.sequence_parallel and num % self.tp:
            raise ValueError(f"sequence parallelism needs the local length ({num}) divisible by "
                             f"tp = {self.tp}; build the ContextPlan with pad_multiple=tp")
        if num:
            # RoPE would extrapolate silently past the limit. One CPU-GPU sync per forward,
            # unless the positions were measured on the host (mpcore.kernels.host_checked).
            most = host_checked.value_range(position_ids)[1]
            if most >= self.cfg.max_position_embeddings:
                raise ValueError(f"position id {most} is beyond max_position_embeddings = "
                                 f"{self.cfg.max_position_embeddings} (positions must be below "
                                 f"it); use shorter documents or sequences, or a model config "
                                 f"with a larger max_position_embeddings")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                doc_id: torch.Tensor | None = None,
                positions_in_doc: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output: str = "loss", temperature: float = 1.0):
        """Per-token outputs of the L local tokens (this cp rank's share of a packed stream).

        Args (all ``[L]`` on the model's device unless noted):
            input_ids: int token ids in ``[0, vocab_size)``, checked before any compute.
            position_ids: int RoPE positions (restarting per document); ``[3, L]`` (temporal,
                height, width) when the config has ``mrope_section``.
            doc_id, positions_in_doc: attention metadata from ``RankLayout``; query i sees key j
                iff same doc_id and ``positions_in_doc[j] <= positions_in_doc[i]`` (on any cp
                rank). ``None``: derived from ``cu_seqlens`` (a contiguous local stream, cp=1).
            cu_seqlens: ``[S+1]`` int32 local segments (``RankLayout.cu_seqlens``).
            labels: int64 shifted next-token ids (``LabelShifter`` before the split) or -100.
            output: ``"loss"`` -> fp32 ``[L]`` (0 where ignored; the caller reduces it with
                ``mpcore.parallel.loss``); ``"loss_sum"`` -> fp32 scalar sum of it (the training
                path: the fused head's faster gradient); ``"logprobs"`` -> ``(logprobs [L], entropy [L])`` fp32;
                ``"logits"`` -> ``[L, V_pad / tp]`` (tests).
            temperature: divides the logits.
        Outputs are replicated over the tp group (also under SP).
        """
        packing = make_packing(input_ids.shape[0], doc_id, positions_in_doc, cu_seqlens)
        self.check_inputs(input_ids, position_ids, packing, labels, output)
        h = self.tok_embeddings(input_ids)  # (L or L/tp, hidden); raises on ids out of vocab
        return self.decode(h, position_ids, packing, labels, output, temperature)

    def decode(self, h: torch.Tensor, position_ids: torch.Tensor, packing: Packing,
               labels: torch.Tensor | None, output: str, temperature: float,
               after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        """The layers, final norm and head on embedded tokens ``h [L(/tp), hidden]`` (inputs
        checked by the caller, e.g. ``forward``; a vision-language model scatters image
        embeddings into ``h`` first). ``after_layer(i, out)`` sees layer i's output ``out
        [L(/tp), hidden]`` (what the residual stream gains there) and returns it, e.g. with
        rows added at visual positions (DeepStack); it must be the same function on every tp
        rank of a cp rank and join the same collectives."""
        plan, cos, sin, h = self.layer_inputs(h, position_ids, packing)
        h, delta = self.run_layers(h, None, cos, sin, plan, after_layer)
        return self.finish(h, delta, labels, output, temperature)

    def layer_inputs(self, h: torch.Tensor, position_ids: torch.Tensor, packing: Packing):
        """``(plan, cos, sin, h)``: what every layer reads, planned once for all of them (no
        per-layer sync or cp metadata gather), and ``h`` in the residual stream's dtype."""
        plan = AttentionPlan(packing.doc_id, packing.positions_in_doc, packing.cu_seqlens,
                             mode=self.cp_mode, group=self.cp_group,
                             backend=self.attention_backend)
        cos, sin = self.rope(position_ids, h.dtype)  # (L, D) each
        compute = matmul_dtype(h)
        if self.residual_dtype == "autocast" and compute is not None:
            h = h.to(compute)  # the residual stream and its gradient in the autocast dtype
        return plan, cos, sin, h

    def layer_items(self) -> list[tuple[int, nn.Module]]:
        """``(global index, layer)`` of the layers this module holds, in order."""
        if isinstance(self.layers, LayerDict):
            return [(int(k), m) for k, m in self.layers.items()]
        return list(enumerate(self.layers))

    def run_layers(self, h: torch.Tensor, delta: torch.Tensor | None, cos, sin,
                   plan: AttentionPlan, after_layer=None):
        """``(h, delta)`` after this module's layers (``DecoderLayer.forward``'s pair);
        ``after_layer(i, out)`` with i the GLOBAL layer index (``decode``)."""
        for i, layer in self.layer_items():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h, delta = checkpoint(layer, h, delta, cos, sin, plan, use_reentrant=False)
            else:
                h, delta = layer(h, delta, cos, sin, plan)
            if after_layer is not None:
                delta = after_layer(i, delta)
        return h, delta

    def finish(self, h: torch.Tensor, delta: torch.Tensor | None,
               labels: torch.Tensor | None, output: str, temperature: float = 1.0):
        """The final norm and the head on the residual pair ``(h, delta)`` (``forward``'s
        outputs); only on the module holding the last layer."""
        # The last add stays a plain one: the final norm is called as a module (its forward
        # hooks see the hidden states the head reads), at the cost of one add per forward.
        h = self.norm(h if delta is None else h + delta, matmul_dtype(h))
        # The head's kernels return partial hidden grads: both mappings sum them over tp.
        h = sp_all_gather(h, self.tp_group) if self.sequence_parallel else copy_to_tp(
            h, self.tp_group)  # (L, hidden)
        return head_forward(h, self.head_weight(), labels, output=output,
                            vocab_size=self.cfg.vocab_size, group=self.tp_group,
                            temperature=temperature)


class LayerDict(nn.ModuleDict):
    """A pipeline stage's layers keyed by global index (``"5"``): iterated as modules, like the
    whole model's ``nn.ModuleList``, so code that walks ``model.layers`` runs on either."""

    def __iter__(self):
        return iter(self.values())


def check_keep_layers(keep_layers: range | None, cfg) -> range:
    """The layers a module builds: all (None), or a non-empty contiguous ``range`` of global
    indices inside ``[0, num_layers)``; ``ValueError`` naming the numbers otherwise."""
    if keep_layers is None:
        return range(cfg.num_layers)
    if not isinstance(keep_layers, range) or keep_layers.step != 1 or not len(keep_layers) or (
            keep_layers.start < 0 or keep_layers.stop > cfg.num_layers):
        raise ValueError(f"keep_layers must be a non-empty range(start, stop) inside "
                         f"[0, {cfg.num_layers}) ({cfg.num_layers} layers), got {keep_layers!r}")
    return keep_layers


def make_packing(num: int, doc_id, positions_in_doc, cu_seqlens) -> Packing:
    if doc_id is not None and positions_in_doc is not None:
        return Packing(doc_id, positions_in_doc, cu_seqlens)
    if doc_id is not None or positions_in_doc is not None or cu_seqlens is None:
        raise ValueError("pass doc_id and positions_in_doc together (RankLayout), or neither "
                         "with cu_seqlens of a contiguous local stream")
    cu = check_cu_seqlens(cu_seqlens, num)  # int64, on cu_seqlens' device
    lengths = cu[1:] - cu[:-1]
    # output_size: the total is known, so a CUDA cu_seqlens costs no CPU-GPU sync here.
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths,
                                  output_size=num)
    return Packing(doc, torch.arange(num, device=cu.device) - cu[doc], cu_seqlens)


def init_weights(model: nn.Module, seed: int) -> None:
    """Call every submodule's ``reset_parameters(param_seed(seed, its name))``."""
    for name, module in model.named_modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters(param_seed(seed, name))


def build_model(cfg: ModelConfig, state: ParallelState, *, sequence_parallel: bool = False,
                cp_mode: str = "none", activation_checkpointing: bool = False,
                attention_backend: str = "auto", fp8: str = "none",
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, keep_layers: range | None = None) -> Transformer:
    """Create the model on the meta device, materialise this rank's shards on ``device`` and
    initialise them (the same function at any tp degree for a given ``seed``).
    ``keep_layers``: a pipeline stage's layers (``Transformer``; each weight the whole model's).

    ``attention_backend`` and ``fp8``: the kernels (module docstring). Raises ``ValueError``
    when ``cfg`` does not fit ``state`` (heads, kv heads, intermediate size vs tp; Ulysses
    heads vs cp), when cp > 1 without a cp mode, on an unknown backend or recipe, or when
    ``fp8`` is asked for on a device without FP8 GEMMs (not CUDA, or compute capability < 8.9).
    """
    check_fp8(fp8, device)
    with torch.device("meta"):
        model = Transformer(cfg, state, sequence_parallel=sequence_parallel, cp_mode=cp_mode,
                            activation_checkpointing=activation_checkpointing,
                            attention_backend=attention_backend, fp8=fp8, dtype=dtype,
                            keep_layers=keep_layers)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
