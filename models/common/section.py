"""Our YAML ``model`` section, derived from the config dataclasses the families build.

A family's YAML keys are defined once, by the frozen config dataclass it builds from them:
:func:`section_of` derives from that dataclass a frozen dataclass with the same field names,
types (tuples become lists, as YAML writes them) and docstrings, each field defaulting to
``defaults[name]``, else the config's own default, else ``None`` (not given: the family fills it
in, or its config refuses the gap when it is built). No section mirrors a config field by field.

    DecoderSection   the shared decoder's keys: ``ModelConfig``'s fields, defaulting to ``TINY``
    VLSection        DecoderSection + ``vision``, which each vision-language family types with
                     its tower's section (e.g. ``section_of(VisionConfig, ...)``)
    a family         its record's ``section`` (``mpcore.models.common.family.Family``): DecoderSection
                     or a subclass adding nested sections (``moe``: ``Qwen3MoeConfig``'s own
                     fields), each derived the same way from the family's dataclass

mpcore's ``model`` section is the family's section plus the run-level keys (``init_from``,
``family``, the kernel choices), which are no part of a model's shape.

:func:`field_docs` gives the attribute docstrings (the string literal under each field) of a
written dataclass, read from its source, and of a derived one, carried in its fields'
metadata. ``--help`` lists them: the docstrings are the reference documentation of every key.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
import typing
from dataclasses import dataclass

from mpcore.models.common.config import ModelConfig

TINY = dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
            intermediate_size=384, rms_norm_eps=1e-5, tie_embeddings=True)
"""The YAML's decoder defaults where they differ from ``ModelConfig``'s: a tiny model that
trains on a CPU (``launch/configs/tiny.yaml`` spells it out)."""

_DERIVED = "__section_of__"  # the config class a derived section was made from


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of dataclass ``cls``: field name -> its docstring (a subclass's
    own docstring wins over its base's)."""
    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}
    for klass in reversed(cls.__mro__):
        if (not dataclasses.is_dataclass(klass) or _DERIVED in vars(klass)
                or not vars(klass).get("__annotations__")):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _optional(tp) -> bool:
    origin = typing.get_origin(tp)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _yaml_type(tp):
    """``tp`` as the section holds it: ``tuple[X, ...]`` -> ``list[X]`` (inside an Optional too)."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return list[typing.get_args(tp)[0]]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_yaml_type(a) for a in typing.get_args(tp)])
    return tp


def section_of(cls: type, name: str, *, defaults: dict | None = None, skip: type | None = None,
               bases: tuple[type, ...] = (), module: str | None = None) -> type:
    """A frozen dataclass ``name`` of the YAML keys of config dataclass ``cls`` (module
    docstring): its fields but those of dataclass ``skip``, same docstrings, ``defaults``
    overriding ``cls``'s defaults, ``None`` where neither gives one. Bind it under ``name``
    at the top of ``module`` (default: ``cls``'s module), where pickle looks for it."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    skipped = {f.name for f in dataclasses.fields(skip)} if skip is not None else set()
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in skipped:
            continue
        tp = _yaml_type(hints[f.name])
        if f.name in defaults:
            default = defaults[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if default is None and not _optional(tp):
            tp = tp | None
        if isinstance(default, tuple):
            default = list(default)
        meta = {"doc": docs.get(f.name, "")}
        if isinstance(default, (list, dict)):
            spec = dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d),
                                     metadata=meta)
        else:
            spec = dataclasses.field(default=default, metadata=meta)
        fields.append((f.name, tp, spec))
    out = dataclasses.make_dataclass(name, fields, bases=bases, frozen=True,
                                     namespace={_DERIVED: cls, "__module__": module or cls.__module__})
    out.__qualname__ = name
    out.__doc__ = f"The YAML keys of ``{cls.__name__}`` (``mpcore.models.common.section``)."
    return out


def given(section) -> dict:
    """The keyword arguments a nested section gives its config: every field but the ``None``
    ones (not given); ``{}`` for ``None`` (no section)."""
    if section is None:
        return {}
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if getattr(section, f.name) is not None}


def _post_init_next(obj, klass: type) -> None:
    """Call the next ``__post_init__`` after ``klass``'s in ``obj``'s MRO (mpcore's run-level
    keys check themselves there), if any."""
    nxt = getattr(super(klass, obj), "__post_init__", None)
    if nxt is not None:
        nxt()


class _DecoderChecks:
    """What a YAML decoder section checks on load (``ModelConfig`` checks the rest when the
    family builds it), and its shape fields."""

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "head_dim", "max_position_embeddings"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"model.{key} must be >= 1, got {value!r}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("model.rope_theta and model.rms_norm_eps must be > 0")
        _post_init_next(self, _DecoderChecks)

    def shape_fields(self) -> dict:
        """The keyword arguments of ``ModelConfig``: this section's decoder keys."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DecoderSection)}


DecoderSection = section_of(ModelConfig, "DecoderSection", defaults=TINY,
                            bases=(_DecoderChecks,), module=__name__)


@dataclass(frozen=True)
class VLSection(DecoderSection):
    """DecoderSection + a vision tower; each vision-language family's subclass types
    ``vision`` with its tower's section."""

    vision: object | None = None
    """The vision tower's keys (typed by the family), or null."""

    def __post_init__(self):
        # model.init_from (a run-level key beside these) brings its own decoder and tower.
        if (self.vision is not None and self.mrope_section is None
                and not getattr(self, "init_from", None)):
            raise ValueError("model.vision is set but model.mrope_section is not; a VL decoder "
                             "uses M-RoPE (e.g. mrope_section: [2, 3, 3] for head_dim 16)")
        super().__post_init__()
