"""Benchmark: Qwen3.5 text training steps, mpcore vs transformers, and the DeltaNet layer vs fla.

Usage (one GPU; fla-core and flash-linear-attention installed so both sides take fla's kernels):
    python -m tests.perf.bench_qwen35 [OUT.json] [--config HF_CONFIG.json] [--seq 8192]
        [--steps 10] [--warmup 3] [--skip-hf] [--profile PROFILE.txt]

``--config``: a Qwen3.5 ``config.json`` (default: the Qwen3.5-0.8B shape,
tests/dist/qwen35_0p8b_config.json; its text decoder is what runs). Both sides: fp32 parameters,
bf16 autocast on CUDA (fp32 on CPU), one document of ``--seq`` random tokens per step, AdamW
(fused on CUDA) with lr 1e-4, gradient clipping at 1.0. mpcore: ``mpcore.models.common.hybrid.model.build``
(``gdn_kernel=auto``: fla when it runs), the training head's ``loss_sum`` output over the
valid tokens. transformers: ``Qwen3_5ForCausalLM`` of the same config (SDPA attention; its own
fla path when flash-linear-attention is installed), ``labels`` loss. ``hf_paths`` records what
transformers' fast path found (fla, causal_conv1d) and its fallback warnings; a side that runs
out of memory is recorded as ``{"error": "out of memory", ...}`` and the other side kept.

Reported per side: median step time over ``--steps`` (after ``--warmup``), tokens/s, peak
allocated memory (reset between sides; null on CPU), first and last loss. ``layer``: one
``GatedDeltaNet`` forward + backward on ``[seq, hidden]`` bf16 (``ours_ms``) against
``floor_ms``: the same work composed straight from fla's pieces (the two projections as plain
bf16 matmuls, fla's conv, its delta rule with the gates and L2 norm, its fused gated RMSNorm,
no layout changes), ``floor_fused_gate_ms``: that floor with fla's in-kernel gate and beta
sigmoid (with ``fused_gate_saving`` and its gradients' distance from the floor's), and
``fla_ms``: fla's conv + rule alone (the earlier definition);
``overhead`` = ours / floor - 1 (the <= 10% target), ``overhead_vs_kernels`` = ours / fla - 1.
With ``--profile``: ``ours_device_ms`` / ``floor_device_ms``, the kernels' time per run in
the profile, and ``overhead_device`` from them (the layer alone is launch-bound at 8192 tokens:
its wall time moves with the host).
null without CUDA and fla. The JSON is rewritten after each part (a timeout keeps what ran).
JSON goes to OUT (default tests/perf/results/qwen35_h200.json).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mpcore.models import family_named
from mpcore.models.common.decoder import init_weights
from mpcore.models.common.hybrid import kernels
from mpcore.models.common.hybrid.hf import config_from_hf, text_fields
from mpcore.models.common.hybrid.layers import GatedDeltaNet
from mpcore.models.common.hybrid.model import build
from mpcore.parallel.attention import AttentionPlan
from mpcore.parallel.state import ParallelState
from tests.perf.step_timing import adamw, autocast, placed_inputs, timed

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "qwen35_h200.json"
DEFAULT_CONFIG = REPO / "tests" / "dist" / "qwen35_0p8b_config.json"


def oom_row(e: Exception, device) -> dict:
    """A side that ran out of memory: the error and the peak it reached (then freed)."""
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"error": "out of memory", "detail": str(e).splitlines()[0][:300], "peak_gib": peak}


def bench_mpcore(hf: dict, batches, device, steps, warmup) -> dict:
    cfg = config_from_hf(hf)
    state = ParallelState()
    model = build(cfg, state, seed=0, device=device)
    opt = adamw(model.parameters(), device)
    it = iter(batches)
    family = family_named("qwen3_5")

    def step() -> float:
        ids = next(it)
        inputs = placed_inputs(family, state, ids, cfg, device)
        with autocast(device):
            loss = model(**inputs, output="loss_sum") / (ids.numel() - 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    out = timed(step, steps, warmup, device)
    x = torch.empty(1, device=device, dtype=torch.bfloat16)
    out["gdn_kernel"] = kernels.resolve("auto", x, cfg.linear_key_head_dim,
                                        cfg.linear_value_head_dim)
    return out


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "fall" in message.lower() and message not in self.lines:
            self.lines.append(message[:300])


def hf_paths() -> dict:
    """What transformers' Qwen3.5 fast path looks for, as installed here."""
    found = {}
    for dist in ("flash-linear-attention", "fla-core", "causal-conv1d"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    found["causal_conv1d importable"] = importlib.util.find_spec("causal_conv1d") is not None
    return found


def deltanet_kernel(model, device) -> dict | None:
    """The Gated DeltaNet kernel the linear-attention layers of ``model`` run in a benchmark
    step on ``device`` (operands bf16 under autocast on CUDA, fp32 on the CPU), asked of the
    first such layer as its forward asks (``GatedDeltaNet.kernel``): ``{"requested": its
    gdn_kernel, "ran": "fla" | "reference", "why": its log line}``; None without such layers."""
    layer = next((m for m in model.modules() if isinstance(m, GatedDeltaNet)), None)
    if layer is None:
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"requested": layer.gdn_kernel,
            "ran": layer.kernel(torch.empty(0, device=device, dtype=dtype)),
            "why": layer.describe_kernel(device, dtype)}


