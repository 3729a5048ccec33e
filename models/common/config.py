"""Decoder-only model configuration (Llama 3, Qwen2, Qwen3 by fields, not by name).

One frozen dataclass. The variants are switches: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3),
``tie_embeddings``, ``rope_scaling`` (Llama 3 frequency scaling). ``check_parallel`` checks the
config against a parallel layout (tp, cp, cp mode) and says how to fix a mismatch.

KV heads under TP: when ``num_kv_heads % tp == 0`` each rank holds ``num_kv_heads / tp`` of them
(sharded); when ``tp % num_kv_heads == 0`` each rank holds the ONE kv head its query heads read
(replicated ``tp / num_kv_heads`` times); anything else is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
CP_MODES = ("none", "ring", "ulysses")
ROPE_STYLES = ("half", "gptj")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and variant switches of a decoder-only transformer."""

    vocab_size: int
    """True vocabulary size: every token id must be below it (the embedding and head are
    padded to a multiple of tp)."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads (divisible by tp)."""
    num_kv_heads: int
    """Key/value heads (GQA); must divide ``num_heads``."""
    intermediate_size: int
    """Width of the SwiGLU hidden layer (divisible by tp)."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_heads``. Must be even (RoPE)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = field(default=None, hash=False)
    """``None`` (plain RoPE) or Llama 3 scaling: a dict with ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Use the input embedding as the output head (no separate head weight)."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    max_position_embeddings: int = 8192
    """Longest position the model is meant for (a run's ``data.seq_len`` stays within it;
    exported to HF)."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2-VL): ``(t, h, w)`` counts of rotary frequency pairs driven by the
    temporal, height and width rows of ``[3, T]`` position ids; sums to ``head_dim / 2``.
    ``None``: plain 1-D RoPE on ``[T]`` positions."""
    mrope_interleaved: bool = False
    """Qwen3-VL M-RoPE: frequency pair j takes row 1 (height) when ``j % 3 == 1`` and
    ``j < 3 * s_h``, row 2 (width) when ``j % 3 == 2`` and ``j < 3 * s_w``, else row 0
    (temporal), as transformers' Qwen3-VL rotary embedding assigns them. False: the contiguous
    Qwen2-VL sections. Needs ``mrope_section``."""
    rotary_dim: int | None = None
    """Partial rotary (GLM-4V: half the head dim): RoPE rotates the first ``rotary_dim`` dims of
    each head, the rest pass through unchanged; even, at most ``head_dim``. ``None``: all of
    ``head_dim`` (a glm4v model from our YAML: half of it). ``mrope_section`` then sums to
    ``rotary_dim / 2``."""
    rope_style: str = "half"
    """Which dims RoPE pairs: ``"half"`` (Llama / GPT-NeoX: ``(i, i + r/2)``) or ``"gptj"``
    (GLM-4V, which always uses it: adjacent ``(2i, 2i + 1)``), r the rotated width."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                                 f"{self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or (
                self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"ModelConfig.head_dim must be a positive even integer (RoPE rotates "
                             f"pairs), got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads "
                             f"{self.num_kv_heads}; GQA needs whole groups of query heads")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        self._check_rotary()
        if self.mrope_section is not None:
            self._check_mrope()
        if not isinstance(self.mrope_interleaved, bool):
            raise ValueError(f"mrope_interleaved must be a bool, got {self.mrope_interleaved!r}")
        if self.mrope_interleaved and self.mrope_section is None:
            raise ValueError("mrope_interleaved needs mrope_section (the t, h, w counts); set "
                             "both or neither")

    def _check_mrope(self) -> None:
        section = self.mrope_section
        if isinstance(section, list):
            section = tuple(section)
            object.__setattr__(self, "mrope_section", section)
        if (not isinstance(section, tuple) or len(section) != 3 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)):
            raise ValueError(f"mrope_section must be three non-negative ints (t, h, w), got "
                             f"{self.mrope_section!r}")
        if sum(section) != self.rope_dim // 2:
            what = "head_dim" if self.rotary_dim is None else "rotary_dim"
            raise ValueError(f"mrope_section {list(section)} sums to {sum(section)} but {what} "
                             f"{self.rope_dim} rotates {self.rope_dim // 2} frequency pairs; "
                             f"the three sections must sum to {what} / 2")
        half = self.rope_dim // 2
        if self.mrope_interleaved and (3 * section[1] - 2 >= half or 3 * section[2] - 1 >= half):
            raise ValueError(f"interleaved mrope_section {list(section)} does not fit "
                             f"{self.rope_dim} rotated dims: height pairs reach index "
                             f"{3 * section[1] - 2} and width pairs {3 * section[2] - 1}, but "
                             f"there are {half} pairs; lower the h and w sections")
        if self.rope_scaling is not None:
            raise ValueError("mrope_section with Llama 3 rope_scaling is not supported; set "
                             "one of the two")

    def _check_rotary(self) -> None:
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        r = self.rotary_dim
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 2 or r % 2
                              or r > self.head_dim):
            raise ValueError(f"rotary_dim must be None or an even integer in [2, head_dim = "
                             f"{self.head_dim}], got {r!r}")

    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates: ``rotary_dim``, or ``head_dim`` when None."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if not isinstance(scaling, dict) or set(scaling) != set(ROPE_SCALING_KEYS):
            raise ValueError(f"rope_scaling must be None or a dict with exactly the Llama 3 keys "
                             f"{ROPE_SCALING_KEYS}, got {scaling!r}")
        if not all(isinstance(scaling[k], (int, float)) and scaling[k] > 0
                   for k in ROPE_SCALING_KEYS):
            raise ValueError(f"rope_scaling values must be positive numbers, got {scaling!r}")
        if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got "
                             f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")

    @property
    def q_size(self) -> int:
        """Width of all query heads: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    def local_kv_heads(self, tp: int) -> int:
        """KV heads each of ``tp`` ranks holds (sharded or, when fewer than tp, one replica)."""
        return max(1, self.num_kv_heads // tp)

    def check_parallel(self, tp: int, cp: int = 1, cp_mode: str = "none") -> None:
        """Raise ``ValueError`` naming the fix when this config cannot run at ``tp`` x ``cp``."""
        if cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}, got {cp_mode!r}")
        if self.num_heads % tp:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by tp {tp}; choose a "
                             f"tp that divides {self.num_heads}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} and tp {tp}: neither divides the "
                             f"other, so kv heads can be neither sharded nor replicated; choose a "
                             f"tp that divides or is a multiple of {self.num_kv_heads}")
        if self.intermediate_size % tp:
            raise ValueError(f"intermediate_size {self.intermediate_size} is not divisible by tp "
                             f"{tp}; choose a tp that divides {self.intermediate_size}")
        if cp_mode == "ulysses" and (self.num_heads // tp) % cp:
            raise ValueError(f"Ulysses needs the local query heads (num_heads / tp = "
                             f"{self.num_heads // tp}) divisible by cp {cp}; use cp_mode='ring' "
                             f"or a cp that divides {self.num_heads // tp}")
