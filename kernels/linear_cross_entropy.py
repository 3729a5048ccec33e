"""Fused linear + cross-entropy and linear + log-prob/entropy heads, vocab-parallel.

Layout: ``hidden [N, H]`` (N local tokens, any order), ``weight [V_local, H]``: rank r of
``group`` holds vocab rows ``[r * V_local, (r + 1) * V_local)``; ``labels [N]`` are GLOBAL vocab
ids, already shifted (by the LabelShifter, before any sequence split), or ``ignore_index``.
Rows at or past ``vocab_size`` are padding: they never enter the softmax and are never a target.
The ``[N, V]`` logits are never held: tokens are walked in chunks whose logits fit in
``_lce_chunks.CHUNK_BYTES`` (512 MiB), see ``kernels/_lce_chunks.py`` for the math.

Cost: the logits GEMM is 2*N*H*V FLOPs and each gradient GEMM as much again.
- ``linear_cross_entropy`` with reduction "mean"/"sum" computes its gradients DURING the forward
  (the upstream gradient is one scalar), so forward + backward is three GEMMs, 6*N*H*V, plus a
  memory-bound row pass; backward only scales the stored gradients by that scalar. The workspace
  is one logits chunk; the stored gradients are the ones autograd would hold anyway.
- reduction "none" and ``linear_logprobs`` keep per-token stats only and recompute the logits in
  backward: four GEMMs, 8*N*H*V.

CUDA tensors run the Triton row kernels (``kernels/_lce_triton.py``); other devices the PyTorch
reference rows (``_lce_chunks.TorchRows``), same chunking. The ops are registered with
``torch.library.custom_op`` (namespace ``mpcore``) so ``torch.compile`` traces them as single
nodes without a graph break.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpcore.kernels import _lce_chunks as chunks
from mpcore.kernels import host_checked
from mpcore.kernels.master_linear import master_linear_applies

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")


def _rows(impl: str):
    if impl == "triton":
        from mpcore.kernels import _lce_triton

        return _lce_triton
    return chunks.TorchRows


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _group(name: str):
    if not name:
        return None
    # Ops take the group by name (custom ops cannot take a ProcessGroup); this is how
    # torch's functional collectives resolve it too.
    return dist.distributed_c10d._resolve_process_group(name)


def _check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    known = host_checked.known_range(labels, ignore_index)
    if known is not None:  # measured on the host before the labels moved here: no sync
        lo, hi = known
        if lo > hi or (lo >= 0 and hi < vocab_size):
            return
    # CPU-GPU sync point: one small reduction over the labels, once per call.
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise ValueError(
            f"labels must lie in [0, vocab_size={vocab_size}) or equal ignore_index="
            f"{ignore_index}; found {int(bad.sum())} out of range (first: {first}). Pass the "
            "tokenizer's true vocab size as vocab_size and mask other ids with ignore_index.")


def _setup(hidden, weight, labels, ignore_index, temperature, vocab_size, group_name, impl,
           fp32_logits):
    _check_label_range(labels, vocab_size, ignore_index)
    head = chunks.Head.build(weight, _group(group_name), vocab_size, temperature, _rows(impl),
                             fp32_logits)
    valid = labels != ignore_index
    return head, valid, head.local_targets(labels, valid)


# --- op 1: sum of token losses with gradients computed in the forward -----------------------

@torch.library.custom_op("mpcore::linear_ce_sum", mutates_args=())
def _ce_sum_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               ignore_index: int, temperature: float, vocab_size: int, group_name: str,
               impl: str, need_dh: bool, need_dw: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # An fp32 master weight under autocast (``_master``) is cast here. Its gradient is
    # accumulated over the chunks in the compute dtype (an in-place addmm per chunk) and saved
    # so; the backward scales it and writes the fp32 gradient in one pass. (Accumulating in
    # fp32 instead, ``addmm(..., out_dtype)``, measured ~+0.5 ms per chunk on the H200 and held
    # an fp32 [V, H] from forward to backward: results/profile_train_h200.txt, fifth session.)
    w = weight.to(hidden.dtype)
    head, valid, tgt = _setup(hidden, w, labels, ignore_index, temperature, vocab_size,
                              group_name, impl, chunks.FP32_LOGITS_CE)
    loss_sum, dh, dw = chunks.forward_ce_with_grad(hidden, w, tgt, valid, head, need_dh,
                                                   need_dw)
    empty = hidden.new_empty(0)
    return loss_sum, empty if dh is None else dh, empty if dw is None else dw


@_ce_sum_op.register_fake
def _(hidden, weight, labels, ignore_index, temperature, vocab_size, group_name, impl, need_dh,
      need_dw):
    empty = hidden.new_empty(0)
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_dh else empty,
            torch.empty_like(weight, dtype=hidden.dtype) if need_dw else empty)


def _ce_sum_setup(ctx, inputs, output):
    # dh and dw are outputs only to be saved; unmaterialized, their (unused) gradients stay
    # None instead of zero tensors of the gradients' size.
    ctx.set_materialize_grads(False)
    ctx.need = inputs[-2:]
    ctx.weight_dtype = inputs[1].dtype  # dw is saved in the compute dtype (hidden's)
    ctx.save_for_backward(output[1], output[2])


@torch.library.custom_op("mpcore::scale_grad_", mutates_args=("grad",))
def _scale_grad_op(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """``grad *= scale`` in place; on CUDA a scale of exactly 1 skips the pass, with no sync."""
    if grad.is_cuda:
        from mpcore.kernels import _lce_triton

        _lce_triton.scale_(grad, scale.float())
    else:
        grad.mul_(scale)


@_scale_grad_op.register_fake
def _(grad, scale):
    return None


@torch.library.custom_op("mpcore::scale_grad_to", mutates_args=())
def _scale_grad_to_op(grad: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` as a new ``dtype`` tensor, one pass (the product in fp32)."""
    if grad.is_cuda:
        from mpcore.kernels import _lce_triton

        return _lce_triton.scale_to(grad, scale.float(), dtype)
    return (grad.float() * scale.float()).to(dtype)


