"""Run a test file's Triton checks under Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the checks run in a fresh
process: the test file is executed as a script with the variable set, and it prints a marker
when every check passed. Shared by the kernel tests of tests/unit.
"""

import os
import subprocess
import sys

import pytest

from kernels._triton import HAVE_TRITON


def run_under_interpreter(path: str, marker: str, timeout: float = 600) -> None:
    """Run ``python path`` with ``TRITON_INTERPRET=1``; fail unless it exits 0 and prints
    ``marker``. The assertion message is the script's whole output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout, proc.stdout + proc.stderr


needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (a CPU-only install without the dev extra): "
    "these checks run the Triton kernels under its CPU interpreter")
