"""Benchmark of the fused loss heads against torch, liger, cut-cross-entropy and verl (CUDA).

    python -m tests.perf.bench_loss [OUT.json] [--chunk-mib 1024,2048]   # one GPU, all shapes and peers
    torchrun --nproc-per-node 2 -m tests.perf.bench_loss --tp2 [OUT.json]

Forward + backward (gradients of hidden and weight), bf16 inputs, median of 10 timed runs after
3 warm-ups (the first also compiles), CUDA events. Floor = 6*N*H*V / (bf16 8192^3 matmul rate measured in the same run).
``--chunk-mib`` adds our two heads again with other logits chunk budgets
(``_lce_chunks.CHUNK_BYTES``, default 512 MiB) as rows ``mpcore CE @N MiB`` and
``mpcore logprobs+entropy @N MiB``, for an A/B of the chunk size in one run.
"Extra GiB" is max_memory_allocated during one step minus memory_allocated before it, with the
gradients (held after the step) included. Errors: against float64 math on a smaller shape.
``--tp2`` splits the vocab over 2 GPUs (NCCL) and reports ms per GPU against tp=1 on rank 0.
Writes JSON (default tests/perf/results/loss_h200.json, or loss_h200_tp2.json) and prints a
table. Peers that are not importable are recorded as "not installed"; an OOM as "OOM".

The RL heads (per-token log-prob + entropy, both with a per-token upstream gradient: the
objective ``sum(lp / N - 0.01 * entropy / N)``): ours (``mpcore.kernels.linear_logprobs``) beside
verl 0.9.1's fused Triton head (``verl.utils.kernel.linear_cross_entropy``, reduction "none",
temperature 1), on the same inputs. verl has no ignore index (a row whose label is outside
the vocabulary gets an unset log-prob), so its rows are given label 0 where ours ignore one
(-100) and that log-prob is zeroed after, as verl's callers mask theirs: the function ours
computes. Before a shape is timed, verl's log-probs, entropy and both gradients are compared
with ours on that shape's inputs (max abs <= 1e-3 on log-probs and entropy, relative norm <=
3e-2 on the gradients: ``RL_TOLERANCE`` says why); a mismatch is recorded instead of a time
and the script exits 1 after writing the JSON, so a wrong call cannot give a ratio.
Per shape ``rl_heads``: both times, verl's ms over ours, and each over the 6NHV floor and
the 8NHV one (4 GEMMs: both heads recompute the logits in backward rather than store them).
verl is loaded from its wheel without ``verl/__init__.py`` (which imports ray): empty
``verl`` and ``verl.utils`` packages whose ``__path__`` is the wheel's, then its kernel
modules. Its kernel is CUDA only (it asserts CUDA tensors and opens NVTX ranges), so the
comparison runs on the GPU only; without verl the row is skipped with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpcore.kernels import _lce_chunks, linear_cross_entropy, linear_logprobs

SHAPES = [(8192, 4096, 128256), (16384, 2048, 151936), (32768, 4096, 128256)]
ERROR_SHAPE = (4096, 2048, 32000)
IGNORE = -100
OURS_RL, VERL_RL = "mpcore logprobs+entropy", "verl logprobs+entropy"
# verl against ours, bf16 inputs. Log-probs and entropy: both heads keep fp32 logits (ours is
# ~1e-5 from float64, results/loss_h200.json). Gradients: each bf16 head is 2e-3 to 1.3e-2 from
# float64 there (CCE the most), so two of them may differ by twice that; a wrong call (a loss
# for a log-prob, another temperature, scored ignored rows, shifted labels) is off by 1e-1 or more.
RL_TOLERANCE = {"logprob_max_abs": 1e-3, "entropy_max_abs": 1e-3, "grad_hidden_rel": 3e-2,
                "grad_weight_rel": 3e-2}


def _time(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time(lambda: a @ b, warmup=5, reps=20)
    return 2 * 8192**3 / ms / 1e9


class _Chunked:
    """One of our heads with ``CHUNK_BYTES`` set to ``mib`` MiB for a whole step (forward and
    backward: the RL head picks its chunks again in backward); see ``_step``."""

    def __init__(self, fn, mib: int):
        self.fn, self.chunk_bytes = fn, mib * 2**20

    def __call__(self, h, w, y):
        return self.fn(h, w, y)


def _peers(chunk_mibs=()):
    """name -> loss(hidden, weight, labels), or the reason it is missing."""
    out = {
        "mpcore CE": lambda h, w, y: linear_cross_entropy(h, w, y),
        "mpcore logprobs+entropy": _mpcore_logprobs,
    }
    for mib in chunk_mibs:
        out[f"mpcore CE @{mib} MiB"] = _Chunked(out["mpcore CE"], mib)
        out[f"mpcore logprobs+entropy @{mib} MiB"] = _Chunked(_mpcore_logprobs, mib)
    out |= {
        "torch bf16 CE": lambda h, w, y: F.cross_entropy(h @ w.T, y),
        "torch fp32 CE": lambda h, w, y: F.cross_entropy((h @ w.T).float(), y),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger FLCE"] = lambda h, w, y: liger(w, h, y)
    except ImportError:
        out["liger FLCE"] = "not installed"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["CCE default"] = lambda h, w, y: cce(h, w, y)
        out["CCE exact"] = lambda h, w, y: cce(h, w, y, filter_eps=None)
    except ImportError:
        out["CCE default"] = out["CCE exact"] = "not installed"
    verl = verl_logprobs_fn()
    out[VERL_RL] = verl if isinstance(verl, str) else (
        lambda h, w, y: _rl_objective(*verl(h, w, y)))
    return out


def _rl_objective(lp, ent):
    """An RL-style objective: both outputs carry a per-token upstream gradient."""
    n = lp.shape[0]
    return (lp * (1.0 / n) - ent * (0.01 / n)).sum()


def _mpcore_logprobs(h, w, y, group=None, vocab_size=None):
    return _rl_objective(*linear_logprobs(h, w, y, group=group, vocab_size=vocab_size))


@functools.cache
def verl_logprobs_fn():
    """(hidden, weight, labels) -> (logprobs [N] fp32, entropy [N] fp32) through verl's fused
    Triton head with our ignore index (module docstring), or why it cannot be had."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return ("skipped: verl is not importable (install the verl 0.9.1 wheel: "
                "pip install --no-deps --target DIR verl-0.9.1-py3-none-any.whl, DIR on "
                "PYTHONPATH; run_device.sh does this with .whl carried)")
    root = spec.submodule_search_locations[0]
    for name, path in (("verl", root), ("verl.utils", os.path.join(root, "utils"))):
        if name not in sys.modules:  # verl/__init__.py imports ray, which the kernel never uses
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
    try:
        # its Triton kernels, which the head imports on its first call: here, so that a
        # failure is the row's reason instead of an error in the middle of the run
        from verl.utils.kernel import kernels  # noqa: F401
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as head
    except ImportError as e:
        return f"skipped: verl's kernel module does not import ({type(e).__name__}: {e})"

    def logprobs(hidden, weight, labels):
        valid = labels != IGNORE
        lp, ent = head(hidden, weight, labels.masked_fill(~valid, 0), 1.0, "none")
        return torch.where(valid, lp, 0.0), ent

    return logprobs


