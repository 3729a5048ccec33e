"""Optional backends, detected in this one module: apex's FusedAdam, and (re-exported from
``mpcore.parallel.te``, which the layers below ``mpcore`` import) TransformerEngine's GEMMs.

A backend is an explicit config value: ``optimizer.backend`` is ``torch``, ``triton``, ``apex`` or
``auto``; ``model.linear_backend`` is ``native``, ``te`` or ``auto`` (``resolve_linear_backend``).
A named backend that is not installed raises ``ValueError`` with the install command; only
``auto`` falls back (apex / TE when importable and on CUDA, else torch / native) and logs its
choice once. No stand-ins for missing packages: a backend is either imported for real or not
used.
"""

from __future__ import annotations

import importlib
import logging

from mpcore.kernels._triton import HAVE_TRITON
from mpcore.parallel.te import (
    TE_INSTALL,
    forward_region,
    resolve_linear_backend,
    te_available,
    use_te,
)

log = logging.getLogger(__name__)

APEX_INSTALL = ("pip install -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
                "--config-settings '--build-option=--cuda_ext' git+https://github.com/NVIDIA/apex")
_logged: set[str] = set()


def apex_fused_adam():
    """apex's ``FusedAdam`` class, or ``None`` when apex (with its CUDA extension) is missing."""
    try:
        return importlib.import_module("apex.optimizers").FusedAdam
    except (ImportError, AttributeError):
        return None


def adam_backend(name: str, device_type: str) -> str:
    """Resolve ``optimizer.backend`` to ``"torch"``, ``"triton"`` or ``"apex"`` for
    ``device_type``: ``auto`` is apex where installed on CUDA, else triton on CUDA
    (``mpcore.optim.TritonAdamW``), else torch.

    Raises ``ValueError`` when ``apex`` is named but not installed or the device is not CUDA.
    """
    if name == "torch":
        return "torch"
    if name == "triton":
        return "triton"  # mpcore.kernels.adamw on CUDA, its PyTorch reference elsewhere
    if name == "apex":
        if device_type != "cuda":
            raise ValueError("optimizer.backend=apex needs CUDA (FusedAdam is a CUDA kernel); "
                             "use optimizer.backend=torch or auto on this device")
        if apex_fused_adam() is None:
            raise ValueError(f"optimizer.backend=apex but apex.optimizers.FusedAdam cannot be "
                             f"imported; install apex from source ({APEX_INSTALL}) or set "
                             f"optimizer.backend=torch")
        return "apex"
    if name != "auto":
        raise ValueError(f"unknown optimizer backend {name!r}; use torch, triton, apex or "
                         f"auto")
    if device_type != "cuda":
        chosen, why = "torch", f" (device {device_type})"
    elif apex_fused_adam() is not None:
        chosen, why = "apex", ""
    elif HAVE_TRITON:  # TritonAdamW: the same update, 8.3 against 11.7 ms/step on Llama-1B
        chosen, why = "triton", " (TritonAdamW; apex not installed)"
    else:
        chosen, why = "torch", " (neither apex nor triton installed)"
    if "adam" not in _logged:
        _logged.add("adam")
        log.info("optimizer.backend=auto: using %s%s", chosen, why)
    return chosen


__all__ = ["APEX_INSTALL", "TE_INSTALL", "adam_backend", "apex_fused_adam", "forward_region",
           "resolve_linear_backend", "te_available", "use_te"]
