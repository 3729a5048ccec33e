"""Triton kernels, each beside a plain PyTorch reference (CUDA runs the kernel, other devices
the reference). Imports nothing else of this project."""

from kernels.linear_cross_entropy import linear_cross_entropy, linear_logprobs
from kernels.rmsnorm import rms_norm, rms_norm_reference
from kernels.rope import rope, rope_reference
from kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "linear_cross_entropy",
    "linear_logprobs",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
