"""TransformerEngine (optional) as the local GEMM of our tensor-parallel linear layers.

Detected here, not in ``mpcore.backends`` (which re-exports it), because ``parallel`` may not
import ``mpcore``. ``linear_backend`` is ``native`` (``F.linear`` or our FP8 kernel), ``te`` or
``auto``; a named TE that is not installed raises ``ValueError`` with the install hint, only
``auto`` falls back, and it logs its choice once. Nothing here imports TE until it is asked for.

What TE does and what stays ours: ``use_te`` gives each ``ColumnParallelLinear`` /
``RowParallelLinear`` a ``TEGemm``, a ``transformer_engine.pytorch.Linear`` (no bias, no tensor
parallelism of its own) kept outside the module tree, so it adds no parameters and no
checkpoint keys. Each call points it at the layer's current weight (the fp32 master, or the
bf16 tensor FSDP2 all-gathers), so the all-gathers, reduce-scatters and all-reduces around the
GEMM, the CP split, the loss heads and the checkpoints are ours and unchanged. Under
``torch.autocast`` TE computes in the autocast dtype (``base.set_activation_dtype``); the
weight's gradient comes back in that dtype and autograd casts it to the weight's.

FP8 recipes (compute capability >= 8.9), both e4m3 forward and e5m2 gradients (``HYBRID``):
    te_delayed   ``DelayedScaling``: scales from an amax history (TE's default length 1024)
    te_current   ``Float8CurrentScaling``: per-tensor scales from each call's own amax (the
                 recipe of our ``tensorwise`` kernel, in TE's kernels)
The weight is quantized on every call (no ``is_first_microbatch``: TE caches no FP8 weight,
which a weight that changes under FSDP2 needs). Rows are zero-padded to a multiple of 16: the
row count is the inner dimension of the FP8 weight-gradient GEMM, whose leading dimensions
cuBLASLt wants in multiples of 16 bytes (TE's ``CanonicalizeGemmInput`` asserts it; 1000 rows
failed on the H200, ``utils.assert_dim_for_fp8_exec``'s multiple of 8 is not enough there).

fp32 weight gradients straight from TE's GEMM (as ``mpcore.kernels.master_linear`` does for the native
path): for an fp32 weight that needs a gradient, TE's wgrad GEMM writes fp32 into a buffer
(TE's ``fuse_wgrad_accumulation`` with ``overwrite_main_grad``: ``main_grad`` of the tensor TE
was given) instead of returning bf16 that autograd would cast to fp32 (one pass reading 2 and
writing 4 bytes per weight element, per micro-batch; the gradient is also not rounded to bf16).
TE is handed an alias of the weight made by ``_WgradOut``; a hook on TE's output allocates the
buffer just before TE's backward runs (no fp32 gradient lives through the forward), and
``_WgradOut``'s backward returns that buffer as the weight's gradient, so autograd accumulates
it as usual: ``.grad`` accumulation over micro-batches, DDP's and FSDP2's hooks, and
``register_post_accumulate_grad_hook`` all see an ordinary gradient. A TE whose wgrad GEMM
does not honour ``overwrite_main_grad`` (probed once on the device: ``_overwrites_main_grad``)
gets a zero-filled buffer to accumulate into instead.

One ``te.autocast`` region per forward: ``forward_region(model)`` (the trainer enters it around
each micro-batch's forward) opens the region once, and every ``TEGemm`` of that recipe inside
runs in it, as TE's own models do. TE updates the delayed-scaling amax histories at the exit of
a region (``FP8GlobalStateManager.reduce_and_update_fp8_tensors``): once per forward, so the
history (TE's default length 1024) spans 1024 steps. A call outside any region (a library user
calling the model directly, activation recompute in the backward) opens its own region, which
is correct but updates the histories once per call. Amaxes are not reduced over ranks
(``reduce_amax=False``: our collectives move bf16, not FP8, so ranks need no common scale).

The delayed-scaling state (per layer: the forward and backward scales and amax histories) is
training state: ``fp8_state`` reads it and ``load_fp8_state`` puts it back in place
(``mpcore.train_state`` checkpoints it per rank, and merges it over the saved ranks when the
layout changes: the largest amax and the smallest scale of each entry).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading

import torch
import torch.nn.functional as F
from torch import nn

from mpcore.kernels.fp8_linear import check_fp8_device
from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear, check_fp8_dims

log = logging.getLogger(__name__)

LINEAR_BACKENDS = ("native", "te", "auto")
TE_RECIPES = ("te_delayed", "te_current")
TE_INSTALL = ("pip install --no-build-isolation 'transformer_engine[pytorch]' (it builds "
              "against the installed torch and CUDA toolkit)")
_logged: set[str] = set()
_import_error = [""]  # why the last import of TE failed
_region = threading.local()  # .fp8: the recipe of the forward_region open on this thread


def transformer_engine():
    """``transformer_engine.pytorch``, or ``None`` when TE (with its torch extension) is
    missing."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except (ImportError, OSError) as e:  # OSError: the package is there, its libraries not
        _import_error[0] = f"{type(e).__name__}: {e}"
        return None


