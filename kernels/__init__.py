from kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: F401
