"""Attention backend names and the choice per kernel call, on CPU: which calls are uniform
(dense SDPA can run them), what auto picks, the errors of named backends that cannot run
a case (te_fused without TransformerEngine: the install hint), and the planner property
te_fused relies on (no causal segment with more queries than keys). The kernels themselves run
in tests/gpu/test_attention_backends_gpu.py."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mpcore.config import load_config
from mpcore.models import ModelConfig, build_model
from mpcore.parallel import te
from mpcore.parallel.attention import AttentionPlan, backends, context_attention, flash
from mpcore.parallel.attention.primitive import plan_block, use_flash
from mpcore.parallel.state import ParallelState

RESULTS = Path(__file__).resolve().parents[1] / "perf" / "results" / "attention_h200.json"
no_te = pytest.mark.skipif(te.te_available(), reason="TransformerEngine is installed here")


def _meta(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return doc, torch.arange(sum(lengths)) - starts[doc]


def _zigzag(lengths, cp, rank):
    """(doc, pos) of rank ``rank``'s tokens: chunks r and 2cp-1-r of every document."""
    docs, poss = [], []
    for d, n in enumerate(lengths):
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            docs.append(torch.full((chunk,), d))
            poss.append(torch.arange(c * chunk, (c + 1) * chunk))
    return torch.cat(docs), torch.cat(poss)


def test_names_and_reference_on_cpu():
    q = torch.randn(10, 4, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn_ragged'"):
        backends.check_name("cudnn_ragged")
    assert not use_flash(q) and not use_flash(q, "reference")
    for name in backends.KERNEL_BACKENDS:
        why = "it needs CUDA" if name != "te_fused" or te.te_available() else \
            "it needs TransformerEngine"
        with pytest.raises(ValueError, match=f"'{name}' cannot run here: {why}"):
            use_flash(q, name)
    with pytest.raises(ValueError, match="unknown attention backend"):
        AttentionPlan(*_meta([4, 6]), backend="fast")


def test_uniform_calls():
    (equal,) = flash.plan_cu_seqlens(torch.tensor([0, 64, 128, 192]), "cpu")
    (ragged,) = flash.plan_cu_seqlens(torch.tensor([0, 64, 100, 192]), "cpu")
    assert equal.uniform and (equal.max_q, equal.max_k) == (64, 64) and not ragged.uniform
    # Zigzag, equal documents: every ring step's calls are uniform (the own block causal with
    # equal sides, the remote blocks full).
    lengths, cp = [64, 64, 64], 2
    for rank in range(cp):
        me = _zigzag(lengths, cp, rank)
        for src in range(cp):
            calls = flash.plan_flash(*me, *_zigzag(lengths, cp, src), "cpu")
            assert calls and all(c.uniform for c in calls), (rank, src)
            assert all(c.max_q == c.max_k for c in calls if c.causal)
    # Ulysses: the gathered rank-major stream sorts into whole documents, one causal call.
    gathered = [torch.cat(t) for t in zip(*(_zigzag(lengths, cp, r) for r in range(cp)),
                                           strict=True)]
    (call,) = flash.plan_flash(*gathered, *gathered, "cpu")
    assert call.causal and call.uniform and call.max_q == 64
    # Documents of different lengths: not uniform.
    mixed = _meta([64, 32, 64])
    assert not any(c.uniform for c in flash.plan_flash(*mixed, *mixed, "cpu"))


def test_auto_and_named_choices():
    (long,) = flash.plan_cu_seqlens(torch.tensor([0, 4096, 8192]), "cpu")
    (short,) = flash.plan_cu_seqlens(torch.tensor([0, 16, 32]), "cpu")
    (ragged,) = flash.plan_cu_seqlens(torch.tensor([0, 4000, 8192]), "cpu")
    assert backends.auto_choice(long, sdpa_available=True) == "sdpa_cudnn"
    assert backends.auto_choice(long, sdpa_available=False) == "flash"
    assert backends.auto_choice(short, sdpa_available=True) == "flash"
    assert backends.auto_choice(ragged, sdpa_available=True) == "flash"
    q = torch.randn(8192, 4, 8)
    assert backends.assign("flash", ragged, q).backend == "flash"
    with pytest.raises(ValueError, match="'sdpa_cudnn' cannot run this attention call: its "
                                         "segments have different lengths"):
        backends.assign("sdpa_cudnn", ragged, q)
    causal_unequal = flash.FlashCall(True, None, None, long.cu_q, long.cu_q, 64, 128, True)
    with pytest.raises(ValueError, match="top-left aligned"):
        backends.assign("sdpa_cudnn", causal_unequal, q)
    assert backends.assign("sdpa_cudnn", long, q).backend == "sdpa_cudnn"


def test_auto_threshold_matches_the_measured_table():
    """AUTO_SDPA_MIN_LEN must agree with the committed measurement: at every measured uniform
    case, auto's choice is the faster of flash and sdpa_cudnn (or within 3% of it)."""
    table = json.loads(RESULTS.read_text())
    rows = [r for r in table["cases"] if r["uniform"] and "sdpa_cudnn" in r["ms"]
            and "flash" in r["ms"]]
    assert rows, "no uniform case in the table"
    for r in rows:
        call = flash.FlashCall(r["causal"], None, None, torch.zeros(1), torch.zeros(1),
                               r["len_q"], r["len_k"], True)
        chosen = backends.auto_choice(call, sdpa_available=True)
        best = min(r["ms"][name] for name in ("flash", "sdpa_cudnn"))
        assert r["ms"][chosen] <= 1.03 * best, (r["name"], chosen, r["ms"])


def test_plan_block_and_context_attention_take_the_backend():
    doc, pos = _meta([5, 1, 7])
    q = torch.randn(13, 4, 8, dtype=torch.float64)
    k, v = torch.randn(13, 2, 8, dtype=torch.float64), torch.randn(13, 2, 8, dtype=torch.float64)
    assert plan_block(q, doc, pos, doc, pos, None, "reference").calls is None
    out_ref = context_attention(q, k, v, doc_id=doc, pos=pos, backend="reference")
    out_auto = context_attention(q, k, v, doc_id=doc, pos=pos)
    assert torch.equal(out_ref, out_auto)  # auto on CPU is the reference
    with pytest.raises(ValueError, match="'flash' cannot run here"):
        context_attention(q, k, v, doc_id=doc, pos=pos, backend="flash")
    with pytest.raises(ValueError, match="not both"):
        context_attention(q, k, v, plan=AttentionPlan(doc, pos), backend="flash")


def test_model_passes_its_backend_to_the_plan():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                      num_kv_heads=2, intermediate_size=48)
    ids = torch.randint(0, 64, (12,))
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(6), torch.arange(6)])
    ref = build_model(cfg, ParallelState(), attention_backend="reference", seed=1)
    auto = build_model(cfg, ParallelState(), seed=1)
    run = dict(cu_seqlens=cu, output="logits")
    torch.testing.assert_close(ref(ids, pos, **run), auto(ids, pos, **run), rtol=0, atol=0)
    named = build_model(cfg, ParallelState(), attention_backend="sdpa_cudnn", seed=1)
    with pytest.raises(ValueError, match="'sdpa_cudnn' cannot run here: it needs CUDA"):
        named(ids, pos, **run)
    with pytest.raises(ValueError, match="unknown attention backend"):
        build_model(cfg, ParallelState(), attention_backend="te")