@_scale_grad_to_op.register_fake
def _(grad, scale, dtype):
    return torch.empty_like(grad, dtype=dtype)


def _ce_sum_backward(ctx, g_loss, _g_dh, _g_dw):
    # The stored gradients are scaled in place: this graph can be backpropagated once.
    dh, dw = ctx.saved_tensors
    need_dh, need_dw = ctx.need
    if g_loss is None:
        return (None,) * 10
    if need_dh:
        _scale_grad_op(dh, g_loss)
    if need_dw:
        if dw.dtype == ctx.weight_dtype:
            _scale_grad_op(dw, g_loss)
        else:  # the fp32 master's gradient from the compute-dtype sum: scaled and cast at once
            dw = _scale_grad_to_op(dw, g_loss, ctx.weight_dtype)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * 8


_ce_sum_op.register_autograd(_ce_sum_backward, setup_context=_ce_sum_setup)


# --- op 2 and 3: per-token log-probs (and entropy), backward recomputes the logits ----------

@torch.library.custom_op("mpcore::linear_logprobs", mutates_args=())
def _logprobs_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 ignore_index: int, temperature: float, vocab_size: int, group_name: str,
                 impl: str, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    head, valid, tgt = _setup(hidden, weight, labels, ignore_index, temperature, vocab_size,
                              group_name, impl, chunks.FP32_LOGITS_RECOMPUTE)
    stats = chunks.forward_stats(hidden, weight, tgt, head, with_entropy)
    logprob, entropy, lse, ez = chunks.finish(stats, valid)
    if not with_entropy:
        entropy, ez = lse.new_empty(0), lse.new_empty(0)
    return logprob, entropy, lse, ez


@_logprobs_op.register_fake
def _(hidden, weight, labels, ignore_index, temperature, vocab_size, group_name, impl,
      with_entropy):
    n = hidden.shape[0]
    vec = hidden.new_empty(n, dtype=torch.float32)
    ent = torch.empty_like(vec) if with_entropy else hidden.new_empty(0, dtype=torch.float32)
    return vec, ent, torch.empty_like(vec), torch.empty_like(ent)


@torch.library.custom_op("mpcore::linear_logprobs_backward", mutates_args=())
def _logprobs_backward_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          lse: torch.Tensor, ez: torch.Tensor, g_lp: torch.Tensor,
                          g_ent: torch.Tensor, ignore_index: int, temperature: float,
                          vocab_size: int, group_name: str, impl: str, need_dh: bool,
                          need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    head = chunks.Head.build(weight, _group(group_name), vocab_size, temperature, _rows(impl),
                             chunks.FP32_LOGITS_RECOMPUTE)
    valid = labels != ignore_index
    tgt = head.local_targets(labels, valid)
    g_lp = torch.where(valid, g_lp.float(), 0.0)  # ignored rows: the log-prob is a constant 0
    g_ent = g_ent.float().contiguous() if g_ent.numel() else None
    dh, dw = chunks.backward(hidden, weight, tgt, lse, ez, g_lp, g_ent, head, need_dh, need_dw)
    empty = hidden.new_empty(0)
    return empty if dh is None else dh, empty if dw is None else dw


