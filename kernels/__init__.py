from kernels.linear_cross_entropy import linear_cross_entropy, linear_logprobs  # noqa: F401
from kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: F401