def _rl_outputs(logprobs_fn, hidden, weight, labels):
    """Log-probs, entropy (detached) and the objective's gradients of hidden and weight."""
    lp, ent = logprobs_fn(hidden, weight, labels)
    grads = torch.autograd.grad(_rl_objective(lp, ent), (hidden, weight))
    return lp.detach(), ent.detach(), *grads


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def compare_rl_heads(peer_fn, hidden, weight, labels) -> dict:
    """The peer's log-probs, entropy and gradients against ours on the same inputs: max abs
    differences, relative norms, and ``ok`` (all within RL_TOLERANCE)."""
    ours = _rl_outputs(lambda h, w, y: linear_logprobs(h, w, y), hidden, weight, labels)
    peer = _rl_outputs(peer_fn, hidden, weight, labels)
    errors = {"logprob_max_abs": (peer[0] - ours[0]).abs().max().item(),
              "entropy_max_abs": (peer[1] - ours[1]).abs().max().item(),
              "grad_hidden_rel": _rel(peer[2], ours[2]), "grad_weight_rel": _rel(peer[3], ours[3])}
    del ours, peer
    torch.cuda.empty_cache()
    # written so that a NaN error fails too
    errors["ok"] = all(errors[k] <= tol for k, tol in RL_TOLERANCE.items())
    return errors


def _inputs(n, h, v, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device=device, generator=gen) / h**0.5).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    labels[::50] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _step(fn, hidden, weight, labels):
    with _lce_chunks.chunk_budget(getattr(fn, "chunk_bytes", None)):
        return torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight))


def measure(fn, hidden, weight, labels, floor_ms):
    """ms, ms/floor and extra peak GiB of one forward+backward, or 'OOM'."""
    try:
        _step(fn, hidden, weight, labels)  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = _step(fn, hidden, weight, labels)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before) / 2**30
        del grads
        ms = _time(lambda: _step(fn, hidden, weight, labels), warmup=2)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    return {"ms": round(ms, 2), "ms_over_floor": round(ms / floor_ms, 3),
            "extra_peak_gib": round(extra, 3)}


