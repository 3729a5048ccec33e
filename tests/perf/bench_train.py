"""Benchmark: training steps of the Llama-3.2-1B shape, mpcore vs transformers (+ liger-kernel).

Usage (one GPU, both sides in one run):
    python -m tests.perf.bench_train [OUT.json] [--config PATH] [--steps 20] [--warmup 5]
        [--seq 4096] [--micro-batch 4] [--activation-checkpointing] [--skip-hf]
        [--fp8 none|tensorwise|te_delayed|te_current] [--attention-backend auto|flash|sdpa_cudnn]
        [--linear-backend native|te|auto] [--variants native:none,te:none,te:te_delayed,...]
        [--timing steady|synced]
Layouts (mpcore only; run under torchrun, e.g. on nvidia-h200-x2):
    torchrun --nproc-per-node 2 -m tests.perf.bench_train OUT.json --tp 2   (or --cp 2, or
        neither for dp=2; --data-parallel fsdp|ddp, --cp-mode ring|ulysses)

mpcore runs through pretrain's own code path (``mpcore.build.build`` + ``Trainer.train_step``:
label shift, CP split, loss over the global valid-token count, true global grad norm, clipping,
fused AdamW, fp32 master weights + bf16 autocast) on ``--config`` (default
launch/configs/llama3_1b.yaml), with random token data instead of the corpus (one document per
sample, ``micro_batch`` samples of ``seq`` tokens per step on each dp rank). The baselines:
``LlamaForCausalLM`` of the same shape (``mpcore.models.hf_config_dict`` of the config: tied, rope
theta 500000 with llama3 scaling for the default), fp32 parameters, bf16 autocast, SDPA
attention, fused AdamW with the same hyper-parameters and the same lr schedule (``lr_at``, 10
warmup steps), gradient clipping at 1.0, the same token batches ``[micro_batch, seq]``; then again with liger-kernel's Llama patches (fused linear cross
entropy, RMSNorm, SwiGLU, RoPE) when liger_kernel imports, else reported as missing.

Without CUDA (a smoke check, e.g. tests/unit/test_bench_smoke.py with launch/configs/tiny.yaml)
both sides run on the CPU the way pretrain does there: fp32 without autocast, unfused AdamW,
gloo under torchrun. The JSON's ``device`` is then "cpu", ``peak_gib`` is null (there is no
allocator peak to read) and ``tokens_per_s_per_gpu`` is per process.

Reported per side: the step time over ``--steps`` timed steps (after ``--warmup``; ``--timing
steady``, the default: their mean, run back to back as a training loop runs them, mpcore's
through ``Trainer.launch_step`` / ``settle`` as ``fit`` does and the baselines' without a
``float(loss)`` per step; ``--timing synced``: the median, the device synchronised around each
step, as before 2026-12-02; the JSON's ``timing`` says which), tokens/s per GPU, peak allocated
memory (``torch.cuda.max_memory_allocated``, reset between sides), and
the first/last loss (a sanity check that each side trains). ``--fp8``, ``--attention-backend``
and ``--linear-backend`` set mpcore's ``model.fp8``, ``model.attention_backend`` and
``model.linear_backend`` (the baselines stay bf16 with SDPA); the JSON names them (``fp8``: the
recipe, ``backend``: the attention backend as asked, ``linear_backend``: the GEMM backend as
resolved, native or te). ``--variants`` times several ``linear_backend:fp8`` pairs of mpcore in
the same process, beside one run of each baseline: the first fills the top-level fields, and
``variants`` lists each with its own speedup and memory ratio against the best baseline. A
third field ``bf16_wgrad`` (``te:te_delayed:bf16_wgrad``) has TE return its weight gradients
in bf16 for autograd to cast (``TEGemm.fp32_wgrad = False``), for an A/B of the fp32 ones;
``lceMIB`` instead (``native:none:lce1024``) sets the loss head's logits chunk budget
(``mpcore.kernels._lce_chunks.CHUNK_BYTES``, default 512 MiB) for that variant, and ``bf16_residual``
(``te:te_delayed:bf16_residual``) runs it with ``model.residual_dtype=autocast`` (the residual
stream in bf16, as Megatron-core and torchtitan keep it; default float32, as transformers).
Options combine with ``+`` (``te:te_delayed:bf16_residual+adamw_triton``); ``adamw_triton`` /
``adamw_torch`` pick that variant's ``optimizer.backend`` (default ``--optimizer-backend``,
torch: PyTorch's fused AdamW).
JSON goes to OUT (default tests/perf/results/train_h200.json), written by rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from mpcore.backends import resolve_linear_backend
from mpcore.build import build, resolve_device, resolve_model_config, setup
from mpcore.config import load_config
from mpcore.kernels import _lce_chunks
from mpcore.launch.pretrain import init_distributed
from mpcore.models import hf_config_dict
from mpcore.optim import lr_at, set_lr
from mpcore.parallel.te import TEGemm
from mpcore.train import Trainer

REPO = Path(__file__).resolve().parents[2]


class Variant(NamedTuple):
    """One ``--variants`` item: ``linear_backend:fp8[:option]``."""

    linear_backend: str
    fp8: str
    bf16_wgrad: bool = False
    chunk_mib: int | None = None  # the loss head's logits chunk budget (None: the default)
    residual_dtype: str = "float32"
    optimizer_backend: str | None = None  # None: --optimizer-backend


DEFAULT_OUT = Path(__file__).parent / "results" / "train_h200.json"
CONFIG = REPO / "launch" / "configs" / "llama3_1b.yaml"


class RandomTokens:
    """Loader stand-in: ``grad_accum`` micro-batches of ``micro_batch`` random samples per step,
    each one document of ``seq`` tokens, drawn from a generator seeded by (seed, dp_rank)."""

    def __init__(self, vocab: int, seq: int, micro_batch: int, grad_accum: int, seed: int,
                 dp_rank: int = 0):
        self.vocab, self.seq, self.micro_batch, self.grad_accum = vocab, seq, micro_batch, grad_accum
        self.gen = torch.Generator().manual_seed(seed * 1000 + dp_rank)

    def tokens(self) -> torch.Tensor:
        """int64 [micro_batch, seq]."""
        return torch.randint(0, self.vocab, (self.micro_batch, self.seq), generator=self.gen)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for _ in range(self.grad_accum):
            ids = self.tokens()
            cu = torch.arange(0, (self.micro_batch + 1) * self.seq, self.seq, dtype=torch.int32)
            pos = torch.arange(self.seq).repeat(self.micro_batch)
            out.append({"input_ids": ids.reshape(-1), "cu_seqlens": cu, "position_ids": pos})
        return out

    def state_dict(self) -> dict:
        return {}


def _device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def back_to_back(step, indices, finish) -> list:
    """``step(i)`` for each i, each finished (``finish(what it returned)``) only after the next
    one was launched, as ``Trainer.fit`` does; the finished values in order."""
    done, earlier = [], None
    for i in indices:
        launched = step(i)
        if earlier is not None:
            done.append(finish(earlier))
        earlier = launched
    if earlier is not None:
        done.append(finish(earlier))
    return done


def _timed(step, steps: int, warmup: int, finish=float, steady: bool = False) -> dict:
    """Run ``step(i)`` for i in range(warmup + steps); ``finish(what it returned)`` is that
    step's loss as a float. Peak memory (CUDA's allocator peak; None on CPU), first/last loss.

    synced (default): the device is synchronised around every step; ``step_ms`` is the median
    of the last ``steps``. steady: the last ``steps`` run back to back as a training loop runs
    them, each step finished after the next one was started (what ``Trainer.fit`` does), the
    device synchronised only before and after them; ``step_ms`` is their mean. A step that
    waits for the device itself (``float(loss)`` inside, or a peer's own sync) gains nothing
    from steady timing; one that never waits overlaps its host work with the previous step."""
    cuda = torch.cuda.is_available()
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(warmup + (0 if steady else steps)):
        _sync()
        start = time.perf_counter()
        losses.append(finish(step(i)))
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if steady:
        _sync()
        start = time.perf_counter()
        losses += back_to_back(step, range(warmup, warmup + steps), finish)
        _sync()
        times = [(time.perf_counter() - start) / steps]
    return {"step_ms": 1e3 * statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "first_loss": losses[0], "last_loss": losses[-1],
            "timing": "steady" if steady else "synced"}


def bench_mpcore(args) -> dict:
    overrides = [f"data.seq_len={args.seq}", f"data.micro_batch={args.micro_batch}",
                 "data.grad_accum=1", f"parallel.tp={args.tp}", f"parallel.cp={args.cp}",
                 f"parallel.cp_mode={args.cp_mode}", f"parallel.data_parallel={args.data_parallel}",
                 f"parallel.sequence_parallel={args.tp > 1}",
                 f"parallel.activation_checkpointing={args.activation_checkpointing}",
                 f"training.device={_device_kind()}", "training.dtype=bfloat16",
                 "checkpoint.resume=false", "checkpoint.every=0",
                 f"optimizer.backend={args.optimizer_backend}",
                 "schedule.warmup_steps=10", f"logging.run_dir={args.run_dir}",
                 f"model.fp8={args.fp8}", f"model.attention_backend={args.attention_backend}",
                 f"model.linear_backend={args.linear_backend}",
                 f"model.residual_dtype={args.residual_dtype}"]
    cfg = load_config(args.config, overrides)
    state = setup(cfg, str(args.config))
    device = resolve_device(cfg)
    loader = RandomTokens(cfg.model.vocab_size, args.seq, args.micro_batch, 1, seed=0,
                          dp_rank=state.dp_rank)
    run = build(cfg, state, device, loader=loader)
    if args.bf16_wgrad:  # TE's weight gradients in bf16, cast to fp32 by autograd (as before)
        for module in run.model.modules():
            if isinstance(getattr(module, "gemm", None), TEGemm):
                module.gemm.fp32_wgrad = False
    trainer = Trainer(run)

    def forward_backward() -> float:  # the model alone: no grad norm, no optimizer step
        loss = trainer._forward_backward(run.loader.next_step())
        run.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    if args.forward_backward_only:
        result = _timed(lambda _: forward_backward(), args.steps, args.warmup)
    elif args.timing == "steady":  # launched, then settled during the next step (as fit)
        result = _timed(lambda _: trainer.launch_step(), args.steps, args.warmup,
                        finish=lambda pending: trainer.settle(pending)[0], steady=True)
    else:
        result = _timed(lambda _: trainer.train_step()[0], args.steps, args.warmup)
    tokens = args.seq * args.micro_batch * state.dp  # per step, whole world
    result["tokens_per_s_per_gpu"] = tokens / (result["step_ms"] / 1e3) / state.world_size
    result["layout"] = {"tp": state.tp, "cp": state.cp, "dp": state.dp,
                        "data_parallel": args.data_parallel, "cp_mode": args.cp_mode,
                        "sequence_parallel": args.tp > 1}
    return result  # the model and optimizer go with this frame


def _hf_config(cfg, source: str):
    """transformers' LlamaConfig of ``cfg``'s model (the fields pretrain's HF export writes)."""
    from transformers import LlamaConfig

    _, model_cfg = resolve_model_config(cfg)
    fields = hf_config_dict(model_cfg)
    arch = fields.pop("architectures")[0]
    fields.pop("model_type")
    if arch != "LlamaForCausalLM":
        raise ValueError(f"{source}: the HF baseline is LlamaForCausalLM (and liger's Llama "
                         f"patches) but this model exports as {arch}; pass --skip-hf or a "
                         f"Llama-shaped config")
    return LlamaConfig(**fields, use_cache=False)


def bench_hf(args, liger: bool) -> dict:
    from transformers import LlamaForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    # mpcore's schedule overrides: both sides step through the same lr_at schedule.
    cfg = load_config(args.config, ["schedule.warmup_steps=10"])
    device = torch.device(_device_kind())
    cuda = device.type == "cuda"  # as pretrain: bf16 autocast and fused AdamW on CUDA only
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(_hf_config(cfg, str(args.config)),
                                          attn_implementation="sdpa").to(device)
    model.train()
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  eps=opt.eps, weight_decay=opt.weight_decay, fused=cuda or None)
    loader = RandomTokens(cfg.model.vocab_size, args.seq, args.micro_batch, 1, seed=0)

    def step(i: int) -> float:
        set_lr(optimizer, lr_at(i + 1, cfg))  # optimizer step i + 1, as Trainer.train_step
        ids = loader.tokens().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not args.forward_backward_only:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # read by _timed (after the next step, when steady)

    result = _timed(step, args.steps, args.warmup, steady=args.timing == "steady")
    result["tokens_per_s_per_gpu"] = args.seq * args.micro_batch / (result["step_ms"] / 1e3)
    return result


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="model config (default: launch/configs/llama3_1b.yaml)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-mode", default="ring", choices=["ring", "ulysses"])
    parser.add_argument("--data-parallel", default="fsdp", choices=["fsdp", "ddp"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="only time mpcore")
    parser.add_argument("--forward-backward-only", action="store_true",
                        help="time forward + backward only (no clipping, no optimizer step)")
    parser.add_argument("--run-dir", default="/tmp/bench_train_run")
    parser.add_argument("--fp8", default="none",
                        choices=["none", "tensorwise", "te_delayed", "te_current"],
                        help="mpcore's model.fp8 (FP8 GEMMs in the decoder projections)")
    parser.add_argument("--linear-backend", default="native", choices=["native", "te", "auto"],
                        help="mpcore's model.linear_backend (TransformerEngine GEMMs: te)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "flash", "sdpa_cudnn", "reference"],
                        help="mpcore's model.attention_backend")
    parser.add_argument("--optimizer-backend", default="torch", choices=["torch", "triton"],
                        help="mpcore's optimizer.backend (a variant's adamw_* option wins)")
    parser.add_argument("--timing", default="steady", choices=["steady", "synced"],
                        help="steady: the timed steps back to back, as training runs them "
                             "(mean); synced: the device synchronised around each (median)")
    parser.add_argument("--variants", default="",
                        help="comma-separated linear_backend:fp8 pairs of mpcore to time beside "
                             "one run of the baselines (e.g. native:none,te:te_delayed); "
                             "overrides --linear-backend and --fp8")
    args = parser.parse_args(argv)
    args.variant_list, args.bf16_wgrad, args.residual_dtype = [], False, "float32"
    for item in filter(None, args.variants.split(",")):
        backend, _, rest = item.partition(":")
        fp8, _, option = rest.partition(":")
        options = set(filter(None, option.split("+")))
        chunks = [o[3:] for o in options if o.startswith("lce") and o[3:].isdigit()]
        adams = [o[len("adamw_"):] for o in options if o.startswith("adamw_")]
        known = {"bf16_wgrad", "bf16_residual", "adamw_torch", "adamw_triton"}
        unknown = options - known - {f"lce{c}" for c in chunks}
        if backend not in ("native", "te", "auto") or fp8 not in (
                "none", "tensorwise", "te_delayed", "te_current") or unknown or len(
                chunks) > 1 or len(adams) > 1 or any(int(c) == 0 for c in chunks):
            parser.error(f"--variants: {item!r} is not linear_backend:fp8[:OPTION[+OPTION]] "
                         "with options bf16_wgrad, bf16_residual, lceMIB, adamw_torch|triton "
                         "(e.g. te:te_delayed or native:none:lce1024+adamw_triton)")
        args.variant_list.append(Variant(
            backend, fp8, "bf16_wgrad" in options, int(chunks[0]) if chunks else None,
            "autocast" if "bf16_residual" in options else "float32",
            adams[0] if adams else None))
    if args.variant_list:
        first = args.variant_list[0]
        args.linear_backend, args.fp8 = first.linear_backend, first.fp8
        args.bf16_wgrad, args.residual_dtype = first.bf16_wgrad, first.residual_dtype
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # pretrain's: NCCL on CUDA, gloo on CPU, within the config's rendezvous timeout
    init_distributed(load_config(args.config).parallel.init_timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"device": device, "torch": torch.__version__,
              "world_size": world, "shape": args.config.stem, "seq": args.seq,
              "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup,
              "activation_checkpointing": args.activation_checkpointing,
              "forward_backward_only": args.forward_backward_only, "fp8": args.fp8,
              "backend": args.attention_backend,
              "linear_backend": resolve_linear_backend(args.linear_backend, _device_kind(),
                                                       args.fp8)}
    hf = world == 1 and not args.skip_hf
    if hf:  # a config the baseline cannot build fails here, before the mpcore run
        _hf_config(load_config(args.config), str(args.config))
    pairs = args.variant_list or [Variant(args.linear_backend, args.fp8, args.bf16_wgrad,
                                          residual_dtype=args.residual_dtype)]
    # Every variant resolved (TE imported) before the first runs: a missing backend fails here.
    resolved = [resolve_linear_backend(v.linear_backend, _device_kind(), v.fp8) for v in pairs]
    variants = []
    for v, chosen in zip(pairs, resolved, strict=True):
        fields = {k: getattr(v, k) for k in ("linear_backend", "fp8", "bf16_wgrad",
                                             "residual_dtype")}
        fields["optimizer_backend"] = v.optimizer_backend or args.optimizer_backend
        one = argparse.Namespace(**{**vars(args), **fields})
        # the loss head's logits chunk budget, for this variant only
        with _lce_chunks.chunk_budget(None if v.chunk_mib is None else v.chunk_mib * 2**20):
            variants.append({"fp8": v.fp8, "linear_backend": chosen,
                             "lce_chunk_mib": _lce_chunks.CHUNK_BYTES // 2**20,
                             "residual_dtype": v.residual_dtype,
                             "optimizer_backend": fields["optimizer_backend"],
                             "mpcore": bench_mpcore(one)})
        if chosen == "te":
            variants[-1]["te_weight_grad"] = ("bf16, cast by autograd" if v.bf16_wgrad
                                              else "fp32")
        _free()
    report["mpcore"] = variants[0]["mpcore"]
    if hf:
        import transformers

        report["transformers_version"] = transformers.__version__
        report["hf"] = bench_hf(args, liger=False)
        _free()
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            report["hf_liger"] = {"missing": str(e)}
        else:
            if torch.cuda.is_available():
                report["hf_liger"] = bench_hf(args, liger=True)
                _free()
            else:  # its Triton kernels take CUDA tensors only
                report["hf_liger"] = {"missing": "liger-kernel imports but needs CUDA"}
        base = report["hf_liger"] if "step_ms" in report["hf_liger"] else report["hf"]
        report["speedup_vs_best_baseline"] = (report["mpcore"]["tokens_per_s_per_gpu"]
                                              / base["tokens_per_s_per_gpu"])
        for v in variants:
            v["speedup_vs_best_baseline"] = (v["mpcore"]["tokens_per_s_per_gpu"]
                                             / base["tokens_per_s_per_gpu"])
            peak, base_peak = v["mpcore"]["peak_gib"], base["peak_gib"]
            v["memory_ratio_vs_best_baseline"] = (None if peak is None or base_peak is None
                                                  else peak / base_peak)
        report["memory_ratio_vs_best_baseline"] = variants[0]["memory_ratio_vs_best_baseline"]
    if args.variant_list:
        report["variants"] = variants
    if rank == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
