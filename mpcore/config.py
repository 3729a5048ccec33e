"""Training configuration: nested frozen dataclasses, YAML files and dotted ``key=value`` overrides.

Layout of a config (every field has a docstring below):

    model       ``family`` and the family's keys (the decoder's shape, ``vision``, ``moe``), and
                the run-level ``init_from``, kernel choices, ``freeze_vision``, ``vision_cp``
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

The ``model`` section's keys depend on its family (``model.family``, or what ``auto`` resolves
to, :func:`section_family`): each family's are a dataclass in its folder under ``models/``
(``Family.section``, derived from the config it builds: ``mpcore.models.common.section``), and
:class:`ModelSection` adds the run-level ones; :func:`model_section` is the type of both. Keys of
nested sections (``model.vision.depth``) are checked against the family's too.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from mpcore import atomic
from mpcore.data.hf_folder import has_tokenizer
from mpcore.models.common.family import Family
from mpcore.models.registry import FAMILIES as REGISTRY
from mpcore.models.registry import family_named, family_of_hf
from mpcore.parallel_config import ParallelSection
from mpcore.parallel_config import choice as _choice
from mpcore.parallel_config import positive as _positive

DTYPES = ("bfloat16", "float32")
# mpcore.parallel.attention.backends.BACKENDS, mpcore.kernels.fp8_linear.RECIPES + mpcore.parallel.te.TE_RECIPES and
# mpcore.parallel.te.LINEAR_BACKENDS (tests check they agree).
ATTENTION_BACKENDS = ("auto", "flash", "sdpa_cudnn", "te_fused", "reference")
FP8_RECIPES = ("none", "tensorwise", "te_delayed", "te_current")
RESIDUAL_DTYPES = ("float32", "autocast")
LINEAR_BACKENDS = ("native", "te", "auto")
DEVICES = ("auto", "cpu", "cuda")
FAMILIES = tuple(REGISTRY)
# mpcore.models.common.hybrid.kernels.GDN_KERNELS (a test checks)
GDN_KERNELS = ("auto", "fla", "reference")


@dataclass(frozen=True)
class ModelSection:
    """The model section's run-level keys, mpcore's own (no part of a model's shape). A
    ``model`` section is an instance of ``model_section(family)``: these keys plus the family's
    own (``Family.section``: the shared decoder's keys, defaults the tiny model, and the
    family's ``vision`` or ``moe``), each defined once, in the family's folder under
    ``models/``. A key of another family is refused, naming the families that take it."""

    family: str = "auto"
    """The model family (mpcore.models.registry), whose keys the section takes: llama (Llama 3 /
    Qwen2 / Qwen3 by the decoder keys), qwen2_vl (Qwen2-VL / Qwen2.5-VL: needs vision),
    qwen3_vl (Qwen3-VL: needs vision, qk_norm, mrope_interleaved), glm4v (GLM-4V / GLM-4.1V:
    needs vision), qwen3_5 (Qwen3.5 text: Gated DeltaNet beside gated attention), qwen3_5_vl
    (Qwen3.5 vision-language: needs vision, mrope_section), qwen3_moe (Qwen3-MoE: needs moe),
    qwen3_vl_moe (Qwen3-VL-MoE: needs vision and moe), qwen3_5_moe (Qwen3.5-MoE: needs moe;
    intermediate_size is the shared expert's width) or qwen3_5_vl_moe (Qwen3.5-MoE
    vision-language, e.g. Qwen3.5-35B-A3B: needs vision, mrope_section and moe;
    intermediate_size is the shared expert's width); auto: the family of init_from's
    config.json, else the family whose nested sections match the most of those given (vision:
    qwen2_vl, moe: qwen3_moe, both: qwen3_vl_moe; the first in that list on a tie), else
    llama."""
    init_from: str | None = None
    """A Hugging Face checkpoint folder (not a file in it) to start from (its config.json
    replaces the shape keys), or null for a fresh initialisation from training.seed."""
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
    residual_dtype: str = "float32"
    """The decoder's residual stream under autocast: float32 (the embedding's dtype, as
    transformers keeps it) or autocast (cast to training.dtype after the embedding, as
    Megatron-core and torchtitan keep it: half the stream's activation memory and traffic; the
    values and gradients along it are rounded to that dtype at every residual add). Without
    autocast (fp32 training) both are float32."""
    freeze_vision: bool = False
    """Keep the vision tower's weights fixed (VL models): no gradients, no optimizer state."""
    vision_cp: str = "split"
    """VL models under cp: split (each cp rank runs the tower on its share of the images,
    balanced by patch count; rows all-gathered) or replicate (every rank runs every image)."""
    gdn_kernel: str = "auto"
    """Gated DeltaNet kernels (the Qwen3.5 families): auto (fla-core's Triton ops on CUDA when
    installed and a first forward + backward there passes, else our PyTorch reference, with one
    warning saying why), fla (fla-core; missing or refused: an error with the install command
    or fla's reason) or reference (any device)."""

    resolved_family: ClassVar[str] = "llama"  # the family whose keys this section type holds

    def __post_init__(self):
        _choice("model", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("model", "fp8", self.fp8, FP8_RECIPES)
        _choice("model", "linear_backend", self.linear_backend, LINEAR_BACKENDS)
        if self.fp8.startswith("te_") and self.linear_backend == "native":
            raise ValueError(f"model.fp8={self.fp8} is a TransformerEngine recipe; set "
                             f"model.linear_backend=te (or auto)")
        if self.fp8 == "tensorwise" and self.linear_backend == "te":
            raise ValueError("model.fp8=tensorwise is mpcore's own kernel (linear_backend "
                             "native); with linear_backend=te use fp8=te_current or te_delayed")
        _choice("model", "residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        _choice("model", "vision_cp", self.vision_cp, ("split", "replicate"))
        _choice("model", "gdn_kernel", self.gdn_kernel, GDN_KERNELS)
        takers = [n for n, f in REGISTRY.items() if "gdn_kernel" in f.options]
        if self.gdn_kernel != "auto" and self.resolved_family not in takers:
            raise ValueError(f"model.gdn_kernel={self.gdn_kernel} is set but the "
                             f"{self.resolved_family} family has no Gated DeltaNet layers (the "
                             f"families that have: {takers}); remove it")
        _choice("model", "family", self.family, ("auto", *FAMILIES))
        if self.family not in ("auto", self.resolved_family):
            raise ValueError(f"model.family={self.family} but the section holds the "
                             f"{self.resolved_family} family's keys; make it with "
                             f"mpcore.config.from_dict")
        if self.init_from and Path(self.init_from).is_file():
            raise ValueError(f"model.init_from={self.init_from} is a file, not a folder; pass the "
                             f"Hugging Face checkpoint folder that holds config.json and the "
                             f"weights (here perhaps {Path(self.init_from).parent})")

    def __reduce__(self):  # the type is made per family (model_section): pickle by family
        return _section_of_family, (self.resolved_family, {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def _combine(family: Family) -> type:
    return dataclasses.make_dataclass(
        f"ModelSection_{family.name}", [], bases=(family.section, ModelSection), frozen=True,
        namespace={"resolved_family": family.name, "__module__": __name__})


_MODEL_SECTIONS = {name: _combine(family) for name, family in REGISTRY.items()}


def model_section(family: str) -> type:
    """The type of a ``model`` section of ``family``: the family's keys and the run-level
    ones (:class:`ModelSection`)."""
    return _MODEL_SECTIONS[family]


def _section_of_family(family: str, kwargs: dict) -> ModelSection:
    return model_section(family)(**kwargs)


def section_family(values: dict) -> Family:
    """The family whose keys the raw ``model`` mapping ``values`` holds (``family``'s rule:
    ``auto`` reads init_from's config.json when there is one)."""
    name = values.get("family", "auto")
    _choice("model", "family", name, ("auto", *FAMILIES))
    if name != "auto":
        return family_named(name)
    init_from = values.get("init_from")
    if isinstance(init_from, str) and (Path(init_from) / "config.json").is_file():
        return family_of_hf(init_from)
    given = {k for k, v in values.items() if v is not None}
    return max(REGISTRY.values(), key=lambda f: len(given & set(f.section_extras)))


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
    """What wrote the datasets: a tokenizer folder (tokenizer.json + tokenizer_config.json,
    as released; its eos ends each text document) or a SentencePiece .model. Default with
    paths: model.init_from's folder when it holds a tokenizer.json; refused without paths
    (the default corpus uses its own)."""
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
    sft_truncate: bool = False
    """Chat (SFT) data: cut a conversation longer than seq_len to its first seq_len tokens
    (counted) instead of stopping with an error that names its source line."""
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


SCRATCH_LR, FINE_TUNE_LR, SCRATCH_WARMUP = 3e-3, 1e-5, 20


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW (decoupled weight decay on matrices, none on norms and biases)."""

    lr: float | None = None
    """Peak learning rate (after warmup). Default (null): 3e-3 from scratch, 1e-5 with
    model.init_from (a from-scratch rate wrecks a release's weights in a few steps)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on parameters with 2 or more dims."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    backend: str = "auto"
    """torch (AdamW, fused on CUDA), triton (``mpcore.optim.TritonAdamW``: the same update in
    one Triton pass over all the parameters on CUDA, PyTorch elsewhere), apex (FusedAdam; needs
    apex) or auto (on CUDA apex when installed, else triton; torch on other devices)."""

    def __post_init__(self):
        if (self.lr is not None and self.lr <= 0) or self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optimizer.lr and eps must be > 0, weight_decay and grad_clip >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        _choice("optimizer", "backend", self.backend, ("auto", "torch", "triton", "apex"))


@dataclass(frozen=True)
class ScheduleSection:
    """Linear warmup from 0 to optimizer.lr, then decay to min_lr_ratio * lr at total_steps."""

    warmup_steps: int | None = None
    """Steps of linear warmup (at most the schedule's length: a 5-step run warms up in 5).
    Default (null): 20 from scratch; with model.init_from 3% of the schedule (at least 1)."""
    total_steps: int | None = None
    """Step at which the decay ends; null means training.max_steps. Keep it fixed across a
    resumed run, or the schedule changes."""
    decay: str = "cosine"
    """cosine or linear."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""

    def __post_init__(self):
        if self.warmup_steps is not None and self.warmup_steps < 0:
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
    async_save: str = "auto"
    """true: write periodic checkpoints in the background (mpcore.checkpoint_async): the step
    that saves only copies this rank's share to pinned host memory, training goes on during
    the write, and the checkpoint is renamed into place (manifest, rotation) at a later step
    boundary once every rank's files are written. Costs one page-locked copy of this rank's
    share, held from the first save on. Stop signals and the last step still save blocking.
    auto (default): true on a GPU when the node's staged copies (fp32 weights + AdamW state of
    its ranks) fit in a quarter of its memory, else false (the run says which). false: every
    save blocks. (Named async_save: async is a Python keyword.)"""
    accept_changes: list[str] = field(default_factory=list)
    """Config keys allowed to differ from the resumed checkpoint's although they change the
    data order or what a step means (e.g. [data.paths] to continue on other data; the
    refusal lists them; data.global_batch names micro_batch x grad_accum x dp)."""

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        flag = {"true": "true", "yes": "true", "on": "true", "1": "true", "false": "false",
                "no": "false", "off": "false", "0": "false"}.get(str(self.async_save).lower(),
                                                                 str(self.async_save).lower())
        _choice("checkpoint", "async_save", flag, ("auto", "true", "false"))
        object.__setattr__(self, "async_save", flag)
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

    model: ModelSection = field(default_factory=lambda: _model_section({}))
    """The model: its family's keys and the run-level ones."""
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
        d, init_from = self.data, self.model.init_from
        if self.optimizer.lr is None:  # defaults that depend on init_from (docstrings: why)
            lr = FINE_TUNE_LR if init_from else SCRATCH_LR
            object.__setattr__(self, "optimizer", dataclasses.replace(self.optimizer, lr=lr))
        if self.schedule.warmup_steps is None:
            total = self.schedule.total_steps or self.training.max_steps
            warmup = max(1, round(0.03 * total)) if init_from else SCRATCH_WARMUP
            object.__setattr__(self, "schedule",
                               dataclasses.replace(self.schedule, warmup_steps=warmup))
        if d.paths and not d.tokenizer and not d.vl_paths and not has_tokenizer(init_from):
            raise ValueError("data.paths is set but data.tokenizer is not (and model.init_from "
                             "has no tokenizer.json); set data.tokenizer to the tokenizer folder "
                             "or SentencePiece .model that wrote the datasets")
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


def _nested(tp) -> type | None:
    """The section dataclass a field of type ``tp`` holds (``vision``, ``moe``), else None."""
    tp = _is_optional(tp)[1]
    return tp if dataclasses.is_dataclass(tp) else None


def _keys(cls: type, prefix: str) -> list[str]:
    """Dotted keys of section ``cls`` under ``prefix``, nested sections' keys included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        sub = _nested(hints[f.name])
        if sub is not None:
            out += _keys(sub, f"{prefix}{f.name}.")
    return out


def valid_keys(family: str | None = None) -> list[str]:
    """Every dotted key (``section.field``, ``model.vision.depth``): the model keys of
    ``family``, or of every family when None."""
    sections = {**_sections(), "model": None}
    families = [family] if family else list(REGISTRY)
    out = []
    for name, cls in sections.items():
        types_ = [cls] if cls is not None else [model_section(f) for f in families]
        for t in types_:
            out += [k for k in _keys(t, f"{name}.") if k not in out]
    return out


def _unknown(key: str, family: Family | None = None) -> ValueError:
    keys = valid_keys(family and family.name)
    candidates = keys + list(_sections())
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # a bare field name, or the right field under the wrong section
        tail = key.rsplit(".", 1)[-1]
        same = [k for k in keys if k.endswith("." + tail)]
        close = same or difflib.get_close_matches(tail, keys, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if family is not None:
        names = [f.name for f in dataclasses.fields(model_section(family.name))]
        return ValueError(f"unknown config key {key!r}{hint} (the {family.name} family's "
                          f"model keys: {', '.join(names)})")
    return ValueError(f"unknown config key {key!r}{hint} (valid sections: "
                      f"{', '.join(_sections())})")


def _unknown_in(key: str, cls: type, family: Family | None) -> ValueError:
    """A key ``where.name`` that nested section ``cls`` (e.g. ``model.vision``) lacks: the
    closest of its keys, every one of them, and the families whose such section has it."""
    where, _, name = key.rpartition(".")
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{where}.{close[0]}'?" if close else ""
    owner = f"the {family.name} family's " if family is not None else ""
    others = [f.name for f in REGISTRY.values() if f is not family
              and name in _keys_at(model_section(f.name), where.split(".")[1:])]
    also = (f"; it is a key of the {' / '.join(others)} family's {where} (model.family)"
            if others else "")
    return ValueError(f"unknown config key {key!r}{hint}{also} ({owner}{where} keys: "
                      f"{', '.join(names)})")


def _keys_at(cls: type, path: list[str]) -> set[str]:
    """Field names of the section nested in ``cls`` at ``path`` (empty when there is none)."""
    for part in path:
        fields = {f.name for f in dataclasses.fields(cls)}
        cls = _nested(typing.get_type_hints(cls)[part]) if part in fields else None
        if cls is None:
            return set()
    return {f.name for f in dataclasses.fields(cls)}


def _is_optional(tp) -> tuple[bool, Any]:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if (origin is typing.Union or origin is types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return True, rest[0]
    return False, tp


def _coerce(value: Any, tp: Any, key: str, family: Family | None = None) -> Any:
    """``value`` (from YAML or an override string) as type ``tp``; ValueError naming ``key``."""
    optional, tp = _is_optional(tp)
    if optional and (value is None or (isinstance(value, str)
                                       and value.strip().lower() in ("null", "none", "~"))):
        return None
    if dataclasses.is_dataclass(tp):  # a nested section (model.vision, model.moe)
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping of its keys or null, got {value!r}")
        return _build(tp, value, key, family)
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
    """Set dotted ``key`` in the nested dict ``tree``. The model section's keys depend on its
    family, which a later override may name: :func:`from_dict` checks them."""
    parts = key.split(".")
    sections = _sections()
    if len(parts) < 2 or parts[0] not in sections or not all(parts):
        raise _unknown(key)
    if parts[0] != "model" and (len(parts) > 2 or parts[1] not in {
            f.name for f in dataclasses.fields(sections[parts[0]])}):
        raise _unknown(key)
    node = tree
    for part in parts[:-1]:
        inner = node.get(part)
        node[part] = dict(inner) if isinstance(inner, dict) else {}
        node = node[part]
    # model.rope_scaling.factor=32, model.vision.depth=2: a key inside a mapping
    node[parts[-1]] = yaml.safe_load(value) if len(parts) > 2 and isinstance(value, str) else value


def _build(cls: type, values: dict, where: str, family: Family | None = None):
    """Section ``cls`` of the mapping ``values`` (any subset of its fields) at ``where``."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:  # (model's own keys are sorted out by _model_section)
            raise (_unknown_in(f"{where}.{key}", cls, family) if "." in where
                   else _unknown(f"{where}.{key}"))
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}", family)
    return cls(**kwargs)


def _model_section(values: dict) -> ModelSection:
    """The ``model`` section of the mapping ``values``: its family's type (section_family);
    a key of another family is refused (left null, as older run folders' config.yaml wrote
    them, it is dropped)."""
    family = section_family(values)
    cls = model_section(family.name)
    names = {f.name for f in dataclasses.fields(cls)}
    kept = {}
    for key, value in values.items():
        if key in names:
            kept[key] = value
            continue
        owners = [f.name for f in REGISTRY.values()
                  if key in {x.name for x in dataclasses.fields(f.section)}]
        if owners and value is not None:
            raise ValueError(f"model.{key} is set but the {family.name} family takes none; "
                             f"set model.family to one of {owners}, or remove model.{key}")
        if not owners:
            raise _unknown(f"model.{key}", family)
    return _build(cls, kept, "model", family)


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
        built[name] = (_model_section(values) if name == "model"
                       else _build(sections[name], values, name))
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
