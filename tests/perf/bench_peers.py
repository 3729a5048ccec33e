"""Benchmark: the 1B training step of the strongest peers beside ours, one row per process.

Usage (one GPU; TransformerEngine and the peer wheels on PYTHONPATH, see tests/perf/NOTES.md):
    python -m tests.perf.bench_peers [--out tests/perf/results/peers] [--config PATH]
        [--shapes 4096x4,16384x1] [--rows megatron_bf16,megatron_fp8,...] [--steps 20]
        [--warmup 5] [--timeout 420]
CPU smoke check (tiny shape, eager, no fused kernels; proves imports, shims and the loops):
    CUDA_VISIBLE_DEVICES= python -m tests.perf.bench_peers --config launch/configs/tiny.yaml \
        --shapes 64x2 --steps 2 --warmup 1 --out /tmp/peers

Rows (each a fresh subprocess, so no row inherits another's allocator, compile cache or TE
state):
    megatron_bf16      Megatron-core GPTModel, TE layer spec, bf16 params, its
                       DistributedDataParallel (fp32 main grads) and distributed optimizer
    megatron_fp8       same, TE DelayedScaling through Megatron (fp8="hybrid", amax history
                       1024, max), as Megatron's own FP8 recipe
    torchtitan_bf16    torchtitan's llama3 "1B" flavour, FSDP2 on one GPU (fp32 params, bf16
                       compute, fp32 reduce), per-block torch.compile, flex attention
    torchtitan_float8  same + torchao float8 tensorwise (dynamic scaling) on every decoder
                       Linear, lm_head kept bf16 (as torchtitan's float8 recipes filter it)
    mpcore_bf16        tests/perf/bench_train.py --skip-hf --variants native:none
    mpcore_te_fp8      tests/perf/bench_train.py --skip-hf --variants te:te_delayed
    mpcore_bf16_res    the same two with the residual stream in bf16 (model.residual_dtype=
    mpcore_te_fp8_res  autocast), as Megatron-core and torchtitan keep theirs (ours is fp32
                       by default, as transformers keeps it under autocast); our rows'
                       optimizer is ``--optimizer-backend`` (torch: PyTorch's fused AdamW,
                       triton: TritonAdamW), named in each row's settings
The shape is the config's model section (default launch/configs/llama3_1b.yaml: hidden 2048,
16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256, tied). Every row trains on the same
tokens: bench_train's ``RandomTokens`` (seed 0), one document of ``seq`` tokens per sample, the
last token of each sample without a target. Every row takes a full step: forward, backward,
gradient clipping at the config's grad_clip, AdamW at the config's lr / betas / weight decay
with 10 warmup steps, each through the peer's own optimizer and scheduler.

Per row, ``OUT/<row>_<seq>x<micro_batch>.json`` holds bench_train's fields (``step_ms`` over
``--steps`` after ``--warmup``: with ``--timing steady``, the default, their mean with the steps
run back to back, each row's step reading its loss after the next step started, as its own
training loop would (Megatron's optimizer still reads its grad norm on the host each step, as
it does in Megatron); ``synced``: the median with the device synchronised around each step;
``timing`` says which; ``tokens_per_s_per_gpu``, ``peak_gib`` from CUDA's
allocator, ``first_loss`` / ``last_loss``) plus ``row``, ``settings`` and ``versions``; a row
that fails writes its ``error`` (the tail of its output) instead and the others still run.
Each row also records ``row_wall_s`` (its process, start to end) and
``matmul_bf16_tflops_before``: the bf16 8192^3 matmul rate measured in this process just before
the row started, which shows whether the GPU kept one speed through the call.
``OUT/summary.json`` gathers them, and a short table goes to stdout: per shape, each row's
step, tokens/s and peak, and our rows' speedup (tokens/s ratio) over each peer row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from mpcore.config import load_config
from tests.perf.bench_loss import matmul_tflops
from tests.perf.bench_train import RandomTokens, _timed
from tests.perf.megatron_peer import (
    AdamSettings,
    fused_settings,
    init_megatron,
    init_single_process_group,
    num_params,
    run_subprocess,
    train_step,
    training_pieces,
    transformer_config,
)
from tests.perf.megatron_peer import cuda as _cuda

REPO = Path(__file__).resolve().parents[2]

CONFIG = REPO / "launch" / "configs" / "llama3_1b.yaml"
DEFAULT_OUT = Path(__file__).parent / "results" / "peers"
OURS = {"mpcore_bf16": "native:none", "mpcore_te_fp8": "te:te_delayed",
        "mpcore_bf16_res": "native:none:bf16_residual",
        "mpcore_te_fp8_res": "te:te_delayed:bf16_residual"}
PEERS = ("megatron_bf16", "megatron_fp8", "torchtitan_bf16", "torchtitan_float8")
ROWS = (*PEERS, *OURS)
WARMUP_LR_STEPS = 10  # bench_train's schedule override, kept for every row
VERSIONED = ("torch", "triton", "megatron-core", "transformer-engine", "transformer_engine_torch",
             "torchtitan", "torchao")


def _versions() -> dict:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class Batches:
    """The shared token data as (ids, labels, loss_mask), int64 / int64 / float [B, S] on
    ``device``: labels are the ids moved left by one, the last position masked (and set to 0,
    a valid id, for peers that index with it). ``crc`` accumulates a checksum of the ids fed,
    so the JSON shows that every row saw the same tokens."""

    def __init__(self, vocab: int, seq: int, micro_batch: int, device: torch.device):
        self.tokens = RandomTokens(vocab, seq, micro_batch, 1, seed=0)
        self.device, self.crc = device, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = self.tokens.tokens()  # (B, S), the same draws bench_train makes
        self.crc = zlib.crc32(ids.numpy().tobytes(), self.crc)
        labels = torch.zeros_like(ids)
        labels[:, :-1] = ids[:, 1:]
        mask = torch.ones(ids.shape, dtype=torch.float32)
        mask[:, -1] = 0.0
        return (ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True),
                mask.to(self.device, non_blocking=True))


# --- Megatron-core ---------------------------------------------------------------------------


def _megatron_model(m, seq: int, fp8: bool):
    """GPTModel of the config's shape; TE layer spec on CUDA (the local spec on the CPU smoke
    path, which has no TE), bf16 parameters, Megatron's fused kernels on CUDA."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    fp8_fields = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                      fp8_amax_compute_algo="max") if fp8 else {}
    config = transformer_config(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        num_query_groups=m.num_kv_heads, kv_channels=m.head_dim or m.hidden_size // m.num_heads,
        ffn_hidden_size=m.intermediate_size, layernorm_epsilon=m.rms_norm_eps, **fp8_fields)
    spec = get_gpt_layer_with_transformer_engine_spec() if _cuda() else get_gpt_layer_local_spec(
        normalization="RMSNorm")
    scaling = m.rope_scaling or {}
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                     max_sequence_length=seq, share_embeddings_and_output_weights=m.tie_embeddings,
                     position_embedding_type="rope", rotary_base=int(m.rope_theta),
                     rope_scaling=bool(scaling),
                     rope_scaling_factor=float(scaling.get("factor", 8.0)))
    settings = {"layer_spec": "transformer_engine" if _cuda() else "local", "params": "bf16",
                "main_grads": "fp32", "optimizer": "distributed (Megatron)",
                "fp8": "hybrid delayed, amax history 1024, max" if fp8 else None,
                **fused_settings()}
    return config, model, settings


