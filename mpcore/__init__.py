"""mpcore: Megatron-style model-parallel training. One import namespace: ``mpcore.kernels``,
``mpcore.parallel``, ``mpcore.models`` and ``mpcore.launch`` are the repository's top-level
folders (pyproject.toml maps them; docs/design.md says why), the runtime is ``mpcore.*``."""

from mpcore._names import check_installed

check_installed()
