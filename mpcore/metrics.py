"""Throughput accounting and the metrics rank 0 reports.

FLOPs per token (torchtitan's convention). A matmul ``[T, m] @ [m, n]`` costs ``2 T m n``
FLOPs forward and twice that backward (gradients of the input and of the weight): 6 FLOPs per
weight per token over forward + backward. Every weight that multiplies activations counts: the
layers and the output head, not the input embedding (a table lookup). Attention adds, per layer
and token, ``q @ k.T`` and ``p @ v`` over ``seq`` keys of width ``h = heads * head_dim``:
``2 * 2 * h * seq`` forward, 3x that with the backward, so ``12 * h * seq``. Causal masking and
document boundaries halve or cut the real work; the convention counts the full square, as
torchtitan and nanoGPT do, so numbers compare across codebases:

    flops_per_token = 6 * (params - input embedding) + 12 * layers * heads * head_dim * seq

For a tied model the shared matrix is the output head, so the count is all parameters.

Output per logged step: one line on stdout, one JSON object in ``RUN_DIR/metrics.jsonl``
(keys ``step loss grad_norm lr tokens_per_s tflops mfu mem_gib``, plus ``valid_loss`` on the
steps that ran a validation, and ``image_tokens_per_s`` for vision-language runs: the image
placeholders among the tokens counted by ``tokens_per_s``, which counts every position; for
mixture-of-experts runs ``aux_loss`` and ``z_loss`` (the step's global router losses, before
their coefficients), ``dropped_tokens`` (0: the block is dropless), ``expert_load`` (tokens
routed to each expert in the step, pooled over MoE layers and ranks; metrics.jsonl only) and
``expert_imbalance`` (its max over its mean: 1 is perfectly balanced)); tokens/s and TFLOP/s
are per device; ``mfu`` is null where the
device has no entry in the peak table, e.g. on CPU), and TensorBoard scalars when enabled
(``pip install -e ".[tensorboard]"``; nothing else needs the package). The stdout line also
shows step time, elapsed time and ETA.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

from mpcore.io_errors import writing
from mpcore.models import family_of

# Dense bf16 peak FLOP/s (without sparsity), by substring of the CUDA device name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "mem_gib")
OPTIONAL_KEYS = ("valid_loss", "mtp_loss", "image_tokens_per_s", "aux_loss", "z_loss",
                 "dropped_tokens", "expert_imbalance", "expert_load")
TENSORBOARD_HINT = ('pip install -e ".[tensorboard]" (or pip install tensorboard), or set '
                    "logging.tensorboard=false")


def num_params(cfg) -> dict[str, int]:
    """Logical parameter counts (independent of tp) of a family's config: ``total``,
    ``embedding``, ``head``, and for a vision-language family ``vision`` (in ``total``)."""
    return family_of(cfg).num_params(cfg)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward; module docstring). For a vision-language
    config, the decoder's only: the tower's work depends on each batch's share of image
    tokens, so TFLOP/s and MFU of VL runs leave it out (they are lower bounds)."""
    return family_of(cfg).flops_per_token(cfg, seq_len)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak for ``dtype`` from the table, or None (CPU, unknown GPU, fp32)."""
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def max_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak resident memory on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsWriter:
    """Stdout line + ``metrics.jsonl`` + optional TensorBoard, on rank 0 only (``enabled``)."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        with writing(self.path, "logging.run_dir"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError(f"logging.tensorboard=true needs the tensorboard package ({e}): "
                                 f"{TENSORBOARD_HINT}") from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict, printed: dict | None = None) -> None:
        """Write one record with the keys ``KEYS`` and those of ``OPTIONAL_KEYS`` it has
        (non-finite floats become null); ``printed`` fields go to the stdout line only."""
        if not self.enabled:
            return
        keys = KEYS + tuple(k for k in OPTIONAL_KEYS if k in record)
        clean = {k: (None if isinstance(record[k], float) and not math.isfinite(record[k])
                     else record[k]) for k in keys}
        shown = [f"{k} {_fmt(v)}" for k, v in clean.items()
                 if not isinstance(v, list)]  # per-expert lists: metrics.jsonl only
        print("  ".join(shown + [f"{k} {v}" for k, v in (printed or {}).items()]), flush=True)
        with writing(self.path, "logging.run_dir"), open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")  # a full disk: StorageError (mpcore.io_errors)
        if self.tb is not None:
            for k in keys[1:]:
                if clean[k] is not None:
                    self.tb.add_scalar(f"train/{k}", clean[k], clean["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
