"""Loss and every parameter's gradient of a tiny Qwen3.5 model of any family on one packed
stream, and how the GPU tests judge a bf16 run against the same model in float64.

Layout: a packed stream ``dict(input_ids [T], cu_seqlens [D+1])``, a VL family's with its
images and video whole (``pixel_values [N, patch_dim]``, ``image_grid_thw [I, 3]``, ...;
``tests.dist.hf_qwen3_vl_tiny.stream``). The models are built through the family's registry
record (``family.build``, ``family.local_inputs``), from the tiny config.json of
``qwen35_hf_scores.config_kwargs``, so nothing here asks which family it has beyond whether it
reads images (``family.modality``).

The judgement (``check_against_float64``): a wrong kernel is off by O(1); bf16 is off by its
own rounding, which swings several-fold from layer to layer on one reduced gradient. So the
loss and each KIND of parameter (its name without the layer index, worst layer against worst
layer) under the kernel tested must be within twice the reference kernel's own bf16 error
against float64, plus a floor (1e-3 of the loss; 1e-2 for a gradient).

Two kinds are judged in other units: each DeltaNet layer's ``A_log`` and ``dt_bias``, whose
gradients are per-head sums over every token of ``dL/dg_t`` times the decay's slope. Those
sums cancel: on the text family's 32k case the terms' magnitudes summed to 50 to 204 times the
sum (``GateSums``: its condition), so bf16's rounding of the terms, which is relative to their
magnitudes, is that many times larger relative to the sum, and swings from run to run (one
layer under the reference in bf16: 0.0043 of the sum on an H100, 0.0192 on the CPU). Their
error is measured against the magnitudes summed (``|| grad - truth || / || sum_t |term_t| ||``,
the measure a sum's rounding is bounded in) and the floor is bf16's unit roundoff, 2^-8: every
term rounded once, all the same way."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from mpcore.batches import place
from mpcore.models import family_named
from mpcore.models.common.hybrid import kernels
from mpcore.models.common.hybrid.layers import GatedDeltaNet
from mpcore.models.common.moe import MoeBlock
from mpcore.moe_step import MoeStep
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import stream
from tests.dist.qwen35_tiny import packed_docs
from tests.gpu.gpu_checks import rel_err
from tests.gpu.qwen35_hf_scores import VISION, config_kwargs

# A VL stream's documents with images and a video (``hf_qwen3_vl_tiny.DOCS``' parts); the
# text-only documents of the case's lengths follow them.
VISUAL_DOCS = [[5, ("image", 1, 4, 6), 4], [2, ("image", 1, 6, 4), 1, ("image", 1, 2, 2), 3],
               [3, ("video", 3, 4, 4), 2]]
ROUTER_STD = 0.5  # router weights' scale: top-k far from ties (qwen35_moe_tiny's sharp router)
DECAY = (0.02, 0.3)  # A = lo + span * U(0, 1): weak decays (qwen35_tiny.randomize_'s)


def fla_rule_or_skip() -> None:
    """fla refuses some GPU / Triton pairs at run time (``kernels.fla_refusal``): then there is
    no fla delta rule to compare, and ``auto`` runs the reference."""
    refusal = kernels.fla_refusal(torch.cuda.current_device())
    if refusal is not None:
        pytest.skip(f"fla-core refuses this GPU and Triton: {refusal}")


def tiny_case(name: str, lengths: list[int], head_dim: int = 128, seed: int = 0):
    """``(family, cfg, stream)``: family ``name``'s tiny config (DeltaNet key and value heads of
    ``head_dim``; positions up to the longest document) and a packed stream of text documents
    of ``lengths``, after ``VISUAL_DOCS`` for a family that reads images."""
    family = family_named(name)
    hf = config_kwargs(name, head_dim, max(4096, max(lengths)))
    cfg = family.config_from_hf({"architectures": list(family.hf_architectures), **hf})
    if family.modality == "image-text":
        s = stream(seed, docs=VISUAL_DOCS + [[n] for n in lengths])
    else:
        ids, cu = packed_docs(lengths, seed)
        s = dict(input_ids=ids, cu_seqlens=cu)
    return family, cfg, s


@torch.no_grad()
def tiny_weights_(model, seed: int = 5) -> None:
    """The built weights made telling, in place (the same in every run of a case): every
    DeltaNet's ``A`` drawn from ``DECAY`` and every MoE router's weights scaled from their
    init std to ``ROUTER_STD``. The init's ``A = U(1, 16)`` forgets within a token or two,
    so a long document tests no state, and ``A_log``'s gradient is 4 to 6 orders below the
    others' (fp32 alone is then 0.16 off float64 on it, CPU, 83 tokens); near-uniform routers
    let bf16 flip many top-k choices, each moving an expert's gradient by O(1 / its tokens),
    noise that would swamp what the kernels do."""
    gen = torch.Generator().manual_seed(seed)
    lo, span = DECAY
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(lo + span * torch.rand(p.shape, generator=gen)))
    for module in model.modules():
        if isinstance(module, MoeBlock):
            module.gate.weight.mul_(ROUTER_STD / module.init_std)


class PinnedRoutes:
    """Every MoE router's top-k choices in the first run it is attached to (the float64 truth),
    imposed on the later runs: a bf16 run routes each token to the experts float64 chose, with
    its own gate probabilities as the weights (renormalised as the block does). Top-k is a
    step function: a token whose best experts are near-tied under float64 changes expert under
    any rounding, and each such flip moves the gradients of the few tokens near it by O(1 /
    their count). At a VL model's 25 image and video tokens that is the tower's whole gradient
    (one flip at an image token, CPU float32: 0.005 of it), so the flips a run happens to take
    would be judged as its kernel's error. ``flips[run][block]`` counts the tokens whose choice
    the run would have changed (printed: how close the run came to the truth's routing)."""

    def __init__(self):
        self.choices: dict[str, torch.Tensor] = {}
        self.flips: list[dict[str, int]] = []

    def attach(self, model) -> None:
        """Record (first run) or impose (later runs) the choices of ``model``'s MoE blocks."""
        pinning = bool(self.choices)
        if pinning:
            self.flips.append({})
        for name, module in model.named_modules():
            if isinstance(module, MoeBlock):
                module.route = self._route(name, module, module.route, pinning)

    def _route(self, name: str, block: MoeBlock, route: Callable, pinning: bool) -> Callable:
        def pinned(x: torch.Tensor):
            logits, probs, weights, experts = route(x)
            if not pinning:
                self.choices[name] = experts.detach().cpu()
                return logits, probs, weights, experts
            want = self.choices[name].to(experts.device)
            moved = (want.sort(-1).values != experts.sort(-1).values).any(-1)
            self.flips[-1][name] = int(moved.sum())
            weights = probs.gather(-1, want)
            if block.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, probs, weights.to(x.dtype), want
        return pinned


class GateSums:
    """What each DeltaNet layer's ``A_log`` and ``dt_bias`` gradients sum, in the run it is
    attached to (the float64 truth): ``signed[name]`` the per-head sums over tokens of their
    terms (``dL/dg_t * dg_t/dtheta``, float64: the gradients themselves, to the gradient's
    own rounding) and ``magnitude[name]`` the sums of the terms' absolute values, both
    ``[Hv]`` by parameter name. ``dg/dA_log = g``; ``dg/ddt_bias = -exp(A_log) *
    sigmoid(a + dt_bias)``."""

    def __init__(self):
        self.signed: dict[str, torch.Tensor] = {}
        self.magnitude: dict[str, torch.Tensor] = {}

    def attach(self, model) -> None:
        for name, module in model.named_modules():
            if isinstance(module, GatedDeltaNet):
                module._gates = self._tap(name, module, module._gates)

    def conditions(self) -> dict[str, float]:
        """``|| magnitude || / || signed ||`` by parameter name: how much the sum cancels."""
        return {n: float(m.norm() / self.signed[n].norm().clamp(min=1e-300))
                for n, m in self.magnitude.items()}

    def _add(self, name: str, terms: torch.Tensor) -> None:
        signed, magnitude = terms.sum(0).cpu(), terms.abs().sum(0).cpu()
        self.signed[name] = self.signed.get(name, 0) + signed
        self.magnitude[name] = self.magnitude.get(name, 0) + magnitude

    def _tap(self, name: str, layer: GatedDeltaNet, gates: Callable) -> Callable:
        def tapped(b: torch.Tensor, a: torch.Tensor):
            g, beta = gates(b, a)
            if g.requires_grad:
                with torch.no_grad():
                    slope = -layer.A_log.double().exp() * torch.sigmoid(
                        a.double() + layer.dt_bias.double())
                    decay = g.detach().double()

                def hook(dg: torch.Tensor) -> None:
                    self._add(f"{name}.A_log", dg.double() * decay)
                    self._add(f"{name}.dt_bias", dg.double() * slope)
                g.register_hook(hook)
            return g, beta
        return tapped


def model_grads(family, cfg, s: dict, kernel: str, dtype: torch.dtype, device: str = "cuda",
                seed: int = 3, init_: Callable | None = None, routes: PinnedRoutes | None = None,
                gate_sums: GateSums | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient (float64 on the CPU, by name) of ``family``'s model
    of ``cfg`` on stream ``s`` with DeltaNet ``kernel``: under bf16 autocast (``dtype``
    bfloat16; fp32 weights, the production path), or wholly in ``dtype`` without autocast
    (float32; or float64, the truth: the reference attention, and the loss taken from the
    logits, since the fused loss head takes no float64). The loss is the summed next-token
    loss over T, plus a MoE model's load-balancing and z terms as the trainer adds them
    (``mpcore.moe_step.MoeStep``: one micro-batch, the whole step). ``init_(model)`` changes
    the built weights in place (``tiny_weights_``); ``routes`` records the MoE
    routing of the first run given it and pins the later runs' to it (``PinnedRoutes``)."""
    state = ParallelState()
    half, wide = dtype == torch.bfloat16, dtype == torch.float64
    model = family.build(cfg, state, seed=seed, device=device, gdn_kernel=kernel,
                         dtype=torch.float32 if half else dtype,
                         attention_backend="reference" if wide else "auto")
    if init_ is not None:
        init_(model)
    if routes is not None:
        routes.attach(model)
    if gate_sums is not None:
        gate_sums.attach(model)
    vision = {k: s[k] for k in VISION if s.get(k) is not None}
    ids = s["input_ids"]
    # As pretrain's step: planned on the host, then placed (mpcore.batches.place), so the
    # batch's host copies (cu_seqlens among them: fla plans its chunks from it) ride along.
    _, local = family.local_inputs(state, ids.cpu(), s["cu_seqlens"].cpu(), cfg, **vision)
    inputs = place(local, family, torch.device(device))
    moe = MoeStep.start(model, [inputs], state, forward=None)  # one micro-batch: no count pass
    with torch.autocast(device, dtype=torch.bfloat16, enabled=half):
        if wide:
            labels = inputs.pop("labels")
            logits = model(**inputs, output="logits")[:, :family.decoder(model).cfg.vocab_size]
            loss = F.cross_entropy(logits.double(), labels, ignore_index=-100,
                                   reduction="sum") / ids.numel()
        else:
            loss = model(**inputs, output="loss").sum() / ids.numel()
        if moe is not None:
            loss = loss + moe.share()
    loss.backward()
    return float(loss.detach()), {n: p.grad.double().cpu() for n, p in model.named_parameters()}


# bf16's unit roundoff: the floor of a gradient judged against its terms' magnitudes.
BF16_ROUNDOFF = 2.0 ** -8


def kind_of(name: str) -> str:
    """A parameter's kind: its name with ``.N.`` for the layer index."""
    return re.sub(r"\.\d+\.", ".N.", name)


def gradient_error(grad: torch.Tensor, want: torch.Tensor,
                   scale: torch.Tensor | None = None) -> float:
    """``rel_err(grad, want)``, or with ``scale`` (``GateSums.magnitude``) the error against it:
    ``|| grad - want || / || scale ||``."""
    if scale is None:
        return rel_err(grad, want)
    return float((grad - want).norm() / scale.norm())


def worst_per_kind(grads: dict, truth: dict, scales: dict | None = None) -> dict[str, float]:
    """Each kind of parameter's (``kind_of``) worst ``gradient_error`` of ``grads`` against
    ``truth`` over its layers, against ``scales[name]`` for a name there."""
    kinds: dict[str, float] = {}
    for name, want in truth.items():
        err = gradient_error(grads[name], want, (scales or {}).get(name))
        kinds[kind_of(name)] = max(kinds.get(kind_of(name), 0.0), err)
    return kinds


# How far two float64 truths of one model on one stream (CPU and CUDA) may differ. They are
# not float64 throughout: the families' RMSNorms normalise in fp32, as transformers' do, so a
# device's own fp32 reduction order moves them. On the CPU, that alone (the norms' mean of
# squares reduced another way: tests/unit/test_qwen35_family_grads.py) moved the gradients by
# up to 7.1e-7 and the loss by 1.4e-10 over the four families' tiny cases; a wholly fp32 run
# was 2.3e-6 off, a bf16 run 1.1e-2 to 1.8e-2. The judgement these truths serve works at
# bf16's 1e-2, and a wrong path is O(1): 1e-4 is far from both.
TRUTHS_AGREE = 1e-4


def check_truths_agree(first: tuple, second: tuple, devices: tuple[str, str]) -> None:
    """The float64 ``(loss, grads)`` of one model computed on ``devices[0]`` (``first``) and on
    ``devices[1]`` (``second``, its MoE routing pinned to the first's) must be one function:
    the loss and every gradient within ``TRUTHS_AGREE``, relative. This is what lets a case
    too long for the CPU take its truth from the GPU."""
    (loss_a, grads_a), (loss_b, grads_b) = first, second
    err, name = max((rel_err(grads_b[n], g), n) for n, g in grads_a.items())
    print(f"float64 truth on {devices[1]} against {devices[0]}: loss {loss_b:.12f} / "
          f"{loss_a:.12f}; worst gradient {name} {err:.2e}")
    assert abs(loss_b - loss_a) <= TRUTHS_AGREE * abs(loss_a), (loss_a, loss_b)
    assert err <= TRUTHS_AGREE, (name, err)


def check_against_float64(truth: tuple, ref: tuple, fla: tuple,
                          gate_sums: GateSums | None = None) -> None:
    """Assert the module docstring's bounds on ``fla``'s ``(loss, grads)`` (``model_grads`` in
    bf16 with the kernel tested) given the reference kernel's in bf16 (``ref``) and the model's
    in float64 (``truth``, its ``GateSums`` in ``gate_sums``: without them every kind is judged
    by ``rel_err``); prints the losses, the worst gradients (A_log among them) and the
    per-kind table: which error is the kernel's own and which is bf16's."""
    (true_loss, want), (ref_loss, ours), (fla_loss, theirs) = truth, ref, fla
    print(f"loss: float64 {true_loss:.6f}, reference bf16 {ref_loss:.6f}, fla bf16 {fla_loss:.6f}")
    assert abs(fla_loss - true_loss) <= 2 * abs(ref_loss - true_loss) + 1e-3 * true_loss
    rows = sorted((rel_err(theirs[n], g) / max(rel_err(ours[n], g), 1e-3), n, rel_err(theirs[n], g),
                   rel_err(ours[n], g)) for n, g in want.items())
    print("fla / reference bf16 gradient error vs float64 (worst 4; name, fla, reference):",
          [(n, f"{a:.4f}", f"{b:.4f}") for _, n, a, b in rows[-4:]])
    print("A_log:", [(n, f"{a:.4f}", f"{b:.4f}") for _, n, a, b in rows if "A_log" in n])
    scales = None
    if gate_sums is not None:
        scales = gate_sums.magnitude
        print("gate sums' conditions (judged against their magnitudes):",
              {n: f"{c:.1f}" for n, c in gate_sums.conditions().items()})
    # Worst layer against worst layer: bf16's error on one reduced gradient swings
    # several-fold from layer to layer (A_log at 295b7e3 / H100: reference 0.018, 0.053,
    # 0.255 over the three DeltaNet layers; fla 0.049, 0.054, 0.164), so one layer's ratio is
    # noise; a wrong fla path is off by O(1) in every layer.
    fla_kinds, ref_kinds = worst_per_kind(theirs, want, scales), worst_per_kind(ours, want, scales)
    print("per kind, worst layer (fla, reference):",
          {k: (f"{fla_kinds[k]:.4f}", f"{ref_kinds[k]:.4f}") for k in sorted(fla_kinds)})
    scaled = {kind_of(n) for n in scales or ()}
    for kind, err in fla_kinds.items():
        floor = BF16_ROUNDOFF if kind in scaled else 1e-2
        assert err <= 2 * ref_kinds[kind] + floor, (kind, err, ref_kinds[kind])
