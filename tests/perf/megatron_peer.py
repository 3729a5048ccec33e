"""Megatron-core as a benchmark peer in one process: the pieces its rows share.

Used by bench_peers.py (the dense 1B step) and bench_moe.py (the Qwen3-MoE step). Megatron
is imported here only inside the functions, so this module imports without it. Everything
follows Megatron's own recipe on one GPU: a world of one (NCCL on CUDA, gloo on the CPU smoke
path), ``initialize_model_parallel(1, 1)`` (tp = pp = cp = ep = 1), bf16 parameters, its
``DistributedDataParallel`` with fp32 gradient buffers, its distributed optimizer (Adam with
fp32 main parameters and its own clip), its ``OptimizerParamScheduler``, and the step of its
training loop (``zero_grad_buffer``, forward with labels -> per-token losses (B, S), masked
mean, backward, ``finalize_model_grads``, ``optimizer.step``, ``scheduler.step``).
On the CPU its rotary embedding, gradient buffers and optimizer do not run (they allocate on
CUDA), so there the rows stop after building the model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def cuda() -> bool:
    return torch.cuda.is_available()


def init_single_process_group() -> None:
    """World of one (Megatron needs a process group even on one GPU): NCCL on CUDA, gloo on
    the CPU, rendezvous through a file."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="megatron_peer_pg_")
        dist.init_process_group("nccl" if cuda() else "gloo", init_method=f"file://{store}/pg",
                                rank=0, world_size=1)
    if cuda():
        torch.cuda.set_device(0)


def init_megatron(seed: int = 0) -> None:
    """The world of one, Megatron's parallel state at tp = pp = ep = 1 and its seeds."""
    init_single_process_group()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    if cuda():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def transformer_config(**fields):
    """Megatron's ``TransformerConfig`` with what every row here shares (SwiGLU, RMSNorm, no
    biases, no dropout, bf16 parameters, init std 0.02; its fused kernels on CUDA), then
    ``fields`` (the shape and anything row-specific) on top."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cuda = cuda()
    fused = dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
                 masked_softmax_fusion=True, cross_entropy_loss_fusion=True) if on_cuda else {}
    base = dict(
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        # no apex here: Megatron's fused wgrad accumulation needs it (ColumnParallelLinear
        # refuses the flag without it)
        gradient_accumulation_fusion=False, use_cpu_initialization=not on_cuda, **fused)
    return TransformerConfig(**{**base, **fields})


def fused_settings() -> dict:
    """The fusion flags ``transformer_config`` turns on (on CUDA), for a row's settings."""
    names = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
             "masked_softmax_fusion", "cross_entropy_loss_fusion")
    return {name: cuda() for name in names}


@dataclass(frozen=True)
class AdamSettings:
    """The optimizer and schedule a row trains with (each peer through its own optimizer)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float
    min_lr: float | None = None  # None: constant lr (no warmup, no decay)
    warmup_steps: int = 0
    total_steps: int = 1


def training_pieces(config, model, adam: AdamSettings):
    """Megatron's DDP (fp32 gradient buffers, no overlap), its distributed optimizer and its
    scheduler (cosine to ``min_lr`` after ``warmup_steps``, or constant): (model, optimizer,
    scheduler). Moves ``model`` to the GPU first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model.cuda()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp, model)
    min_lr = adam.lr if adam.min_lr is None else adam.min_lr
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=adam.lr, min_lr=min_lr, weight_decay=adam.weight_decay,
        adam_beta1=adam.betas[0], adam_beta2=adam.betas[1], adam_eps=adam.eps,
        clip_grad=adam.grad_clip, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True), [model])
    decay_steps = max(adam.total_steps, adam.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if adam.warmup_steps else adam.lr, max_lr=adam.lr, min_lr=min_lr,
        lr_warmup_steps=adam.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="constant" if adam.min_lr is None else "cosine",
        start_wd=adam.weight_decay, end_wd=adam.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, ids, positions, labels, mask) -> torch.Tensor:
    """One step of Megatron's loop on one micro-batch: the masked mean of its per-token
    losses, backward (MoE aux losses add their gradients through Megatron's own scaler),
    gradient finalisation, the optimizer with its clip, the scheduler. Returns the detached
    mean cross-entropy. ids / labels int64, mask float, all (B, S) on the GPU."""
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    optimizer.zero_grad()
    per_token = model(input_ids=ids, position_ids=positions, attention_mask=None,
                      labels=labels)  # (B, S) fp32 losses; TE's attention is causal
    loss = (per_token.float() * mask).sum() / mask.sum()
    loss.backward()
    finalize_model_grads([model])
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("megatron: optimizer step skipped (non-finite gradients)")
    scheduler.step(increment=1)
    return loss.detach()


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def run_subprocess(cmd: list[str], timeout: int) -> None:
    """Run ``cmd`` from the repo root in its own session; past ``timeout`` seconds the whole
    session is killed (inductor's compile workers with it) and TimeoutExpired raised. A
    non-zero exit raises RuntimeError whose first line is the exit and the output's last line
    (the error), followed by the command and the output's tail."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        output = output.strip()
        last = output.splitlines()[-1] if output else ""
        raise RuntimeError(f"exit {proc.returncode}: {last}\n{' '.join(cmd)}\n{output[-4000:]}")
