"""Sizes every vision tower config derives from its fields, and the tp check of its widths.

A family's vision config (a frozen dataclass with ``hidden_size``, ``num_heads``,
``in_channels``, ``temporal_patch_size``, ``patch_size`` and ``spatial_merge_size``) inherits
:class:`VisionGeometry` for ``head_dim``, ``patch_dim`` (the width of one ``pixel_values`` row)
and ``merge_unit`` (patches merged into one output row).
"""

from __future__ import annotations


class VisionGeometry:
    """Derived sizes (module docstring)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one ``pixel_values`` row: ``in_channels * temporal_patch_size *
        patch_size ** 2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row: ``spatial_merge_size ** 2``."""
        return self.spatial_merge_size ** 2


def check_tp_widths(tp: int, widths: tuple[tuple[str, int], ...]) -> None:
    """``ValueError`` naming the first ``(what, width)`` that tp does not divide, and the fix."""
    for what, n in widths:
        if n % tp:
            raise ValueError(f"vision tower: {what} = {n} is not divisible by tp = {tp}; "
                             f"choose a tp that divides {n}")