@contextlib.contextmanager
def fast_path_recorded(into: dict, record: bool = True):
    """Around transformers' runs: then ``into["hf_fast_path"]`` (when ``record``) holds what
    its Qwen3.5 DeltaNet fast path found installed (:func:`hf_paths`) and the fallback warnings
    transformers logged meanwhile."""
    captured = _Captured()
    logging.getLogger("transformers").addHandler(captured)
    try:
        yield
    finally:
        logging.getLogger("transformers").removeHandler(captured)
        if record:
            into["hf_fast_path"] = {**hf_paths(), "fallback_warnings": captured.lines}


def bench_hf(hf: dict, batches, device, steps, warmup) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    captured = _Captured()
    logging.getLogger("transformers").addHandler(captured)
    text = {k: v for k, v in text_fields(hf).items()
            if k not in ("attn_output_gate", "mtp_num_hidden_layers", "model_type")}
    model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**text),
                                            attn_implementation="sdpa").to(device)
    model.train()
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def step() -> float:
        ids = next(it).to(device)[None]
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    try:
        out = timed(step, steps, warmup, device)
    except torch.cuda.OutOfMemoryError as e:
        out = oom_row(e, device)
    finally:
        logging.getLogger("transformers").removeHandler(captured)
    out["fallback_warnings"] = captured.lines
    return out


def _layer_inputs(cfg, seq, device):
    with torch.device("meta"):
        layer = GatedDeltaNet(cfg, tp_group=None, sequence_parallel=False, gdn_kernel="fla")
    layer = layer.to_empty(device=device)
    init_weights(layer, 0)
    x = torch.randn(seq, cfg.hidden_size, device=device, requires_grad=True)
    plan = AttentionPlan(torch.zeros(seq, dtype=torch.int64, device=device),
                         torch.arange(seq, device=device),
                         torch.tensor([0, seq], dtype=torch.int32, device=device))
    return layer, x, plan