def expected_params(m) -> int:
    """Parameters of a Llama of the config's shape (tied or not), for the peers' shape check:
    embedding, per layer q/k/v/o + gate/up/down + two norms, the final norm, the head."""
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    attention = m.hidden_size * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    layer = attention + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    head = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    return m.vocab_size * m.hidden_size + m.num_layers * layer + m.hidden_size + head


def run_megatron(args, fp8: bool) -> dict:
    """One Megatron-core row: its DDP with fp32 grad buffers, the distributed optimizer and
    its scheduler, stepped as its own training loop steps (``megatron_peer``)."""
    cfg = load_config(args.config)
    m, opt = cfg.model, cfg.optimizer
    init_megatron(seed=0)
    config, model, settings = _megatron_model(m, args.seq, fp8)
    device = torch.device("cuda" if _cuda() else "cpu")
    data = Batches(m.vocab_size, args.seq, args.micro_batch, device)
    positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)
    settings["num_params"] = num_params(model)
    if settings["num_params"] != expected_params(m):
        raise RuntimeError(f"megatron: {settings['num_params']} parameters, the config's shape "
                           f"has {expected_params(m)}")
    if not _cuda():  # its rotary embedding, DDP buffers and optimizer allocate on CUDA only
        return {"skipped": "Megatron runs on CUDA only (rotary embedding, DDP grad buffers); "
                           "checked on the CPU: the model of this shape", "settings": settings}
    adam = AdamSettings(lr=opt.lr, min_lr=opt.lr * cfg.schedule.min_lr_ratio,
                        weight_decay=opt.weight_decay, betas=tuple(opt.betas), eps=opt.eps,
                        grad_clip=opt.grad_clip, warmup_steps=WARMUP_LR_STEPS,
                        total_steps=args.warmup + args.steps)
    model, optimizer, scheduler = training_pieces(config, model, adam)

    def step(_: int) -> torch.Tensor:  # its optimizer reads its grad norm itself (a sync)
        ids, labels, mask = data.next()
        return train_step(model, optimizer, scheduler, ids, positions, labels, mask).detach()

    result = _timed(step, args.steps, args.warmup, steady=args.timing == "steady")
    result["settings"], result["tokens_crc32"] = settings, data.crc
    return result


