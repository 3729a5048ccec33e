"""Pipeline bubble benchmark: a schedule's step wall time and measured bubble against its
theoretical bubble (``mpcore.parallel.pp_schedule.theoretical_bubble``).

    python -m tests.perf.bench_pp [OUT.json] [--pp 2] [--microbatches 2,4,8]
                                  [--schedules 1F1B,GPipe,...]       # CPU, gloo, spawned ranks
    torchrun --nproc-per-node 4 -m tests.perf.bench_pp --gpu [OUT.json] [--pp 4] ...  # CUDA, NCCL

A Llama-shaped decoder (``SHAPE``; 8 layers, bf16 autocast on CUDA, fp32 on CPU), each
micro-batch one packed stream of ``TOKENS`` tokens in 4 documents. Per schedule and micro-batch
count: 2 warm-up steps, then the median of 5 timed steps (barrier before, slowest rank's time).
The measured bubble of a rank is ``1 - busy / wall``, where ``busy`` is the same stages'
forward and backward of every micro-batch run back to back without the pipeline (no waiting,
no p2p) on that rank, measured right after each timed step (median over the pairs); the rank
with the most idle time is reported. The JSON records the machine's load average: on a shared
machine other processes' work shows up as bubble. On the CPU the ranks
share the machine's cores (one thread each), so compare schedules within one run, not across
machines. Writes JSON (default tests/perf/results/pp_cpu.json or pp_gpu.json) and prints a
table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpcore.models.common.config import ModelConfig
from mpcore.models.common.decoder import build_model
from mpcore.models.common.inputs import local_text_inputs
from mpcore.models.common.stage import build_stages
from mpcore.parallel.loss import global_valid_count
from mpcore.parallel.pp import Pipeline
from mpcore.parallel.pp_schedule import SCHEDULES, placement, theoretical_bubble
from mpcore.parallel.state import ParallelState

SHAPE = dict(vocab_size=2048, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
             intermediate_size=704, tie_embeddings=False)
TOKENS = 512
WARMUP, TIMED = 2, 5
RESULTS = Path(__file__).parent / "results"


def _inputs(state: ParallelState, m: int, device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(m):
        ids = torch.randint(0, SHAPE["vocab_size"], (TOKENS,), generator=gen).to(device)
        cu = torch.tensor([0, 100, 250, 400, TOKENS], dtype=torch.int32, device=device)
        out.append(local_text_inputs(state, ids, cu)[1])
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(pipe: Pipeline, batches, device) -> float:
    """Seconds of this rank's stages' forward + backward over every micro-batch, back to back
    (module docstring)."""
    start = time.perf_counter()
    for module in pipe.modules:
        module.begin(batches)
        example, _ = module.example_io(batches.capacity, device)
        for i in range(len(batches)):
            x = torch.tensor([i], device=device) if module.is_first else torch.randn_like(
                example).requires_grad_()
            out = module(x)
            out.backward(torch.ones_like(out) if module.is_last else torch.randn_like(out))
    _sync(device)
    return time.perf_counter() - start


def _time_step(pipe: Pipeline, batches, device) -> float:
    dist.barrier()
    start = time.perf_counter()
    pipe.step(batches)
    _sync(device)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
    return float(elapsed)


def bench_one(state: ParallelState, schedule: str, m: int, device) -> dict:
    virtual = 1 if placement(schedule) == "single" else 2
    cfg = ModelConfig(**SHAPE)
    stages = build_stages(build_model, cfg, state, schedule=schedule, virtual=virtual,
                          device=device)
    pipe = Pipeline(stages, state, schedule=schedule, num_microbatches=m, virtual=virtual,
                    device=device)
    inputs = _inputs(state, m, device)
    batches = pipe.micro_batches(inputs, global_valid_count([i["labels"] for i in inputs], None))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        for _ in range(WARMUP):
            _time_step(pipe, batches, device)
        # Each timed step paired with a busy measurement right after it, so a change of the
        # machine's load between them (other processes) moves both.
        pairs = [(_time_step(pipe, batches, device), _busy(pipe, batches, device))
                 for _ in range(TIMED)]
    wall = statistics.median(w for w, _ in pairs)
    idle = torch.tensor(statistics.median(max(0.0, 1.0 - b / w) for w, b in pairs))
    dist.all_reduce(idle, op=dist.ReduceOp.MAX)
    return {"schedule": schedule, "pp": state.pp, "virtual": virtual, "microbatches": m,
            "step_ms": round(1e3 * wall, 2), "measured_bubble": round(float(idle), 4),
            "theoretical_bubble": round(theoretical_bubble(schedule, state.pp, m, virtual), 4)}


def run(rank: int, world: int, schedules: list[str], counts: list[int], device_kind: str):
    torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if (
        device_kind == "cuda") else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state = ParallelState.build(pp=world)
    rows = []
    for schedule in schedules:
        for m in counts:
            try:
                rows.append(bench_one(state, schedule, m, device))
            except ValueError as e:  # a count this schedule refuses: recorded, not timed
                rows.append({"schedule": schedule, "pp": world, "microbatches": m,
                             "refused": str(e)})
    return rows


def _arg(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def main(argv: list[str]) -> None:
    gpu = "--gpu" in argv
    pp = int(_arg(argv, "--pp", "2"))
    counts = [int(x) for x in _arg(argv, "--microbatches", "2,4,8").split(",")]
    schedules = _arg(argv, "--schedules", ",".join(SCHEDULES)).split(",")
    flags = {"--pp", "--microbatches", "--schedules"}
    values = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags}
    paths = [a for a in argv if not a.startswith("--") and a not in values]
    out = Path(paths[0]) if paths else RESULTS / ("pp_gpu.json" if gpu else "pp_cpu.json")
    if gpu:  # under torchrun: this process is one rank
        dist.init_process_group("nccl")
        rows = run(dist.get_rank(), dist.get_world_size(), schedules, counts, "cuda")
        if dist.get_rank() != 0:
            return
    else:
        from tests.dist.harness import run_distributed

        rows = run_distributed(run, pp, schedules, counts, "cpu", timeout=1800)[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cuda" if gpu else "cpu", "shape": SHAPE,
                               "load_average_1min": os.getloadavg()[0],
                               "tokens_per_microbatch": TOKENS, "rows": rows}, indent=1))
    print(f"{'schedule':<22}{'m':>4}{'step ms':>10}{'bubble':>9}{'theory':>9}")
    for r in rows:
        if "refused" in r:
            print(f"{r['schedule']:<22}{r['microbatches']:>4}  refused: {r['refused'][:60]}")
        else:
            print(f"{r['schedule']:<22}{r['microbatches']:>4}{r['step_ms']:>10.1f}"
                  f"{r['measured_bubble']:>9.3f}{r['theoretical_bubble']:>9.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
