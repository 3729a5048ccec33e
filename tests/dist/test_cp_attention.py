"""Ring and Ulysses attention at cp 2 and 4 (gloo) against single-process full attention.

The reference is F.scaled_dot_product_attention per document (causal) in float64 on the unsplit
stream, and its autograd for dq/dk/dv. The CP runs are fp32 on each rank's split of the same
tensors; the split is built here (not with mpcore.parallel.context) so this test depends only on the
attention contract: per-token doc_id and pos. One spawn per cp size loops over every case.
"""

import torch
import torch.nn.functional as F

from mpcore.parallel.attention import AttentionPlan, context_attention
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed

LENGTHS = [7, 1, 13, 4, 10]  # odd lengths and a length-1 document
HEADS = [(4, 2), (4, 1), (6, 3)]  # (H, H_kv): GQA, H_kv < cp, H_kv not dividing cp
LAYOUTS = ["zigzag", "zigzag-chunk-major", "contiguous"]
TOL = 1e-5


def _split(lengths, cp, layout):
    """Per rank: (global index of each local token or -1 for padding, doc_id, pos).

    zigzag: each document padded to a multiple of 2*cp and cut into 2*cp chunks; rank r holds
    chunks r and 2cp-1-r of every document (per document, or all low chunks first with
    ``-chunk-major``). contiguous: the stream padded to a multiple of cp (padding is its own
    document) and cut into cp equal pieces.
    """
    docs, start = [], 0
    for d, n in enumerate(lengths):
        padded = -(-n // (2 * cp)) * 2 * cp if layout.startswith("zigzag") else n
        docs.append([(start + p if p < n else -1, d, p) for p in range(padded)])
        start += n
    if layout == "contiguous":
        flat = [t for doc in docs for t in doc]
        flat += [(-1, len(lengths), p) for p in range(-len(flat) % cp)]
        per = len(flat) // cp
        ranks = [flat[r * per:(r + 1) * per] for r in range(cp)]
    else:
        ranks = []
        for r in range(cp):
            lo, hi = [], []
            for doc in docs:
                c = len(doc) // (2 * cp)
                lo.append(doc[r * c:(r + 1) * c])
                hi.append(doc[(2 * cp - 1 - r) * c:(2 * cp - r) * c])
            if layout == "zigzag":
                ranks.append([t for a, b in zip(lo, hi, strict=True) for t in a + b])
            else:
                ranks.append([t for a in lo for t in a] + [t for b in hi for t in b])
    return [torch.tensor(toks).T for toks in ranks]  # (3, T_local) each


def _reference(q, k, v, grad):
    """Float64 SDPA per document; returns out and (dq, dk, dv)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    outs = []
    for qd, kd, vd in zip(*(t.split(LENGTHS) for t in leaves), strict=True):
        kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1),
                                           vd.transpose(0, 1), is_causal=True)
        outs.append(o.transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _local(full, index, seed):
    """Rows of ``full`` at ``index`` (fp32); padding rows get fresh random values."""
    noise = torch.randn(len(index), *full.shape[1:], generator=torch.Generator().manual_seed(seed),
                        dtype=full.dtype)
    real = index >= 0
    noise[real] = full[index[real]]
    return noise.float()


def _one_case(rank, cp, group, mode, layout, heads, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    total, dim = sum(LENGTHS), 8
    q = torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(total, kv_heads, dim, generator=g, dtype=torch.float64) for _ in "kv")
    grad = torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
    ref_out, ref_grads = _reference(q, k, v, grad)

    index, doc_id, pos = _split(LENGTHS, cp, layout)[rank]
    leaves = [_local(t, index, seed + 10 * rank + i).requires_grad_()
              for i, t in enumerate((q, k, v))]
    out = context_attention(*leaves, doc_id=doc_id, pos=pos, mode=mode, group=group)
    local_grad = torch.zeros(len(index), heads, dim)  # padding outputs carry no loss
    real = index >= 0
    local_grad[real] = grad[index[real]].float()
    out.backward(local_grad)

    diffs = {"out": (out[real].double() - ref_out[index[real]]).abs().max().item()}
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, ref_grads, strict=True):
        diffs[name] = (leaf.grad[real].double() - want[index[real]]).abs().max().item()
        diffs[name + "_pad"] = leaf.grad[~real].abs().max().item() if (~real).any() else 0.0
    return diffs


def _all_cases(rank, world):
    group = ParallelState.build(cp=world).cp_group
    results = {}
    seed = 0
    for mode in ("ring", "ulysses"):
        for layout in LAYOUTS:
            for heads, kv_heads in HEADS:
                seed += 1
                if mode == "ulysses" and heads % world != 0:
                    continue
                case = f"cp{world} {mode} {layout} H{heads}/{kv_heads}"
                results[case] = _one_case(rank, world, group, mode, layout, heads, kv_heads,
                                          seed)
    results["errors"] = _bad_inputs(rank, world, group)
    results["plan"] = _plan_reuse(rank, world, group)
    return results


def _plan_reuse(rank, world, group):
    """One AttentionPlan serving three "layers": the metadata is gathered once per mode, and
    every layer's output and gradients equal those of a call planned on its own."""
    from mpcore.parallel.attention import ring, ulysses

    index, doc_id, pos = _split(LENGTHS, world, "zigzag")[rank]
    gathers = []
    for module in (ring, ulysses):
        original = module.gather_metadata
        def counting(*args, _original=original, **kwargs):
            gathers.append(1)
            return _original(*args, **kwargs)
        module.gather_metadata = counting
    diffs = {}
    for mode in ("ring", "ulysses"):
        plan = AttentionPlan(doc_id, pos, mode=mode, group=group)
        gathers.clear()
        worst = 0.0
        for layer in range(3):
            g = torch.Generator().manual_seed(100 * rank + layer)
            q, k, v = (torch.randn(len(index), 4, 8, generator=g).requires_grad_()
                       for _ in "qkv")
            shared = context_attention(q, k, v, plan=plan)
            grads = torch.autograd.grad(shared.sum(), (q, k, v))
            alone = context_attention(q, k, v, doc_id=doc_id, pos=pos, mode=mode, group=group)
            grads_alone = torch.autograd.grad(alone.sum(), (q, k, v))
            worst = max([worst, (shared - alone).abs().max().item()]
                        + [(a - b).abs().max().item() for a, b in zip(grads, grads_alone,
                                                                     strict=True)])
        diffs[mode] = (worst, len(gathers))  # 1 gather for the plan + 3 for the lone calls
    return diffs


def _bad_inputs(rank, world, group):
    """Messages of the ValueErrors raised for cp-specific misuse (same on every rank)."""
    index, doc_id, pos = _split(LENGTHS, world, "contiguous")[rank]
    x = torch.randn(len(index), 8, 8)
    messages = []
    for mode, heads in (("ulysses", world + 1), ("none", 4)):  # world + 1 heads: not % cp
        try:
            context_attention(x[:, :heads], x[:, :1], x[:, :1], doc_id=doc_id, pos=pos,
                              group=group, mode=mode)
        except ValueError as err:
            messages.append(str(err))
    return messages


def _check(results):
    for r in results:
        messages = r.pop("errors")
        assert len(messages) == 2, messages
        assert "heads % cp == 0" in messages[0] and "mode='ring'" in messages[0]
        assert "mode='none'" in messages[1]
        plan = r.pop("plan")
        assert plan == {"ring": (0.0, 4), "ulysses": (0.0, 4)}, plan
    worst = {}
    for r in results:
        for case, diffs in r.items():
            for name, d in diffs.items():
                worst[(case, name)] = max(worst.get((case, name), 0.0), d)
    print("\n".join(f"{c} {n}: {d:.2e}" for (c, n), d in sorted(worst.items())
                    if n in ("out", "dq")))
    bad = {key: d for key, d in worst.items() if not d <= TOL}
    assert not bad, bad
    return worst


def test_cp2_ring_and_ulysses_match_full_attention():
    worst = _check(run_distributed(_all_cases, 2))
    assert len({case for case, _ in worst}) == 2 * len(LAYOUTS) * len(HEADS)


def test_cp4_ring_and_ulysses_match_full_attention():
    worst = _check(run_distributed(_all_cases, 4))
    # H=6 does not split over cp=4 under ulysses: those cases are checked to raise instead.
    assert len({case for case, _ in worst}) == (2 * len(HEADS) - 1) * len(LAYOUTS)
