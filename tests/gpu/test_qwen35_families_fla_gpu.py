"""Every Qwen3.5 family (text, MoE, VL, VL-MoE) with fla's Gated DeltaNet kernels, forward and
backward, against our reference kernel and float64. Skipped without CUDA (conftest) or fla-core.

Each family's tiny model (``qwen35_grads.tiny_case``: the shared tiny shapes at the released
DeltaNet head size, 128, built through the family's registry record, weak decays and sharp
routers: ``tiny_weights_``; a MoE model's bf16 runs routed as its float64 run routed:
``PinnedRoutes``) on one packed stream: text documents of 1, 2, 3, 1001 and 8192
tokens (32768 instead of 8192: marked slow), after two documents with images and one with a
video for a VL family. Loss (a MoE model's with its load-balancing term) and every parameter's
gradient, under bf16 autocast on CUDA with ``gdn_kernel="fla"`` and with ``"reference"``,
each against the same model wholly in float64 with the reference kernel. Bounds
(``check_against_float64``): fla's loss within twice the reference's bf16 error plus 1e-3 of
the loss; each kind of parameter's worst layer (router, experts, shared expert, tower included)
within twice the reference's plus 1e-2; the DeltaNet gates' ``A_log`` and ``dt_bias``, whose
per-head sums over tokens cancel (on the text family's 32k case, the terms' magnitudes were 50
to 204 times the sum), measured against their terms' magnitudes (``GateSums``) with bf16's
unit roundoff as the floor. There the plain relative error of one layer swings with the
rounding: 0.0043 and 0.0192 under the same reference kernel on an H100 and on the CPU, and
fla's 0.0276 failed the plain bound (twice the reference's worst layer, 0.0059, plus 1e-2).

Where the float64 truth runs: at 8k on the CPU, the path tests/unit/test_qwen35_family_grads.py
proves there, and again on the GPU, which must agree with it to 1e-4 (``check_truths_agree``:
the norms compute in fp32, as transformers' do, so the devices' reduction orders differ by
about 1e-6; bf16's errors are 1e-2 and a wrong path's O(1)). At 32k on the GPU alone: the
CPU's took 596 s and 16 GB for the text family on 2 cores (the attention's documents are
quadratic). A float64 MoE runs its experts' loop on CUDA (``grouped_available``: the grouped
GEMM takes no float64). At 8k the CPU truths took about 40 s (text) to 80 s (VL-MoE) on 2
cores. ``run_device.sh qwen35 tests32 'FAMILY...'`` runs the named families' 32k cases."""

import pytest
import torch

from mpcore.models.common.hybrid import kernels
from tests.gpu.qwen35_grads import (
    GateSums,
    PinnedRoutes,
    check_against_float64,
    check_truths_agree,
    fla_rule_or_skip,
    model_grads,
    tiny_case,
    tiny_weights_,
)
from tests.gpu.qwen35_hf_scores import FAMILIES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.fla_ops() is None,
                                 reason=f"fla-core not installed ({kernels.INSTALL_HINT})")]
# Each case: its documents' lengths and the devices of its float64 truth (the first is judged
# against; the others must agree with it).
CASES = {"8k": ([1, 2, 3, 1001, 8192], ("cpu", "cuda")),
         "32k": pytest.param([1, 2, 3, 1001, 32768], ("cuda",), marks=pytest.mark.slow)}


@pytest.mark.parametrize("lengths, truths", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_family_fla_and_reference_against_float64(name, lengths, truths):
    fla_rule_or_skip()
    family, cfg, s = tiny_case(name, lengths)
    routes, sums = PinnedRoutes(), GateSums()
    print(f"{name}, {s['input_ids'].numel()} tokens:")
    truth, *others = [model_grads(family, cfg, s, "reference", torch.float64, device=device,
                                  init_=tiny_weights_, routes=routes,
                                  gate_sums=sums if device == truths[0] else None)
                      for device in truths]
    for device, other in zip(truths[1:], others, strict=True):
        check_truths_agree(truth, other, (truths[0], device))
    ref, fla = (model_grads(family, cfg, s, kernel, torch.bfloat16, init_=tiny_weights_,
                            routes=routes)
                for kernel in ("reference", "fla"))
    if routes.flips:
        runs = [f"float64 {d}" for d in truths[1:]] + ["reference bf16", "fla bf16"]
        print(f"tokens whose experts these runs would have changed (pinned to float64 "
              f"{truths[0]}'s):", dict(zip(runs, (sum(r.values()) for r in routes.flips), strict=True)))
    check_against_float64(truth, ref, fla, sums)
