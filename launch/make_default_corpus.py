"""Build launch/data/default_corpus.jsonl, the small corpus that ships with mpcore.

The text is the docstrings of a fixed, sorted list of pure-Python standard library modules,
read with ``ast`` from the source files of the running interpreter (nothing is imported or
executed). One document per docstring, in source order, module by module:

    {"text": "<module>.<qualname>\\n\\n<cleaned docstring>"}

The output is committed, so every machine trains on identical bytes whatever Python it runs;
this script only documents how it was made (and remakes it: ``python
launch/make_default_corpus.py``). The docstrings are under the PSF license, whose text is
copied beside the corpus as launch/data/LICENSE-PSF.txt.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import shutil
import sys
import sysconfig
from pathlib import Path

# Paths under the stdlib folder, without ".py"; sorted so the corpus order is fixed.
MODULES = sorted(
    """
    _collections_abc _pydecimal argparse ast asyncio/base_events asyncio/events
    asyncio/futures asyncio/locks asyncio/queues asyncio/streams asyncio/tasks base64 bisect
    calendar cmd codecs collections/__init__ colorsys concurrent/futures/_base configparser
    contextlib copy csv dataclasses datetime difflib doctest email/message email/utils enum
    filecmp fileinput fnmatch fractions ftplib functools getopt gettext glob gzip heapq hmac
    html/parser http/client http/cookiejar http/server imaplib importlib/_bootstrap_external
    importlib/metadata/__init__ inspect ipaddress json/decoder json/encoder locale
    logging/__init__ logging/handlers mailbox mimetypes multiprocessing/pool netrc numbers
    operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint pydoc
    queue random re/__init__ reprlib sched secrets selectors shlex shutil smtplib socket
    socketserver statistics string subprocess tarfile tempfile textwrap threading timeit
    tkinter/__init__ tokenize trace traceback turtle typing unittest/case unittest/mock
    urllib/parse urllib/request uuid warnings wave weakref xml/dom/minidom
    xml/etree/ElementTree zipfile zipimport
    """.split()
)
MIN_CHARS = 20


def docstrings(path: Path, module: str):
    """Yield ``(qualname, docstring)`` for the module and every class/function, in source order."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node, prefix):
        doc = ast.get_docstring(node, clean=False)
        if doc is not None:
            yield prefix, doc
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, f"{prefix}.{child.name}")

    yield from visit(tree, module)


def build(stdlib: Path, output: Path) -> tuple[int, int]:
    """Write the corpus; return (documents, bytes)."""
    num_docs = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8", newline="\n") as f:
        for name in MODULES:
            module = name.removesuffix("/__init__").replace("/", ".")
            for qualname, doc in docstrings(stdlib / f"{name}.py", module):
                text = inspect.cleandoc(doc)
                if len(text) < MIN_CHARS or not text.isascii():
                    continue
                f.write(json.dumps({"text": f"{qualname}\n\n{text}"}) + "\n")
                num_docs += 1
    return num_docs, output.stat().st_size


def main() -> None:
    here = Path(__file__).resolve().parent / "data"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=here / "default_corpus.jsonl")
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    num_docs, size = build(stdlib, args.output)
    license_file = stdlib / "LICENSE.txt"
    if license_file.exists():
        shutil.copyfile(license_file, args.output.parent / "LICENSE-PSF.txt")
    print(
        f"{args.output}: {num_docs} documents, {size} bytes, from {stdlib} "
        f"(Python {sys.version.split()[0]})"
    )


if __name__ == "__main__":
    main()
