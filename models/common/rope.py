"""Rotary position embedding (RoPE), plain theta or with the Llama 3 frequency scaling.

Layout: positions ``[T]`` int (the batch's position ids: they restart at 0 in every document and
travel with the tokens through the context-parallel split, so each rank rotates its own tokens by
their true positions). ``cos, sin [T, head_dim]``; ``x [T, heads, head_dim]``. The rotation is the
"rotate half" form of Hugging Face's Llama: pairs ``(x[i], x[i + head_dim / 2])``.

M-RoPE (Qwen2-VL, ``mrope_section=(s_t, s_h, s_w)``): positions are ``[3, T]`` (temporal,
height, width rows; equal rows for text tokens). Frequency pair j takes its angle from row 0 for
the first ``s_t`` pairs, row 1 for the next ``s_h``, row 2 for the last ``s_w``; the two halves
of ``head_dim`` repeat that choice, as in transformers' Qwen2-VL rotary embedding. Interleaved
M-RoPE (Qwen3-VL, ``mrope_interleaved``): pair j takes row 1 when ``j % 3 == 1`` and
``j < 3 * s_h``, row 2 when ``j % 3 == 2`` and ``j < 3 * s_w``, row 0 otherwise.

Numerics follow transformers: inverse frequencies and angles in fp32, cos/sin cast to the
residual stream's dtype (fp32 under autocast); the rotation itself is ``mpcore.kernels.rope.rope``.

Partial rotary (``rotary_dim`` r < head_dim, GLM-4V) rotates the first r dims of each head, with
frequencies of a width-r head; ``apply_rope(style="gptj")`` pairs adjacent dims instead of
halves (GLM-4V's interleaved form: its tables repeat each angle for the two dims of a pair).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mpcore.kernels.host_checked import copy_to
from mpcore.kernels.rope import rope


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies; ``scaling`` is None or the Llama 3 dict.

    Llama 3 scaling keeps high frequencies (wavelength below ``original / high_freq_factor``),
    divides low ones (wavelength above ``original / low_freq_factor``) by ``factor`` and
    interpolates smoothly in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions. No parameters; ``inv_freq`` is a non-persistent
    buffer recomputed by ``reset_parameters`` (the model is built on the meta device)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None,
                 mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False,
                 rotary_dim: int | None = None):
        super().__init__()
        # Partial rotary: the tables cover the rotated dims only (``apply_rope`` passes the
        # rest through), and the frequencies are those of a head of that width.
        head_dim = head_dim if rotary_dim is None else rotary_dim
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.mrope_section, self.mrope_interleaved = mrope_section, mrope_interleaved
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32),
                             persistent=False)

    def reset_parameters(self, seed: int = 0) -> None:
        del seed  # deterministic: nothing is drawn
        with torch.no_grad():
            self.inv_freq.copy_(inverse_frequencies(self.head_dim, self.theta, self.scaling))

    def _mrope_rows(self, device) -> torch.Tensor:
        """``[D/2]`` int64: the position row (0 t, 1 h, 2 w) of each frequency pair. Made on
        the host and copied without a CPU-GPU sync (``mpcore.kernels.host_checked.copy_to``)."""
        _, s_h, s_w = self.mrope_section
        if self.mrope_interleaved:
            row = torch.zeros(self.head_dim // 2, dtype=torch.int64)
            row[1:3 * s_h:3] = 1
            row[2:3 * s_w:3] = 2
        else:  # contiguous: 0 for the first s_t pairs, 1 for the next s_h, 2 for the last s_w
            row = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))
        return copy_to(row, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """``positions [T]`` (``[3, T]`` with M-RoPE) -> ``(cos, sin)``, each ``[T, head_dim]``
        (``[T, rotary_dim]`` under partial rotary) in ``dtype``."""
        if self.mrope_section is None:
            if positions.dim() != 1:
                raise ValueError(f"position ids must be [T], got shape "
                                 f"{tuple(positions.shape)} (this model has no M-RoPE)")
            angles = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, D/2)
        else:
            if positions.dim() != 2 or positions.shape[0] != 3:
                raise ValueError(f"M-RoPE position ids must be [3, T] (temporal, height, "
                                 f"width), got shape {tuple(positions.shape)}")
            row = self._mrope_rows(positions.device)
            chosen = positions.float().index_select(0, row)  # (D/2, T)
            angles = chosen.t() * self.inv_freq.float()[None, :]  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out_dtype: torch.dtype | None = None, style: str = "half") -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, head_dim]`` (``mpcore.kernels.rope.rope``:
    one fused Triton kernel per pass on CUDA, the PyTorch reference elsewhere).

    The rotation runs in float32 (float64 for float64 operands) and is rounded once to
    ``out_dtype``, by default ``torch.result_type(x, cos)`` as in eager; on CPU the result
    equals eager ``x * cos + rotate_half(x) * sin`` cast to ``out_dtype``, bitwise, for fp32 x
    and for bf16 x with fp32 tables. Differentiable in x only; the tables must not require grad.

    Partial rotary (tables ``[T, r]`` with r < head_dim) rotates ``x[..., :r]`` and passes the
    rest through. ``style="gptj"`` pairs adjacent dims ``(2i, 2i + 1)`` (GLM-4V) instead of
    ``(i, i + r/2)``: the rotated dims are viewed evens-then-odds, which turns adjacent pairs
    into rotate-half pairs with the same tables, rotated by the same kernel and put back; each
    output element is the same two products and sum as the adjacent-pair formula.
    """
    r = cos.shape[-1]
    if style == "half" and (x.dim() != 3 or r >= x.shape[-1]):
        return rope(x, cos, sin, out_dtype)  # full width (the kernel checks the shapes)
    if style not in ("half", "gptj") or r > x.shape[-1] or r % 2:
        raise ValueError(f"apply_rope: style must be 'half' or 'gptj' and the tables' width "
                         f"{r} even and at most head_dim {x.shape[-1]}; got style={style!r}")
    part, rest = x[..., :r], x[..., r:]
    if style == "gptj":
        part = part.unflatten(-1, (r // 2, 2)).transpose(-1, -2).flatten(-2)  # evens, odds
    out = rope(part, cos, sin, out_dtype)
    if style == "gptj":
        out = out.unflatten(-1, (2, r // 2)).transpose(-1, -2).flatten(-2)
    return torch.cat([out, rest.to(out.dtype)], dim=-1) if rest.shape[-1] else out