def te_available() -> bool:
    return transformer_engine() is not None


def _require_te(what: str, device_type: str) -> None:
    if not te_available():
        raise ValueError(f"{what} but transformer_engine.pytorch cannot be imported "
                         f"({_import_error[0]}); install it ({TE_INSTALL}) or use "
                         f"model.linear_backend=native")
    if device_type != "cuda":
        raise ValueError(f"{what} needs CUDA (TransformerEngine's kernels are CUDA only), got "
                         f"device {device_type}; use model.linear_backend=native")


def resolve_linear_backend(name: str, device_type: str, fp8: str = "none") -> str:
    """Resolve ``model.linear_backend`` to ``"native"`` or ``"te"`` for ``device_type`` and the
    ``fp8`` recipe. ``auto``: te for TE's recipes, native for ``tensorwise`` (our kernel), else
    te when importable and on CUDA. Raises ``ValueError`` when te is needed but not installed
    or the device is not CUDA, and on a recipe of the other backend."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; use one of {list(LINEAR_BACKENDS)}")
    if fp8 in TE_RECIPES and name == "native":
        raise ValueError(f"fp8={fp8} is a TransformerEngine recipe; set "
                         f"model.linear_backend=te (or auto)")
    if fp8 == "tensorwise" and name == "te":
        raise ValueError("fp8=tensorwise is mpcore's own FP8 kernel (linear_backend=native); "
                         "with TransformerEngine use fp8=te_current (the same recipe) or "
                         "te_delayed")
    if name == "te" or fp8 in TE_RECIPES:
        _require_te(f"model.linear_backend={name}, fp8={fp8}", device_type)
        chosen = "te"
    elif name == "native" or fp8 == "tensorwise":
        chosen = "native"
    else:
        chosen = "te" if device_type == "cuda" and te_available() else "native"
    if name == "auto" and "linear" not in _logged:
        _logged.add("linear")
        why = "" if chosen == "te" or fp8 == "tensorwise" else (
            " (TransformerEngine not installed)" if device_type == "cuda"
            else f" (device {device_type})")
        log.info("model.linear_backend=auto: using %s%s", chosen, why)
    return chosen


def _recipe(fp8: str):
    """TE's recipe object for ``fp8`` (``None``: no FP8, the autocast dtype)."""
    if fp8 == "none":
        return None
    recipe = importlib.import_module("transformer_engine.common.recipe")
    if fp8 == "te_delayed":
        return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, reduce_amax=False)
    return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)


def _autocast(te, recipe):
    """``te.autocast`` (the 2.x spelling), else the older ``fp8_autocast``."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=recipe is not None, recipe=recipe)
    return te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe)


_OVERWRITES: dict[str, bool] = {}  # does this TE's wgrad GEMM overwrite main_grad (probed)?


class _Slot:
    """One TE call's fp32 weight-gradient buffer: the alias TE was given (whose ``main_grad``
    TE writes) and the buffer, from the pre-backward hook to ``_WgradOut``'s backward."""

    __slots__ = ("alias", "grad")

    def __init__(self):
        self.alias = self.grad = None


class _WgradOut(torch.autograd.Function):
    """Identity on the weight (a view TE is given). TE writes the weight's gradient into the
    view's ``main_grad`` and returns none for it; this backward returns that buffer."""

    @staticmethod
    def forward(ctx, weight, slot):
        ctx.set_materialize_grads(False)
        ctx.slot = slot
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        slot = ctx.slot
        buf, alias = slot.grad, slot.alias
        slot.grad = slot.alias = None
        if buf is None:
            raise RuntimeError("TransformerEngine's backward ran without the fp32 weight-gradient "
                               "buffer (the hook on its output did not fire)")
        # Drop every other reference, so that autograd can take the buffer as .grad itself
        # instead of copying it (AccumulateGrad steals a gradient nobody else holds).
        if alias is not None and hasattr(alias, "main_grad"):
            del alias.main_grad
        if grad is not None:  # TE returned a gradient as well (a TE that ignores main_grad)
            buf = buf + grad
        return buf, None