def _floor(layer, x, seq, fused_gate: bool = False):
    """The layer's work straight from fla's pieces (module docstring): one step's closure. With
    ``fused_gate``, fla's delta rule takes the raw gate and beta and computes the decay
    (``-exp(A_log) * softplus(a + dt_bias)``) and ``sigmoid(beta)`` in its kernel
    (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``): the launches that saves are a
    candidate for our layer (tests/perf/NOTES.md)."""
    chunk_rule, conv, gated_norm = kernels.fla_ops()
    hk, hv = layer.num_key_heads, layer.num_value_heads
    dk, dv = layer.key_dim, layer.value_dim
    cu = torch.tensor([0, seq], device=x.device)
    sizes = [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv]
    conv_w = layer.conv_weight[:, 0]

    def step() -> float:
        with autocast(x.device):
            proj = F.linear(x, layer.w_in.weight)
        q, k, v, z, b, a = proj.split(sizes, dim=-1)
        mixed = conv(proj[None, :, :sum(sizes[:3])], conv_w.to(proj.dtype), activation="silu",
                     cu_seqlens=cu)
        mixed = mixed[0] if isinstance(mixed, tuple) else mixed
        qc, kc, vc = mixed[0].split(sizes[:3], dim=-1)
        if fused_gate:
            g, beta = a, b
            gates = dict(use_gate_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias,
                         use_beta_sigmoid_in_kernel=True)
        else:
            g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
            beta, gates = b.sigmoid(), {}
        o, _ = chunk_rule(qc.reshape(1, seq, hk, dk), kc.reshape(1, seq, hk, dk),
                          vc.reshape(1, seq, hv, dv), g[None], beta[None],
                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **gates)
        o = gated_norm(o[0], z.reshape(seq, hv, dv), layer.norm.norm.weight, None,
                       activation="silu", eps=layer.norm.norm.eps)
        with autocast(x.device):
            y = F.linear(o.reshape(seq, hv * dv), layer.out_proj.weight)
        y.float().sum().backward()
        return 0.0

    return step


def bench_layer(hf: dict, seq: int, device, steps, warmup, profile: str | None) -> dict | None:
    """Our DeltaNet layer vs the same work from fla's pieces and vs fla's two kernels alone,
    forward + backward, bf16."""
    if device.type != "cuda" or kernels.fla_ops() is None:
        return None
    cfg = config_from_hf(hf)
    layer, x, plan = _layer_inputs(cfg, seq, device)

    def ours() -> float:
        with autocast(device):
            y = layer(x, plan)
        y.float().sum().backward()
        return 0.0

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    bf = dict(device=device, dtype=torch.bfloat16)
    conv_x = torch.randn(seq, 2 * hk * dk + hv * dv, **bf, requires_grad=True)
    conv_w = torch.randn(conv_x.shape[1], cfg.linear_conv_kernel_dim, **bf, requires_grad=True)
    g = torch.randn(seq, hv, device=device).sigmoid().log().requires_grad_()
    beta = torch.rand(seq, hv, **bf, requires_grad=True)
    cu = torch.tensor([0, seq], device=device)
    pos = torch.arange(seq, device=device)

    def fla() -> float:
        mixed = kernels.short_conv(conv_x, conv_w, pos, cu, "fla")
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        o = kernels.gated_delta_rule(q.reshape(seq, hk, dk), k.reshape(seq, hk, dk),
                                     v.reshape(seq, hv, dv), g, beta, cu, "fla")
        o.float().sum().backward()
        return 0.0

    floor = _floor(layer, x, seq)
    a, f, b = (timed(fn, steps, warmup, device) for fn in (ours, floor, fla))
    out = {"ours_ms": 1e3 * a["step_s"], "floor_ms": 1e3 * f["step_s"],
           "fla_ms": 1e3 * b["step_s"], "overhead": a["step_s"] / f["step_s"] - 1,
           "overhead_vs_kernels": a["step_s"] / b["step_s"] - 1,
           "ours_peak_gib": a["peak_gib"], "floor_peak_gib": f["peak_gib"],
           "fla_peak_gib": b["peak_gib"]}
    out.update(_fused_gate_floor(layer, x, seq, f, steps, warmup, device))
    if profile:
        device_ms = write_profile(profile, {"ours": ours, "floor": floor})
        out.update(ours_device_ms=device_ms["ours"], floor_device_ms=device_ms["floor"],
                   overhead_device=device_ms["ours"] / device_ms["floor"] - 1)
    return out


