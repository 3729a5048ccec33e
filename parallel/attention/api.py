"""``context_attention``: the one attention entry point of the models.

Layout: packed streams, this rank's tokens. ``q [T, H, D]``, ``k``/``v`` ``[T, H_kv, D]``
(``H % H_kv == 0``: GQA), ``doc_id [T]`` (integer document labels, compared for equality only;
padding gets its own label or its own positions) and ``pos [T]`` (position of the token inside
its document). Attention is causal within documents: query t sees key s iff
``doc_id[s] == doc_id[t]`` and ``pos[s] <= pos[t]``, across all ranks of the cp group.

Modes:
    "none"     local attention (the whole stream is on this rank; ``group`` of size 1 or None)
    "ring"     K/V blocks travel around ``group`` (``ring.py``)
    "ulysses"  all-to-all tokens <-> heads over ``group`` (``ulysses.py``; needs H % cp == 0)
A cp group of size 1 runs the local path whatever the mode.

Kernels: ``backend`` (``backends.py``: ``auto``, ``flash``, ``sdpa_cudnn``, ``te_fused``,
``reference``) picks what computes each block, under every mode.
"""

from __future__ import annotations

import torch

from mpcore.parallel.attention import backends
from mpcore.parallel.attention.primitive import Block, attend_block, plan_block, use_flash
from mpcore.parallel.attention.ring import plan_ring, ring_attend
from mpcore.parallel.attention.ulysses import check_ulysses_heads, plan_ulysses, ulysses_attend
from mpcore.parallel.labels import check_cu_seqlens
from mpcore.parallel.state import ProcessGroup, group_size

MODES = ("none", "ring", "ulysses")


def _check_metadata(doc_id, pos, cu_seqlens, mode, cp) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown context-parallel attention mode {mode!r}; use one of {MODES}")
    if mode == "none" and cp > 1:
        raise ValueError(f"mode='none' attends within this rank only, but the cp group has "
                         f"{cp} ranks; use mode='ring' or mode='ulysses' (or group=None)")
    for name, t in (("doc_id", doc_id), ("pos", pos)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be [T_local], got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if doc_id.shape != pos.shape:
        raise ValueError(f"doc_id must be [T_local] like pos, got shapes {tuple(doc_id.shape)} "
                         f"and {tuple(pos.shape)}; pass the metadata of this rank's tokens "
                         "(split it with the same context split as the tokens)")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, doc_id.shape[0])  # the labels' check: one sync


def _check_qkv(q, k, v, num_tokens: int, mode: str, cp: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape "
                             f"{tuple(t.shape)}; reshape the projection output to 3 dims")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k/v have {k.shape[0]}; pass the "
                         "same local tokens for q, k and v")
    if q.shape[0] != num_tokens:
        raise ValueError(f"doc_id must be [T_local] = [{q.shape[0]}] like q, got metadata of "
                         f"{num_tokens} tokens; pass the metadata of this rank's tokens (split "
                         "it with the same context split as the tokens)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k/v head_dim {k.shape[2]}; project q, k "
                         "and v to the same head_dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads "
                         f"{k.shape[1]}; choose num_kv_heads dividing num_heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast "
                         "them to one dtype")
    if mode == "ulysses" and cp > 1:
        check_ulysses_heads(q.shape[1], cp)


