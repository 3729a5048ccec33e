"""score.py's numbers for every Qwen3.5 family on CUDA (tiny checkpoints at the released
DeltaNet head size, 128), against transformers.

Truth: transformers in float64 on the CPU, per document, in a process without fla
(``qwen35_hf_scores``). float32: our scores (``gdn_kernel=auto``: the reference kernel, fp32
math) within 1e-4 of the truth and of transformers' float32 PyTorch path on the GPU. What
transformers' float32 gives WITH fla (its default once fla imports) and what our float32 gives
through fla's kernels are printed beside them: fla takes float32 dots in TF32. bfloat16 (fla's
kernels where they run): our error no more than twice transformers' own bf16 run on the GPU
(with fla) plus a floor, for every family (text documents 1 to 2999 tokens; the VL families
with images, a video and text-only documents).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mpcore.models.common.hybrid import kernels
from tests.gpu.qwen35_hf_scores import (
    FAMILIES,
    errors,
    hf_scores,
    make_checkpoint,
    ours,
    without_fla_env,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Every family's checkpoint and stream, and transformers' float64 CPU scores (plus, for
    the text family, its float32 CUDA PyTorch path) from one process without fla."""
    env = without_fla_env()
    if env is None:
        pytest.skip("fla is installed in the interpreter's own site: no process without it "
                    "for transformers' float64 reference")
    root = tmp_path_factory.mktemp("qwen35_score")
    cases, jobs = {}, []
    for family in FAMILIES:
        folder = root / family
        kind, s = make_checkpoint(family, folder)
        cases[family] = (folder, kind, s)
        jobs.append(dict(folder=str(folder), kind=kind, stream=s, device="cpu",
                         dtype="float64", out=str(root / f"{family}_f64.pt")))
    jobs.append(dict(folder=str(root / "qwen3_5"), kind="text", stream=cases["qwen3_5"][2],
                     device="cuda", dtype="float32", out=str(root / "qwen3_5_f32_torch.pt")))
    torch.save(jobs, root / "jobs.pt")
    subprocess.run([sys.executable, "-m", "tests.gpu.qwen35_hf_scores", str(root / "jobs.pt")],
                   check=True, env=env, timeout=900)
    truth = {f: torch.load(root / f"{f}_f64.pt") for f in FAMILIES}
    return cases, truth, torch.load(root / "qwen3_5_f32_torch.pt")


def test_float32_within_1e4_of_float64_and_transformers(setup):
    cases, truth, hf32_torch = setup
    folder, kind, s = cases["qwen3_5"]
    ours32 = ours(folder, s, torch.float32)
    rows = {"ours fp32 (auto: reference)": ours32,
            "transformers fp32 CUDA, PyTorch path": hf32_torch}
    if kernels.fla_ops() is not None and kernels.fla_refusal(0) is None:
        rows["ours fp32 through fla (gdn_kernel=fla)"] = ours(folder, s, torch.float32, "fla")
        rows["transformers fp32 CUDA with fla"] = hf_scores(folder, kind, s, "cuda",
                                                            torch.float32)
    for name, got in rows.items():
        print(f"{name}: max |logprob err| {errors(got, truth['qwen3_5'])[0]:.2e}, "
              f"|entropy err| {errors(got, truth['qwen3_5'])[1]:.2e} vs transformers float64")
    assert max(errors(ours32, truth["qwen3_5"])) <= 1e-4
    assert max(errors(ours32, hf32_torch)) <= 1e-4
    for family in FAMILIES[1:]:
        folder, _, s = cases[family]
        err = errors(ours(folder, s, torch.float32), truth[family])
        print(f"{family} fp32: {err}")
        assert max(err) <= 1e-4, (family, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_within_twice_transformers_bf16(setup, family):
    cases, truth, _ = setup
    folder, kind, s = cases[family]
    ours16 = errors(ours(folder, s, torch.bfloat16), truth[family])
    theirs16 = errors(hf_scores(folder, kind, s, "cuda", torch.bfloat16), truth[family])
    print(f"{family} bf16: ours {ours16}, transformers {theirs16} (logprob, entropy)")
    assert ours16[0] <= 2 * theirs16[0] + 1e-2 and ours16[1] <= 2 * theirs16[1] + 1e-2, (
        ours16, theirs16)
