"""Benchmark: a Qwen3-MoE or Qwen3.5-MoE training step, mpcore vs transformers, and the expert
GEMMs' rate.

Usage (one GPU):
    python -m tests.perf.bench_moe [OUT.json] [--family qwen3_moe|qwen3_5_moe] [--layers N]
        [--seq 4096] [--steps 10] [--warmup 3] [--hf-experts grouped_mm,batched_mm,eager]
        [--skip-hf] [--tiny] [--megatron] [--megatron-timeout 420]

The model is Qwen3-30B-A3B (launch/configs/qwen3_30b_a3b.yaml: hidden 2048, 32 heads, 4 KV
heads of 128, 128 experts of width 768, top 8, vocab 151936, untied head) cut to ``--layers``
decoder layers, the number that fits one GPU with fp32 parameters and AdamW state (each layer
holds 0.6 B parameters, 16 bytes each with the optimizer: about 9.7 GB). ``--tiny``: a shape
that runs on a CPU in seconds (for the smoke test). mpcore and transformers: fp32 parameters,
bf16 autocast on CUDA (fp32 on CPU); every side: one document of ``--seq`` random tokens per
step (the same ones), the mean token cross-entropy plus ``router_aux_loss_coef`` times the
load-balancing loss, AdamW (fused on CUDA), lr 1e-4, clipping at 1.0. mpcore: the qwen3_moe
family's model (experts backend auto: PyTorch's grouped GEMM on CUDA), the aux loss through
``mpcore.moe_step.MoeStep`` as training computes it. transformers: ``Qwen3MoeForCausalLM`` of
the same config with SDPA attention and ``output_router_logits``, once per experts
implementation of ``--hf-experts`` that this transformers has (the fastest is the peer).
``--family qwen3_5_moe``: Qwen3.5-35B-A3B's text decoder (``QWEN3_5_35B_A3B``, the release's
config.json text fields, transformers' ``Qwen3_5MoeTextConfig`` defaults: hidden 2048, 40
layers in the pattern of three Gated DeltaNet layers (16 key / 32 value heads of 128, 4-tap
conv) then one gated full-attention layer (16 heads, 2 KV heads of 256, a quarter rotated,
theta 1e7): ``full_attention_interval`` 4; every layer's feed-forward 256 experts of width 512,
top 8 renormalised, plus a shared expert of 512 behind its sigmoid gate; vocab 248320, untied
head, aux coef 1e-3) cut to its first ``--layers`` layers of that pattern, default 4: the
smallest cut that keeps the pattern (the first full-attention layer is layer 3), and the only
one that fits one GPU: each layer holds 0.84 B parameters (the experts 0.81 B), 13.5 GB with
fp32 gradients and AdamW state, the embedding and head 1.02 B (16.3 GB), so 4 layers are 4.38
B parameters, 65.3 GiB before activations; 8 (two periods) would be 115 GiB, past an H200
once transformers' full [seq, 248320] logits are added. On an H100 (80 GB) the 4-layer
transformers rows may run out of memory (recorded as their error); an H200 fits them. A cut
without a full-attention layer is refused. mpcore: the qwen3_5_moe family's model with
``gdn_kernel=auto`` (fla on CUDA when it runs; ``mpcore.gdn_kernel`` says which kernel ran);
transformers: ``Qwen3_5MoeForCausalLM``, each experts implementation as for Qwen3-MoE, its
DeltaNet fast path recorded in ``hf_fast_path`` (``tests/perf/bench_qwen35.hf_paths`` and the
fallback warnings it logged). ``--tiny`` shrinks either family's widths and counts, keeping its
layer pattern.
``--megatron`` (Qwen3-MoE only): Megatron-core's MoE as a second peer, in its own subprocess (run first, before
this process takes GPU memory): ``GPTModel`` with the TransformerEngine layer spec for MoE (TE's
grouped GEMM experts, ``moe_grouped_gemm``), the alltoall token dispatcher at ep = 1 with its
permute and router fusions, the router in fp32, softmax over the top-k logits
(``moe_router_pre_softmax`` off: the same weights as ``norm_topk_prob``), its micro-batch
``aux_loss`` at ``router_aux_loss_coef``; bf16 parameters, fp32 gradient buffers and its
distributed optimizer (Adam with fp32 main parameters: ``tests/perf/megatron_peer.py``), AdamW's
defaults at lr 1e-4, clip 1.0, constant lr. Its aux loss is Megatron's own: per layer ``E *
sum_e f_e P_e`` with f the fraction of the layer's top-k slots (summing to 1, not to k), summed
over layers; ours and transformers' pool the layers' rows into one statistic. The weight of that
term in the step is tiny (coef 1e-3) and its cost the same. Its reported loss is the masked mean
cross-entropy plus that weighted aux loss (read from its metrics tracker). The parameter counts
of the three models must agree (checked; the run stops otherwise). On the CPU the row builds the
model of the shape with Megatron's local spec (per-expert MLPs, the allgather dispatcher: its
alltoall dispatcher, rotary embedding, gradient buffers and optimizer need CUDA), checks its
parameter count and reports itself skipped.

Reported per side: median step time over ``--steps`` (after ``--warmup``), tokens/s, peak
allocated memory (reset between sides; null on CPU), first and last loss, the parameter count;
``speedup`` (over the fastest transformers) and ``speedup_vs_megatron`` are step-time ratios,
``tokens_crc32`` the checksum of the ids every side trained on, ``cuda_alloc_conf`` the
``PYTORCH_CUDA_ALLOC_CONF`` every side ran under (Megatron's child inherits it). ``experts``:
one MoE layer's expert computation alone (its ``seq * top_k`` routed rows, counts drawn from a
random router), forward + backward, in TFLOP/s through the grouped GEMM, beside the same FLOPs
done as one dense SwiGLU GEMM pair (the dense GEMM rate of this machine at that shape). JSON
goes to OUT (default tests/perf/results/moe_h200.json), first once our row is done, with ``hf``
saying that transformers' rows have not finished (``HF_UNFINISHED``): a run ended during them (a
call's time limit) leaves our row and says so; where every transformers row failed, it holds
each one's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import torch

from mpcore.models.common.moe import run_experts
from mpcore.models.registry import family_named
from mpcore.moe_step import MoeStep
from mpcore.parallel.state import ParallelState
from tests.families import hf_classes
from tests.perf.bench_qwen35 import HF_UNFINISHED, deltanet_kernel, fast_path_recorded
from tests.perf.megatron_peer import (
    AdamSettings,
    cuda,
    fused_settings,
    init_megatron,
    num_params,
    run_subprocess,
    train_step,
    training_pieces,
    transformer_config,
)
from tests.perf.step_timing import adamw, autocast, placed_inputs, timed

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = Path(__file__).parent / "results" / "moe_h200.json"
# Qwen3-30B-A3B's config.json (its shape fields; num_hidden_layers set by --layers).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1e6, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
TINY = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Qwen3.5-35B-A3B's config.json text fields (transformers' Qwen3_5MoeTextConfig defaults are the
# same); num_hidden_layers and layer_types set by --layers (``cut``).
QWEN3_5_35B_A3B = dict(
    architectures=["Qwen3_5MoeForCausalLM"], vocab_size=248320, hidden_size=2048,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, attn_output_gate=True,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TINY_3_5 = {**QWEN3_5_35B_A3B, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32}
# family -> (full shape, tiny shape, name in the JSON, default --layers)
SHAPES = {"qwen3_moe": (QWEN3_30B_A3B, TINY, "Qwen3-30B-A3B", 6),
          "qwen3_5_moe": (QWEN3_5_35B_A3B, TINY_3_5, "Qwen3.5-35B-A3B", 4)}
HF_EXPERTS = ("grouped_mm", "batched_mm", "eager")
# step_timing.adamw: torch's AdamW defaults at lr 1e-4; the clip of _train_step.
ADAM = AdamSettings(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0)


def cut(family: str, tiny: bool, layers: int) -> dict:
    """The config.json dict of ``family``'s shape (``--tiny``: its tiny one) with its first
    ``layers`` decoder layers. Qwen3.5-MoE: ``layer_types`` the first ``layers`` of the release's
    pattern (full attention every ``full_attention_interval``-th layer), given to both sides;
    ``ValueError`` when the cut has no full-attention layer."""
    full, small, _, _ = SHAPES[family]
    hf = {**(small if tiny else full), "num_hidden_layers": layers}
    if "full_attention_interval" in hf:
        every = hf["full_attention_interval"]
        hf["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                             for i in range(layers)]
        if "full_attention" not in hf["layer_types"]:
            raise ValueError(f"--layers {layers} cuts {SHAPES[family][2]} before its first "
                             f"full-attention layer (layer {every - 1}): use --layers >= "
                             f"{every}, so that the cut keeps the hybrid pattern")
    return hf


def token_batches(hf: dict, seq: int, n: int) -> list[torch.Tensor]:
    """The ``n`` documents of ``seq`` random ids (int64, CPU) every side trains on, in order."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, hf["vocab_size"], (seq,), generator=gen) for _ in range(n)]