def _overwrites_main_grad(te) -> bool:
    """Whether TE's Linear with ``fuse_wgrad_accumulation`` writes (not adds) the weight
    gradient into a ``main_grad`` whose tensor has ``overwrite_main_grad`` set: one tiny fp32
    forward and backward on the current CUDA device into a NaN-filled buffer, compared with
    the exact gradient (cached; False without CUDA)."""
    if "overwrite" not in _OVERWRITES:
        ok = False
        try:
            device = torch.device("cuda", torch.cuda.current_device())
            # The probe's init and input draw from a forked RNG: the run's random streams are
            # the same with and without TE.
            with torch.random.fork_rng(devices=[device]):
                lin = te.Linear(64, 32, bias=False, params_dtype=torch.float32, device=device,
                                fuse_wgrad_accumulation=True)
                x = torch.randn(16, 64, device=device)
                w = lin.weight
                w.main_grad = torch.full_like(w, float("nan"))
                w.overwrite_main_grad = True
                with _autocast(te, None):
                    lin(x).sum().backward()
            exact = torch.ones(16, 32, device=device).t() @ x
            ok = bool(torch.allclose(w.main_grad, exact, rtol=1e-2, atol=1e-2))
        except (RuntimeError, TypeError, AttributeError, AssertionError):
            ok = False
        _OVERWRITES["overwrite"] = ok
    return _OVERWRITES["overwrite"]


class TEGemm:
    """``y = x @ weight.T`` through ``transformer_engine.pytorch.Linear`` (module docstring).

    A plain object, not an ``nn.Module``: the TE module inside stays out of the model's
    parameters, state dict and FSDP2 units. Shapes: x ``[..., in]``, weight ``[out, in]``
    (given per call) -> ``[..., out]`` in the autocast dtype (else x's).
    """

    def __init__(self, out_features: int, in_features: int, fp8: str = "none"):
        self.te, self.fp8, self.recipe = transformer_engine(), fp8, _recipe(fp8)
        # On the meta device: its own weight is never used (replaced on every call).
        self.module = self.te.Linear(in_features, out_features, bias=False,
                                     params_dtype=torch.float32, device="meta")
        self.module._parameters["weight"] = None
        self.overwrite = _overwrites_main_grad(self.te)
        self.fp32_wgrad = True  # False: TE's gradient in the compute dtype, cast by autograd

    def _wgrad_alias(self, weight: torch.Tensor):
        """``(tensor to give TE, slot)``: an alias whose ``main_grad`` TE writes (fp32 weight
        needing a gradient), else ``(weight, None)``."""
        fused = (self.fp32_wgrad and weight.dtype == torch.float32 and weight.requires_grad
                 and torch.is_grad_enabled())
        self.module.fuse_wgrad_accumulation = fused
        if not fused:
            return weight, None
        slot = _Slot()
        slot.alias = _WgradOut.apply(weight, slot)
        slot.alias.overwrite_main_grad = self.overwrite
        return slot.alias, slot

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        x2 = x.reshape(rows, x.shape[-1])
        pad = -rows % 16 if self.recipe is not None else 0
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))  # zero rows change no sum and no amax
        # Linear.forward reads its weight by name (_get_weight_tensors: getattr per
        # weight_names; one weight, so noop_cat returns it as is), and _Linear.apply takes it
        # as an input: the gradient flows to our tensor.
        given, slot = self._wgrad_alias(weight)
        self.module._parameters["weight"] = given
        inside = getattr(_region, "fp8", None) == self.fp8
        try:
            with contextlib.nullcontext() if inside else _autocast(self.te, self.recipe):
                y = self.module(x2)
        finally:
            self.module._parameters["weight"] = None  # no reference kept between calls
        if slot is not None:
            y.register_hook(_alloc_hook(slot, self.overwrite))
        if pad:  # a slice only when rows were added: its backward is a zero-fill and a copy
            y = y[:rows]
        return y.view(*x.shape[:-1], y.shape[-1])

    def __repr__(self) -> str:
        return f"te(fp8={self.fp8})"


def _alloc_hook(slot: _Slot, overwrite: bool):
    """The hook on TE's output that gives the alias its fp32 gradient buffer right before TE's
    backward (empty when TE overwrites it, else zeros to accumulate into)."""

    def hook(grad):
        new = torch.empty_like if overwrite else torch.zeros_like
        slot.grad = slot.alias.main_grad = new(slot.alias, dtype=torch.float32,
                                               memory_format=torch.contiguous_format)

    return hook


