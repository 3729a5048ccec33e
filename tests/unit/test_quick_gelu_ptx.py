"""The QuickGELU kernels compiled for an H100/H200 (sm_90) without a GPU: Triton lowers them to
PTX here, and their bf16 loads and stores must be 16-byte vectors.

Whether they are depends on the size argument ``n``: the kernels mask ``offs < n``, and Triton
vectorises a masked access only where it knows the mask is constant over a vector, that is,
where ``n`` is specialised on its divisibility by 16 (what a launch with such an ``n`` gives,
unless the kernel opts out with ``do_not_specialize``). Opted out, every access is 2 bytes
wide, and on the H200 the forward pass ran at about a quarter of the copy bandwidth (302 us for
the 338 MB of the Qwen2-VL-2B tower's MLP activation per block)."""

import re

import pytest
from interpret import needs_triton

pytestmark = needs_triton


def _ptx(kernel, signature: dict, constants: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = kernel.arg_names
    # What a launch passes for 16-byte aligned pointers and an n divisible by 16.
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
             if t.startswith("*") or a == "n"}
    consts = {(names.index(a),): v for a, v in constants.items()}
    full = {**signature, **{a: "constexpr" for a in constants}}
    try:
        compiled = compile(ASTSource(kernel, full, consts, attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # no CUDA backend in this triton build
        pytest.skip(f"triton cannot compile for sm_90 here: {exc}")
    return compiled.asm["ptx"]


@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_bf16_accesses_are_16_byte_vectors(which):
    from kernels import quick_gelu

    kernel = getattr(quick_gelu, f"_quick_gelu_{which}_kernel")
    assert not kernel.do_not_specialize, "n must stay specialised (module docstring)"
    pointers = ["x_ptr", "y_ptr"] if which == "fwd" else ["x_ptr", "dy_ptr", "dx_ptr"]
    ptx = _ptx(kernel, {**{p: "*bf16" for p in pointers}, "n": "i32"}, {"BLOCK": 4096})
    accesses = set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx))
    assert accesses and all(".v4." in a for a in accesses), sorted(accesses)
