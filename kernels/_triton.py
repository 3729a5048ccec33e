"""Triton when it is installed, or a stand-in that lets the kernel modules import without it.

Triton (about 1 GB installed) is needed only where the Triton kernels run: on CUDA (CUDA
builds of torch depend on it, so it comes with them) and under ``TRITON_INTERPRET=1`` in the
tests. A CPU-only install has no use for it: there every op runs its PyTorch reference. The
kernel modules use two names while they are imported, ``triton.jit`` (a decorator) and
``tl.constexpr`` (in kernel signatures); without triton both resolve here, and every other use
of ``triton`` or ``tl`` (launching a kernel, sizing its grid) raises an ``ImportError`` that
says how to install it. Usage in a kernel module::

    from mpcore.kernels._triton import tl, triton
"""

from __future__ import annotations

import torch

INSTALL_HINT = ("the Triton kernels need triton, which is not installed: CUDA builds of torch "
                "bring it; on a CPU machine pip install triton (only needed for "
                "TRITON_INTERPRET=1), or call the *_reference functions")

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _Kernel:
        """A ``@triton.jit`` function without triton: defined, never run."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise ImportError(f"{self.__name__}: {INSTALL_HINT}")

        def __call__(self, *args, **kwargs):
            raise ImportError(f"{self.__name__}: {INSTALL_HINT}")

    class _Absent:
        """``triton`` and ``triton.language`` when triton is not installed (module docstring)."""

        constexpr = None  # read only in kernel signatures' annotations

        @staticmethod
        def jit(fn=None, **kwargs):
            return _Kernel(fn) if fn is not None else _Kernel

        def __getattr__(self, name):
            raise ImportError(f"triton.{name}: {INSTALL_HINT}")

    triton = tl = _Absent()


def eager_or_op(op, fn, *args):
    """``fn(*args)`` in eager mode, the custom op ``op`` (registered over ``fn``) while
    ``torch.compile`` traces, so that compiled graphs keep it without a graph break. Eager
    dispatch through a ``torch.library.custom_op`` costs about 50 us of host time per call
    (measured on the CPU here, against a direct call of the same function); the kernels run
    several such calls per layer, and a step whose host is slower than its device (TE FP8) idles
    for them. Same values either way: the op runs ``fn``."""
    return op(*args) if torch.compiler.is_compiling() else fn(*args)
