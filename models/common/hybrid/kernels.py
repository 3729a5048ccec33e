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
import inspect
import warnings

import torch

from mpcore.models.common.hybrid import deltanet

GDN_KERNELS = ("auto", "fla", "reference")
INSTALL_HINT = ("pip install fla-core==0.6.0 triton==3.7.1  (fla's Gated DeltaNet backward needs "
                "Triton >= 3.7.1 on Hopper, fla issue #640; README: Qwen3.5 on the GPU)")
_HALF = (torch.bfloat16, torch.float16)
# fla-core 0.6.0's chunk kernels: the state kernel asserts K <= 256 (chunk_delta_h.py), and a
# Triton dot needs at least 16 along each side, so narrower heads are not run there.
FLA_KEY_DIMS = (16, 256)


@functools.cache
def fla_ops():
    """``(chunk_gated_delta_rule, causal_conv1d, rms_norm_gated)`` of fla-core, or None when it
    is missing."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.modules.fused_norm_gate import rms_norm_gated
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, causal_conv1d, rms_norm_gated


@functools.cache
def fla_version() -> str:
    """``fla-core X on Triton Y``, what a log line names (fla_ops() must not be None)."""
    import fla
    import triton
    return f"fla-core {getattr(fla, '__version__', '?')} on Triton {triton.__version__}"


@functools.cache
def fla_refusal(device_index: int) -> str | None:
    """Why fla-core cannot run the gated delta rule forward AND backward on this CUDA device,
    or None when it can. Measured once per device by a tiny call (a Triton compile, seconds):
    fla refuses some Triton/GPU pairs at run time (0.6.0 raises in the gated backward on Hopper
    with Triton >= 3.4, < 3.7.1 unless tilelang is installed), which a version table here
    would go stale on."""
    return probe(fla_ops()[0], torch.device("cuda", device_index))


def probe(chunk_rule, device: torch.device) -> str | None:
    """``fla_refusal``'s tiny forward + backward of ``chunk_rule`` on ``device``: its error, or
    None. Gradients are on whatever the caller's mode: the first question often comes from
    score.py, under ``inference_mode``, where the backward would fail for that reason alone and
    the refusal is cached for the process."""
    bf = dict(device=device, dtype=torch.bfloat16)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            q, k, v = (torch.randn(1, 16, 1, 16, **bf, requires_grad=True) for _ in range(3))
            g = torch.zeros(1, 16, 1, device=bf["device"], requires_grad=True)
            beta = torch.rand(1, 16, 1, **bf, requires_grad=True)
            out, _ = chunk_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=torch.tensor([0, 16], device=bf["device"]))
            out.float().sum().backward()
    except (RuntimeError, ValueError, NotImplementedError, AssertionError) as e:  # fla's refusals
        return f"{type(e).__name__}: {e}"
    return None


def head_refusal(key_dim: int, value_dim: int) -> str | None:
    """Why fla-core's kernels do not take DeltaNet heads of these sizes, or None."""
    low, high = FLA_KEY_DIMS
    if not low <= key_dim <= high or value_dim < low:
        return (f"DeltaNet heads of key dim {key_dim} / value dim {value_dim}: fla-core's chunk "
                f"kernels take key dims {low}..{high} and value dims >= {low}")
    return None


def check_kernel(name: str) -> str:
    if name not in GDN_KERNELS:
        raise ValueError(f"gdn_kernel must be one of {GDN_KERNELS}, got {name!r}")
    return name


def choose(name: str, device: torch.device | str, dtype: torch.dtype, key_dim: int,
           value_dim: int) -> tuple[str, str]:
    """``(kernel, why)``: what runs the DeltaNet layers under ``gdn_kernel=name`` for operands
    of ``dtype`` on ``device`` with heads of ``key_dim`` / ``value_dim``; ``kernel`` is
    ``"fla"`` or ``"reference"``. Pure (no warning); ``ValueError`` naming the fix when ``fla``
    is named but cannot run. The one decision behind ``resolve`` and ``describe``."""
    check_kernel(name)
    device = torch.device(device)
    if name == "reference":
        return "reference", "gdn_kernel=reference"
    heads = head_refusal(key_dim, value_dim)
    if name == "fla":
        if device.type != "cuda":
            raise ValueError(f"gdn_kernel='fla' needs a CUDA device, got {device}; use "
                             f"gdn_kernel='auto' or 'reference'")
        if fla_ops() is None:
            raise ValueError(f"gdn_kernel='fla' but fla-core is not installed; {INSTALL_HINT}"
                             f" (or use gdn_kernel='auto' to fall back to the reference)")
        if heads is not None:
            raise ValueError(f"gdn_kernel='fla' cannot run this checkpoint: {heads}; use "
                             f"gdn_kernel='auto' or 'reference' (the PyTorch reference)")
        return "fla", f"gdn_kernel=fla, {fla_version()}"
    if device.type != "cuda":
        return "reference", f"gdn_kernel=auto on {device.type}: fla-core's kernels are CUDA-only"
    if dtype not in _HALF:
        return "reference", (f"gdn_kernel=auto with {str(dtype).removeprefix('torch.')} "
                             f"operands: fla's chunk kernels take their float32 dots in TF32, "
                             f"the reference keeps float32 exact")
    if fla_ops() is None:
        return "reference", f"gdn_kernel=auto: fla-core is not installed ({INSTALL_HINT})"
    if heads is not None:
        return "reference", f"gdn_kernel=auto: {heads}"
    refusal = fla_refusal(device.index if device.index is not None else
                          torch.cuda.current_device())
    if refusal is not None:
        return "reference", (f"gdn_kernel=auto: fla-core refuses this GPU and Triton "
                             f"({refusal}); {INSTALL_HINT}")
    return "fla", f"gdn_kernel=auto, {fla_version()}, {str(dtype).removeprefix('torch.')}"