def test_te_fused_is_a_backend_name():
    assert load_config(None, ["model.attention_backend=te_fused"]).model.attention_backend \
        == "te_fused"
    assert backends.check_name("te_fused") == "te_fused"
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      intermediate_size=48)
    assert build_model(cfg, ParallelState(), attention_backend="te_fused").attention_backend \
        == "te_fused"


@no_te
def test_te_fused_without_te_names_the_install_hint():
    q = torch.randn(12, 4, 8)
    hint = re.escape(te.TE_INSTALL)
    assert "install it" in backends.kernel_refusal("te_fused", q)
    with pytest.raises(ValueError, match=f"'te_fused' cannot run here: it needs "
                                         f"TransformerEngine.*{hint}"):
        use_flash(q, "te_fused")
    doc, pos = _meta([5, 7])
    k = v = torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match=hint):
        context_attention(q, k, v, doc_id=doc, pos=pos, backend="te_fused")
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      intermediate_size=48)
    model = build_model(cfg, ParallelState(), attention_backend="te_fused", seed=1)
    with pytest.raises(ValueError, match=hint):
        model(torch.randint(0, 64, (12,)), pos, cu_seqlens=torch.tensor([0, 5, 12]),
              output="logits")
    # The kernel itself, called without TE, says the same.
    from mpcore.parallel.attention.te_fused import te_fused_forward

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=hint):
        te_fused_forward(q, k, v, cu, cu, 7, 7, True, 0.35)
    assert not backends.te_usable(q)  # what auto asks for a call te_fused would win


