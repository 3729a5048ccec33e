"""The attention primitive against PyTorch's own attention, in float64 on CPU.

References: ``F.scaled_dot_product_attention`` per document with a causal mask (forward, and
its autograd for gradients), ``torch.logsumexp`` of the masked scores for the lse. The flash
planner (the CUDA path's host half) is run with a kernel that emulates flash varlen semantics
(per segment, causal aligned at the bottom right) so its plans are checked on CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from mpcore.parallel.attention import AttentionPlan, context_attention, flash, reference
from mpcore.parallel.attention.primitive import attention_with_lse, use_flash

F64 = torch.float64


def _stream(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g, dtype=F64)
    k = torch.randn(total, kv_heads, dim, generator=g, dtype=F64)
    v = torch.randn(total, kv_heads, dim, generator=g, dtype=F64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    pos = torch.arange(total) - starts[doc]
    return q, k, v, doc, pos


def _sdpa_per_doc(q, k, v, lengths):
    """Reference: SDPA on each document, causal, kv heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1),
                                           vd.transpose(0, 1), is_causal=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _lse_per_doc(q, k, lengths, scale):
    group = q.shape[1] // k.shape[1]
    out = []
    for qd, kd in zip(q.split(lengths), k.split(lengths), strict=True):
        s = torch.einsum("thd,shd->hts", qd, kd.repeat_interleave(group, 1)) * scale
        causal = torch.ones(len(qd), len(qd), dtype=torch.bool).tril()
        out.append(torch.logsumexp(s.masked_fill(~causal, float("-inf")), dim=-1))
    return torch.cat(out, dim=1)


