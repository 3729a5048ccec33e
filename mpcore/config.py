"""Training configuration: nested frozen dataclasses, YAML files and dotted ``key=value`` overrides.

Layout of a config (every field has a docstring below):

    model       shape of the decoder (the fields of ``models.ModelConfig``) + ``init_from``
    parallel    tp, cp, cp_mode, cp_layout, sequence_parallel, data_parallel, checkpointing
    data        dataset prefixes and blend weights, tokenizer, seq_len, batch sizes, seed
    optimizer   AdamW hyper-parameters, gradient clipping, backend
    schedule    warmup and decay of the learning rate
    checkpoint  where, how often, how many to keep, whether to resume
    logging     run directory, log interval, TensorBoard
    training    steps, seed, dtype, device, bad-step tolerance

:func:`load_config` reads an optional YAML file (nested mappings, any subset of the fields),
applies overrides such as ``optimizer.lr=1e-3`` or ``data.paths=[a,b]``, converts every value to
its field's type and validates it. Unknown keys raise ``ValueError`` naming the closest valid
key. :func:`save_config` writes the resolved config (every field) as YAML, which
:func:`load_config` reads back to an equal config.

This module sits low in the layering (it imports nothing of ours): the ``model`` section mirrors
``models.ModelConfig`` by field name and the training loop converts it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpcore import atomic

DTYPES = ("bfloat16", "float32")
# parallel.attention.backends.BACKENDS, kernels.fp8_linear.RECIPES + parallel.te.TE_RECIPES and
# parallel.te.LINEAR_BACKENDS (tests check they agree).
ATTENTION_BACKENDS = ("auto", "flash", "sdpa_cudnn", "te_fused", "reference")
FP8_RECIPES = ("none", "tensorwise", "te_delayed", "te_current")
LINEAR_BACKENDS = ("native", "te", "auto")
DEVICES = ("auto", "cpu", "cuda")
# models.registry.FAMILIES (a test checks they agree)
FAMILIES = ("llama", "qwen2_vl", "qwen3_vl", "glm4v", "qwen3_5", "qwen3_moe",
            "qwen3_vl_moe", "qwen3_5_moe")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{section}.{name} must be >= 1, got {value!r}")


def _choice(section: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class ModelSection:
    """The decoder's shape (names as in ``models.ModelConfig``); defaults: the tiny model."""

    vocab_size: int = 2048
    """Vocabulary size; every token id of the data must be below it."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of decoder layers."""
    num_heads: int = 4
    """Query heads (divisible by parallel.tp)."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); divides num_heads."""
    intermediate_size: int = 384
    """Width of the SwiGLU hidden layer (divisible by parallel.tp)."""
    head_dim: int | None = None
    """Per-head width; null means hidden_size / num_heads."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """null, or Llama 3 scaling: {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = True
    """Use the input embedding as the output head."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on q and k per head (Qwen3)."""
    max_position_embeddings: int = 8192
    """Longest position the model is meant for (exported to Hugging Face)."""
    init_from: str | None = None
    """A Hugging Face checkpoint folder (not a file in it) to start from (its config.json
    replaces the shape fields above), or null for a fresh initialisation from training.seed."""
    family: str = "auto"
    """The model family (models.registry): llama (Llama 3 / Qwen2 / Qwen3 by the fields above),
    qwen2_vl (Qwen2-VL / Qwen2.5-VL: needs vision), qwen3_vl (Qwen3-VL: needs vision, qk_norm,
    mrope_interleaved), glm4v (GLM-4V / GLM-4.1V: needs vision), qwen3_5 (Qwen3.5 text:
    Gated DeltaNet beside gated attention), qwen3_moe (Qwen3-MoE: needs moe) or qwen3_5_moe
    (Qwen3.5-MoE: Qwen3.5's layers with MoE blocks; needs moe, intermediate_size is the
    shared expert's width); auto: the family of init_from's config.json, else qwen2_vl when
    vision is set, else llama."""
    attention_backend: str = "auto"
    """Attention kernels: auto (per call the fastest that takes it, measured on an H200; the
    exact reference on CPU), flash (PyTorch flash varlen), sdpa_cudnn (dense cuDNN SDPA: every
    document of the local stream of one length, e.g. fixed-length samples), te_fused
    (TransformerEngine's fused attention on the packed stream; not installed: an error with the
    install command) or reference."""
    linear_backend: str = "native"
    """GEMMs of the four projections of each decoder layer: native (torch, or our FP8 kernel),
    te (TransformerEngine inside our TP/SP layers; not installed: an error with the install
    command) or auto (te when importable on CUDA and fp8 is not tensorwise, else native)."""
    fp8: str = "none"
    """none, or FP8 GEMMs in those projections (e4m3 activations and weights, e5m2 gradients)
    on a GPU of compute capability >= 8.9 (Ada, Hopper): tensorwise (our kernel, per-tensor
    current scaling; linear_backend native), te_delayed (TE's DelayedScaling: scales from an
    amax history) or te_current (TE's Float8CurrentScaling); te_* need linear_backend te/auto."""
    mrope_section: list[int] | None = None
    """M-RoPE (vision-language models): frequency pairs of the temporal, height and width
    position rows, summing to head_dim / 2; null for plain RoPE."""
    mrope_interleaved: bool = False
    """Qwen3-VL's interleaved M-RoPE (models.ModelConfig.mrope_interleaved); needs
    mrope_section."""
    rotary_dim: int | None = None
    """Partial rotary: dims of each head RoPE rotates (models.ModelConfig.rotary_dim); null:
    all of head_dim (a glm4v model defaults to half of it)."""
    rope_style: str = "half"
    """RoPE pairs: half (Llama) or gptj (adjacent dims; models.ModelConfig.rope_style; a glm4v
    model always uses gptj)."""
    vision: dict | None = None
    """A vision tower trained from scratch (a Qwen2-VL-style model): the fields of
    models.qwen2_vl.VisionConfig (arch, depth, hidden_size, num_heads, intermediate_size,
    patch_size, ...; out_hidden_size defaults to hidden_size); needs mrope_section. Null: a
    decoder-only model, unless init_from is a Qwen2-VL / Qwen2.5-VL checkpoint."""
    freeze_vision: bool = False
    """Keep the vision tower's weights fixed (VL models): no gradients, no optimizer state."""
    moe: dict | None = None
    """A mixture-of-experts model from scratch (model.family qwen3_moe): the MoE fields of
    models.qwen3_moe.config.Qwen3MoeConfig (num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers,
    router_aux_loss_coef, router_z_loss_coef). Null: the family's defaults."""
    vision_cp: str = "split"
    """VL models under cp: split (each cp rank runs the tower on its share of the images,
    balanced by patch count; rows all-gathered) or replicate (every rank runs every image)."""

    def __post_init__(self):
        _positive("model", self, "vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "intermediate_size", "head_dim", "max_position_embeddings")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("model.rope_theta and model.rms_norm_eps must be > 0")
        _choice("model", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("model", "fp8", self.fp8, FP8_RECIPES)
        _choice("model", "linear_backend", self.linear_backend, LINEAR_BACKENDS)
        if self.fp8.startswith("te_") and self.linear_backend == "native":
            raise ValueError(f"model.fp8={self.fp8} is a TransformerEngine recipe; set "
                             f"model.linear_backend=te (or auto)")
        if self.fp8 == "tensorwise" and self.linear_backend == "te":
            raise ValueError("model.fp8=tensorwise is mpcore's own kernel (linear_backend "
                             "native); with linear_backend=te use fp8=te_current or te_delayed")
        _choice("model", "vision_cp", self.vision_cp, ("split", "replicate"))
        _choice("model", "family", self.family, ("auto", *FAMILIES))
        if self.vision is not None and not isinstance(self.vision, dict):
            raise ValueError(f"model.vision must be a mapping of VisionConfig fields or null, "
                             f"got {self.vision!r}")
        if self.init_from and Path(self.init_from).is_file():
            raise ValueError(f"model.init_from={self.init_from} is a file, not a folder; pass the "
                             f"Hugging Face checkpoint folder that holds config.json and the "
                             f"weights (here perhaps {Path(self.init_from).parent})")
        if self.vision is not None and self.mrope_section is None and not self.init_from:
            raise ValueError("model.vision is set but model.mrope_section is not; a VL decoder "
                             "uses M-RoPE (e.g. mrope_section: [2, 3, 3] for head_dim 16)")

    def shape_fields(self) -> dict:
        """The keyword arguments of ``models.ModelConfig``: every field but ``init_from``, the
        kernel choices (``attention_backend``, ``fp8``, ``linear_backend``; ``mpcore.build``),
        and the family's own fields (``model.family``; the vision ones are qwen2_vl's)."""
        out = dataclasses.asdict(self)
        for name in ("init_from", "family", "attention_backend", "fp8", "linear_backend",
                     "vision", "freeze_vision", "vision_cp", "moe"):
            del out[name]
        return out


@dataclass(frozen=True)
class ParallelSection:
    """How the world is split: rank = tp_rank + tp * (cp_rank + cp * dp_rank); dp is inferred."""

    tp: int = 1
    """Tensor-parallel degree (ranks sharing each layer's weights)."""
    cp: int = 1
    """Context-parallel degree (ranks sharing each sequence)."""
    ep: int = 1
    """Expert-parallel degree of a MoE model: its experts split over ep of the dp x cp ranks
    (ep divides dp * cp; ep fastest inside dp x cp, parallel.state). Needs data_parallel
    fsdp (expert weights sharded over the expert-data-parallel group). Checkpoints hold every
    expert, so a run resumes at any ep (mpcore.logical)."""
    cp_mode: str = "ring"
    """Context-parallel attention when cp > 1: ring or ulysses."""
    cp_layout: str = "zigzag"
    """Token split over cp ranks: zigzag (load-balanced causal) or contiguous."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the tp group (needs tp > 1 to matter)."""
    data_parallel: str = "fsdp"
    """Gradient reduction over the dp x cp group: fsdp (FSDP2 fully_shard) or ddp."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward instead of storing its activations."""
    init_timeout_s: float = 300.0
    """Seconds the ranks wait for each other when the process group forms (the rendezvous and
    a first collective); past it every waiting rank exits with a message (exit code 4)
    instead of hanging, and torchrun --max-restarts can restart the run."""
    step_timeout_s: float = 300.0
    """Seconds a rank may go without progress in training (a phase of a step: data,
    forward/backward, optimizer, validation; 3x for a checkpoint save and for the first step
    of a process, which compiles and autotunes) before every rank stops with a message naming
    the rank that is behind (exit code 5; mpcore.watchdog), instead of waiting for the
    collective's own timeout (30 min gloo, 10 min NCCL). 300 s is 4x the longest phase measured
    here (a 70 s save of a 2.2B VL run on an H200, before the 3x). 0 disables it."""

    def __post_init__(self):
        _positive("parallel", self, "tp", "cp", "ep")
        if self.step_timeout_s < 0:
            raise ValueError(f"parallel.step_timeout_s must be >= 0 seconds (0 disables the "
                             f"step watchdog), got {self.step_timeout_s!r}")
        if self.ep > 1 and self.data_parallel != "fsdp":
            raise ValueError(f"parallel.ep={self.ep} needs parallel.data_parallel=fsdp (DDP "
                             f"would average different experts over dp x cp)")
        if not self.init_timeout_s > 0:
            raise ValueError(f"parallel.init_timeout_s must be > 0 seconds, got "
                             f"{self.init_timeout_s!r}")
        _choice("parallel", "cp_mode", self.cp_mode, ("ring", "ulysses"))
        _choice("parallel", "cp_layout", self.cp_layout, ("zigzag", "contiguous"))
        _choice("parallel", "data_parallel", self.data_parallel, ("fsdp", "ddp"))


@dataclass(frozen=True)
class DataSection:
    """What is read and how it is batched. A global batch is micro_batch * grad_accum * dp
    samples of seq_len tokens."""

    paths: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (PREFIX.bin / PREFIX.idx from launch/prepare_data.py); empty
    means the default corpus shipped with the repo, prepared on first use."""
    weights: list[float] = field(default_factory=list)
    """Blend weights, one per path; empty means equal weights."""
    tokenizer: str | None = None
    """The SentencePiece .model that wrote the datasets (its eos id ends each document);
    required with paths, refused without them (the default corpus uses its own)."""
    cache_dir: str = "runs/data"
    """Where the default corpus is prepared (tokenizer + dataset) on first use."""
    default_vocab_size: int = 2048
    """Vocabulary of the tokenizer trained on the default corpus (<= model.vocab_size)."""
    seq_len: int = 256
    """Tokens per packed sample."""
    micro_batch: int = 4
    """Samples per micro-batch on each dp rank (one packed stream of micro_batch * seq_len)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 1234
    """Seed of the sample order and the blend."""
    valid_fraction: float = 0.0
    """Fraction of each dataset's documents (its last ones) held out for the validation loss
    and never trained on; 0 holds out nothing."""
    vl_paths: list[str] = field(default_factory=list)
    """Vision-language runs: image-text dataset folders (launch/prepare_vl_data.py); empty
    means the image set shipped with the repo, prepared on first use. Text datasets of paths
    blend in; weights then list the VL datasets first, then the text ones."""
    vl_drop_long: bool = False
    """VL runs: drop (and count) samples longer than seq_len instead of stopping with an
    error (samples are never cut: an image never crosses a micro-batch)."""

    def __post_init__(self):
        _positive("data", self, "default_vocab_size", "seq_len", "micro_batch", "grad_accum")
        if not 0 <= self.valid_fraction < 1:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {self.valid_fraction!r}")
        if self.weights and not self.vl_paths and len(self.weights) != len(self.paths):
            raise ValueError(f"data.weights has {len(self.weights)} entries but data.paths has "
                             f"{len(self.paths)}; give one weight per path or none")
        if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
            raise ValueError(f"data.weights must be >= 0 with a positive sum, got {self.weights}")
        if self.paths and not self.tokenizer and not self.vl_paths:
            raise ValueError("data.paths is set but data.tokenizer is not; set data.tokenizer to "
                             "the SentencePiece .model that wrote the datasets")
        if self.tokenizer and not self.paths and self.vl_paths:
            raise ValueError(f"data.tokenizer={self.tokenizer} is set with data.vl_paths only; a "
                             f"VL run uses the tokenizer its datasets were prepared with "
                             f"(tokenizer.json in each folder), so drop data.tokenizer")
        if self.tokenizer and not self.paths:
            # The default corpus is tokenized by the model trained on it (its cache is keyed
            # by that); a tokenizer given alone would be silently ignored.
            raise ValueError(
                f"data.tokenizer={self.tokenizer} is set but data.paths is empty, and the default "
                f"corpus uses its own tokenizer; to train on the default corpus with yours, "
                f"prepare it first: python launch/prepare_data.py --input "
                f"launch/data/default_corpus.jsonl --output-prefix runs/data/mine --tokenizer "
                f"{self.tokenizer}, then set data.paths=[runs/data/mine]; or drop data.tokenizer")


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW (decoupled weight decay on matrices, none on norms and biases)."""

    lr: float = 3e-3
    """Peak learning rate (after warmup)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on parameters with 2 or more dims."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    backend: str = "auto"
    """torch (AdamW, fused on CUDA), apex (FusedAdam; needs apex) or auto (apex when installed
    and on CUDA, else torch)."""

    def __post_init__(self):
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optimizer.lr and eps must be > 0, weight_decay and grad_clip >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        _choice("optimizer", "backend", self.backend, ("auto", "torch", "apex"))


@dataclass(frozen=True)
class ScheduleSection:
    """Linear warmup from 0 to optimizer.lr, then decay to min_lr_ratio * lr at total_steps."""

    warmup_steps: int = 20
    """Steps of linear warmup (at most the schedule's length: a 5-step run warms up in 5)."""
    total_steps: int | None = None
    """Step at which the decay ends; null means training.max_steps. Keep it fixed across a
    resumed run, or the schedule changes."""
    decay: str = "cosine"
    """cosine or linear."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        _positive("schedule", self, "total_steps")
        _choice("schedule", "decay", self.decay, ("cosine", "linear"))
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints (torch.distributed.checkpoint) in DIR/step-N with a DIR/latest pointer."""

    dir: str | None = None
    """Checkpoint folder; null means RUN_DIR/checkpoints."""
    every: int = 100
    """Save every N steps and at the last step; 0 saves only on a stop signal (SIGTERM, SIGINT,
    SIGUSR1)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones are deleted after a save; the newest one saved
    from a finite state is always kept)."""
    resume: bool = True
    """Resume from the newest checkpoint in DIR that verifies (its manifest), when DIR holds
    any; with false, a DIR that holds checkpoints refuses unless overwrite is set."""
    overwrite: bool = False
    """Start over in a folder that holds an earlier run: delete DIR's checkpoints and
    RUN_DIR/metrics.jsonl first. Needs resume=false (it never resumes)."""
    async_save: bool = False
    """Write periodic checkpoints in the background (mpcore.checkpoint_async): the step that
    saves only copies this rank's share to host memory, training goes on during the write,
    and the checkpoint is renamed into place (manifest, rotation) at a later step boundary
    once every rank's files are written. Costs host memory for one staged copy. Stop signals
    and the last step still save blocking. (Named async_save: async is a Python keyword.)"""
    accept_changes: list[str] = field(default_factory=list)
    """Config keys allowed to differ from the resumed checkpoint's although they change the
    data order or what a step means (e.g. [data.paths] to continue on other data; the
    refusal lists them; data.global_batch names micro_batch x grad_accum x dp)."""

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        _positive("checkpoint", self, "keep_last")
        if self.overwrite and self.resume:
            raise ValueError("checkpoint.overwrite=true deletes the folder's checkpoints and "
                             "starts over, so it cannot resume; set checkpoint.resume=false "
                             "with it")
        known = set(valid_keys()) | {"data.global_batch"}
        unknown = [k for k in self.accept_changes if k not in known]
        if unknown:
            raise ValueError(f"checkpoint.accept_changes has unknown keys {unknown}; name "
                             f"config keys such as data.paths or data.global_batch")


@dataclass(frozen=True)
class LoggingSection:
    """What rank 0 reports."""

    run_dir: str = "runs/tiny"
    """Run folder: config.yaml, metrics.jsonl, tensorboard/, and checkpoints by default."""
    log_every: int = 10
    """Print and record metrics every N steps (and at the first and last)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to RUN_DIR/tensorboard (needs the tensorboard package)."""

    def __post_init__(self):
        _positive("logging", self, "log_every")


@dataclass(frozen=True)
class TrainingSection:
    """The run itself."""

    max_steps: int = 200
    """Optimizer steps to train (a resumed run continues up to it)."""
    seed: int = 0
    """Seed of the weight initialisation and the RNG streams."""
    dtype: str = "bfloat16"
    """Autocast dtype on CUDA (weights and optimizer stay fp32); CPU always runs fp32."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm."""
    eval_every: int = 0
    """Validation loss on the held-out documents (data.valid_fraction) every N steps and at
    the last step; 0 never evaluates."""
    eval_batches: int = 4
    """Micro-batches per dp rank in each validation (the same ones every time)."""

    def __post_init__(self):
        _positive("training", self, "max_steps", "max_bad_steps", "eval_batches")
        if self.eval_every < 0:
            raise ValueError(f"training.eval_every must be >= 0, got {self.eval_every}")
        _choice("training", "dtype", self.dtype, DTYPES)
        _choice("training", "device", self.device, DEVICES)


@dataclass(frozen=True)
class Config:
    """A whole training run; see the module docstring."""

    model: ModelSection = field(default_factory=ModelSection)
    """The decoder."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """The parallel layout."""
    data: DataSection = field(default_factory=DataSection)
    """Datasets and batching."""
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """AdamW."""
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    """Learning-rate schedule."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    """Metrics and run folder."""
    training: TrainingSection = field(default_factory=TrainingSection)
    """Steps, seed, dtype."""

    def __post_init__(self):
        seq, most = self.data.seq_len, self.model.max_position_embeddings
        if seq > most:
            raise ValueError(f"data.seq_len={seq} exceeds model.max_position_embeddings={most}: "
                             f"positions would reach {seq - 1}, beyond what the model is meant "
                             f"for; lower data.seq_len to <= {most} or raise "
                             f"model.max_position_embeddings")
        if self.training.eval_every and not self.data.valid_fraction:
            raise ValueError(f"training.eval_every={self.training.eval_every} needs held-out "
                             f"documents; set data.valid_fraction (e.g. 0.05) or "
                             f"training.eval_every=0")

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule."""
        return self.schedule.total_steps or self.training.max_steps

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.logging.run_dir) / "checkpoints")


# ----------------------------------------------------------------------------- loading


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def valid_keys() -> list[str]:
    """Every dotted key (``section.field``)."""
    return [f"{name}.{f.name}" for name, cls in _sections().items()
            for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ValueError:
    keys = valid_keys()
    candidates = keys + list(_sections())
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # a bare field name, or the right field under the wrong section
        tail = key.rsplit(".", 1)[-1]
        same = [k for k in keys if k.endswith("." + tail)]
        close = same or difflib.get_close_matches(tail, keys, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint} (valid sections: "
                      f"{', '.join(_sections())})")


def _is_optional(tp) -> tuple[bool, Any]:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if (origin is typing.Union or origin is types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return True, rest[0]
    return False, tp


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` (from YAML or an override string) as type ``tp``; ValueError naming ``key``."""
    optional, tp = _is_optional(tp)
    if optional and (value is None or (isinstance(value, str)
                                       and value.strip().lower() in ("null", "none", "~"))):
        return None
    bad = ValueError(f"{key}={value!r} is not a valid {getattr(tp, '__name__', tp)}"
                     + ("" if not optional else " (or null)"))
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            parsed = yaml.safe_load(value) if value.strip().startswith("[") else (
                [v for v in value.split(",") if v.strip()])
            value = parsed
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise bad from None
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise AssertionError(f"unhandled config type {tp} for {key}")


def _set(tree: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested dict ``tree`` (checked against the dataclasses)."""
    parts = key.split(".")
    sections = _sections()
    if len(parts) < 2 or parts[0] not in sections:
        raise _unknown(key)
    names = {f.name for f in dataclasses.fields(sections[parts[0]])}
    if parts[1] not in names:
        raise _unknown(key)
    section = tree.setdefault(parts[0], {})
    if len(parts) == 2:
        section[parts[1]] = value
        return
    # model.rope_scaling.factor=32: a key inside a dict-valued field.
    hints = typing.get_type_hints(sections[parts[0]])
    if _is_optional(hints[parts[1]])[1] is not dict or len(parts) != 3:
        raise _unknown(key)
    inner = section.get(parts[1]) or {}
    section[parts[1]] = {**inner, parts[2]: yaml.safe_load(value) if isinstance(value, str)
                         else value}


def from_dict(tree: dict) -> Config:
    """A validated :class:`Config` from nested mappings (any subset of the fields)."""
    if not isinstance(tree, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(tree).__name__}")
    sections = _sections()
    built = {}
    for name, values in tree.items():
        if name not in sections:
            raise _unknown(str(name))
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {name!r} must be a mapping, got {values!r}")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise _unknown(f"{name}.{key}")
            kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
        built[name] = cls(**kwargs)
    return Config(**built)


def to_dict(cfg: Config) -> dict:
    """Nested plain dict of every field (what :func:`save_config` writes)."""
    return dataclasses.asdict(cfg)


def parse_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """``["a.b=1", ...]`` -> ``[("a.b", "1"), ...]``; raises ValueError on a missing ``=``."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value; write e.g. optimizer.lr=1e-3")
        out.append((key.strip(), value))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """The config of YAML file ``path`` (or the defaults) with dotted ``overrides`` applied.

    Override values are parsed as YAML scalars/lists and converted to the field's type
    (``optimizer.lr=1e-3`` is a float, ``data.paths=[a,b]`` a list, ``model.head_dim=null``).
    """
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist; pass a YAML file such as "
                             f"launch/configs/tiny.yaml")
        with open(path) as f:
            try:
                tree = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(_yaml_error(path, e)) from None
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections")
    for key, value in parse_overrides(list(overrides)):
        _set(tree, key, value)
    try:
        return from_dict(tree)
    except (TypeError, ValueError) as e:
        where = f"{path}" if path is not None else "the defaults"
        raise ValueError(f"{e} (config: {where}"
                         + (f" + overrides {list(overrides)})" if overrides else ")")) from None


def _yaml_error(path: Path, error: yaml.YAMLError) -> str:
    """``FILE:LINE:COLUMN: what`` of a YAML syntax error (lines and columns from 1)."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else f"{path}"
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    return (f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")
            + "; fix the file (indent nested keys, write key: value)")


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved ``cfg`` as YAML (every field), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