# --- torchtitan ------------------------------------------------------------------------------


def torchtitan_shims() -> list[str]:
    """Make torchtitan 0.3.0 (written against a newer torch) import and run on torch 2.11; each
    shim applies only where this torch lacks what torchtitan uses. Returns the ones applied."""
    import inspect
    import types

    import torch.distributed.fsdp as fsdp
    from torch.nn.attention.flex_attention import create_block_mask

    applied = []
    if not hasattr(fsdp, "DataParallelMeshDims"):  # imported by its full_dtensor path only
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        applied.append("torch.distributed.fsdp.DataParallelMeshDims placeholder")
    try:  # imported at module level by parts of torchtitan the benchmark never calls
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")
        stub.Dataset = stub.load_dataset = None
        stub.distributed = types.ModuleType("datasets.distributed")
        stub.distributed.split_dataset_by_node = None
        sys.modules["datasets"], sys.modules["datasets.distributed"] = stub, stub.distributed
        applied.append("empty datasets module")
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        import torchtitan.models.common.decoder as decoder

        make_mask = decoder.create_attention_mask

        def create_attention_mask(*a, separate_full_blocks=True, **kw):
            return make_mask(*a, **kw)

        decoder.create_attention_mask = create_attention_mask
        applied.append("create_attention_mask without separate_full_blocks=")
    return applied


def _torchtitan_model_config(m, float8: bool, cuda: bool):
    """torchtitan's llama3 "1B" flavour when the config is that shape (checked field by
    field), else the same builder at the config's shape (the CPU smoke path, where SDPA
    stands in for flex attention and float8 is emulated)."""
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
        llama3_configs,
    )

    config = llama3_configs["1B"](attn_backend="flex")
    attention, ffn = config.layers[0].attention, config.layers[0].feed_forward
    theirs = (config.dim, len(config.layers), attention.n_heads, attention.n_kv_heads,
              ffn.w1.out_features, config.vocab_size, config.enable_weight_tying)
    ours = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size,
            m.vocab_size, m.tie_embeddings)
    flavour = "1B" if theirs == ours else None
    if flavour is None:
        dim, vocab = m.hidden_size, m.vocab_size
        config = Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=m.tie_embeddings,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=_EMBEDDING_SKIP_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab,
                                  param_init=_output_linear_init(dim)),
            layers=_build_llama3_layers(
                n_layers=m.num_layers, dim=dim, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads,
                hidden_dim=m.intermediate_size, attn_backend="flex",
                rope=ComplexRoPE.Config(dim=dim // m.num_heads, max_seq_len=131072,
                                        theta=m.rope_theta, scaling="none")))
    if not cuda:  # flex attention has no backward on the CPU: torch SDPA, causal
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if float8:
        converter = Float8LinearConverter.Config(
            filter_fqns=["lm_head"], model_compile_enabled=cuda, emulate=not cuda).build()
        if cuda:  # its recipes are rowwise; tensorwise is torchao's default config
            import torch._inductor.config
            from torchao.float8 import Float8LinearConfig

            converter.torchao_config = Float8LinearConfig.from_recipe_name("tensorwise")
            torch._inductor.config.emulate_precision_casts = False  # set for rowwise only
        config = converter.convert(config)
    return config, flavour


