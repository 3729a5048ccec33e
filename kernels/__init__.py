"""Triton kernels, each beside a plain PyTorch reference (CUDA runs the kernel, other devices
the reference). Imports nothing else of this project.

The package exports the loss heads and RMSNorm (plain, and fused with the residual add before
it); the fused SwiGLU, RoPE, QuickGELU and the LayerNorm of the vision towers are imported from
their modules (``from mpcore.kernels.swiglu import swiglu``, ``from mpcore.kernels.rope import rope``,
``mpcore.kernels.quick_gelu``, ``mpcore.kernels.layernorm``): re-exporting a function named like its module
would hide the module behind the function.
Two helpers for the layers live here too, as modules: ``mpcore.kernels.master_linear`` (fp32 weight
gradients straight out of the GEMM under autocast) and ``mpcore.kernels.host_checked`` (value ranges
measured on the host, so the layers need no device sync to check ids and labels).
"""

if __name__ != "mpcore.kernels":  # reached by the bare name; mpcore/_names.py says why
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "mpcore" / "_names.py"))["bare_import"](
        __name__, __path__)
else:
    from mpcore.kernels.linear_cross_entropy import linear_cross_entropy, linear_logprobs
    from mpcore.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_reference

__all__ = ["add_rms_norm", "linear_cross_entropy", "linear_logprobs", "rms_norm",
           "rms_norm_reference"]