@_logprobs_backward_op.register_fake
def _(hidden, weight, labels, lse, ez, g_lp, g_ent, ignore_index, temperature, vocab_size,
      group_name, impl, need_dh, need_dw):
    empty = hidden.new_empty(0)
    return (torch.empty_like(hidden) if need_dh else empty,
            torch.empty_like(weight) if need_dw else empty)


def _logprobs_setup(ctx, inputs, output):
    hidden, weight, labels = inputs[:3]
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
    ctx.args = inputs[3:8]  # ignore_index, temperature, vocab_size, group_name, impl
    ctx.with_entropy = inputs[8]
    ctx.save_for_backward(hidden, weight, labels, output[2], output[3])


def _logprobs_backward(ctx, g_lp, g_ent, _g_lse, _g_ez):
    hidden, weight, labels, lse, ez = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if g_lp is None:
        g_lp = torch.zeros_like(lse)
    if g_ent is None or not ctx.with_entropy:
        g_ent = lse.new_empty(0)
    dh, dw = _logprobs_backward_op(hidden, weight, labels, lse, ez, g_lp, g_ent, *ctx.args,
                                   need_dh, need_dw)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * 7


_logprobs_op.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


# --- public API ------------------------------------------------------------------------------

def _validate(hidden, weight, labels, temperature, vocab_size, group, master=False) -> int:
    """Static checks (no device sync); returns the resolved vocab_size. ``master``: the
    weight is the fp32 master weight of 16-bit ``hidden`` (cast inside the op)."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor (bf16, fp16 or fp32), got "
                         f"{getattr(hidden, 'dtype', type(hidden))}; cast the hidden states.")
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"hidden dtype {hidden.dtype} is not supported; use one of {_DTYPES}.")
    if weight.dtype != hidden.dtype and not master:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the "
                         "same dtype; cast one of them (under autocast both run in the autocast dtype).")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected hidden [N, H], weight [V_local, H], labels [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}. "
                         "Flatten the batch and sequence dims first.")
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"hidden has {hidden.shape[0]} tokens but labels has {labels.shape[0]}: labels must "
            "be shifted BEFORE the sequence split (LabelShifter) and then split with the hidden "
            "states, so that each rank passes labels of its local hidden length.")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight width {weight.shape[1]} != hidden width {hidden.shape[1]}; "
                         "pass the output head weight [V_local, H] (not transposed).")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}.")
    if hidden.device != weight.device or hidden.device != labels.device:
        raise ValueError(f"hidden, weight and labels must be on one device, got {hidden.device},"
                         f" {weight.device}, {labels.device}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    tp = dist.get_world_size(group) if group is not None else 1
    padded = weight.shape[0] * tp
    if vocab_size is None:
        return padded
    if not 1 <= vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, V_local * tp = {padded}]; "
                         "pass the true (unpadded) vocab size of the tokenizer.")
    return int(vocab_size)


def _autocast(hidden, weight):
    """Under autocast, ``hidden`` and ``weight`` in the autocast dtype, as ``nn.Linear`` would
    see them (custom ops are not autocast-aware by themselves); the kernels still accumulate
    and return in fp32. Outside autocast, unchanged."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and hidden.is_floating_point() and weight.is_floating_point()):
        return hidden, weight  # _validate says what is wrong
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight
    dtype = torch.get_autocast_dtype(device_type)
    return hidden.to(dtype), weight.to(dtype)


def _master(hidden, weight, reduction) -> torch.dtype | None:
    """The autocast dtype when the gradient-in-forward op should take ``weight`` as the fp32
    master weight (CUDA autocast, fp32 weight needing its gradient), else None."""
    if reduction == "none" or not isinstance(hidden, torch.Tensor) \
            or not isinstance(weight, torch.Tensor):
        return None
    return master_linear_applies(hidden, weight)


def _cross_entropy(hidden, weight, labels, ignore_index, reduction, temperature, vocab_size,
                   group, impl):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    master = _master(hidden, weight, reduction)
    if master is None:
        hidden, weight = _autocast(hidden, weight)
    else:
        hidden = hidden.to(master)
    vocab_size = _validate(hidden, weight, labels, temperature, vocab_size, group,
                           master is not None)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    args = (ignore_index, float(temperature), vocab_size, _group_name(group), impl)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction == "none":
        return -_logprobs_op(hidden, weight, labels, *args, False)[0]
    if grad:
        loss_sum = _ce_sum_op(hidden, weight, labels, *args, hidden.requires_grad,
                              weight.requires_grad)[0]
    else:
        loss_sum = -_logprobs_op(hidden, weight, labels, *args, False)[0].sum()
    if reduction == "sum":
        return loss_sum
    num_valid = (labels != ignore_index).sum()
    # Like torch: NaN when no label is valid, and then zero gradients rather than NaN.
    loss = loss_sum / num_valid.clamp(min=1)
    return torch.where(num_valid > 0, loss, float("nan"))


