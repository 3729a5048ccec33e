"""The command line of ``launch/pretrain.py``: arguments, ``--help`` and ``--print-config``.

    pretrain.py [CONFIG.yaml] [section.key=value ...] [--print-config]

``--help`` lists every config key with its default and its docstring. The docstrings are the
string literals under each field of the dataclasses in ``mpcore/config.py`` and, for the model
section's family keys, of the config dataclasses under ``models/`` they are derived from
(``mpcore.models.common.section.field_docs``). ``--print-config`` prints the resolved config as YAML
and trains nothing.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpcore import config as config_module
from mpcore.models.common.section import field_docs

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


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _key_lines(cls: type, prefix: str, indent: int, width: int, only=None, tag="") -> list[str]:
    """``prefix.key = default`` and the docstring of each field of ``cls`` (those named in
    ``only``, when given), a nested section's keys below it, ``tag`` before each docstring."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        default = yaml.safe_dump(_default(f), default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix(" ...").strip()
        lines.append(f"{' ' * indent}{prefix}{f.name} = {default}")
        text = " ".join((tag + docs.get(f.name, "")).split())
        pad = " " * (indent + 4)
        lines.extend(textwrap.wrap(text, width, initial_indent=pad, subsequent_indent=pad))
        nested = config_module._nested(hints[f.name])
        if nested is not None:
            lines += _key_lines(nested, f"{prefix}{f.name}.", indent + 2, width)
    return lines


def _model_lines(width: int) -> list[str]:
    """The model section's keys: those every family takes, then each family's own (a nested
    section shared by several families listed once, naming them)."""
    types_ = {name: config_module.model_section(name) for name in config_module.FAMILIES}
    names = [{f.name for f in dataclasses.fields(t)} for t in types_.values()]
    common = set.intersection(*names)
    lines = _key_lines(types_["llama"], "model.", 2, width, only=common)
    seen: dict[tuple, list[str]] = {}
    for family, t in types_.items():
        hints = typing.get_type_hints(t)
        for f in dataclasses.fields(t):
            if f.name not in common:
                seen.setdefault((f.name, hints[f.name]), []).append(family)
    for (name, _), families in seen.items():
        t = types_[families[0]]
        lines += _key_lines(t, "model.", 2, width, only={name},
                            tag=f"(family {', '.join(families)}) ")
    return lines


def config_help(width: int = 100) -> str:
    """Every config key as ``section.key = default`` and its docstring, section by section."""
    lines = []
    section_docs = field_docs(config_module.Config)
    for name, cls in config_module._sections().items():
        lines.append(f"{name}: {section_docs.get(name, '')}")
        lines += (_model_lines(width) if name == "model"
                  else _key_lines(cls, f"{name}.", 2, width))
        lines.append("")
    return "\n".join(lines)


def resolved_yaml(cfg: config_module.Config) -> str:
    """``cfg`` as the YAML that ``save_config`` writes to the run folder."""
    return yaml.safe_dump(config_module.to_dict(cfg), sort_keys=False)
