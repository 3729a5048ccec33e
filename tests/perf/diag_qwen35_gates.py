"""Where fla's error on the DeltaNet gate parameters (``A_log``, ``dt_bias``) comes from, at 8k
and 32k (a diagnostic for issue 36, not a timing): one GPU, fla-core on Triton >= 3.7.1.

``A_log``'s and ``dt_bias``' gradients are sums over every token of the gradient of the log
decay ``g``. An error that every token shares (one rounding of something all of them read)
does not average out in that sum, and the sum cancels, so relative to it any error is
magnified. Three suspects, each a row: fla's chunk states, stored in the operands' dtype (bf16
under autocast; the reference keeps fp32); fla's conv weight, once rounded to bf16 on its way
in; and the sum's own cancellation. On an H100 at a5810b4 fp32 operands did not move the
worst layer; on the CPU the rounded weight raised our reference's errors (the rounding is
gone since 57874c9), but on an H100 at 8b5da20 fla's errors were lower with it, in all six
layer-seeds at 32k; the cancellation was 30 to 204-fold (tests/perf/RESULTS.md, "The Qwen3.5
families at 8k and 32k on one H100" and the section after it).

Two measurements, each against the same thing in float64:
- The rule alone (``kernels.gated_delta_rule``, released head size 128, value heads grouped
  2 -> 4, random inputs as tests/gpu/test_qwen35_fla_gpu.py makes them): ``dg``'s error per
  token, and its error summed over each value head's tokens (what ``A_log`` sees), for fla on
  bf16 operands, fla on fp32 operands (states in fp32, dots in TF32) and the reference on bf16
  operands.
- The text family's tiny model on the packed stream of
  tests/gpu/test_qwen35_families_fla_gpu.py (documents 1, 2, 3, 1001 and 8192 or 32768) under
  bf16 autocast with each of the three, and with fla given its conv weight rounded to bf16 (the
  path before fla got the weight in its own dtype): every DeltaNet layer's ``A_log`` and
  ``dt_bias`` gradient error, relative and against the magnitudes of their per-token terms, for
  two seeds (data, build and decay draw), and from the float64 run each one's condition as a
  sum over tokens (``qwen35_grads.GateSums``: ``|| sum_t |term_t| || / || sum_t term_t ||``).

    python -m tests.perf.diag_qwen35_gates OUT.json [--cases 32k,8k] [--seeds 0,1]
        [--measure rule,model] [--model-rules fla,fla_conv_weight_bf16,fla_fp32,reference]

(fla's cold compile for fp32 operands is most of a fresh machine's first row: leave ``fla_fp32``
out of the model rows and ``rule`` out of the measurements to spare it.)

The JSON is rewritten after every row, so a run cut off keeps what it measured."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from mpcore.models.common.hybrid import deltanet, kernels
from tests.gpu.gpu_checks import rel_err
from tests.gpu.qwen35_grads import (
    GateSums,
    gradient_error,
    model_grads,
    tiny_case,
    tiny_weights_,
)

LENGTHS = {"8k": [1, 2, 3, 1001, 8192], "32k": [1, 2, 3, 1001, 32768]}
RULES = ("fla", "fla_fp32", "reference")
MODEL_RULES = ("fla", "fla_conv_weight_bf16", "fla_fp32", "reference")


def _fla_on_fp32_operands():
    """fla's delta rule given fp32 ``q, k, v, beta`` (its states then fp32, its dots TF32), its
    output cast back to the operands' dtype: the bf16 path with fla's storage precision
    raised and nothing else changed."""
    rule, *others = kernels.fla_ops()

    def wide_rule(q, k, v, g, beta, **kwargs):
        out, state = rule(q.float(), k.float(), v.float(), g, beta.float(), **kwargs)
        return out.to(v.dtype), state

    return mock.patch.object(kernels, "fla_ops", lambda: (wide_rule, *others))


def _conv_weight_rounded():
    """fla's conv given its weight rounded to the operands' dtype, as before it got the weight
    in its own dtype."""
    conv = kernels.short_conv

    def rounded(x, weight, positions, cu_seqlens, kernel, cu_host=None):
        return conv(x, weight.to(x.dtype), positions, cu_seqlens, kernel, cu_host)

    return mock.patch.object(kernels, "short_conv", rounded)


def _variant(rule: str):
    return {"fla_fp32": _fla_on_fp32_operands, "fla_conv_weight_bf16": _conv_weight_rounded
            }.get(rule, contextlib.nullcontext)()


def _rule_case(lengths: list[int], seed: int, device: str = "cuda") -> dict:
    gen = torch.Generator(device).manual_seed(seed)
    t, hk, hv, d = sum(lengths), 2, 4, 128
    bf = dict(device=device, dtype=torch.bfloat16)
    randn = functools.partial(torch.randn, device=device, generator=gen)
    q, k, v = randn(t, hk, d).to(**bf), randn(t, hk, d).to(**bf), randn(t, hv, d).to(**bf)
    g = -torch.nn.functional.softplus(randn(t, hv)) * 0.2
    beta = torch.rand(t, hv, device=device, generator=gen).to(**bf)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    weights = torch.randn(t, hv, d, device=device, dtype=torch.float64,
                          generator=torch.Generator(device).manual_seed(seed + 7))
    wide = [x.detach().double().requires_grad_() for x in inputs]
    (deltanet.chunk_gated_delta_rule(*wide, cu) * weights).sum().backward()
    truth = wide[3].grad
    row = {}
    for rule in RULES:
        for x in inputs:
            x.grad = None
        with _variant(rule):
            out = kernels.gated_delta_rule(*inputs, cu, "reference" if rule == "reference"
                                           else "fla")
        (out.double() * weights).sum().backward()
        dg = inputs[3].grad.double()
        row[rule] = {"dg": rel_err(dg, truth),
                     "dg_summed_per_head": rel_err(dg.sum(0), truth.sum(0))}
    return row


def _model_case(lengths: list[int], seed: int, device: str = "cuda",
                rules: tuple[str, ...] = MODEL_RULES) -> dict:
    family, cfg, s = tiny_case("qwen3_5", lengths, seed=seed)
    init_ = functools.partial(tiny_weights_, seed=5 + seed)
    run = functools.partial(model_grads, family, cfg, s, device=device, seed=3 + seed,
                            init_=init_)
    sums = GateSums()
    _, truth = run("reference", torch.float64, gate_sums=sums)
    row = {"condition": {n: round(c, 1) for n, c in sums.conditions().items()}}
    for rule in rules:
        with _variant(rule):
            _, grads = run("reference" if rule == "reference" else "fla", torch.bfloat16)
        row[rule] = {n: round(rel_err(grads[n], truth[n]), 5) for n in sums.magnitude}
        row[rule + " (against the magnitudes)"] = {
            n: float(f"{gradient_error(grads[n], truth[n], m):.3g}")
            for n, m in sums.magnitude.items()}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cases", default="32k,8k")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--measure", default="rule,model", help="rule, model or both")
    p.add_argument("--model-rules", default=",".join(MODEL_RULES),
                   help=f"the model rows, some of {','.join(MODEL_RULES)}")
    args = p.parse_args(argv)
    measures = args.measure.split(",")
    model_rules = tuple(args.model_rules.split(","))
    unknown = [m for m in measures if m not in ("rule", "model")] + [
        r for r in model_rules if r not in MODEL_RULES] + [
        c for c in args.cases.split(",") if c not in LENGTHS]
    if unknown:
        p.error(f"unknown {unknown}: cases are {sorted(LENGTHS)}, measures rule and model, "
                f"model rules {list(MODEL_RULES)}")
    if not torch.cuda.is_available() or kernels.fla_ops() is None:
        print("needs CUDA and fla-core", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "fla": kernels.fla_version(),
              "rule": {}, "model": {}}
    seeds = [int(x) for x in args.seeds.split(",")]
    for name in args.cases.split(","):
        cases = {"rule": _rule_case,
                 "model": functools.partial(_model_case, rules=model_rules)}
        for what in measures:
            case = cases[what]
            for seed in seeds:
                start = time.perf_counter()
                row = case(LENGTHS[name], seed)
                result[what][f"{name}_seed{seed}"] = row
                print(f"{what} {name} seed {seed} ({time.perf_counter() - start:.0f} s):",
                      json.dumps(row), flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
