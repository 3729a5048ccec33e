"""The command line of ``launch/pretrain.py``: arguments, ``--help`` and ``--print-config``.

    pretrain.py [CONFIG.yaml] [section.key=value ...] [--print-config]

``--help`` lists every config key with its default and its docstring. The docstrings are the
string literals under each field of the dataclasses in ``mpcore/config.py`` (attribute
docstrings); Python keeps no trace of them at run time, so they are read from the source with
``ast``. ``--print-config`` prints the resolved config as YAML and trains nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpcore import config as config_module

CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Args:
    config: Path
    overrides: list[str]
    help: bool = False
    print_config: bool = False


def parse_args(argv: list[str], default_config: Path) -> Args:
    """``[CONFIG.yaml] [key=value ...]`` plus the flags ``-h/--help`` and ``--print-config``.

    Raises ``ValueError`` for an unknown flag, or a first argument that is neither a YAML file
    (``.yaml``/``.yml``) nor an override (``key=value``), so a misnamed config is not taken for
    an override.
    """
    flags = {a for a in argv if a.startswith("-")}
    unknown = flags - {"-h", "--help", "--print-config"}
    if unknown:
        raise ValueError(f"unknown option {sorted(unknown)[0]!r}; pretrain.py takes "
                         f"[CONFIG.yaml] [section.key=value ...] [--print-config] [--help]")
    rest = [a for a in argv if not a.startswith("-")]
    config = default_config
    if rest and rest[0].endswith(CONFIG_SUFFIXES):
        config, rest = Path(rest[0]), rest[1:]
    for i, arg in enumerate(rest):
        if "=" in arg:
            continue
        if i == 0 or Path(arg).exists() or "/" in arg:
            raise ValueError(f"{arg!r} is not a config file: the first argument is read as a "
                             f"config only when it ends in .yaml or .yml (rename it, e.g. "
                             f"{Path(arg).stem}.yaml), and every other argument must be an "
                             f"override section.key=value")
        raise ValueError(f"argument {arg!r} is not an override section.key=value; write e.g. "
                         f"optimizer.lr=1e-3 (a config file must come first and end in .yaml)")
    return Args(config, rest, help="-h" in flags or "--help" in flags,
                print_config="--print-config" in flags)


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of dataclass ``cls``: field name -> the string literal under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def config_help(width: int = 100) -> str:
    """Every config key as ``section.key = default`` and its docstring, section by section."""
    lines = []
    section_docs = field_docs(config_module.Config)
    for name, cls in config_module._sections().items():
        lines.append(f"{name}: {section_docs.get(name, '')}")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = yaml.safe_dump(_default(f), default_flow_style=True).strip()
            default = default.removesuffix("\n...").removesuffix(" ...").strip()
            lines.append(f"  {name}.{f.name} = {default}")
            text = " ".join(docs.get(f.name, "").split())
            lines.extend(textwrap.wrap(text, width, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6))
        lines.append("")
    return "\n".join(lines)


def resolved_yaml(cfg: config_module.Config) -> str:
    """``cfg`` as the YAML that ``save_config`` writes to the run folder."""
    return yaml.safe_dump(config_module.to_dict(cfg), sort_keys=False)