LENGTHS = [5, 1, 7, 2, 1, 9]  # odd lengths and length-1 documents


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_forward_and_grads_match_sdpa(heads, kv_heads, monkeypatch):
    monkeypatch.setattr(reference, "_MAX_SCORES", 300)  # several query chunks
    q, k, v, doc, pos = _stream(LENGTHS, heads, kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_with_lse(*leaves, doc_q=doc, pos_q=pos)
    want = _sdpa_per_doc(q, k, v, LENGTHS)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, _lse_per_doc(q, k, LENGTHS, q.shape[-1] ** -0.5),
                               rtol=1e-12, atol=1e-12)
    assert lse.shape == (heads, sum(LENGTHS))

    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    _sdpa_per_doc(*ref, LENGTHS).backward(grad)
    for name, got, leaf in zip("qkv", leaves, ref, strict=True):
        torch.testing.assert_close(got.grad, leaf.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_token_order_is_free_and_scale_is_used():
    q, k, v, doc, pos = _stream(LENGTHS, seed=1)
    perm = torch.randperm(len(doc), generator=torch.Generator().manual_seed(3))
    out, lse = attention_with_lse(q, k, v, doc_q=doc, pos_q=pos, softmax_scale=0.3)
    out_p, lse_p = attention_with_lse(q[perm], k[perm], v[perm], doc_q=doc[perm],
                                      pos_q=pos[perm], softmax_scale=0.3)
    torch.testing.assert_close(out_p, out[perm], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p, lse[:, perm], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, _lse_per_doc(q, k, LENGTHS, 0.3), rtol=1e-12, atol=1e-12)


def test_rows_without_visible_keys_and_merge():
    q, k, v, doc, pos = _stream(LENGTHS, seed=2)
    full_out, full_lse = reference.reference_forward(q, k, v, doc, pos, doc, pos, 0.5)
    # Keys split into two disjoint random sets: each part hides some rows entirely.
    part = torch.rand(len(doc), generator=torch.Generator().manual_seed(4)) < 0.5
    a = reference.reference_forward(q, k[part], v[part], doc, pos, doc[part], pos[part], 0.5)
    b = reference.reference_forward(q, k[~part], v[~part], doc, pos, doc[~part], pos[~part], 0.5)
    assert torch.isinf(a[1]).any() and torch.isinf(b[1]).any()
    assert torch.isfinite(a[0]).all() and torch.isfinite(b[0]).all()
    merged_out, merged_lse = reference.merge_partials(*a, *b)
    torch.testing.assert_close(merged_out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-12, atol=1e-12)
    assert reference.any_visible(doc, pos, doc[part], pos[part])
    assert not reference.any_visible(doc[:5], pos[:5], doc[5:], pos[5:])


def test_cpu_never_selects_flash():
    q = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    assert not use_flash(q)


# --- the flash planner, with an emulated varlen kernel ------------------------------------


def _segment_meta(cu_q, cu_k, max_q, max_k, causal):
    """(doc, pos) that make the masked reference compute exactly what flash varlen computes."""
    len_q, len_k = cu_q.diff().long(), cu_k.diff().long()
    assert (len_q > 0).all() and (len_k > 0).all(), "empty segment in a plan"
    assert max_q == int(len_q.max()) and max_k == int(len_k.max())
    if causal:  # bottom-right alignment; a longer query side would leave rows with no key
        assert (len_k >= len_q).all()
    doc_q = torch.repeat_interleave(torch.arange(len(len_q)), len_q)
    doc_k = torch.repeat_interleave(torch.arange(len(len_k)), len_k)
    pos_k = torch.arange(len(doc_k)) - cu_k.long()[doc_k]
    pos_q = torch.arange(len(doc_q)) - cu_q.long()[doc_q] + (len_k - len_q)[doc_q]
    if not causal:
        pos_q = torch.full_like(pos_q, 1 << 30)
    return doc_q, pos_q, doc_k, pos_k


def _emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    return reference.reference_forward(q, k, v, *_segment_meta(cu_q, cu_k, max_q, max_k, causal),
                                       scale)


def _emulated_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    meta = _segment_meta(cu_q, cu_k, max_q, max_k, causal)
    return reference.reference_backward(dout, q, k, v, out, lse, *meta, scale)


def _zigzag(lengths, cp, rank, interleave_docs):
    """Rank ``rank``'s (doc, pos): each doc padded to 2*cp chunks, chunks rank and 2cp-1-rank."""
    lo, hi = [], []
    for d, n in enumerate(lengths):
        c = -(-n // (2 * cp))
        for chunk, dest in ((rank, lo), (2 * cp - 1 - rank, hi)):
            dest.append([(d, p) for p in range(chunk * c, (chunk + 1) * c)])
    if interleave_docs:  # per doc: low chunk then high chunk
        pairs = [t for a, b in zip(lo, hi, strict=True) for t in a + b]
    else:  # all low chunks, then all high chunks
        pairs = [t for a in lo for t in a] + [t for b in hi for t in b]
    return torch.tensor(pairs).T


def _plans_to_check():
    lengths = [9, 1, 14, 4]
    for cp in (2, 4):
        for inter in (True, False):
            metas = [_zigzag(lengths, cp, r, inter) for r in range(cp)]
            for r in range(cp):
                for src in range(cp):
                    yield f"zigzag cp{cp} {r}<-{src}", metas[r], metas[src], r != src
            gathered = torch.cat(metas, dim=1)  # Ulysses: rank-major order
            yield f"ulysses cp{cp}", gathered, gathered, False
    g = torch.Generator().manual_seed(5)
    full = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)),
                        torch.cat([torch.arange(n) for n in lengths])])
    for i in range(6):  # random subsets in random order on both sides
        pick_q = torch.randperm(full.shape[1], generator=g)[: 10 + i]
        pick_k = torch.randperm(full.shape[1], generator=g)[: 12 + i]
        yield f"random {i}", full[:, pick_q], full[:, pick_k], False


def test_flash_plans_compute_the_masked_attention():
    g = torch.Generator().manual_seed(6)
    for name, mq, mk, off_diagonal in _plans_to_check():
        q = torch.randn(mq.shape[1], 4, 8, generator=g, dtype=F64)
        k, v = (torch.randn(mk.shape[1], 2, 8, generator=g, dtype=F64) for _ in range(2))
        want_out, want_lse = reference.reference_forward(q, k, v, mq[0], mq[1], mk[0], mk[1],
                                                         0.4)
        calls = flash.plan_flash(mq[0], mq[1], mk[0], mk[1], "cpu")
        assert len(calls) <= 2 and [c.causal for c in calls] in ([], [True], [False],
                                                                   [True, False]), name
        assert bool(calls) == reference.any_visible(mq[0], mq[1], mk[0], mk[1]), name
        out, lse = flash.run_forward(q, k, v, calls, 0.4, kernel=_emulated_forward)
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12, msg=name)
        if off_diagonal:  # zigzag: remote blocks are fully visible or invisible per chunk
            assert all(not c.causal for c in calls), f"{name}: off-diagonal causal call"
        dout = torch.randn_like(q)
        want = reference.reference_backward(dout, q, k, v, want_out, want_lse, mq[0], mq[1],
                                            mk[0], mk[1], 0.4)
        got = flash.run_backward(dout, q, k, v, out, lse, calls, 0.4,
                                 kernel=_emulated_backward)
        for n, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=f"{name} {n}")