class AttentionPlan:
    """The attention metadata of this rank's tokens, checked once and planned once.

    A model builds one per forward and hands it to every layer's :func:`context_attention`:
    all layers attend over the same tokens, so the metadata checks (a CPU-GPU sync for
    ``cu_seqlens`` on the GPU), the cp metadata all-gather and the flash kernel plan (host-side
    work on the metadata) run at the first layer only. The plan is made on first use for the
    path ``q`` takes (``primitive.use_flash``) and kept per path; under the ring and Ulysses
    modes that first use is a collective over ``group``, which every rank reaches at the same
    layer. ``doc_id``, ``pos`` ``[T_local]`` and ``cu_seqlens`` as in :func:`context_attention`;
    ``backend``: the attention kernels (``backends.BACKENDS``). Raises ``ValueError`` on
    malformed metadata, an unknown backend or a mode that does not fit the group, and at the
    first layer when a named backend cannot run these tokens (the reason in the message).
    """

    def __init__(self, doc_id: torch.Tensor, pos: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None, *, mode: str = "none",
                 group: ProcessGroup | None = None, backend: str = "auto"):
        self.cp = group_size(group)
        _check_metadata(doc_id, pos, cu_seqlens, mode, self.cp)
        self.doc_id, self.pos, self.cu_seqlens = doc_id, pos, cu_seqlens
        self.mode, self.group = mode, group
        self.backend = backends.check_name(backend)
        self.num_tokens = doc_id.shape[0]
        self._planned: dict = {}

    def blocks(self, q: torch.Tensor) -> list[Block]:
        """The blocks of ``q``'s path: one (local attention, or Ulysses over the gathered
        stream) or ``cp`` (the ring's steps); planned on the first call for that path."""
        key = (use_flash(q, self.backend), q.device)
        if key not in self._planned:
            if self.cp == 1:
                planned = [plan_block(q, self.doc_id, self.pos, self.doc_id, self.pos,
                                      self.cu_seqlens, self.backend)]
            elif self.mode == "ring":
                planned = plan_ring(q, self.doc_id, self.pos, self.group, self.cu_seqlens,
                                    self.backend)
            else:
                planned = [plan_ulysses(q, self.doc_id, self.pos, self.group, self.backend)]
            self._planned[key] = planned
        return self._planned[key]


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      doc_id: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, mode: str = "none",
                      group: ProcessGroup | None = None,
                      softmax_scale: float | None = None,
                      plan: AttentionPlan | None = None, backend: str = "auto") -> torch.Tensor:
    """Causal, document-respecting attention of this rank's tokens; returns ``out [T, H, D]``
    in q's dtype (with autograd).

    The metadata comes either as ``doc_id``, ``pos`` (and optionally ``cu_seqlens``), ``mode``
    and ``group``, planned for this call alone, or as a ``plan`` (:class:`AttentionPlan`, made
    once and shared by the layers of a model; then pass none of those).

    ``group``: the cp group (None: a world of one). ``cu_seqlens [S + 1]`` (optional): local
    segments such that causal attention over this rank's tokens in their order, cut at
    ``cu_seqlens``, is the mask restricted to the local tokens (``mpcore.parallel.context``'s
    ``RankLayout.cu_seqlens`` is such: a zigzag document's two chunks form one segment). On
    CUDA it lets the local path, and the ring's own-block step, run one flash call without the
    host-side plan; the CPU path and ulysses do not use it. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. ``backend``: the attention kernels (``backends.py``; with a plan, the
    plan's). Raises ``ValueError`` on bad shapes, an unknown mode, ``mode="none"`` with a cp
    group larger than one, heads not divisible by cp under ulysses, or a named backend that
    cannot run these tokens.
    """
    if plan is None:
        if doc_id is None or pos is None:
            raise ValueError("pass doc_id and pos (the metadata of this rank's tokens), or a "
                             "plan (AttentionPlan)")
        plan = AttentionPlan(doc_id, pos, cu_seqlens, mode=mode, group=group, backend=backend)
    elif doc_id is not None or pos is not None or cu_seqlens is not None or group is not None \
            or mode != "none" or backend != "auto":
        raise ValueError("pass either a plan or doc_id/pos/cu_seqlens/mode/group/backend, not "
                         "both: the plan already holds the metadata, mode, group and backend")
    _check_qkv(q, k, v, plan.num_tokens, plan.mode, plan.cp)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    blocks = plan.blocks(q)
    if plan.cp == 1:
        out, _ = attend_block(q, k, v, blocks[0], scale)
        return out
    if plan.mode == "ring":
        out, _ = ring_attend(q, k, v, blocks, scale, plan.group)
        return out
    return ulysses_attend(q, k, v, blocks[0], scale, plan.group)