def describe(name: str, device: torch.device | str, dtype: torch.dtype, key_dim: int,
             value_dim: int) -> str:
    """One log line: which DeltaNet kernel runs and why (``choose``); a ``fla`` that cannot run
    is described by its error instead of raising."""
    try:
        kernel, why = choose(name, device, dtype, key_dim, value_dim)
    except ValueError as e:
        return f"Gated DeltaNet kernel: none ({e})"
    label = "fla chunk (Triton)" if kernel == "fla" else "reference (PyTorch chunked, fp32 math)"
    return f"Gated DeltaNet kernel: {label}; {why}"


@functools.cache
def _warn_fallback(why: str) -> None:
    warnings.warn(f"Gated DeltaNet layers run the PyTorch reference (slow): {why}",
                  stacklevel=4)


def check_available(name: str, device: torch.device | str) -> None:
    """At build time: ``ValueError`` when ``name`` is ``fla`` but ``device`` is not CUDA, fla-core
    is missing, or fla-core refuses this GPU and Triton (so a run fails before any step, not at
    its first forward). Head sizes are checked by each layer (``GatedDeltaNet``)."""
    check_kernel(name)
    if name != "fla":
        return
    choose(name, device, torch.bfloat16, FLA_KEY_DIMS[1], FLA_KEY_DIMS[1])
    device = torch.device(device)
    refusal = fla_refusal(device.index if device.index is not None else
                          torch.cuda.current_device())
    if refusal is not None:
        raise ValueError(f"gdn_kernel='fla' but fla-core refuses this GPU and Triton: "
                         f"{refusal}; {INSTALL_HINT}, or use gdn_kernel='auto' (the reference)")


def resolve(name: str, x: torch.Tensor, key_dim: int | None = None,
            value_dim: int | None = None) -> str:
    """``"fla"`` or ``"reference"`` for operands like ``x`` (``choose``) in heads of ``key_dim``
    / ``value_dim`` (not checked when not given). A fallback under ``auto`` that costs speed
    (CUDA, half precision) warns once per reason."""
    if key_dim is None or value_dim is None:
        key_dim = value_dim = FLA_KEY_DIMS[1]
    kernel, why = choose(name, x.device, x.dtype, key_dim, value_dim)
    if kernel == "reference" and name == "auto" and x.is_cuda and x.dtype in _HALF:
        _warn_fallback(why)
    return kernel


def _resolved(kernel: str) -> str:
    if kernel not in ("fla", "reference"):
        raise ValueError(f"a resolved DeltaNet kernel is 'fla' or 'reference', got {kernel!r} "
                         f"(resolve gdn_kernel first: kernels.resolve)")
    return kernel


@functools.cache
def _host_segments_taken() -> bool:
    """fla-core's conv and delta rule take ``cu_seqlens_cpu`` (0.6: the segments' host copy,
    so they plan their chunks without a device sync)."""
    try:
        return all("cu_seqlens_cpu" in inspect.signature(op).parameters for op in fla_ops()[:2])
    except (TypeError, ValueError):  # a wrapper that hides its parameters: pass none
        return False


def _segments_kwargs(cu_seqlens: torch.Tensor, cu_host: torch.Tensor | None,
                     device: torch.device) -> dict:
    out = {"cu_seqlens": cu_seqlens.to(device, torch.int64)}
    if cu_host is not None and _host_segments_taken():
        out["cu_seqlens_cpu"] = cu_host
    return out


def short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
               cu_seqlens: torch.Tensor, kernel: str,
               cu_host: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv)`` of ``x [T, C]`` (may be a view with a row stride: fla
    reads it in place) by ``weight [C, K]`` per segment (``positions [T]`` in-segment
    positions, ``cu_seqlens [S+1]`` the segments, ``cu_host`` the same int64 on the host when
    known there); ``kernel``: ``"fla"`` or ``"reference"``. fla gets ``weight`` in its own dtype,
    as the reference does: its kernel reads the weight into fp32 and sums its gradient in fp32,
    so an fp32 weight under bf16 autocast is neither rounded to bf16 going in nor its gradient
    coming out (rounding it was a systematic error that every token of a document shared)."""
    if _resolved(kernel) == "reference":
        return deltanet.causal_conv1d(x, weight, positions)
    out = fla_ops()[1](x[None], weight, activation="silu",
                       **_segments_kwargs(cu_seqlens, cu_host, x.device))
    out = out[0] if isinstance(out, tuple) else out  # newer fla also returns a final state
    return out[0]


@functools.cache
def _fla_groups_heads() -> bool:
    """fla-core >= 0.6 runs value heads grouped over key heads itself (value head h reads key
    head ``h // (Hv / Hk)``, as ours): no repeated copy of q and k."""
    import fla
    major, minor = (int(p) for p in fla.__version__.split(".")[:2])
    return (major, minor) >= (0, 6)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, cu_seqlens: torch.Tensor, kernel: str,
                     cu_host: torch.Tensor | None = None) -> torch.Tensor:
    """``deltanet.chunk_gated_delta_rule`` (q, k L2-normalised inside) through ``kernel``
    (``"fla"`` or ``"reference"``): ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g`` (fp32),
    ``beta [T, Hv]`` -> ``[T, Hv, Dv]``; ``cu_host``: ``short_conv``'s."""
    if _resolved(kernel) == "reference":
        return deltanet.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens)
    hk, hv = k.shape[1], v.shape[1]
    if hv != hk and not _fla_groups_heads():
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    out, _ = fla_ops()[0](q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                          **_segments_kwargs(cu_seqlens, cu_host, v.device),
                          use_qk_l2norm_in_kernel=True)
    return out[0]