def _torchtitan_model(args, m, float8: bool, cuda: bool):
    """The model as torchtitan's Trainer builds it: meta build with the RoPE cache sized to
    the sequence, ``parallelize_llama`` (per-block compile, then FSDP2 on a mesh of one, its
    classic ``partial_dtensor`` backend), ``to_empty`` + ``init_weights``. Returns the model,
    the compile config (the loss takes it too) and the flavour's name."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    model_config, flavour = _torchtitan_model_config(m, float8, cuda)
    for layer in model_config.layers:  # the Trainer sizes RoPE to training.seq_len
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=args.seq)
    if not cuda:  # torchtitan names its mesh "cuda" whenever no accelerator is found
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world_size=1)
    training = TrainingConfig(local_batch_size=args.micro_batch, seq_len=args.seq,
                              max_norm=load_config(args.config).optimizer.grad_clip,
                              disable_cuda_graphs=True, mixed_precision_param="bfloat16",
                              mixed_precision_reduce="float32")
    compile_config = CompileConfig(enable=cuda, components=["model", "loss"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_config.build()
    model = parallelize_llama(model, parallel_dims=dims, training=training,
                              parallelism=parallelism, compile_config=compile_config,
                              ac_config=None, dump_folder=tempfile.mkdtemp())
    model.to_empty(device=torch.device("cuda" if cuda else "cpu"))
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if num_params(model) != expected_params(m):
        raise RuntimeError(f"torchtitan: {num_params(model)} parameters, the config's shape "
                           f"has {expected_params(m)}")
    return model, compile_config, flavour


def torchtitan_loss(loss_fn, logits: torch.Tensor, labels: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy of ``logits`` (B, S, V) against ``Batches``' labels and
    mask: the masked positions take its ignore index (-100), the sum over the rest is divided
    by their count (its global_valid_tokens)."""
    labels = labels.masked_fill(mask == 0, -100)
    loss, _ = loss_fn(logits, labels, (labels != -100).sum())
    return loss


def run_torchtitan(args, float8: bool) -> dict:
    """One torchtitan row with its own training pieces: the model of ``_torchtitan_model``,
    its AdamW container (fused) and warmup scheduler, its ``clip_grad_norm_``, its compiled
    full-logits cross-entropy (sum over valid tokens / their count)."""
    shims = torchtitan_shims()
    init_single_process_group()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed import utils as dist_utils

    cuda = _cuda()
    cfg = load_config(args.config)
    m, opt = cfg.model, cfg.optimizer
    model, compile_config, flavour = _torchtitan_model(args, m, float8, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    optimizers = dataclasses.replace(
        default_adamw(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                      weight_decay=opt.weight_decay),
        implementation="fused" if cuda else "for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=WARMUP_LR_STEPS, decay_ratio=None).build(
        optimizers=optimizers, training_steps=args.warmup + args.steps)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=m.vocab_size).build(
        compile_config=compile_config)
    data = Batches(m.vocab_size, args.seq, args.micro_batch, device)
    positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)
    # causal, one document per sample (flex's BlockMask; SDPA's is_causal on the CPU)
    masks = model.get_attention_masks(positions=positions) if cuda else None
    params = list(model.parameters())

    def step(_: int) -> float:
        ids, labels, mask = data.next()
        optimizers.zero_grad(set_to_none=True)
        loss = torchtitan_loss(loss_fn, model(ids, positions, masks), labels, mask)
        loss.backward()
        dist_utils.clip_grad_norm_(params, opt.grad_clip, foreach=True)
        optimizers.step()
        schedulers.step()
        return loss.detach()  # its trainer reads the loss at log steps only

    result = _timed(step, args.steps, args.warmup, steady=args.timing == "steady")
    result["settings"] = {"flavour": flavour or "same builder at the config's shape",
                          "fsdp2": "mesh of 1, bf16 params, fp32 reduce",
                          "attention": "flex" if cuda else "sdpa (CPU)",
                          "compile": "per block + loss" if cuda else "off (CPU)",
                          "num_params": num_params(model),
                          "float8": ("tensorwise, lm_head bf16" if cuda else "emulated")
                          if float8 else None, "cuda_graphs": "off", "shims": shims}
    result["tokens_crc32"] = data.crc
    return result


