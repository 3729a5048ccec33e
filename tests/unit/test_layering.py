"""The import layering, read from the source: kernels <- parallel <- models <- mpcore <- launch.

Every ``.py`` file under the five source folders is parsed (``ast``, nothing is imported), and
every import in it is collected, at module level and inside functions alike (an import hidden in
a function is still a dependency; hiding one to dodge a circle is what this test exists to stop).
Relative imports are resolved against the file's package. Each import of ours is mapped to its
layer (0 kernels, 1 parallel, 2 models, 3 the runtime ``mpcore.*``, 4 launch), and three rules
are checked, each failure naming ``file:line``:

1. a lower layer never imports a higher one;
2. no circle among our modules (the cycle is printed, module by module);
3. a family folder under ``models/`` imports only ``models/common`` (and the lower layers), never
   a sibling family: families compose shared parts, not each other. ``models/registry.py`` and
   ``models/__init__.py`` sit above the families and may import them all. The one kind left:
   a MoE variant imports its dense family's record to derive its own (``LINEAGE_EDGES``).

The one exemption: ``mpcore._names``. The four folders' ``__init__.py`` import it only on the
route where a folder was reached under its bare name (``import kernels`` from the repository
root); it is standard-library only and imports nothing of ours, so it cannot close a circle or
pull the runtime into a lower layer. Every other ``mpcore.*`` module is layer 3.

Layout: a graph of module names (``mpcore.models.llama.family``) to the modules they import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# folder (relative to the repository) -> the package name it installs as (pyproject.toml)
PACKAGE_DIRS = {"kernels": "mpcore.kernels", "parallel": "mpcore.parallel",
                "models": "mpcore.models", "mpcore": "mpcore", "launch": "mpcore.launch"}
LAYER_NAMES = ("kernels", "parallel", "models", "mpcore (runtime)", "launch")
# Standard-library only guard run by the four folders' __init__ on the bare-name route
# (mpcore/_names.py); see this file's docstring.
EXEMPT = frozenset({"mpcore._names"})
FAMILY_ROOT = "mpcore.models"
FAMILY_SHARED = frozenset({"common"})


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


def layer_of(module: str) -> int | None:
    """0..4 for our modules (see ``LAYER_NAMES``), ``None`` for anything else or an exemption."""
    if module in EXEMPT or not (module == "mpcore" or module.startswith("mpcore.")):
        return None
    for layer, prefix in enumerate(("mpcore.kernels", "mpcore.parallel", "mpcore.models")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    if module == "mpcore.launch" or module.startswith("mpcore.launch."):
        return 4
    return 3


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` under the five folders."""
    files = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([package, *parts])] = path
    return files


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from {'.' * level}{name} import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, source: str, path: str, is_package: bool,
               known: set[str]) -> list[Import]:
    """Every import in ``source`` (all nesting levels). ``from X import y`` targets ``X.y`` when
    that is one of our modules (``known``), else ``X``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, sub if sub in known else base, path, node.lineno))
    return found


def all_imports(root: Path = REPO) -> list[Import]:
    """The imports of every source module under ``root``, targets restricted to our modules."""
    files = module_files(root)
    known = set(files)
    found: dict[Import, None] = {}  # ordered set: two names from one module are one import
    for module, path in files.items():
        rel = str(path.relative_to(root))
        found.update((i, None) for i in imports_of(module, path.read_text(), rel,
                                                   path.name == "__init__.py", known)
                     if layer_of(i.target) is not None)
    return list(found)


def upward(imports: list[Import]) -> list[str]:
    """``file:line: a (layer) imports b (higher layer)`` for each import against the layering."""
    bad = []
    for i in imports:
        low, high = layer_of(i.source), layer_of(i.target)
        if low is not None and high is not None and high > low:
            bad.append(f"{i.path}:{i.line}: {i.source} ({LAYER_NAMES[low]}) imports {i.target} "
                       f"({LAYER_NAMES[high]})")
    return bad


def _family(module: str) -> str | None:
    """The family folder a module lives in (``qwen3_vl``), or None (common, registry, others)."""
    parts = module.split(".")
    if len(parts) < 3 or ".".join(parts[:2]) != FAMILY_ROOT:
        return None
    return None if parts[2] in FAMILY_SHARED or parts[2] == "registry" else parts[2]


def sibling_imports(imports: list[Import]) -> list[str]:
    """``file:line: ...`` for each import from one family folder into another."""
    bad = []
    for i in imports:
        mine, theirs = _family(i.source), _family(i.target)
        if mine is not None and theirs is not None and mine != theirs:
            bad.append(f"{i.path}:{i.line}: family {mine} imports family {theirs} ({i.target})")
    return bad


def cycles(imports: list[Import]) -> list[str]:
    """One printed cycle per strongly connected component of the module graph (Tarjan)."""
    graph: dict[str, dict[str, Import]] = {}
    for i in imports:
        graph.setdefault(i.source, {}).setdefault(i.target, i)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, {}):
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, dict[str, Import]], component: set[str]) -> str:
    """A concrete cycle through ``component``, one ``file:line`` edge per line."""
    start = min(component)
    path, seen = [start], {start}
    while True:  # walk inside the component until a module repeats: that closes a cycle
        nxt = min(t for t in graph[path[-1]] if t in component)
        if nxt in seen:
            path = path[path.index(nxt):] + [nxt]
            break
        path.append(nxt)
        seen.add(nxt)
    edges = [graph[a][b] for a, b in zip(path[:-1], path[1:], strict=True)]
    return f"circle of {len(edges)} modules:\n" + "\n".join(
        f"    {e.path}:{e.line}: {e.source} -> {e.target}" for e in edges)


def test_no_upward_import():
    bad = upward(all_imports())
    assert not bad, ("imports against kernels <- parallel <- models <- mpcore <- launch; move what "
                     "the lower layer needs down into it:\n" + "\n".join(bad))


def test_no_circle():
    found = cycles(all_imports())
    assert not found, ("import circles; break them by moving the shared part down, not by an "
                       "import inside a function:\n" + "\n".join(found))


# The sibling-family imports that remain, by design: a MoE variant is derived from its dense
# family's registry record (models/common/moe_family.py: moe_variant keeps the dense record's
# accessors, options, inputs and image processing, so the variant cannot drift from it), and
# that record lives in the dense family's folder. Every part (configs, models, HF I/O, inputs)
# comes from models/common. Only these (importer, imported) folder pairs may appear, and at
# most this many imports; a new pair or a higher count fails.
LINEAGE_EDGES = frozenset({
    ("qwen3_5_moe", "qwen3_5"), ("qwen3_vl_moe", "qwen3_vl"), ("qwen3_5_vl_moe", "qwen3_5_vl"),
})
SIBLING_IMPORTS_LEFT = 3  # one record import per MoE variant; issue 34 counted 74


def test_families_do_not_import_each_other():
    bad = sibling_imports(all_imports())
    edges = {(line.split(": family ")[1].split(" imports family ")[0],
              line.split(" imports family ")[1].split(" (")[0]) for line in bad}
    new = sorted(edges - LINEAGE_EDGES)
    assert not new, (f"new imports between sibling family folders {new}; compose parts from "
                     "models/common instead:\n" + "\n".join(
                         line for line in bad if any(f"family {a} imports family {b} " in line
                                                     for a, b in new)))
    assert len(bad) <= SIBLING_IMPORTS_LEFT, (
        f"{len(bad)} imports between sibling family folders, over the {SIBLING_IMPORTS_LEFT} "
        "left; compose parts from models/common instead:\n" + "\n".join(bad))


def test_checks_can_fail(tmp_path):
    """A synthetic tree with one upward import, one circle (through a function-level, relative
    import) and one sibling-family import: each check names it."""
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "models" / "fam_a").mkdir()
    (tmp_path / "models" / "fam_b").mkdir()
    (tmp_path / "models" / "fam_a" / "__init__.py").write_text("")
    (tmp_path / "models" / "fam_b" / "__init__.py").write_text("")
    (tmp_path / "models" / "fam_b" / "x.py").write_text("from ..fam_a import y\n")
    (tmp_path / "models" / "fam_a" / "y.py").write_text(
        "import os\n\n\ndef f():\n    from mpcore.data import z\n")
    (tmp_path / "mpcore" / "__init__.py").write_text("from mpcore import _names\n")
    (tmp_path / "mpcore" / "_names.py").write_text("import sys\n")
    (tmp_path / "mpcore" / "data.py").write_text("from mpcore.models.fam_a import y\n")
    imports = all_imports(tmp_path)
    assert upward(imports) == [
        "models/fam_a/y.py:5: mpcore.models.fam_a.y (models) imports mpcore.data "
        "(mpcore (runtime))"]
    assert sibling_imports(imports) == [
        "models/fam_b/x.py:1: family fam_b imports family fam_a (mpcore.models.fam_a.y)"]
    found = cycles(imports)
    assert len(found) == 1 and "circle of 2 modules" in found[0], found
    assert "models/fam_a/y.py:5" in found[0] and "mpcore/data.py:1" in found[0], found


@pytest.mark.parametrize("module, layer", [("mpcore.kernels.adamw", 0), ("mpcore.parallel", 1),
                                           ("mpcore.models.common.rope", 2), ("mpcore.data", 3),
                                           ("mpcore.launch.score", 4), ("mpcore._names", None),
                                           ("torch", None), ("mpcorex", None)])
def test_layer_of(module, layer):
    assert layer_of(module) == layer
