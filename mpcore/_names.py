"""The guard on the repository's top-level folders' bare names (``kernels``, ``parallel``,
``models``, ``launch``).

Those folders are the packages ``mpcore.kernels``, ``mpcore.parallel``, ``mpcore.models`` and
``mpcore.launch`` (pyproject.toml maps them; docs/design.md says why). Python still finds them
under their bare names whenever the repository's root is on ``sys.path`` (a shell started in the
checkout, ``python -m``, pytest). Each folder's ``__init__`` calls :func:`bare_import` when it
runs under a name other than its own, and this module decides what that import means:

- another installed distribution owns the name (``kernels`` is Hugging Face's kernel hub, which
  transformers >= 5.25 imports): that package is loaded in place of the folder, so the checkout
  never shadows it;
- nobody else owns it: a stand-in module with no file, no version and no contents, whose every
  use (``from models import registry``, ``kernels.rms_norm``) raises the ``ImportError`` that
  names the import to write instead. The import itself does not fail, because availability
  probes (transformers' ``find_spec`` then ``import_module``, where a package has no metadata)
  would crash on it; they read the stand-in as a PEP 420 namespace folder and move on.

Standard library only. The folders run this file by path (``runpy``), not by importing it:
importing it would run ``mpcore/__init__``, whose :func:`check_installed` refuses a checkout
that is not installed, and a probe of ``kernels`` in such a checkout must not crash.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a or ".").resolve() == b
    except OSError:
        return False


def bare_import(name: str, path: list[str]) -> None:
    """Resolve ``import <name>`` that reached our folder ``path[0]`` under its bare name.

    Puts another distribution's top-level ``name`` into ``sys.modules[name]`` (the import
    statement then returns it), or the stand-in whose every use names ``mpcore.<name>``.
    """
    ours = Path(path[0]).resolve()
    elsewhere = [entry for entry in sys.path if not _same_dir(entry, ours.parent)]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is not None and spec.loader is not None and spec.origin != str(ours / "__init__.py"):
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    sys.modules[name] = _Moved(name, ours)
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


class _Moved(types.ModuleType):
    """A bare name of ours that no other distribution owns (module docstring)."""

    def __init__(self, name: str, folder: Path):
        super().__init__(name)
        self._folder = folder
        # A package's mark, empty: ``import models.registry`` reaches _MovedFinder (below)
        # instead of stopping at "'models' is not a package".
        self.__path__: list[str] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__") or attr == "_folder":
            raise AttributeError(attr)  # what probes ask (__file__, __version__)
        raise self.moved(f"from mpcore.{self.__name__} import {attr}")

    def moved(self, write: str) -> ImportError:
        """The error for a use of this stand-in; ``write``: the import to write instead."""
        name, folder = self.__name__, self._folder
        return ImportError(
            f"'{name}' is not an import name of mpcore: the folder {folder} is the package "
            f"'mpcore.{name}' (write '{write}'). If 'mpcore.{name}' is not found either, this "
            f"checkout is not installed: pip install -e . in {folder.parent}", name=name)


class _MovedFinder:
    """``import models.registry`` (a dotted import under a stand-in): the error naming
    ``import mpcore.models.registry``. Finds nothing else."""

    def find_spec(self, fullname: str, path=None, target=None):
        head = sys.modules.get(fullname.partition(".")[0])
        if "." in fullname and isinstance(head, _Moved):
            raise head.moved(f"import mpcore.{fullname}")
        return None


LAYERS = ("kernels", "parallel", "models", "launch")
"""The top-level folders installed under ``mpcore.``."""


def check_installed() -> None:
    """Refuse, at ``import mpcore``, an install whose ``mpcore.<layer>`` packages are missing.

    That is an install made before the one namespace (it put ``kernels``, ``models``, ... at the
    top level, where Hugging Face's ``kernels`` also lives) or a checkout put on ``sys.path``
    without installing it; either way the next import would fail with a bare
    ``No module named 'mpcore.kernels'``.
    """
    missing = [name for name in LAYERS if importlib.util.find_spec(f"mpcore.{name}") is None]
    if missing:
        here = Path(__file__).resolve().parent
        raise ImportError(
            f"mpcore at {here} has no {', '.join('mpcore.' + m for m in missing)}: this install "
            f"predates mpcore's one namespace (it installed {', '.join(missing)} as top-level "
            f"names) or the checkout is not installed; run pip install -e . in {here.parent}")
