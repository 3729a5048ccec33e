"""The import names: the distribution installs ``mpcore`` and nothing else, every package folder
is listed under it, and no top-level folder of the repository imports under its bare name.

The bare-name checks run in subprocesses started in the repository's root, where Python finds the
folders by their bare names (what a user with a shell in the checkout gets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from mpcore._names import LAYERS

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([kwargs.pop("python", sys.executable), "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, **kwargs)


def _installed_packages() -> set[str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
               ["packages"])


def test_every_package_folder_is_installed_under_mpcore():
    expected = set()
    for layer in ("mpcore", *LAYERS):
        for init in (REPO / layer).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / layer).parts
            base = "mpcore" if layer == "mpcore" else f"mpcore.{layer}"
            expected.add(".".join((base, *parts)))
    assert {f"mpcore.{layer}" for layer in LAYERS} <= expected
    assert _installed_packages() == expected, (
        "pyproject.toml's [tool.setuptools] packages must list every package folder: "
        f"missing {sorted(expected - _installed_packages())}, "
        f"extra {sorted(_installed_packages() - expected)}")


def test_a_bare_name_in_the_checkout_is_never_our_folder():
    # One interpreter for the four names: `import X` itself succeeds either way.
    code = ("import importlib, json\n"
            "out = {}\n"
            f"for layer in {list(LAYERS)!r}:\n"
            "    module = importlib.import_module(layer)\n"
            "    try:\n"
            "        getattr(module, 'anything_' + layer)\n"
            "        error = None\n"
            "    except (AttributeError, ImportError) as e:\n"
            "        error = str(e)\n"
            "    out[layer] = [getattr(module, '__file__', None), error]\n"
            "print(json.dumps(out))")
    proc = _python(code, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for layer, (loaded, error) in json.loads(proc.stdout.splitlines()[-1]).items():
        if loaded is not None:
            # Another distribution owns the name (Hugging Face's kernels): it, not our folder.
            assert REPO not in Path(loaded).resolve().parents, f"import {layer} loaded {loaded}"
        else:
            # Nobody else does: a stand-in without a file, whose every use names the new import.
            assert f"from mpcore.{layer} import anything_{layer}" in error, error


def test_an_availability_probe_reads_a_bare_name_of_ours_as_absent():
    # transformers' own check (find_spec, no metadata, then import_module): a crash here breaks
    # `import transformers` in the checkout wherever no distribution owns the name.
    proc = _python("from transformers.utils.import_utils import _is_package_available\n"
                   "print(_is_package_available('models', True))", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["(False,", "'N/A')"]


def test_the_old_import_of_a_submodule_names_the_new_one():
    proc = _python("from models import registry", cwd=REPO)
    assert proc.returncode != 0
    assert "from mpcore.models import registry" in proc.stderr, proc.stderr


def test_the_old_dotted_import_names_the_new_one():
    proc = _python("import models.registry", cwd=REPO)
    assert proc.returncode != 0
    assert "write 'import mpcore.models.registry'" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_transformers_and_our_models_import_together_in_the_checkout_and_elsewhere(tmp_path):
    # transformers >= 5.25 imports Hugging Face's `kernels` (the kernel hub) where installed;
    # the checkout's kernels/ folder must not stand in for it.
    code = ("import transformers, mpcore.models, mpcore.kernels\n"
            "from transformers.integrations import hub_kernels\n"
            "import mpcore.models.registry as r\n"
            "assert r.FAMILIES\n"
            "print(mpcore.kernels.__name__)")
    for cwd in (REPO, tmp_path):
        proc = _python(code, cwd=cwd)
        assert proc.returncode == 0, f"in {cwd}: {proc.stderr[-2000:]}"
        assert proc.stdout.split() == ["mpcore.kernels"]


def test_one_module_is_loaded_once_under_one_name():
    proc = _python("import sys, mpcore.models, mpcore.launch.score\n"
                   "names = [n for n in sys.modules if n.split('.')[0] in "
                   "('kernels', 'parallel', 'models', 'launch')]\n"
                   "files = [m.__file__ for m in sys.modules.values() "
                   "if getattr(m, '__file__', None) and m.__name__.startswith('mpcore')]\n"
                   "assert len(files) == len(set(files)), 'a file loaded twice'\n"
                   "print(names)", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_built_wheel_installs_mpcore_only_and_imports_in_a_clean_venv(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels), str(REPO)], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("mpcore-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"mpcore"}, tops
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        with zipfile.ZipFile(wheel) as z:
            assert z.read(top_level[0]).decode().split() == ["mpcore"]
    for shipped in ("mpcore/launch/configs/tiny.yaml", "mpcore/launch/data/default_corpus.jsonl",
                    "mpcore/launch/data/images/captions.jsonl",
                    "mpcore/launch/slurm/pretrain.sbatch", "mpcore/models/registry.py"):
        assert shipped in names, f"{shipped} is not in the wheel"

    # torch, transformers, ... come from this interpreter's site-packages; mpcore from the wheel
    # (the venv's own site-packages come first, before this environment's editable install).
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "--no-deps", "-q", str(wheel)], capture_output=True, text=True,
                             timeout=600)
    if install.returncode and "no such option: --python" in install.stderr:
        pytest.skip("this pip has no --python option (pip >= 22.3 has)")
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import mpcore, mpcore.models, mpcore.launch.score, transformers\n"
            "from mpcore.data.corpus import DEFAULT_CORPUS\n"
            "from mpcore.models.registry import FAMILIES\n"
            "assert DEFAULT_CORPUS.is_file(), DEFAULT_CORPUS\n"
            "print(mpcore.__file__, mpcore.models.__file__, len(FAMILIES))")
    proc = _python(code, cwd=tmp_path, python=str(python))
    assert proc.returncode == 0, proc.stderr[-3000:]
    mpcore_file, models_file, count = proc.stdout.split()
    assert Path(mpcore_file).is_relative_to(env_dir) and Path(models_file).is_relative_to(env_dir)
    assert int(count) >= 10
