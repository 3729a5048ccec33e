"""Triton kernels, each beside a plain PyTorch reference (CUDA runs the kernel, other devices
the reference). Imports nothing else of this project.

The package exports the loss heads and RMSNorm (plain, and fused with the residual add before it); the fused SwiGLU and RoPE are imported from
their modules (``from kernels.swiglu import swiglu``, ``from kernels.rope import rope``):
re-exporting a function named like its module would hide the module behind the function.
"""

from kernels.linear_cross_entropy import linear_cross_entropy, linear_logprobs
from kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_reference

__all__ = ["add_rms_norm", "linear_cross_entropy", "linear_logprobs", "rms_norm",
           "rms_norm_reference"]