def errors_vs_fp64(peers):
    """Loss abs error and grad relative errors of each method against float64 math."""
    n, h, v = ERROR_SHAPE
    hidden, weight, labels = _inputs(n, h, v, seed=1)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = F.cross_entropy(h64 @ w64.T, labels)
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    out = {}
    for name, fn in peers.items():
        if isinstance(fn, str) or "logprobs" in name or isinstance(fn, _Chunked):
            continue
        loss = fn(hidden, weight, labels)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        out[name] = {"loss_abs": abs(loss.item() - ref.item()),
                     "grad_hidden_rel": ((gh.double() - rh).norm() / rh.norm()).item(),
                     "grad_weight_rel": ((gw.double() - rw).norm() / rw.norm()).item()}
    log_p = torch.log_softmax(h64.detach() @ w64.detach().T, -1)
    valid = labels >= 0
    rlp = log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    rent = -(log_p.exp() * log_p).sum(-1)
    heads = {OURS_RL: lambda h, w, y: linear_logprobs(h, w, y), VERL_RL: verl_logprobs_fn()}
    for name, head in heads.items():
        if isinstance(head, str):
            continue
        with torch.no_grad():
            lp, ent = head(hidden.detach(), weight.detach(), labels)
        out[name] = {"logprob_max_abs": (lp.double() - rlp)[valid].abs().max().item(),
                     "entropy_max_abs": (ent.double() - rent).abs().max().item()}
    return out