def use_te(module: nn.Module, fp8: str = "none") -> int:
    """Run the local GEMM of every ``ColumnParallelLinear`` / ``RowParallelLinear`` in
    ``module`` (itself included) through TransformerEngine with ``fp8`` (``none``, i.e. the
    autocast dtype, or one of ``TE_RECIPES``); returns how many layers. Call it after the build
    (weights materialised), before FSDP2 wrapping or after: it changes no parameter. Raises
    ``ValueError`` without TE or CUDA, on a GPU without FP8 for a recipe, on layers built with
    our FP8 kernel, and on local shapes FP8 cannot take (dims multiples of 16)."""
    if fp8 not in ("none", *TE_RECIPES):
        raise ValueError(f"unknown TransformerEngine recipe {fp8!r}; use none or one of "
                         f"{list(TE_RECIPES)}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    _require_te(f"linear_backend=te (fp8={fp8})", device.type)
    if fp8 != "none":
        check_fp8_device(fp8, device)
    layers = [m for m in module.modules() if isinstance(m, (ColumnParallelLinear,
                                                             RowParallelLinear))]
    for layer in layers:
        if layer.fp8 != "none":
            raise ValueError(f"{type(layer).__name__} was built with fp8={layer.fp8!r} (our "
                             f"kernel); build it with fp8='none' and pass the TE recipe here")
        check_fp8_dims(fp8, layer.weight, type(layer).__name__)
        layer.gemm = TEGemm(*layer.weight.shape, fp8)
    return len(layers)


def forward_region(module: nn.Module):
    """A function returning the context to run one forward of ``module`` in: one
    ``te.autocast`` region for all its ``TEGemm`` layers (module docstring), or a null context
    when ``module`` has none. Raises ``ValueError`` when its layers mix recipes."""
    recipes = {layer.gemm.fp8 for layer in module.modules()
               if isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
               and isinstance(layer.gemm, TEGemm)}
    if not recipes:
        return contextlib.nullcontext
    if len(recipes) > 1:
        raise ValueError(f"the model's TransformerEngine layers mix fp8 recipes {sorted(recipes)};"
                         f" use_te gives one recipe to all of them")
    fp8 = recipes.pop()
    te, recipe = transformer_engine(), _recipe(fp8)

    @contextlib.contextmanager
    def region():
        outer = getattr(_region, "fp8", None)
        _region.fp8 = fp8
        try:
            with _autocast(te, recipe):
                yield
        finally:
            _region.fp8 = outer

    return region


# ---------------------------------------------------------------- FP8 scaling state
FP8_STATE_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def fp8_state_layers(module: nn.Module) -> dict[str, TEGemm]:
    """Module name -> the ``TEGemm`` of each layer of ``module`` whose recipe keeps state
    between steps (``te_delayed``); ``{}`` when there is none."""
    return {name: m.gemm for name, m in module.named_modules()
            if isinstance(getattr(m, "gemm", None), TEGemm) and m.gemm.fp8 == "te_delayed"}


def _meta_tensors(gemm: TEGemm) -> dict[str, torch.Tensor] | None:
    meta = gemm.module.fp8_meta
    if "scaling_fwd" not in meta or "scaling_bwd" not in meta:
        return None
    return {f"{kind}_{way}": getattr(meta[f"scaling_{way}"], kind)
            for way in ("fwd", "bwd") for kind in ("scale", "amax_history")}


def fp8_state(gemm: TEGemm) -> dict[str, torch.Tensor] | None:
    """The layer's delayed-scaling state (``FP8_STATE_KEYS``: views of TE's own tensors, on
    the device), or None before its first FP8 forward (TE allocates it there)."""
    return _meta_tensors(gemm)


def load_fp8_state(gemm: TEGemm, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (``fp8_state``'s keys) into the layer's scaling state in place,
    allocating that state first (as TE's first FP8 forward would) when the layer has not run
    yet. Raises ``ValueError`` on a shape that differs (another amax history length)."""
    if _meta_tensors(gemm) is None:
        with _autocast(gemm.te, gemm.recipe):
            gemm.module.init_fp8_metadata(num_gemms=1)
    mine = _meta_tensors(gemm)
    if mine is None:
        raise RuntimeError("this TransformerEngine keeps its FP8 scaling state elsewhere "
                           "(fp8_meta has no scaling_fwd / scaling_bwd after init)")
    for key in FP8_STATE_KEYS:
        if tuple(values[key].shape) != tuple(mine[key].shape):
            raise ValueError(f"FP8 state {key}: the checkpoint holds {tuple(values[key].shape)}, "
                             f"this run's recipe {tuple(mine[key].shape)} (another "
                             f"amax_history_len?)")
        with torch.no_grad():
            mine[key].copy_(values[key])


def merge_fp8_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One layer's state for a new layout from the states its old ranks saved: per entry the
    largest amax history value and the smallest scale (the scale that the largest amax would
    give: no rank's tensors overflow where they did not before)."""
    out = {}
    for key in FP8_STATE_KEYS:
        stacked = torch.stack([s[key] for s in states])
        out[key] = stacked.amin(0) if key.startswith("scale") else stacked.amax(0)
    return out