def test_te_fused_takes_every_call_and_auto_keeps_its_choices(monkeypatch):
    (long,) = flash.plan_cu_seqlens(torch.tensor([0, 4096, 8192]), "cpu")
    (short,) = flash.plan_cu_seqlens(torch.tensor([0, 16, 32]), "cpu")
    (ragged,) = flash.plan_cu_seqlens(torch.tensor([0, 1, 4000, 8192]), "cpu")
    causal_unequal = flash.FlashCall(True, None, None, long.cu_q, long.cu_q, 64, 128, True)
    q = torch.randn(8192, 4, 8)
    for call in (long, short, ragged, causal_unequal):
        assert backends.assign("te_fused", call, q).backend == "te_fused"
    choose = backends.auto_choice
    # ragged causal, longest 4095: flash measured faster; shorter or full ragged: te_fused
    assert choose(ragged, sdpa_available=True, te_available=True) == "flash"
    (short_ragged,) = flash.plan_cu_seqlens(torch.tensor([0, 1, 700, 1024]), "cpu")
    full_ragged = flash.FlashCall(False, None, None, ragged.cu_q, ragged.cu_q, 4095, 4095, False)
    for call in (short_ragged, full_ragged):
        assert choose(call, sdpa_available=True, te_available=True) == "te_fused"
        assert choose(call, sdpa_available=True, te_available=False) == "flash"
    monkeypatch.setattr(backends, "AUTO_TE_RAGGED_FULL", False)
    assert choose(full_ragged, sdpa_available=True, te_available=True) == "flash"
    assert choose(long, sdpa_available=True, te_available=True) == "sdpa_cudnn"
    assert choose(short, sdpa_available=True, te_available=True) == "flash"
    assert backends.assign("auto", short_ragged, q).backend == "flash"  # q on the CPU: no TE


def _segment_lengths(call):
    return call.cu_q.diff().numpy(), call.cu_k.diff().numpy()


def test_planned_calls_give_every_query_a_key():
    """What te_fused relies on (te_fused.py): in every planned call each segment has queries
    and keys, and a causal segment has no more queries than keys, so with the bottom-right
    mask every query row sees at least its diagonal key (flash would give a row with no key
    lse -inf; TE is never asked to). Random documents, zigzag and contiguous ring blocks at
    cp 2..4, the Ulysses stream, and random subsets of query/key tokens."""
    rng = np.random.default_rng(0)
    cases = []
    for cp in (2, 3, 4):
        lengths = [int(n) * 2 * cp for n in rng.integers(1, 40, size=6)]
        metas = [_zigzag(lengths, cp, r) for r in range(cp)]
        cases += [(metas[r], metas[s]) for r in range(cp) for s in range(cp)]
        doc, pos = _meta(lengths)
        bounds = np.linspace(0, len(doc), cp + 1).astype(int)
        parts = [(doc[a:b], pos[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        cases += [(parts[r], parts[s]) for r in range(cp) for s in range(r + 1)]
        gathered = [torch.cat(t) for t in zip(*metas, strict=True)]
        cases.append((gathered, gathered))
    doc, pos = _meta([int(n) for n in rng.integers(1, 60, size=8)])
    for _ in range(20):
        pick_q = torch.from_numpy(rng.random(len(doc)) < 0.5)
        pick_k = torch.from_numpy(rng.random(len(doc)) < 0.5)
        cases.append(((doc[pick_q], pos[pick_q]), (doc[pick_k], pos[pick_k])))
    num_calls = 0
    for (doc_q, pos_q), (doc_k, pos_k) in cases:
        for call in flash.plan_flash(doc_q, pos_q, doc_k, pos_k, "cpu"):
            len_q, len_k = _segment_lengths(call)
            assert (len_q >= 1).all() and (len_k >= 1).all()
            if call.causal:
                assert (len_q <= len_k).all() and call.max_q <= call.max_k
            num_calls += 1
    assert num_calls > 50


def test_auto_te_ragged_matches_the_measured_table():
    """AUTO_TE_RAGGED_* must agree with the committed measurement: at every measured call of
    different segment lengths, auto's choice between flash and te_fused (``te_pays``) is the
    faster of the two or within 3% of it; and along the uniform causal rows (the same kernels
    by segment length) te_fused is within 3% of flash up to AUTO_TE_RAGGED_CAUSAL_MAX_LEN and
    flash within 3% of te_fused beyond it."""
    table = json.loads(RESULTS.read_text())
    rows = [r for r in table["cases"] if "te_fused" in r["ms"] and "flash" in r["ms"]]
    if not rows:
        pytest.skip("attention_h200.json has no te_fused rows yet (run "
                    "tests/perf/bench_attention.py with TransformerEngine on the H200)")
    ragged = [r for r in rows if not r["uniform"]]
    assert ragged and any(not r["causal"] for r in ragged)
    for r in ragged:
        call = flash.FlashCall(r["causal"], None, None, None, None, r["len_q"], r["len_k"], False)
        chosen = "te_fused" if backends.te_pays(call) else "flash"
        best = min(r["ms"]["flash"], r["ms"]["te_fused"])
        assert r["ms"][chosen] <= 1.03 * best, (r["name"], chosen, r["ms"])
    limit = backends.AUTO_TE_RAGGED_CAUSAL_MAX_LEN
    by_length = [r for r in rows if r["uniform"] and r["causal"]]
    assert any(r["len_q"] <= limit for r in by_length) and any(r["len_q"] > limit
                                                              for r in by_length)
    for r in by_length:
        faster, other = ("te_fused", "flash") if r["len_q"] <= limit else ("flash", "te_fused")
        assert r["ms"][faster] <= 1.03 * r["ms"][other], (r["name"], r["ms"])