# --- one row in this process, or all rows as subprocesses ------------------------------------


def run_row(args) -> dict:
    """The row named ``args.row`` in this process (``--one``)."""
    if args.row in ("megatron_bf16", "megatron_fp8"):
        if _cuda():  # TE before anything loads cuDNN (tests/perf/NOTES.md)
            import transformer_engine.pytorch  # noqa: F401
        result = run_megatron(args, fp8=args.row == "megatron_fp8")
    else:
        result = run_torchtitan(args, float8=args.row == "torchtitan_float8")
    if "step_ms" in result:
        result["tokens_per_s_per_gpu"] = args.seq * args.micro_batch / (result["step_ms"] / 1e3)
    return result


def run_ours(args, variant: str, out: Path) -> dict:
    """Our row: bench_train.py in its own process (pretrain's code path), its mpcore fields."""
    raw = out.with_suffix(".bench_train.json")
    cmd = [sys.executable, str(Path(__file__).parent / "bench_train.py"), str(raw), "--config",
           str(args.config), "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--skip-hf",
           "--timing", args.timing, "--optimizer-backend", args.optimizer_backend,
           "--variants", variant, "--run-dir", tempfile.mkdtemp(prefix="bench_peers_run_")]
    run_subprocess(cmd, args.timeout)
    report = json.loads(raw.read_text())
    raw.unlink()
    variant_report = report["variants"][0]
    result = dict(report["mpcore"])
    result["settings"] = {"bench_train_variants": variant, "fp8": variant_report["fp8"],
                          "linear_backend": variant_report["linear_backend"],
                          "residual_dtype": variant_report["residual_dtype"],
                          "optimizer_backend": variant_report["optimizer_backend"],
                          "attention_backend": report["backend"]}
    crc_data = Batches(load_config(args.config).model.vocab_size, args.seq, args.micro_batch,
                       torch.device("cpu"))
    for _ in range(args.warmup + args.steps):  # the draws bench_train made, by construction
        crc_data.next()
    result["tokens_crc32"] = crc_data.crc
    return result


def _row_json(args, row: str, result: dict) -> dict:
    return {"row": row, "device": torch.cuda.get_device_name() if _cuda() else "cpu",
            "shape": args.config.stem, "seq": args.seq, "micro_batch": args.micro_batch,
            "steps": args.steps, "warmup": args.warmup, "versions": _versions(), **result}


