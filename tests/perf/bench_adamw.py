"""Benchmark: one AdamW step over Llama-3.2-1B's parameters, PyTorch's fused AdamW against
``TritonAdamW`` (optimizer.backend=triton, with block-size variants), against the bytes floor.

Usage: python -m tests.perf.bench_adamw [OUT.json] [--config CFG] [--bandwidth-gbs GB/s]

The step is what training runs: fp32 parameters, fp32 gradients, ``grad_scale`` (the clip
divisor) and ``found_inf`` (0) set as ``mpcore.train`` sets them, the groups of
``build_optimizer`` (weight decay on matrices). Timed with CUDA events over back-to-back steps
(device time, the host's launches overlapped), and the host time of one ``step()`` call with
the device idle (a call that synchronised with the device would show its device time here).
Floor: 28 bytes per element (parameter, gradient, two moments read; parameter and moments
written) at the HBM bandwidth (H200: 4.8 TB/s nominal); PyTorch's fused step also writes the
divided gradient back (32 bytes).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mpcore.config import load_config
from mpcore.kernels import adamw as kernel_module
from mpcore.optim import TritonAdamW

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "adamw_h200.json"
CONFIG = REPO / "launch" / "configs" / "llama3_1b.yaml"
VARIANTS = {"torch_fused": None, "triton": (1024, 4), "triton_b2048_w8": (2048, 8),
            "triton_b2048_w4": (2048, 4), "triton_b512_w2": (512, 2)}


def _shapes(cfg) -> list[tuple[int, ...]]:
    """The decoder's parameter shapes (fused qkv and gate|up, tied embedding), from a model
    built on the meta device."""
    from mpcore.build import resolve_model_config, run_family
    from mpcore.parallel.state import ParallelState

    family = run_family(cfg)
    _, model_cfg = resolve_model_config(cfg, family)
    with torch.device("meta"):
        model = family.build(model_cfg, ParallelState(), seed=0, device="meta",
                             dtype=torch.float32)
    return [tuple(p.shape) for p in model.parameters()]


def _optimizer(name, params, lr):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if name == "torch_fused":
        return torch.optim.AdamW(groups, fused=True, **kw)
    return TritonAdamW(groups, **kw)


def _time(name, shapes, steps, warmup) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)
              for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=gen) * 1e-3 for s in shapes]
    opt = _optimizer(name, params, 1e-4)
    opt.found_inf = torch.zeros((), device="cuda")
    opt.grad_scale = torch.full((), 1.5, device="cuda")
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        opt.step()
    end.record()
    torch.cuda.synchronize()
    host = []  # one call's host time, the device idle before it (nothing queued to wait on)
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    out = {"device_ms": start.elapsed_time(end) / steps, "host_ms": 1e3 * sorted(host)[2],
           "finite": finite}
    del opt, params, grads
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw.py needs a CUDA GPU")
    shapes = _shapes(load_config(args.config))
    numel = sum(torch.Size(s).numel() for s in shapes)
    floor = {"28B": 28 * numel / (args.bandwidth_gbs * 1e9) * 1e3,
             "32B": 32 * numel / (args.bandwidth_gbs * 1e9) * 1e3}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "config": args.config.stem, "params": len(shapes), "numel": numel,
              "bandwidth_gbs": args.bandwidth_gbs, "floor_ms": floor, "rows": {}}
    default = (kernel_module.BLOCK, kernel_module.NUM_WARPS)
    for name, launch in VARIANTS.items():
        if launch is not None:
            kernel_module.BLOCK, kernel_module.NUM_WARPS = launch
        try:
            row = _time(name, shapes, args.steps, args.warmup)
        finally:
            kernel_module.BLOCK, kernel_module.NUM_WARPS = default
        row["of_28B_floor"] = floor["28B"] / row["device_ms"]
        report["rows"][name] = row
        print(f"{name:>18}: device {row['device_ms']:7.3f} ms/step ({row['of_28B_floor']:.0%} "
              f"of the 28 B floor {floor['28B']:.3f} ms), host {row['host_ms']:.3f} ms/call")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
