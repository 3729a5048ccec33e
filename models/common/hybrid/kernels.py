"""The Gated DeltaNet kernels: fla-core on CUDA (optional), our PyTorch reference everywhere.

``gdn_kernel`` names what runs the short convolution and the chunked gated delta rule:
    "reference"  ``mpcore.models.common.hybrid.deltanet`` (any device, any float dtype; what CPU tests use)
    "fla"        fla-core's Triton ops with ``cu_seqlens`` (CUDA, bf16/fp16 operands); a
                 ``ValueError`` with the install line when fla-core is missing or off CUDA
    "auto"       fla where it can run (CUDA, half-precision operands, fla installed, and a
                 tiny forward + backward once per device passes: ``fla_refusal``), else the
                 reference, with one warning saying why
This module is the ONE place that looks for fla-core. Both kernels take the same packed layout
(``deltanet.py``'s docstring): segments never share a convolution window or a state.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mpcore.models.common.hybrid import deltanet

GDN_KERNELS = ("auto", "fla", "reference")
INSTALL_HINT = "pip install fla-core  (pure-Python Triton kernels: flash-linear-attention)"
_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def fla_ops():
    """``(chunk_gated_delta_rule, causal_conv1d)`` of fla-core, or None when it is missing."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, causal_conv1d


@functools.cache
def fla_refusal(device_index: int) -> str | None:
    """Why fla-core cannot run the gated delta rule forward AND backward on this CUDA device,
    or None when it can. Measured once per device by a tiny call (a Triton compile, seconds):
    fla refuses some Triton/GPU pairs at run time (0.6.0 raises in the gated backward on Hopper
    with Triton >= 3.4, < 3.7.1 unless tilelang is installed), which a version table here
    would go stale on."""
    chunk_rule = fla_ops()[0]
    bf = dict(device=torch.device("cuda", device_index), dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, 16, 1, 16, **bf, requires_grad=True) for _ in range(3))
    g = torch.zeros(1, 16, 1, device=bf["device"], requires_grad=True)
    beta = torch.rand(1, 16, 1, **bf, requires_grad=True)
    try:
        out, _ = chunk_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                            cu_seqlens=torch.tensor([0, 16], device=bf["device"]))
        out.float().sum().backward()
    except (RuntimeError, ValueError, NotImplementedError) as e:  # fla's own refusals
        return f"{type(e).__name__}: {e}"
    return None


@functools.cache
def _warn_fla_refused(reason: str) -> None:
    warnings.warn(f"fla-core cannot run the gated delta rule here ({reason}); Gated DeltaNet "
                  f"layers run the PyTorch reference (slow)", stacklevel=3)


def check_kernel(name: str) -> str:
    if name not in GDN_KERNELS:
        raise ValueError(f"gdn_kernel must be one of {GDN_KERNELS}, got {name!r}")
    return name


@functools.cache
def _warn_no_fla() -> None:
    warnings.warn(f"fla-core is not installed: Gated DeltaNet layers run the PyTorch reference "
                  f"on CUDA (slow); {INSTALL_HINT}", stacklevel=3)


def check_available(name: str, device: torch.device | str) -> None:
    """At build time: ``ValueError`` when ``name`` is ``fla`` but ``device`` is not CUDA or
    fla-core is missing (so a run fails before any step, not at its first forward)."""
    check_kernel(name)
    if name != "fla":
        return
    if torch.device(device).type != "cuda":
        raise ValueError(f"gdn_kernel='fla' needs a CUDA device, got {device}; use "
                         f"gdn_kernel='auto' or 'reference'")
    if fla_ops() is None:
        raise ValueError(f"gdn_kernel='fla' but fla-core is not installed; {INSTALL_HINT}"
                         f" (or use gdn_kernel='auto' to fall back to the reference)")
    refusal = fla_refusal(torch.device(device).index or 0)
    if refusal is not None:
        raise ValueError(f"gdn_kernel='fla' but fla-core refuses this GPU and Triton: "
                         f"{refusal}; use gdn_kernel='auto' (the reference) or do what it says")


def resolve(name: str, x: torch.Tensor) -> str:
    """``"fla"`` or ``"reference"`` for operands like ``x`` under kernel ``name``."""
    check_kernel(name)
    if name == "reference":
        return name
    on_cuda = x.is_cuda
    if name == "fla":
        if not on_cuda:
            raise ValueError(f"gdn_kernel='fla' needs CUDA tensors, got {x.device}; use "
                             f"gdn_kernel='auto' or 'reference'")
        if fla_ops() is None:
            raise ValueError(f"gdn_kernel='fla' but fla-core is not installed; {INSTALL_HINT}"
                             f" (or use gdn_kernel='auto' to fall back to the reference)")
        return "fla"
    if not on_cuda or x.dtype not in _HALF:
        return "reference"
    if fla_ops() is None:
        _warn_no_fla()
        return "reference"
    refusal = fla_refusal(x.device.index or 0)
    if refusal is not None:
        _warn_fla_refused(refusal)
        return "reference"
    return "fla"


def short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
               cu_seqlens: torch.Tensor, kernel: str) -> torch.Tensor:
    """``silu(causal depthwise conv)`` of ``x [T, C]`` by ``weight [C, K]`` per segment
    (``positions [T]`` in-segment positions, ``cu_seqlens [S+1]`` the segments)."""
    if resolve(kernel, x) == "reference":
        return deltanet.causal_conv1d(x, weight, positions)
    out = fla_ops()[1](x[None], weight.to(x.dtype), activation="silu",
                       cu_seqlens=cu_seqlens.to(x.device, torch.int64))
    out = out[0] if isinstance(out, tuple) else out  # newer fla also returns a final state
    return out[0]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, cu_seqlens: torch.Tensor, kernel: str) -> torch.Tensor:
    """``deltanet.chunk_gated_delta_rule`` (q, k L2-normalised inside) through ``kernel``:
    ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g`` (fp32), ``beta [T, Hv]`` -> ``[T, Hv, Dv]``."""
    if resolve(kernel, v) == "reference":
        return deltanet.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens)
    hk, hv = k.shape[1], v.shape[1]
    if hv != hk:  # value heads grouped over key heads: every fla version takes equal heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    out, _ = fla_ops()[0](q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                          cu_seqlens=cu_seqlens.to(v.device, torch.int64),
                          use_qk_l2norm_in_kernel=True)
    return out[0]