def run_all(args) -> list[dict]:
    """Every (shape, row) in a fresh subprocess (ours through bench_train.py); a failure is
    recorded as that row's ``error`` and the rest go on."""
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq, micro_batch in args.shape_list:
        one = argparse.Namespace(**{**vars(args), "seq": seq, "micro_batch": micro_batch})
        for row in args.row_list:
            out = args.out / f"{row}_{seq}x{micro_batch}.json"
            print(f"== {row} {seq}x{micro_batch}", flush=True)
            check = _gpu_check()
            started = time.monotonic()
            try:
                if row in OURS:
                    result = _row_json(one, row, run_ours(one, OURS[row], out))
                else:
                    run_subprocess([sys.executable, __file__, "--one", row, "--config", str(args.config),
                          "--seq", str(seq), "--micro-batch", str(micro_batch), "--steps",
                          str(args.steps), "--warmup", str(args.warmup), "--timing",
                          args.timing, "--out", str(out)],
                         args.timeout)
                    result = json.loads(out.read_text())
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                result = _row_json(one, row, {"error": str(e)[-4000:]})
                print(f"   failed: {str(e).splitlines()[0]}", flush=True)
            result["row_wall_s"] = round(time.monotonic() - started, 1)
            result["matmul_bf16_tflops_before"] = check
            out.write_text(json.dumps(result, indent=1) + "\n")
            rows.append(result)  # the summary after each row: a call cut short keeps it
            (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _gpu_check() -> float | None:
    """The bf16 8192^3 matmul rate (TFLOP/s), measured here just before a row starts: rows of
    one call compare only while the GPU runs at one speed, and this says whether it did (a GPU
    slowed down between rows shows as a lower rate). None without CUDA."""
    if not _cuda():
        return None
    rate = round(matmul_tflops(), 1)
    torch.cuda.empty_cache()  # the row's process gets the memory back
    return rate


def table(rows: list[dict]) -> str:
    """Per shape: step ms, tokens/s, peak GiB, first/last loss, and each of our rows' speedup
    (tokens/s ratio) and memory ratio (peak over peak) against every peer row."""
    lines = []
    for shape in dict.fromkeys((r["seq"], r["micro_batch"]) for r in rows):
        group = [r for r in rows if (r["seq"], r["micro_batch"]) == shape]
        lines.append(f"seq {shape[0]} x micro-batch {shape[1]}")
        lines.append(f"{'row':<18} {'step ms':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss':>14}"
                     f" {'TFLOP/s':>8} {'wall s':>7}")
        for r in group:
            if "step_ms" not in r:
                why = r.get("skipped") or "failed: " + r.get("error", "?").splitlines()[0]
                lines.append(f"{r['row']:<18} {why[:90]}")
                continue
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            rate = r.get("matmul_bf16_tflops_before")
            lines.append(f"{r['row']:<18} {r['step_ms']:>9.1f} {r['tokens_per_s_per_gpu']:>10.0f}"
                         f" {peak:>9} {r['first_loss']:>6.2f}->{r['last_loss']:<6.2f}"
                         f" {'-' if rate is None else rate:>8} {r.get('row_wall_s', '-'):>7}")
        done = [r for r in group if "step_ms" in r]
        for ours in (r for r in done if r["row"] in OURS):
            ratios = ", ".join(_ratio(ours, p) for p in done if p["row"] not in OURS)
            lines.append(f"  {ours['row']} vs: {ratios}")
    return "\n".join(lines)


def _ratio(ours: dict, peer: dict) -> str:
    """``peer Sx`` (our tokens/s over the peer's), with ``(memory Mx)`` (our peak over the
    peer's) where both have one."""
    text = f"{peer['row']} {ours['tokens_per_s_per_gpu'] / peer['tokens_per_s_per_gpu']:.2f}x"
    if ours["peak_gib"] and peer["peak_gib"]:
        text += f" (memory {ours['peak_gib'] / peer['peak_gib']:.2f}x)"
    return text


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the per-row JSON (with --one: the row's JSON file)")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--shapes", default="4096x4,16384x1", help="SEQxMICRO_BATCH, comma-separated")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=420, help="seconds per row")
    parser.add_argument("--timing", default="steady", choices=["steady", "synced"],
                        help="bench_train's --timing, for every row (each step as its own "
                             "training loop runs it: steady)")
    parser.add_argument("--optimizer-backend", default="torch", choices=["torch", "triton"],
                        help="our rows' optimizer.backend (bench_train's --optimizer-backend)")
    parser.add_argument("--one", dest="row", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.row_list = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.row_list) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    try:
        args.shape_list = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: {args.shapes!r} is not SEQxMICRO_BATCH[,...] (e.g. 4096x4)")
    if any(len(s) != 2 or min(s) < 1 for s in args.shape_list):
        parser.error(f"--shapes: {args.shapes!r} is not SEQxMICRO_BATCH[,...] (e.g. 4096x4)")
    args.config = args.config.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:  # a child: one row, its JSON to --out
        args.out.write_text(json.dumps(_row_json(args, args.row, run_row(args)), indent=1) + "\n")
        return 0
    print(table(run_all(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
