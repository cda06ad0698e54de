"""Generate argparse flags from config dataclasses, and build the dataclasses back.

One generic mapping, used for every ``--qrl-*`` flag (docs/DESIGN.md: "flags are generated from
them (``add_qrl_args``, usable as Megatron's ``extra_args_provider``)"):

* flag name: ``--qrl-<prefix>-<field-with-dashes>`` (``--qrl-<field>`` when the prefix is
  empty), or the name declared in the field's metadata (``{"flag": "--qrl-..."}``, or
  megatron-core's ``{"argparse_meta": {"arg_names": [...]}}``);
* type from the annotation: ``int``/``float``/``str``, ``Optional[X]`` / ``X | None`` (the
  value ``none`` sets None; a ``float`` flag refuses ``nan`` / ``inf`` naming the flag), ``bool`` as ``--qrl-x`` / ``--no-qrl-x``, ``Literal[...]`` as
  choices, ``tuple[str, ...]`` as zero or more values; choices also from the metadata key
  ``choices`` (a sequence, or a callable returning one, evaluated when the flag is made);
* help: the docstring string literal placed under the field (read once with ``ast``);
* default: the field's default (a group may override defaults / choices of a foreign
  dataclass it cannot annotate, see :class:`ConfigGroup`);
* a flag given without a value: the metadata ``{"const": value}`` (``--qrl-x`` alone sets
  ``value``, ``--qrl-x v`` sets ``v``, absent leaves the default); the metavar shown in the
  help: ``{"metavar": "..."}``;
* "may change on resume": the metadata ``{"on_resume": "may change"}``
  (:attr:`FlagSpec.may_change_on_resume`; ``rl.checkpoint`` compares every other flag);
* a field whose type is itself a dataclass (e.g. ``RolloutConfig.sglang``) gives that
  dataclass's flags under ``--qrl-<prefix>-<field>-`` (its :class:`FlagSpec` ``field`` is
  dotted, ``sglang.sync``); the group builds it whole from them.

Every generated argument records on the namespace that the user set it (``explicit_dests``),
which is how presets apply BEFORE user flags (user flags win) whatever the argv order.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

__all__ = [
    "EXPLICIT_ATTR",
    "ConfigGroup",
    "FlagSpec",
    "add_group_args",
    "explicit_dests",
    "field_docstrings",
    "finite_float",
    "flag_specs",
]

EXPLICIT_ATTR = "_qrl_explicit_dests"
"""Namespace attribute: the set of dests the command line set explicitly."""

NONE_WORD = "none"
"""Value that sets an ``Optional`` field to None on the command line."""


@dataclass(frozen=True)
class ConfigGroup:
    """One config dataclass exposed as flags under ``--qrl-<prefix>-``."""

    key: str
    """Key of the built instance in ``qrl_configs_from_args(args)``."""
    cls: type
    """The dataclass (ours or a foreign one such as ``PolicyLossConfig``)."""
    prefix: str = ""
    """Flag prefix after ``--qrl-`` (dashes); empty gives ``--qrl-<field>``."""
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-field ``{"default": ..., "choices": ..., "flag": ..., "help": ...}`` for foreign
    dataclasses whose fields we cannot annotate (e.g. ``kind`` has no default upstream)."""


@dataclass(frozen=True)
class FlagSpec:
    """The argparse view of one dataclass field."""

    group: str
    field: str
    flag: str
    dest: str
    kind: str
    """``scalar`` | ``bool`` | ``list``."""
    type: Callable[[str], Any] | None
    optional: bool
    choices: tuple[Any, ...] | None
    default: Any
    help: str
    may_change_on_resume: bool = False
    """The field's metadata ``{"on_resume": "may change"}``: a resumed run may set it to
    another value (run length, saving, how the same weights reach the engine, waits)."""
    const: Any = None
    """The value of the flag given alone (metadata ``{"const": value}``); None: the flag
    needs a value."""
    metavar: str | None = None
    """The value's name in the help (metadata ``{"metavar": ...}``); None: argparse's."""


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literals placed under each field of ``cls``
    (and its dataclass bases), parsed with ``ast`` (callers parse once per call, no cache)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
                if isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unions other than Optional[X] are not supported as flags: {tp!r}")
    return tp, False