def _fused_gate_floor(layer, x, seq, floor: dict, steps, warmup, device) -> dict:
    """``floor_fused_gate_ms`` (``_floor`` with fla's in-kernel gates), the launches' saving
    against the floor (``fused_gate_saving`` = floor / fused - 1), and how far the fused path's
    gradients of ``A_log``, ``dt_bias`` and ``x`` are from the floor's (relative max error:
    two bf16 paths of one function differ by rounding, a wrong gate by O(1); the judgement
    against float64 is the GPU tests', once a layer uses it). A fla that refuses the flags is
    recorded as ``floor_fused_gate_error``, the rest of the row kept."""
    try:
        watched = {"x": x, "A_log": layer.A_log, "dt_bias": layer.dt_bias}
        grads = {}
        for fused in (False, True):
            for t in watched.values():
                t.grad = None
            _floor(layer, x, seq, fused_gate=fused)()
            missing = [name for name, t in watched.items() if t.grad is None]
            if missing:
                raise RuntimeError(f"no gradient for {missing} (fused_gate={fused})")
            grads[fused] = {name: t.grad.float().clone() for name, t in watched.items()}
        diff = {name: float((grads[True][name] - a).abs().max() / a.abs().max().clamp_min(1e-30))
                for name, a in grads[False].items()}
        t = timed(_floor(layer, x, seq, fused_gate=True), steps, warmup, device)
    except Exception as e:  # a refusal of fla's is this row's result, the rest is kept
        return {"floor_fused_gate_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"floor_fused_gate_ms": 1e3 * t["step_s"],
            "fused_gate_saving": floor["step_s"] / t["step_s"] - 1,
            "fused_gate_grad_rel_diff": diff}


def write_profile(path: str, steps: dict) -> dict:
    """Each step's CUDA kernels (3 runs, after one warm run), by total device time; returns
    each step's kernel time per run in ms (the layer alone is launch-bound at 8192 tokens, so
    this, not the wall time, says what its kernels cost)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    parts, device_ms = [], {}
    for name, fn in steps.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                          max_name_column_width=70)
        parts.append(f"== {name} (3 steps)\n{table}")
        # the kernels' own rows, as the table's "Self CUDA time total" (the CPU ops'
        # rows repeat the time of the kernels they launched)
        device_ms[name] = sum(e.self_device_time_total for e in prof.key_averages()
                              if e.device_type == DeviceType.CUDA) / 3e3
    Path(path).write_text("\n".join(parts))
    print("\n".join(p[:4000] for p in parts), flush=True)
    return device_ms


# What a JSON holds for transformers' row(s) while they run: a process ended during them (a
# call's time limit) leaves our rows and says that theirs did not finish.
HF_UNFINISHED = ("not finished: the process ended during transformers' rows (a time limit or a "
                 "crash; its log says which)")


def _save(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--profile", default=None, help="write the layer's kernel profile here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = json.loads(Path(args.config).read_text())
    vocab = config_from_hf(hf).vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.seq,), generator=gen)
               for _ in range(args.steps + args.warmup)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "config": str(args.config), "seq": args.seq, "torch": torch.__version__,
              "hf_paths": hf_paths()}
    if device.type == "cuda":
        import triton
        result["triton"] = triton.__version__
    if not args.skip_layer:
        result["layer"] = bench_layer(hf, args.seq, device, args.steps, args.warmup,
                                      args.profile)
        _save(result, args.out)
    try:
        result["mpcore"] = bench_mpcore(hf, batches, device, args.steps, args.warmup)
        result["mpcore"]["tokens_per_s"] = args.seq / result["mpcore"]["step_s"]
    except torch.cuda.OutOfMemoryError as e:
        result["mpcore"] = oom_row(e, device)
    _save(result, args.out)
    if not args.skip_hf:
        _save({**result, "hf": HF_UNFINISHED}, args.out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["hf"] = bench_hf(hf, batches, device, args.steps, args.warmup)
        if "step_s" in result["hf"] and "step_s" in result["mpcore"]:
            result["hf"]["tokens_per_s"] = args.seq / result["hf"]["step_s"]
            result["speedup"] = result["hf"]["step_s"] / result["mpcore"]["step_s"]
            if device.type == "cuda":
                result["memory_ratio"] = result["mpcore"]["peak_gib"] / result["hf"]["peak_gib"]
        _save(result, args.out)
    if args.skip_layer:
        result["layer"] = None
        _save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
