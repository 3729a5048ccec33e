"""A CPU install without triton: everything imports, the kernel tests pass on the references.

triton is hidden from a fresh interpreter (``sys.modules["triton"] = None`` makes every
``import triton`` raise ImportError, as on a machine where it was never installed); that process
imports the whole library and the entry points, trains nothing, and runs the kernel unit tests,
whose interpreter checks then skip and say why.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HIDE = "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None; "


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE + code], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_everything_imports_and_a_kernel_launch_says_how_to_install():
    proc = _run(
        "import mpcore.kernels, mpcore.parallel, mpcore.models, mpcore.train, mpcore.launch.pretrain, mpcore.launch.score, "
        "mpcore.launch.export_hf\n"
        "import torch\n"
        "from mpcore.kernels._triton import HAVE_TRITON\n"
        "from mpcore.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_triton\n"
        "assert not HAVE_TRITON\n"
        "x, w = torch.randn(4, 32), torch.randn(32)\n"
        "assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))\n"
        "try:\n"
        "    rms_norm_triton(x, w, 1e-6)\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "refused: triton.next_power_of_2: the Triton kernels need triton" in proc.stdout


@pytest.mark.slow
def test_kernel_unit_tests_pass_without_triton():
    files = ["tests/unit/test_rmsnorm.py", "tests/unit/test_swiglu.py",
             "tests/unit/test_rope_kernel.py", "tests/unit/test_fp8_linear.py",
             "tests/unit/test_quick_gelu.py", "tests/unit/test_layer_norm_kernel.py"]
    proc = _run("import pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', "
                f"*{files!r}]))")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # five interpreter checks, and the four sm_90 compiles (QuickGELU's and LayerNorm's)
    assert "9 skipped" in out, out[-2000:]
    assert out.count("triton is not installed") >= 5, out[-2000:]