def tokens_crc(batches) -> int:
    crc = 0
    for ids in batches:
        crc = zlib.crc32(ids.numpy().tobytes(), crc)
    return crc


def _train_step(model, opt, device, loss_of):
    def step() -> float:
        with autocast(device):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def bench_mpcore(hf: dict, batches, device, steps, warmup, family_name: str = "qwen3_moe"
                 ) -> dict:
    family = family_named(family_name)
    cfg = family.config_from_hf(hf)
    state = ParallelState()
    # Qwen3.5-MoE: fla's DeltaNet kernels on CUDA where they run, else the reference (warned)
    hybrid = {"gdn_kernel": "auto"} if "gdn_kernel" in family.options else {}
    model = family.build(cfg, state, seed=0, device=device, **hybrid)
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def loss_of():
        ids = next(it)
        inputs = placed_inputs(family, state, ids, cfg, device)
        moe = MoeStep.start(model, [inputs], state, lambda inp: model(**inp, output="loss_sum"))
        ce = model(**inputs, output="loss_sum") / (ids.numel() - 1)
        return ce + moe.share()

    result = timed(_train_step(model, opt, device, loss_of), steps, warmup, device)
    if hybrid:
        result["gdn_kernel"] = deltanet_kernel(model, device)
    return {**result, "params": num_params(model)}