def run_single(path, chunk_mibs=()) -> int:
    rate = matmul_tflops()
    peers = _peers(chunk_mibs)
    if isinstance(peers[VERL_RL], str):
        print(f"{VERL_RL}: {peers[VERL_RL]}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "verl": _version("verl"), "matmul_bf16_tflops": round(rate, 1), "shapes": []}
    for n, h, v in SHAPES:
        floor_ms = 6 * n * h * v / (rate * 1e9)
        hidden, weight, labels = _inputs(n, h, v)
        grad_gib = (hidden.numel() + weight.numel()) * 2 / 2**30
        row = {"N": n, "H": h, "V": v, "floor_ms": round(floor_ms, 2),
               "grad_gib": round(grad_gib, 3), "results": {}}
        for name, fn in peers.items():
            check = None
            if name == VERL_RL and not isinstance(fn, str):  # same function as ours, or no time
                check = compare_rl_heads(verl_logprobs_fn(), hidden, weight, labels)
                print(name, "vs ours:", check, flush=True)
            if isinstance(fn, str):
                row["results"][name] = fn
            elif check is not None and not check["ok"]:
                row["results"][name] = {"mismatch": check}
            else:
                row["results"][name] = measure(fn, hidden, weight, labels, floor_ms)
            if check is not None:
                row["verl_vs_mpcore"] = check
            print(name, n, h, v, row["results"][name], flush=True)
        row["rl_heads"] = rl_heads(row["results"], floor_ms)
        result["shapes"].append(row)
        del hidden, weight, labels
        torch.cuda.empty_cache()
    result["errors_vs_fp64"] = {"shape": ERROR_SHAPE, "methods": errors_vs_fp64(peers)}
    _write(result, path)
    _print_table(result)
    mismatched = [r["N"] for r in result["shapes"]
                  if "verl_vs_mpcore" in r and not r["verl_vs_mpcore"]["ok"]]
    if mismatched:
        print(f"FAIL: verl's head differs from ours at N = {mismatched} (verl_vs_mpcore in the "
              "JSON): its call does not compute our function, so no ratio is given")
        return 1
    return 0


def rl_heads(results: dict, floor_ms: float) -> dict | None:
    """Ours and verl's RL head at one shape: ms, verl's ms over ours, each over the 6NHV and
    8NHV floors; None unless both were timed."""
    ours, verl = results.get(OURS_RL), results.get(VERL_RL)
    if not (isinstance(ours, dict) and "ms" in ours and isinstance(verl, dict) and "ms" in verl):
        return None
    floor8 = floor_ms * 8 / 6
    return {"mpcore_ms": ours["ms"], "verl_ms": verl["ms"],
            "verl_over_mpcore": round(verl["ms"] / ours["ms"], 3),
            "mpcore_over_6nhv": ours["ms_over_floor"], "verl_over_6nhv": verl["ms_over_floor"],
            "mpcore_over_8nhv": round(ours["ms"] / floor8, 3),
            "verl_over_8nhv": round(verl["ms"] / floor8, 3)}


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_tp2(path):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rate = matmul_tflops()
    rows = []
    for n, h, v in SHAPES:
        hidden, weight, labels = _inputs(n, h, v)
        v_local = -(-v // world)
        w_pad = torch.zeros(v_local * world, h, device="cuda", dtype=weight.dtype)
        w_pad[:v] = weight.detach()
        shard = w_pad[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        del w_pad
        row = {"N": n, "H": h, "V": v, "floor_ms_tp1": round(6 * n * h * v / (rate * 1e9), 2)}
        for name, loss_fn in [("CE", _tp_ce), ("logprobs+entropy", _tp_logprobs)]:
            tp1 = None
            if rank == 0:
                tp1 = measure(lambda a, b, c, f=loss_fn, v=v: f(a, b, c, None, v), hidden, weight,
                              labels, row["floor_ms_tp1"])
            dist.barrier()
            tp2 = measure(lambda a, b, c, f=loss_fn, v=v: f(a, b, c, dist.group.WORLD, v), hidden,
                          shard, labels, row["floor_ms_tp1"] / world)
            if rank == 0:
                ratio = (tp2["ms"] / tp1["ms"] if isinstance(tp1, dict) and isinstance(tp2, dict)
                         else None)
                row[name] = {"tp1": tp1, "tp2_per_gpu": tp2,
                             "tp2_over_tp1": None if ratio is None else round(ratio, 3)}
                print(name, n, h, v, row[name], flush=True)
        rows.append(row)
        del hidden, weight, labels, shard
        torch.cuda.empty_cache()
    if rank == 0:
        _write({"device": torch.cuda.get_device_name(), "world": world,
                "matmul_bf16_tflops": round(rate, 1), "shapes": rows}, path)
        print(f"{'N x H x V':>22} {'head':>18} {'tp1 ms':>8} {'tp2 ms/GPU':>11} {'ratio':>6}")
        for r in rows:
            for name in ("CE", "logprobs+entropy"):
                d = r[name]
                t1 = d["tp1"]["ms"] if isinstance(d["tp1"], dict) else d["tp1"]
                t2 = d["tp2_per_gpu"]["ms"] if isinstance(d["tp2_per_gpu"], dict) else "OOM"
                print(f"{r['N']:>6} x {r['H']:>4} x {r['V']:>6} {name:>18} {t1:>8} {t2:>11} "
                      f"{d['tp2_over_tp1']!s:>6}")
    dist.destroy_process_group()


def _tp_ce(h, w, y, group, vocab):
    return linear_cross_entropy(h, w, y, group=group, vocab_size=vocab)


def _tp_logprobs(h, w, y, group, vocab):
    return _mpcore_logprobs(h, w, y, group=group, vocab_size=vocab)


def _write(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


def _cell(r):
    if isinstance(r, str):
        return r
    if "mismatch" in r:
        return "MISMATCH vs ours, not timed: " + ", ".join(
            f"{k} {v:.2e}" for k, v in r["mismatch"].items() if k != "ok")
    return f"{r['ms']:.1f} / {r['ms_over_floor']:.2f}x / {r['extra_peak_gib']:.2f}"


def _print_table(result):
    print(f"bf16 matmul: {result['matmul_bf16_tflops']} TFLOP/s;"
          " cells: ms / x floor / extra peak GiB")
    for row in result["shapes"]:
        print(f"\n{row['N']} x {row['H']} x {row['V']}: floor {row['floor_ms']} ms, "
              f"grads {row['grad_gib']} GiB")
        for name, r in row["results"].items():
            print(f"  {name:>24}: {_cell(r)}")
        rl = row.get("rl_heads")
        if rl:
            print(f"  RL head: verl {rl['verl_ms']} ms / mpcore {rl['mpcore_ms']} ms = "
                  f"{rl['verl_over_mpcore']}x; x 8NHV floor: mpcore {rl['mpcore_over_8nhv']}, "
                  f"verl {rl['verl_over_8nhv']}")
    print("\nerrors vs fp64 at", result["errors_vs_fp64"]["shape"])
    for name, e in result["errors_vs_fp64"]["methods"].items():
        print(f"  {name:>24}: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))


def main(argv):
    tp2 = "--tp2" in argv
    args = [a for a in argv if a != "--tp2"]
    chunk_mibs = ()
    if "--chunk-mib" in args:
        i = args.index("--chunk-mib")
        chunk_mibs = tuple(int(m) for m in args[i + 1].split(","))
        del args[i:i + 2]
    default = "loss_h200_tp2.json" if tp2 else "loss_h200.json"
    path = args[0] if args else os.path.join(os.path.dirname(__file__), "results", default)
    if tp2:
        run_tp2(path)
        return 0
    return run_single(path, chunk_mibs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