def finite_float(text: str) -> float:
    """``float(text)``, refusing NaN and +-inf (argparse then names the flag: ``argument
    --qrl-x: nan is not a finite number``); every generated ``float`` flag parses with it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


finite_float.__name__ = "float"


def _optional_parser(base: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() == NONE_WORD else base(text)

    parse.__name__ = getattr(base, "__name__", "value")  # argparse error text uses it
    return parse


def _scalar_type(tp: Any, where: str) -> tuple[Callable[[str], Any], tuple[Any, ...] | None]:
    if typing.get_origin(tp) is typing.Literal:
        values = typing.get_args(tp)
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or kinds.pop() not in (str, int, float):
            raise TypeError(f"{where}: Literal values must all be str, int or float: {values}")
        return type(values[0]), tuple(values)
    if tp is float:
        return finite_float, None
    if tp in (int, str):
        return tp, None
    raise TypeError(f"{where}: annotation {tp!r} cannot become a flag (use int, float, str, "
                    "bool, Literal[...], Optional[...] or tuple[str, ...])")


def _meta(f: dataclasses.Field, group: ConfigGroup) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    mcore = f.metadata.get("argparse_meta", {})  # megatron-core's convention
    if "arg_names" in mcore:
        meta["flag"] = mcore["arg_names"][0]
    for key in ("choices", "help", "default"):
        if key in mcore:
            meta[key] = mcore[key]
    meta.update({k: v for k, v in f.metadata.items() if k != "argparse_meta"})
    meta.update(group.overrides.get(f.name, {}))
    return meta


def _default(f: dataclasses.Field, meta: Mapping[str, Any]) -> Any:
    if "default" in meta:
        return meta["default"]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None  # required field: the group builder names the flag if it stays unset


def flag_specs(group: ConfigGroup) -> list[FlagSpec]:
    """The flags of every init field of ``group.cls`` (see the module docstring)."""
    if not dataclasses.is_dataclass(group.cls):
        raise TypeError(f"config group {group.key!r}: {group.cls!r} is not a dataclass")
    hints = typing.get_type_hints(group.cls, include_extras=False)
    docs = field_docstrings(group.cls)
    unknown = set(group.overrides) - {f.name for f in dataclasses.fields(group.cls)}
    if unknown:
        raise TypeError(f"config group {group.key!r}: overrides name unknown fields {unknown}")
    specs = []
    for f in dataclasses.fields(group.cls):
        if not f.init:
            continue
        where = f"{group.cls.__name__}.{f.name}"
        meta = _meta(f, group)
        stem = f.name.replace("_", "-")
        if dataclasses.is_dataclass(hints[f.name]):  # one dataclass: its flags, nested
            sub = ConfigGroup(group.key, hints[f.name], f"{group.prefix}-{stem}".strip("-"))
            specs += [dataclasses.replace(s, field=f"{f.name}.{s.field}") for s in flag_specs(sub)]
            continue
        flag = meta.get("flag") or (f"--qrl-{group.prefix}-{stem}" if group.prefix else f"--qrl-{stem}")
        if not flag.startswith("--qrl-"):
            raise TypeError(f"{where}: flag {flag!r} must start with --qrl-")
        tp, optional = _unwrap_optional(hints[f.name])
        choices = meta.get("choices")
        choices = tuple(choices() if callable(choices) else choices) if choices else None
        if tp is bool:
            kind, parse = "bool", None
        elif typing.get_origin(tp) in (tuple, list):
            args = typing.get_args(tp)
            if args not in ((str, Ellipsis), (str,)):
                raise TypeError(f"{where}: only tuple[str, ...] / list[str] sequences are flags")
            kind, parse = "list", str
        else:
            kind = "scalar"
            parse, lit = _scalar_type(tp, where)
            choices = choices or lit
            if optional:
                parse = _optional_parser(parse)
        help_text = meta.get("help") or docs.get(f.name)
        if not help_text:
            raise TypeError(f"{where}: no docstring under the field (it is the flag's help)")
        dest = flag[2:].replace("-", "_")
        specs.append(FlagSpec(group.key, f.name, flag, dest, kind, parse, optional, choices,
                              _default(f, meta), help_text,
                              meta.get("on_resume") == "may change", meta.get("const"),
                              meta.get("metavar")))
    return specs


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    seen = set(getattr(namespace, EXPLICIT_ATTR, ()))
    seen.add(dest)
    setattr(namespace, EXPLICIT_ATTR, seen)


class _Store(argparse.Action):
    """``store`` that records the dest as explicitly set."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list):
            values = tuple(values)
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _Bool(argparse.BooleanOptionalAction):
    """``--qrl-x`` / ``--no-qrl-x`` that records the dest as explicitly set."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


def explicit_dests(args: argparse.Namespace) -> set[str]:
    """Dests the command line set (empty for a namespace built by hand)."""
    return set(getattr(args, EXPLICIT_ATTR, ()))


def _help(spec: FlagSpec) -> str:
    text = spec.help.replace("%", "%%")
    if spec.kind == "bool":
        return text  # BooleanOptionalAction appends the default itself
    shown = NONE_WORD if spec.default is None else spec.default
    return f"{text} (default: {shown})"


def add_group_args(parser_or_group: Any, group: ConfigGroup) -> list[FlagSpec]:
    """Add the flags of ``group`` to an argparse parser or argument group."""
    specs = flag_specs(group)
    for s in specs:
        kw: dict[str, Any] = {"dest": s.dest, "default": s.default, "help": _help(s)}
        if s.kind == "bool":
            parser_or_group.add_argument(s.flag, action=_Bool, **kw)
            continue
        kw.update(action=_Store, type=s.type)
        if s.kind == "list":
            kw.update(nargs="*", metavar="STR")
        if s.const is not None:
            kw.update(nargs="?", const=s.const)
        if s.choices is not None:
            kw["choices"] = list(s.choices) + ([None] if s.optional else [])
            kw["metavar"] = "{" + ",".join(map(str, s.choices)) + "}"
        if s.metavar is not None:
            kw["metavar"] = s.metavar
        parser_or_group.add_argument(s.flag, **kw)
    return specs


def specs_by_flag(groups: Sequence[ConfigGroup]) -> dict[str, FlagSpec]:
    """``{flag: FlagSpec}`` over ``groups``; a flag declared twice is an error."""
    keys = [g.key for g in groups]
    if len(set(keys)) != len(keys):
        raise TypeError(f"config group keys must be unique, got {keys}")
    out: dict[str, FlagSpec] = {}
    for g in groups:
        for s in flag_specs(g):
            if s.flag in out:
                raise TypeError(f"flag {s.flag} is generated by both {out[s.flag].group!r} and {g.key!r}")
            out[s.flag] = s
    return out
