"""The README's RL snippet ("As a library", the block starting ``# rl_step.py``) runs as
written in one process, at tp=2 and at tp=2 x cp=2 (ring), and every layout computes the same
log-probs, loss and gradients (of the final norm, replicated over tp) as the single process."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from mpcore.parallel.loss import sum_over_group
from tests.dist.harness import run_distributed
from tests.unit.release_tokenizers import make_release

pytestmark = pytest.mark.slow  # 4 gloo ranks
README = Path(__file__).resolve().parents[2] / "README.md"


def snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith("# rl_step.py")]
    assert len(found) == 1, "README.md must hold one python block starting '# rl_step.py'"
    return found[0]


def run_snippet(rank, world, folder: str) -> dict:
    os.chdir(folder)
    ns: dict = {"__name__": "__main__"}
    exec(compile(snippet(), "README.md:rl_step.py", "exec"), ns)
    state, model = ns["state"], ns["model"]
    norm = [p for name, p in model.named_parameters() if name.endswith("norm.weight")][-1]
    return {"loss": float(sum_over_group(ns["loss"].detach(), state.dp_cp_group)),
            "logprobs": ns["full"], "norm_grad": norm.grad.clone(),
            "norm_after": norm.detach().clone()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    make_release(tmp / "runs" / "release_tiny")
    return str(tmp)


def test_readme_rl_snippet_is_one_function_at_every_layout(folder):
    here = os.getcwd()
    try:
        ref = run_snippet(0, 1, folder)
    finally:
        os.chdir(here)
    assert ref["loss"] != 0 and ref["norm_grad"].abs().sum() > 0
    for world in (2, 4):
        for rank, got in enumerate(run_distributed(run_snippet, world, folder, timeout=300)):
            where = f"world {world} rank {rank}"
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]) + 1e-7, where
            assert torch.allclose(got["logprobs"], ref["logprobs"], atol=1e-5), where
            assert torch.allclose(got["norm_grad"], ref["norm_grad"], rtol=1e-5, atol=1e-7), where
            assert torch.allclose(got["norm_after"], ref["norm_after"], atol=1e-6), where
