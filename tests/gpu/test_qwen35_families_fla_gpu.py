"""Every Qwen3.5 family (text, MoE, VL, VL-MoE) with fla's Gated DeltaNet kernels, forward and
backward, against our reference kernel and float64. Skipped without CUDA (conftest) or fla-core.

Each family's tiny model (``qwen35_grads.tiny_case``: the shared tiny shapes at the released
DeltaNet head size, 128, built through the family's registry record, weak decays and sharp
routers: ``tiny_weights_``; a MoE model's bf16 runs routed as its float64 run routed:
``PinnedRoutes``) on one packed stream: text documents of 1, 2, 3, 1001 and 8192
tokens (32768 instead of 8192: marked slow), after two documents with images and one with a
video for a VL family. Loss (a MoE model's with its load-balancing term) and every parameter's
gradient, under bf16 autocast on CUDA with ``gdn_kernel="fla"`` and with ``"reference"``,
each against the same model wholly in float64 with the reference kernel, on the CPU: the path
tests/unit/test_qwen35_family_grads.py proves there, and CUDA has no float64 MoE (its grouped
GEMM takes none). Bounds (``check_against_float64``): fla's loss within twice the reference's
bf16 error plus 1e-3 of the loss; each kind of parameter's worst layer (router, experts,
shared expert, tower included) within twice the reference's plus 1e-2. The float64 runs
dominate the time: about 40 s (text) to 80 s (VL-MoE) on 2 CPU cores at 8k; at 32k the text
family's took 596 s there and 16 GB (the attention's documents are quadratic), so the 32k
cases run one family per device call (``run_device.sh qwen35 tests32 FAMILY``)."""

import pytest
import torch

from mpcore.models.common.hybrid import kernels
from tests.gpu.qwen35_grads import (
    PinnedRoutes,
    check_against_float64,
    fla_rule_or_skip,
    model_grads,
    tiny_case,
    tiny_weights_,
)
from tests.gpu.qwen35_hf_scores import FAMILIES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.fla_ops() is None,
                                 reason=f"fla-core not installed ({kernels.INSTALL_HINT})")]
CASES = {"8k": [1, 2, 3, 1001, 8192],
         "32k": pytest.param([1, 2, 3, 1001, 32768], marks=pytest.mark.slow)}


@pytest.mark.parametrize("lengths", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_family_fla_and_reference_against_float64(name, lengths):
    fla_rule_or_skip()
    family, cfg, s = tiny_case(name, lengths)
    routes = PinnedRoutes()
    truth = model_grads(family, cfg, s, "reference", torch.float64, device="cpu",
                        init_=tiny_weights_, routes=routes)
    ref, fla = (model_grads(family, cfg, s, kernel, torch.bfloat16, init_=tiny_weights_,
                            routes=routes)
                for kernel in ("reference", "fla"))
    print(f"{name}, {s['input_ids'].numel()} tokens:")
    if routes.flips:
        print("tokens whose experts bf16 would have changed (pinned to float64's; reference, fla):",
              [sum(run.values()) for run in routes.flips])
    check_against_float64(truth, ref, fla)