def _logprobs(hidden, weight, labels, temperature, vocab_size, group, with_entropy,
              ignore_index, impl):
    hidden, weight = _autocast(hidden, weight)
    vocab_size = _validate(hidden, weight, labels, temperature, vocab_size, group)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    logprob, entropy, _, _ = _logprobs_op(hidden, weight, labels, ignore_index,
                                          float(temperature), vocab_size, _group_name(group),
                                          impl, with_entropy)
    return logprob, entropy if with_entropy else None


def _impl(hidden: torch.Tensor) -> str:
    return "triton" if hidden.is_cuda else "torch"


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         temperature: float = 1.0, vocab_size: int | None = None,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Cross-entropy of ``softmax(hidden @ weight_full.T / temperature)`` against ``labels``.

    Args:
        hidden: ``[N, H]`` bf16, fp16 or fp32, this rank's tokens (replicated across ``group``).
        weight: ``[V_local, H]``, same dtype (under autocast both are cast to the autocast
            dtype, as for ``nn.Linear``); rank r of ``group`` holds vocab rows
            ``[r * V_local, (r + 1) * V_local)``.
        labels: ``[N]`` integer GLOBAL vocab ids in ``[0, vocab_size)`` or ``ignore_index``,
            already shifted, same on every rank of ``group``.
        reduction: ``"mean"`` over valid labels (NaN when there are none, like torch),
            ``"sum"``, or ``"none"`` (``[N]``, 0 where ignored).
        vocab_size: the true vocab; default ``V_local * tp``. Rows past it are padding.
        group: the tensor-parallel group the vocab is split over (None: not split). Forward
            runs two small all-reduces over it per token chunk when gradients are computed in
            the forward (mean/sum with grad), otherwise two per call; backward runs none.

    Returns:
        fp32 loss: a scalar, or ``[N]`` for ``reduction="none"``.

    Gradients come back in the input dtype. The gradient of ``hidden`` is this rank's PARTIAL
    sum over its vocab shard: the caller reduces it over ``group`` (the TP layer feeding the
    head does so in the backward of its copy-to-TP f mapping). For mean/sum the gradients are
    computed in the forward and stored, so the graph can be backpropagated once (not with
    ``retain_graph`` twice). Raises ValueError on shape/dtype mismatches and on labels outside
    ``[0, vocab_size)`` other than ``ignore_index`` (that check syncs with the device once).
    """
    return _cross_entropy(hidden, weight, labels, ignore_index, reduction, temperature,
                          vocab_size, group, _impl(hidden))


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    temperature: float = 1.0, vocab_size: int | None = None,
                    group: dist.ProcessGroup | None = None, with_entropy: bool = True,
                    ignore_index: int = -100
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log p(label)`` and entropy of ``softmax(hidden @ weight_full.T / T)``.

    Shapes, sharding, ``vocab_size`` and ``group`` as in :func:`linear_cross_entropy`.
    Returns ``(logprobs [N] fp32, entropy [N] fp32 or None)``. Rows whose label equals
    ``ignore_index`` get logprob 0 and no gradient through it; their entropy is still the
    softmax's entropy (mask it if it is not wanted). Gradients flow through both outputs to
    ``hidden`` (this rank's partial sum, reduced by the caller over ``group``) and ``weight``.
    Forward: two all-reduces per call; backward recomputes the logits chunk by chunk, no
    collective.
    """
    return _logprobs(hidden, weight, labels, temperature, vocab_size, group, with_entropy,
                     ignore_index, _impl(hidden))


def linear_cross_entropy_reference(hidden, weight, labels, *, ignore_index=-100,
                                   reduction="mean", temperature=1.0, vocab_size=None,
                                   group=None):
    """:func:`linear_cross_entropy` computed with the chunked PyTorch row math, on any device."""
    return _cross_entropy(hidden, weight, labels, ignore_index, reduction, temperature,
                          vocab_size, group, "torch")


def linear_logprobs_reference(hidden, weight, labels, *, temperature=1.0, vocab_size=None,
                              group=None, with_entropy=True, ignore_index=-100):
    """:func:`linear_logprobs` computed with the chunked PyTorch row math, on any device."""
    return _logprobs(hidden, weight, labels, temperature, vocab_size, group, with_entropy,
                     ignore_index, "torch")