def test_one_call_covering_every_row_skips_the_merge():
    """The local causal step (one call, rows in order) returns the kernel's results as they
    are, equal to what the general path (scatter, fp32 merge, cast back) makes of them."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(9)
    q = torch.randn(24, 4, 8, generator=g)
    k, v = (torch.randn(24, 2, 8, generator=g) for _ in range(2))
    (call,) = flash.plan_cu_seqlens(torch.tensor([0, 9, 10, 24]), "cpu")
    returned = []

    def bf16_forward(*args):  # a kernel whose output is in a lower dtype than fp32
        out, lse = _emulated_forward(*args)
        returned.append(out.to(torch.bfloat16))
        return returned[-1], lse

    def bf16_backward(*args):
        grads = tuple(t.to(torch.bfloat16) for t in _emulated_backward(*args))
        returned.append(grads)
        return grads

    indexed = replace(call, q_index=torch.arange(24), k_index=torch.arange(24))
    out, lse = flash.run_forward(q, k, v, [call], 0.4, kernel=bf16_forward)
    assert out is returned[-1]  # no copy, no merge
    out_general, lse_general = flash.run_forward(q, k, v, [indexed], 0.4, kernel=bf16_forward)
    assert out_general.dtype == torch.float32
    assert torch.equal(out, out_general.to(out.dtype)) and torch.equal(lse, lse_general)
    dout = torch.randn(q.shape, generator=g)
    grads = flash.run_backward(dout, q, k, v, out_general, lse, [call], 0.4,
                               kernel=bf16_backward)
    assert grads is returned[-1]
    general = flash.run_backward(dout, q, k, v, out_general, lse, [indexed], 0.4,
                                 kernel=bf16_backward)
    for a, b in zip(grads, general, strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b.to(a.dtype))


def test_local_cu_seqlens_give_the_own_block_of_a_zigzag_rank():
    # mpcore.parallel.context's local cu_seqlens: one segment per document (chunk r, then 2cp-1-r).
    g = torch.Generator().manual_seed(8)
    for cp in (2, 4):
        for rank in range(cp):
            doc, pos = _zigzag([9, 1, 14, 4], cp, rank, interleave_docs=True)
            starts = torch.ones_like(doc, dtype=torch.bool)
            starts[1:] = doc[1:] != doc[:-1]
            cu = torch.cat([starts.nonzero().flatten(), torch.tensor([len(doc)])]).int()
            q = torch.randn(len(doc), 4, 8, generator=g, dtype=F64)
            k, v = (torch.randn(len(doc), 2, 8, generator=g, dtype=F64) for _ in range(2))
            want = reference.reference_forward(q, k, v, doc, pos, doc, pos, 0.4)
            got = flash.run_forward(q, k, v, flash.plan_cu_seqlens(cu, "cpu"), 0.4,
                                    kernel=_emulated_forward)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_flash_plan_of_ulysses_stream_is_one_permuted_causal_call():
    lengths = [9, 1, 14, 4]
    gathered = torch.cat([_zigzag(lengths, 2, r, True) for r in range(2)], dim=1)
    (call,) = flash.plan_flash(gathered[0], gathered[1], gathered[0], gathered[1], "cpu")
    assert call.causal and call.q_index is not None
    assert torch.equal(call.cu_q, call.cu_k) and len(call.cu_q) == len(lengths) + 1


def test_flash_plan_rejects_duplicate_positions():
    doc = torch.tensor([0, 0, 0])
    pos = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="share"):
        flash.plan_flash(doc, pos, doc, pos, "cpu")


# --- context_attention: the local path and its input checks --------------------------------


def test_context_attention_local_equals_sdpa_in_every_mode():
    q, k, v, doc, pos = _stream(LENGTHS, seed=7)
    want = _sdpa_per_doc(q, k, v, LENGTHS)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).int()
    for mode in ("none", "ring", "ulysses"):  # a cp group of one is local attention
        out = context_attention(q, k, v, doc_id=doc, pos=pos, cu_seqlens=cu, mode=mode)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12, msg=mode)


@pytest.mark.parametrize("change,match", [
    ({"q": lambda q: q[:, 0]}, "q must be"),
    ({"v": lambda v: v[:, :1]}, "same shape"),
    ({"k": lambda k: k[:-1], "v": lambda v: v[:-1]}, "tokens"),
    ({"k": lambda k: k[..., :4], "v": lambda v: v[..., :4]}, "head_dim"),
    ({"q": lambda q: q[:, :3]}, "multiple of kv heads"),
    ({"v": lambda v: v.float(), "k": lambda k: k.float()}, "dtypes"),
    ({"doc_id": lambda d: d[:-1]}, "doc_id must be"),
    ({"pos": lambda p: p.double()}, "integer"),
    ({"cu_seqlens": lambda c: torch.tensor([0])}, "cu_seqlens must be 1-D"),
    ({"cu_seqlens": lambda c: torch.tensor([1, 25])}, "start at 0"),
    ({"cu_seqlens": lambda c: torch.tensor([0, 9, 9, 25])}, "strictly increasing"),
    ({"cu_seqlens": lambda c: torch.tensor([0, 9, 24])}, "stream has 25 tokens"),
    ({"mode": lambda m: "zigzag"}, "unknown context-parallel attention mode"),
])
def test_context_attention_rejects_bad_input(change, match):
    q, k, v, doc, pos = _stream(LENGTHS)
    args = {"q": q, "k": k, "v": v, "doc_id": doc, "pos": pos, "cu_seqlens": None,
            "mode": "none"}
    args.update({name: fn(args[name]) for name, fn in change.items()})
    with pytest.raises(ValueError, match=match):
        context_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_attention_plan_is_checked_once_and_planned_once(monkeypatch):
    """A model's layers share one AttentionPlan: the block is planned at the first layer only,
    and every layer's result is that of a call planned on its own."""
    from mpcore.parallel.attention import api

    q, k, v, doc, pos = _stream(LENGTHS, seed=3)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).int()
    calls = []
    original = api.plan_block
    monkeypatch.setattr(api, "plan_block", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    plan = AttentionPlan(doc, pos, cu)
    for scale in (0.1, 0.2, 0.3):
        shared = context_attention(q * scale, k, v, plan=plan)
        alone = context_attention(q * scale, k, v, doc_id=doc, pos=pos, cu_seqlens=cu)
        assert torch.equal(shared, alone)
    assert len(calls) == 4  # once for the plan, once for each of the three lone calls
    with pytest.raises(ValueError, match="either a plan or"):
        context_attention(q, k, v, plan=plan, doc_id=doc, pos=pos)
    with pytest.raises(ValueError, match="doc_id and pos"):
        context_attention(q, k, v)
    with pytest.raises(ValueError, match=r"\[T_local\] = \[24\] like q"):
        context_attention(q[:24], k[:24], v[:24], plan=plan)
    with pytest.raises(ValueError, match="strictly increasing"):
        AttentionPlan(doc, pos, torch.tensor([0, 9, 9, 25]))


def test_query_chunk_without_any_key_of_its_document():
    """A whole query chunk whose documents have no keys here: out 0, lse -inf, zero grads."""
    from mpcore.parallel.attention.reference import reference_backward, reference_forward

    q = torch.randn(300, 2, 8, dtype=torch.float64)
    k = torch.randn(5, 2, 8, dtype=torch.float64)
    v = torch.randn(5, 2, 8, dtype=torch.float64)
    doc_q, pos_q = torch.zeros(300, dtype=torch.long), torch.arange(300)
    doc_k, pos_k = torch.ones(5, dtype=torch.long), torch.arange(5)
    out, lse = reference_forward(q, k, v, doc_q, pos_q, doc_k, pos_k, 0.3)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    dq, dk, dv = reference_backward(torch.randn_like(q), q, k, v, out, lse, doc_q, pos_q,
                                    doc_k, pos_k, 0.3)
    assert not dq.any() and not dk.any() and not dv.any()
