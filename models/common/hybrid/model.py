"""The Qwen3.5 text decoder: the shared ``Transformer`` with Qwen3.5's blocks and norms.

What differs from ``mpcore.models.common.decoder.Transformer`` (whose forward, packing, head and
layout rules it keeps): each layer is a ``Qwen35Block`` (gated attention or Gated DeltaNet by
``cfg.layer_types``) and the final norm is zero-centred. The shared RoPE tables cover only the
``rotary_dim`` rotated dims of each head (partial rotary), by M-RoPE rows when the config has
``mrope_section`` (the vision-language model, ``mpcore.models.qwen3_5_vl``). Built on the meta device and
initialised per shard like ``build_model``: the same function at any tp degree.
"""

from __future__ import annotations

import functools

import torch

from mpcore.kernels.fp8_linear import check_fp8
from mpcore.models.common.decoder import Transformer, init_weights
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.kernels import check_available, check_kernel
from mpcore.models.common.hybrid.layers import Qwen35Block
from mpcore.models.common.hybrid.mtp import MtpBlock, forward_with_mtp
from mpcore.models.common.norm import RMSNorm
from mpcore.parallel.state import ParallelState


class Qwen35Transformer(Transformer):
    """The decoder (module docstring); ``gdn_kernel``: ``mpcore.models.common.hybrid.kernels``."""

    def __init__(self, cfg: Qwen35Config, state: ParallelState, *, gdn_kernel: str = "auto",
                 **kwargs):
        if not isinstance(cfg, Qwen35Config):
            raise TypeError(f"Qwen35Transformer needs a Qwen35Config, got {type(cfg).__name__}")
        check_kernel(gdn_kernel)
        if cfg.uses_mtp and kwargs.get("keep_layers") is not None:
            raise ValueError("the MTP block reads the embedding and the last hidden state, "
                             "which a pipeline stage does not both hold; train MTP at pp = 1 "
                             "(set the MTP weight to 0 to train at pp > 1)")
        super().__init__(cfg, state, layer=functools.partial(Qwen35Block, gdn_kernel=gdn_kernel),
                         **kwargs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, group=state.tp_group,
                            sum_grad_over_tp=self.sequence_parallel, zero_centred=True,
                            dtype=kwargs.get("dtype")) if self.is_last else None
        # Multi-token prediction (mpcore.models.common.hybrid.mtp): built only when trained.
        self.mtp = MtpBlock(cfg, state, sequence_parallel=self.sequence_parallel,
                            fp8=kwargs.get("fp8", "none"), dtype=kwargs.get("dtype")
                            ) if cfg.uses_mtp else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                mtp_input_ids: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None, **kwargs):
        """``Transformer.forward``; with ``mtp_input_ids`` (and ``mtp_labels``) also the MTP
        head's output: ``MtpOutput(main, mtp)`` (``mpcore.models.common.hybrid.mtp``)."""
        if mtp_input_ids is None:
            if mtp_labels is not None:
                raise ValueError("mtp_labels given without mtp_input_ids; pass both "
                                 "(hybrid.mtp.local_inputs makes them)")
            return super().forward(input_ids, position_ids, **kwargs)
        return forward_with_mtp(self, input_ids, position_ids, mtp_input_ids=mtp_input_ids,
                                mtp_labels=mtp_labels, **kwargs)


def make_model(cfg: Qwen35Config, state: ParallelState, *, sequence_parallel: bool = False,
               cp_mode: str = "none", activation_checkpointing: bool = False,
               attention_backend: str = "auto", fp8: str = "none", gdn_kernel: str = "auto",
               dtype: torch.dtype = torch.float32,
               keep_layers: range | None = None) -> Qwen35Transformer:
    """The model on the meta device (``build`` and ``load_hf`` materialise it)."""
    with torch.device("meta"):
        return Qwen35Transformer(cfg, state, sequence_parallel=sequence_parallel,
                                 cp_mode=cp_mode,
                                 activation_checkpointing=activation_checkpointing,
                                 attention_backend=attention_backend, fp8=fp8,
                                 gdn_kernel=gdn_kernel, dtype=dtype, keep_layers=keep_layers)


def build(cfg: Qwen35Config, state: ParallelState, *, seed: int = 0,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          fp8: str = "none", **options) -> Qwen35Transformer:
    """Create on meta, materialise this rank's shards on ``device``, initialise from ``seed``
    (``build_model``'s keyword arguments, plus ``gdn_kernel``). Raises ``ValueError`` when
    ``cfg`` does not fit ``state`` (``Qwen35Config.check_parallel``)."""
    model = materialise(make_model, cfg, state, device=device, dtype=dtype, fp8=fp8, **options)
    init_weights(model, seed)
    return model


def materialise(make, cfg, state: ParallelState, *, device: torch.device | str, dtype: torch.dtype,
                fp8: str, **options):
    """``make(cfg, state, ...)`` (a meta-device builder: this family's ``make_model`` or the
    MoE family's) with this rank's storage allocated on ``device``, not initialised; ``fp8``
    and ``gdn_kernel`` are checked against ``device`` first (``ValueError`` naming the fix)."""
    check_fp8(fp8, device)
    check_available(options.get("gdn_kernel", "auto"), device)
    model = make(cfg, state, fp8=fp8, dtype=dtype, **options)
    model.to_empty(device=device)
    return model
