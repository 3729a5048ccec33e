"""Qwen3.5 text decoder configuration: ``ModelConfig`` plus the hybrid layers' fields.

Layers are ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"`` (gated softmax
attention); ``layer_types`` lists them, or, when None, every ``full_attention_interval``-th
layer is full attention (transformers' rule: layer i is full iff ``(i + 1) % interval == 0``).
Full attention: ``num_heads`` query heads (each with an output gate), ``num_kv_heads``, QK-norm,
RoPE on the first ``partial_rotary_factor * head_dim`` dims: plain 1-D RoPE on text, or (the
vision-language model, ``mpcore.models.qwen3_5_vl``) interleaved M-RoPE over those dims, with
``mrope_section`` summing to ``rotary_dim / 2`` and ``mrope_interleaved`` true. DeltaNet:
``linear_num_key_heads`` query/key heads of ``linear_key_head_dim``,
``linear_num_value_heads`` value heads of ``linear_value_head_dim`` (a multiple of the key
heads: value head h reads key head ``h // (Hv / Hk)``), a depthwise causal conv of
``linear_conv_kernel_dim`` taps.

Parallel layout (``check_parallel``): DeltaNet key and value heads split over tp (each rank a
contiguous run of key heads and the value heads grouped on them), then again over cp (the
DeltaNet all-to-all, ``mpcore.models.common.hybrid.cp``): both counts must divide by tp * cp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpcore.models.common.config import ModelConfig

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config(ModelConfig):
    """A Qwen3.5 text decoder (module docstring); ``qk_norm`` is always on."""

    partial_rotary_factor: float = 0.25
    """Fraction of head_dim that RoPE rotates (the rest passes through)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer ``linear_attention`` or ``full_attention``; None: by full_attention_interval."""
    full_attention_interval: int = 4
    """Every this-many-th layer is full attention when layer_types is None."""
    linear_num_key_heads: int = 16
    """DeltaNet query/key heads."""
    linear_num_value_heads: int = 32
    """DeltaNet value heads (a multiple of linear_num_key_heads)."""
    linear_key_head_dim: int = 128
    """DeltaNet query/key head width."""
    linear_value_head_dim: int = 128
    """DeltaNet value head width."""
    linear_conv_kernel_dim: int = 4
    """Taps of the DeltaNet short convolution."""
    mtp_num_hidden_layers: int = 0
    """Multi-token-prediction layers of the checkpoint (config.json's ``mtp_num_hidden_layers``;
    the released Qwen3.5 checkpoints have 1, the only depth trained; 0: none; a deeper
    checkpoint loads with ``mtp_loss_weight = 0``, its ``mtp.*`` skipped)."""
    mtp_loss_weight: float = 0.0
    """Weight of the MTP loss: total = main + weight * mtp (``mpcore.models.common.hybrid.mtp``).
    0: no MTP block is built or run (the main model exactly as without it). Qwen does not
    publish the weight its releases were trained with."""

    def __post_init__(self):
        object.__setattr__(self, "qk_norm", True)
        # M-RoPE sections count the ROTATED pairs, known only once head_dim is resolved: the
        # base check runs without them, then again below with rotary_dim set.
        section, interleaved = self.mrope_section, self.mrope_interleaved
        object.__setattr__(self, "mrope_section", None)
        object.__setattr__(self, "mrope_interleaved", False)
        super().__post_init__()  # head_dim resolved
        # ModelConfig.rotary_dim, from the factor (a meta.json round trip gives both: they agree)
        rotary = int(self.head_dim * self.partial_rotary_factor)
        if self.rotary_dim not in (None, rotary):
            raise ValueError(f"rotary_dim {self.rotary_dim} disagrees with partial_rotary_factor "
                             f"{self.partial_rotary_factor} x head_dim {self.head_dim} = "
                             f"{rotary}; give one of the two")
        object.__setattr__(self, "rotary_dim", rotary)
        for name in ("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen35Config.{name} must be a positive integer, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if self.qkv_bias:
            raise ValueError("Qwen3.5 has no attention biases; set qkv_bias false")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dims of head_dim {self.head_dim}; it "
                             f"must be in (0, 1] with an even, non-zero count")
        if self.rope_scaling is not None:
            raise ValueError("Qwen3.5 uses plain RoPE; set rope_scaling null")
        object.__setattr__(self, "mrope_section", section)
        object.__setattr__(self, "mrope_interleaved", interleaved)
        if section is not None:
            if interleaved is not True:
                raise ValueError("Qwen3.5's M-RoPE is interleaved (transformers always "
                                 "interleaves it): set mrope_interleaved true with mrope_section")
            self._check_mrope()
        elif interleaved:
            raise ValueError("mrope_interleaved needs mrope_section (the t, h, w counts); set "
                             "both or neither")
        self._check_mtp()
        types = self.layer_types
        if types is None:
            types = tuple("full_attention" if (i + 1) % self.full_attention_interval == 0
                          else "linear_attention" for i in range(self.num_layers))
        types = tuple(types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must list {self.num_layers} entries (num_layers) of "
                             f"{LAYER_TYPES}, got {list(types)}")

    def _check_mtp(self) -> None:
        layers, weight = self.mtp_num_hidden_layers, self.mtp_loss_weight
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise ValueError(f"model.mtp_num_hidden_layers must be an integer >= 0 (the released "
                             f"Qwen3.5 checkpoints have 1), got {layers!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                0 <= weight < float("inf")):
            raise ValueError(f"model.mtp_loss_weight must be a finite number >= 0 (0 turns "
                             f"multi-token prediction off), got {weight!r}")
        object.__setattr__(self, "mtp_loss_weight", float(weight))
        if weight > 0 and layers > 1:  # a deeper checkpoint still loads (and scores) at 0
            raise ValueError(f"model.mtp_loss_weight={weight} trains one MTP layer (the released "
                             f"depth) but this model has mtp_num_hidden_layers={layers}; "
                             f"deeper MTP is not supported: set model.mtp_loss_weight=0 (its "
                             f"mtp.* tensors are then skipped)")
        if weight > 0 and layers == 0:
            raise ValueError(f"model.mtp_loss_weight={weight} needs an MTP layer but this model has "
                             f"none (mtp_num_hidden_layers=0: a checkpoint without mtp.* "
                             f"weights, or a model section without it); set "
                             f"model.mtp_loss_weight=0, or set model.mtp_num_hidden_layers=1 "
                             f"for a model trained from scratch")

    def with_mtp_weight(self, weight: float) -> Qwen35Config:
        """This config with ``mtp_loss_weight`` set (its checks: ``ValueError`` naming the
        fix); the run-level weight a checkpoint's config does not hold."""
        return dataclasses.replace(self, mtp_loss_weight=weight)

    @property
    def uses_mtp(self) -> bool:
        """True when the MTP block is built and trained (``mtp_loss_weight > 0``)."""
        return self.mtp_loss_weight > 0

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def check_parallel(self, tp: int, cp: int = 1, cp_mode: str = "none") -> None:
        """``ModelConfig.check_parallel`` plus the DeltaNet heads over tp x cp."""
        super().check_parallel(tp, cp, cp_mode)
        if "linear_attention" not in self.layer_types:
            return
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            heads = getattr(self, name)
            if heads % (tp * cp):
                raise ValueError(f"{name} {heads} is not divisible by tp x cp = {tp} x {cp} = "
                                 f"{tp * cp}: each rank runs whole DeltaNet heads (split over tp, "
                                 f"then over cp by the all-to-all); choose tp and cp whose "
                                 f"product divides {heads}")