def hf_experts_available() -> tuple[str, ...]:
    """The experts implementations this transformers registers (of ``HF_EXPERTS``); () when
    it has no experts interface (then its one implementation runs, named ``default``)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ()
    names = set(ALL_EXPERTS_FUNCTIONS.valid_keys()) | {"eager"}
    return tuple(n for n in HF_EXPERTS if n in names)


# keys of our config dicts that transformers' config class does not take
HF_DROPPED = ("architectures", "attn_output_gate", "full_attention_interval")


def bench_hf(hf: dict, batches, device, steps, warmup, experts: str,
             family: str = "qwen3_moe") -> dict:
    config_cls, model_cls = hf_classes(family)
    config = config_cls(**{k: v for k, v in hf.items() if k not in HF_DROPPED},
                        output_router_logits=True)
    kwargs = {"attn_implementation": "sdpa"}
    if experts != "default":
        kwargs["experts_implementation"] = experts
    with torch.device(device):
        model = model_cls._from_config(config, **kwargs)
    model.train()
    opt = adamw(model.parameters(), device)
    it = iter(batches)

    def loss_of():
        ids = next(it).to(device)[None]
        return model(input_ids=ids, labels=ids).loss  # includes coef * aux loss

    result = timed(_train_step(model, opt, device, loss_of), steps, warmup, device)
    return {**result, "params": num_params(model)}


def megatron_moe_model(hf: dict, seq: int):
    """Megatron-core's GPTModel of ``hf``'s Qwen3-MoE shape (module docstring): the TE layer
    spec with grouped-GEMM experts and the alltoall dispatcher on CUDA, the local spec with
    per-expert MLPs and the allgather dispatcher elsewhere (the same parameters). Returns
    (config, model, settings). Call after ``megatron_peer.init_megatron``."""
    if not hf["norm_topk_prob"] or hf["mlp_only_layers"] or hf["decoder_sparse_step"] != 1:
        raise ValueError("megatron_moe_model: the Qwen3-30B-A3B layout only (norm_topk_prob, "
                         "every layer MoE)")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    on_cuda = cuda()
    moe = dict(
        num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_grouped_gemm=on_cuda,
        moe_token_dispatcher_type="alltoall" if on_cuda else "allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=hf["router_aux_loss_coef"],
        moe_router_dtype="fp32", moe_router_pre_softmax=False, moe_router_score_function="softmax",
        moe_permute_fusion=on_cuda, moe_router_fusion=on_cuda)
    config = transformer_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"],
        layernorm_epsilon=hf["rms_norm_eps"], qk_layernorm=True, **moe)
    spec_args = dict(num_experts=hf["num_experts"], moe_grouped_gemm=on_cuda, qk_layernorm=True)
    spec = (get_gpt_layer_with_transformer_engine_spec(**spec_args) if on_cuda
            else get_gpt_layer_local_spec(**spec_args, normalization="RMSNorm"))
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=hf["vocab_size"],
                     max_sequence_length=seq,
                     share_embeddings_and_output_weights=hf["tie_word_embeddings"],
                     position_embedding_type="rope", rotary_base=int(hf["rope_theta"]))
    settings = {"layer_spec": "transformer_engine" if on_cuda else "local",
                "experts": "TEGroupedMLP (grouped GEMM)" if on_cuda else "SequentialMLP (CPU)",
                "params": "bf16", "main_grads": "fp32", "optimizer": "distributed (Megatron)",
                **moe, **fused_settings()}
    return config, model, settings


def megatron_aux_loss(coef: float) -> float:
    """The weighted load-balancing loss of the last forward, from Megatron's metrics tracker
    (which records each layer's aux loss over its coefficient), then cleared for the next."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("load_balancing_loss")
    aux = 0.0 if entry is None else coef * float(entry.values.sum())
    tracker.clear()
    return aux


def bench_megatron(hf: dict, batches, steps: int, warmup: int, expected_params: int) -> dict:
    """The Megatron-core row, in this process (``--megatron-row``): its model, checked to
    have ``expected_params``, trained as its own loop trains (``megatron_peer``) on
    ``batches``; on the CPU the model alone, then reported skipped."""
    if cuda():  # TE before anything loads cuDNN (tests/perf/NOTES.md)
        import transformer_engine.pytorch  # noqa: F401
    init_megatron(seed=0)
    seq = batches[0].numel()
    config, model, settings = megatron_moe_model(hf, seq)
    settings["num_params"] = num_params(model)
    if settings["num_params"] != expected_params:
        raise RuntimeError(f"megatron: {settings['num_params']} parameters, mpcore's model of "
                           f"this shape has {expected_params}")
    if not cuda():
        return {"skipped": "Megatron's MoE runs on CUDA only (alltoall dispatcher, rotary "
                           "embedding, DDP grad buffers); checked on the CPU: the model of this "
                           "shape", "params": settings["num_params"], "settings": settings}
    adam = dataclasses.replace(ADAM, total_steps=steps + warmup)
    model, optimizer, scheduler = training_pieces(config, model, adam)
    device = torch.device("cuda")
    positions = torch.arange(seq, device=device)[None]
    mask = torch.ones(1, seq, device=device)
    mask[:, -1] = 0.0  # the last token has no target
    it = iter(batches)

    def step() -> float:
        ids = next(it).to(device)[None]
        labels = torch.zeros_like(ids)  # a valid id where masked
        labels[:, :-1] = ids[:, 1:]
        ce = train_step(model, optimizer, scheduler, ids, positions, labels, mask)
        return float(ce) + megatron_aux_loss(hf["router_aux_loss_coef"])

    result = timed(step, steps, warmup, device)
    return {**result, "params": settings["num_params"], "settings": settings,
            "tokens_crc32": tokens_crc(batches),
            "versions": {n: _version(n) for n in ("megatron-core", "transformer-engine")}}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_megatron_row(args, timeout: int) -> dict:
    """``bench_megatron`` in a fresh subprocess (no allocator, compile cache or cuDNN state
    shared with our rows); a failure or timeout comes back as the row's ``error``."""
    out = Path(args.out).with_suffix(".megatron.json")
    cmd = [sys.executable, __file__, str(out), "--megatron-row", "--layers", str(args.layers),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           *(["--tiny"] if args.tiny else [])]
    try:
        run_subprocess(cmd, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[-4000:]}
    row = json.loads(out.read_text())
    out.unlink()
    return row


def bench_experts(hf: dict, seq: int, device, steps, warmup) -> dict | None:
    """One layer's experts alone, fwd + bwd, bf16: grouped GEMM vs one dense GEMM pair of the
    same FLOPs (module docstring). Null without CUDA."""
    if device.type != "cuda":
        return None
    e, k = hf["num_experts"], hf["num_experts_per_tok"]
    h, i = hf["hidden_size"], hf["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    # Expert of each of the seq * k routed rows: k distinct experts per token, at random.
    picks = torch.rand(seq, e, generator=gen).topk(k, dim=-1).indices.flatten()
    counts = torch.bincount(picks, minlength=e).tolist()
    rows = seq * k
    bf = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, h, **bf, requires_grad=True)
    w13 = (torch.randn(e, 2 * i, h, **bf) * h ** -0.5).requires_grad_()
    w2 = (torch.randn(e, h, i, **bf) * i ** -0.5).requires_grad_()
    dense13 = (torch.randn(1, 2 * i, h, **bf) * h ** -0.5).requires_grad_()
    dense2 = (torch.randn(1, h, i, **bf) * i ** -0.5).requires_grad_()
    flops = 3 * 2 * rows * (h * 2 * i + i * h)  # forward + backward (twice the forward)

    def grouped() -> float:
        run_experts(x, w13, w2, counts, "grouped").float().sum().backward()
        return 0.0

    def dense() -> float:
        run_experts(x, dense13, dense2, [rows], "grouped").float().sum().backward()
        return 0.0

    a, b = timed(grouped, steps, warmup, device), timed(dense, steps, warmup, device)
    return {"rows": rows, "experts": e, "min_rows": min(counts), "max_rows": max(counts),
            "grouped_ms": 1e3 * a["step_s"], "grouped_tflops": flops / a["step_s"] / 1e12,
            "dense_ms": 1e3 * b["step_s"], "dense_tflops": flops / b["step_s"] / 1e12}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    p.add_argument("--family", default="qwen3_moe", choices=sorted(SHAPES),
                   help="Qwen3-30B-A3B's or Qwen3.5-35B-A3B's decoder, cut to --layers")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the cut (default: 6 for qwen3_moe, 4 for "
                        "qwen3_5_moe: module docstring)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hf-experts", default=",".join(HF_EXPERTS),
                   help="transformers experts implementations to time (those it has)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized shape (smoke test)")
    p.add_argument("--megatron", action="store_true",
                   help="also Megatron-core's MoE (needs megatron-core, and TransformerEngine "
                        "on CUDA), in its own subprocess")
    p.add_argument("--megatron-timeout", type=int, default=420, help="seconds for that row")
    p.add_argument("--megatron-row", action="store_true", help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)
    if args.megatron and args.family != "qwen3_moe":
        p.error(f"--megatron: the Megatron-core row is built for Qwen3-MoE only (its GPTModel "
                f"has no Gated DeltaNet layers); drop --megatron, or use --family qwen3_moe "
                f"(got --family {args.family})")
    if args.layers is None:
        args.layers = SHAPES[args.family][3]
    return args


def check_params(name: str, found: int, expected: int) -> None:
    if found != expected:
        raise RuntimeError(f"{name}: {found} parameters, mpcore's model of this shape has "
                           f"{expected}: the sides are not the same model")


def run_hf(result: dict, hf: dict, batches, device, args) -> None:
    """transformers under each wanted experts implementation it has; the fastest is the peer."""
    import transformers

    result["transformers"] = transformers.__version__
    wanted = [n for n in args.hf_experts.split(",") if n]
    have = hf_experts_available()
    names = [n for n in wanted if n in have] if have else ["default"]
    result["hf"] = {}
    for name in names:
        try:
            r = bench_hf(hf, batches, device, args.steps, args.warmup, name, args.family)
        except torch.OutOfMemoryError as e:  # batched_mm gathers a weight copy per routed row
            r = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
            _progress(f"transformers ({name})", r)
            result["hf"][name] = r
            continue
        _progress(f"transformers ({name})", r)
        check_params(f"transformers ({name})", r["params"], result["params"])
        r["tokens_per_s"] = args.seq / r["step_s"]
        result["hf"][name] = r
    ran = [n for n in result["hf"] if "step_s" in result["hf"][n]]
    if not ran:  # main writes each row's error and stops
        return
    fastest = min(ran, key=lambda n: result["hf"][n]["step_s"])
    result["hf_fastest"] = fastest
    peer = result["hf"][fastest]
    result["speedup"] = peer["step_s"] / result["mpcore"]["step_s"]
    if device.type == "cuda":
        result["memory_ratio"] = result["mpcore"]["peak_gib"] / peer["peak_gib"]


def run_hf_logged(result: dict, hf: dict, batches, device, args) -> None:
    """``run_hf``; for Qwen3.5-MoE also ``hf_fast_path`` (``bench_qwen35.fast_path_recorded``)."""
    with fast_path_recorded(result, record=args.family != "qwen3_moe"):
        run_hf(result, hf, batches, device, args)


def add_megatron(result: dict, row: dict, seq: int) -> None:
    """The Megatron row into ``result``, with our speedup and memory ratio against it."""
    result["megatron"] = row
    if "params" in row:
        check_params("megatron", row["params"], result["params"])
    if "step_s" not in row:
        return
    if row["tokens_crc32"] != result["tokens_crc32"]:
        raise RuntimeError("megatron: trained on other tokens than mpcore (crc32 differs)")
    row["tokens_per_s"] = seq / row["step_s"]
    result["speedup_vs_megatron"] = row["step_s"] / result["mpcore"]["step_s"]
    if row["peak_gib"] and result["mpcore"]["peak_gib"]:
        result["memory_ratio_vs_megatron"] = result["mpcore"]["peak_gib"] / row["peak_gib"]


def _progress(name: str, row: dict) -> None:
    """One line per side as it finishes (the JSON comes at the end)."""
    if "step_s" in row:
        print(f"== {name}: {row['step_s']:.3f} s/step, peak {row['peak_gib']} GiB, loss "
              f"{row['loss_first']:.3f} -> {row['loss_last']:.3f}", flush=True)
    else:
        why = row.get("skipped") or row.get("error", "?")
        print(f"== {name}: {why.splitlines()[0]}", flush=True)


def _write(path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        hf = cut(args.family, args.tiny, args.layers)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    batches = token_batches(hf, args.seq, args.steps + args.warmup)
    family = family_named(args.family)
    counts = family.num_params(family.config_from_hf(hf))
    if args.megatron_row:
        _write(args.out, bench_megatron(hf, batches, args.steps, args.warmup, counts["total"]))
        return 0
    # Megatron first, before this process holds GPU memory (its cache would crowd the child).
    megatron = run_megatron_row(args, args.megatron_timeout) if args.megatron else None
    if megatron is not None:
        _progress("megatron", megatron)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "shape": "tiny" if args.tiny else SHAPES[args.family][2], "layers": args.layers,
              "seq": args.seq, "params": counts["total"], "active_params": counts["active"],
              "torch": torch.__version__, "tokens_crc32": tokens_crc(batches),
              "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "mpcore": bench_mpcore(hf, batches, device, args.steps, args.warmup,
                                     args.family)}
    if args.family != "qwen3_moe":
        result = {"family": args.family, "layer_types": hf["layer_types"], **result}
    _progress("mpcore", result["mpcore"])
    check_params("mpcore (built)", result["mpcore"]["params"], counts["total"])
    result["mpcore"]["tokens_per_s"] = args.seq / result["mpcore"]["step_s"]
    if not args.skip_hf:
        # mpcore's row kept should every transformers row fail, or the process be ended during
        # them (a call's time limit): the file then says that they did not finish.
        _write(args.out, {**result, "hf": HF_UNFINISHED})
        run_hf_logged(result, hf, batches, device, args)
        if "hf_fastest" not in result:  # every row failed: the file says how, then we stop
            _write(args.out, result)
            raise SystemExit("no transformers experts implementation ran: "
                             + json.dumps(result["hf"]))
    if megatron is not None:
        add_megatron(result, megatron, args.seq)
    result["experts"] = bench_experts(hf, args.seq, device, args.steps, args.warmup)
    _write(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
