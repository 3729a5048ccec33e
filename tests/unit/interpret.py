"""Run a test file's Triton checks under Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the checks run in a fresh
process: the test module is run with ``python -m`` from the repository root with the variable
set, and it prints a marker when every check passed. Shared by the kernel tests of tests/unit, with ``sm90_ptx``: a kernel
compiled for the H200 without one, to check what its memory accesses compile to.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpcore.kernels._triton import HAVE_TRITON

REPO = Path(__file__).resolve().parents[2]


def run_under_interpreter(module: str, marker: str, timeout: float = 600) -> None:
    """Run ``python -m module`` (a test module's ``__name__``, e.g. ``tests.unit.test_swiglu``)
    from the repository root with ``TRITON_INTERPRET=1``; fail unless it exits 0 and prints
    ``marker``. The assertion message is the script's whole output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout, proc.stdout + proc.stderr


needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (a CPU-only install without the dev extra): "
    "these checks run the Triton kernels under its CPU interpreter")


def sm90_ptx(kernel, signature: dict, constants: dict, num_warps: int = 4) -> str:
    """``kernel`` (a ``@triton.jit`` function) compiled to PTX for an H100/H200 (sm_90) here,
    without a GPU, as a launch would specialise it: ``signature`` maps the arguments to Triton
    types, ``constants`` the constexprs to values; pointers and the integers the kernel does
    not opt out of specialising (``do_not_specialize``) are taken as divisible by 16 (aligned
    tensors, sizes and strides that are multiples of 16). Skips where this triton build has no
    CUDA backend to compile with; any other compile error fails."""
    from triton import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    if "nvidia" not in backends.backends:
        pytest.skip("this triton build has no CUDA backend to compile for sm_90 with")
    names = kernel.arg_names
    unspecialised = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
             if t.startswith("*") or (t == "i32" and a not in unspecialised)}
    source = ASTSource(kernel, {**signature, **{a: "constexpr" for a in constants}},
                       {(names.index(a),): v for a, v in constants.items()}, attrs)
    # A kernel that does not compile fails the test here; only a missing backend skips.
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]


def global_accesses(ptx: str) -> set[str]:
    """The kinds of global loads and stores in ``ptx`` (``ld.global.v4.b32``, ...)."""
    return set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx))
