"""Configuration knobs declared once: each field of a config dataclass carries its flag, its
environment variable, its default, its bounds and its help (``knob(...)``), and a config holds
sub-configs (``section(...)``). Everything else is read from that declaration:

- ``check(config)`` validates a config from its declared bounds (its ``__post_init__`` calls it;
  cross-field rules stay explicit checks of the config's own);
- ``build(cls, flat)`` builds a config tree from flat names (``block_size=8``: the serve flags in
  snake_case, as ``LLM(**kwargs)`` and the parsed command line give them);
- ``add_flags(parser, cls)`` declares every knob of a tree on an argparse parser, with its
  ``QUIRE_<FLAG>`` variable as the default (``server.cli``);
- ``walk(cls)`` lists the knobs of a tree, for the generated reference (docs/configuration.md) and
  the test that the operator's CRD agrees with the engine.

A knob's public ``name`` is its field name unless declared otherwise; the flag is ``--`` + the
name with dashes, the variable ``QUIRE_`` + the name in capitals. Pure Python (argparse only).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

ENV_PREFIX = "QUIRE_"
_KNOB = "quire.knob"
_SECTION = "quire.section"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)

_C = TypeVar("_C")


def parse_bytes(text: str) -> int:
    """``1073741824``, ``4G`` (10^9) or ``4GiB`` (2^30) -> bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 2147483648, 2G, 2GiB)")
    number, unit, binary = match.groups()
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``QUIRE_MAX_NUM_SEQS``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class _Same(enum.Enum):
    SAME = "same"  # a flag's default that is the field's


class Kind(enum.Enum):
    """What a knob's value is, read from the field's annotation."""

    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    STR = "str"
    ENUM = "enum"
    NAMES = "names"  # tuple[str, ...]: one or more values (nargs="+")


@dataclass(frozen=True, slots=True)
class Knob:
    """The declaration of one field (``dataclasses.field`` metadata). Bounds: ``min`` (>=),
    ``above`` (>), ``max`` (<=), ``power_of_two``; ``choices`` for a string (an enum field's
    choices are its values). ``flag=False``: derived at start-up, not settable from outside;
    ``flag_default``: the flag's default where it differs from the field's (a value the caller
    resolves, e.g. --served-model-name defaults to --model); ``parse``: the flag's text ->
    value (e.g. ``parse_bytes``); ``unit``: named in bound messages and the reference."""

    default: Any
    help: str
    name: str | None = None  # public name (flag, variable, flat keyword); None: the field's
    min: float | None = None
    above: float | None = None
    max: float | None = None
    power_of_two: bool = False
    choices: tuple[str, ...] | None = None
    flag: bool = True
    flag_default: Any = _Same.SAME
    parse: Callable[[str], Any] | None = None
    unit: str = ""
    metavar: str | None = None


def knob(default: Any, help: str, **declared: Any) -> Any:
    """A config field declared once (see ``Knob``); its default is ``default``."""
    spec = Knob(default, help, **declared)
    return dataclasses.field(default=default, metadata={_KNOB: spec})


def section(cls: type[Any]) -> Any:
    """A sub-config field: the tree goes on in ``cls`` (default: ``cls()``)."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: cls})


class Entry(NamedTuple):
    """One knob of a tree, found by ``walk``."""

    name: str  # public name: block_size
    path: tuple[str, ...]  # attribute path from the root: ("cache", "block_size")
    owner: type[Any]  # the config class declaring it
    field: str  # its attribute in ``owner``
    kind: Kind
    enum: type[enum.Enum] | None
    optional: bool  # None is allowed: the annotation says ``| None``
    knob: Knob

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.flag)

    @property
    def choices(self) -> tuple[str, ...] | None:
        if self.enum is not None:
            return tuple(str(m.value) for m in self.enum)
        return self.knob.choices

    @property
    def flag_default(self) -> Any:
        value = self.knob.flag_default
        if value is _Same.SAME:
            value = self.knob.default
        return value.value if isinstance(value, enum.Enum) else value

    def bounds_text(self) -> str:
        """``power of two, 1..256``, ``(0, 1]``, ``>= 0 GiB``: the declared bounds, as the
        messages and the reference write them."""
        k, unit = self.knob, f" {self.knob.unit}" if self.knob.unit else ""
        if k.power_of_two:
            return f"a power of two in {_num(k.min if k.min is not None else 1)}..{_num(k.max)}"
        if k.max is not None and k.above is not None:
            return f"in ({_num(k.above)}, {_num(k.max)}]{unit}"
        if k.max is not None and k.min is not None:
            return f"in {_num(k.min)}..{_num(k.max)}{unit}"
        if k.max is not None:
            return f"<= {_num(k.max)}{unit}"
        if k.min is not None:
            return f">= {_num(k.min)}{unit}"
        if k.above is not None:
            return f"> {_num(k.above)}{unit}"
        return ""


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- reading the declaration --------------------------------------------------------------


_ENTRIES: dict[type[Any], tuple[Entry, ...]] = {}  # by class, read once (annotations resolved)


def entries(cls: type[Any]) -> tuple[Entry, ...]:
    """The knobs declared directly in ``cls`` (not its sections), in field order."""
    found = _ENTRIES.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get(_KNOB)
            if spec is not None:
                kind, enum_type, optional = _kind(hints[f.name])
                name = spec.name or f.name
                out.append(Entry(name, (f.name,), cls, f.name, kind, enum_type, optional, spec))
        found = _ENTRIES[cls] = tuple(out)
    return found


def _kind(annotation: Any) -> tuple[Kind, type[enum.Enum] | None, bool]:
    """(kind, enum type, None allowed) of ``T`` or ``T | None``."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = typing.get_args(annotation)
        optional = type(None) in args
        (annotation,) = [a for a in args if a is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return Kind.NAMES, None, optional
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return Kind.ENUM, annotation, optional
    by_type = {bool: Kind.BOOL, int: Kind.INT, float: Kind.FLOAT, str: Kind.STR}
    return by_type[annotation], None, optional


def sections(cls: type[Any]) -> Iterator[tuple[str, type[Any]]]:
    for f in dataclasses.fields(cls):
        sub = f.metadata.get(_SECTION)
        if sub is not None:
            yield f.name, sub


def walk(cls: type[Any], path: tuple[str, ...] = ()) -> Iterator[Entry]:
    """Every knob of the tree rooted at ``cls``, depth first in field order, with its path."""
    sub_of = dict(sections(cls))
    own = {e.field: e for e in entries(cls)}
    for f in dataclasses.fields(cls):
        if f.name in own:
            yield own[f.name]._replace(path=(*path, f.name))
        elif f.name in sub_of:
            yield from walk(sub_of[f.name], (*path, f.name))


def flags(cls: type[Any]) -> dict[str, Entry]:
    """The settable knobs of a tree by public name (``flag=False`` ones are derived)."""
    return {e.name: e for e in walk(cls) if e.knob.flag}


# ---- validation ---------------------------------------------------------------------------


def check(config: Any) -> None:
    """Validate (and normalise: an enum's string form, a list of names) every knob of
    ``config``'s own fields against its declaration; ``ValueError`` naming the knob and the
    limit. Called by each config's ``__post_init__`` (sections check themselves)."""
    for entry in entries(type(config)):
        value = getattr(config, entry.field)
        normal = _checked(entry, value)
        if normal is not value:
            object.__setattr__(config, entry.field, normal)


def _checked(entry: Entry, value: Any) -> Any:
    name, k = entry.name, entry.knob
    if value is None:
        if entry.optional:
            return None
        raise ValueError(f"{name} must be given; got None")
    kind = entry.kind
    if kind is Kind.ENUM:
        assert entry.enum is not None
        if isinstance(value, entry.enum):
            return value
        try:
            return entry.enum(value)
        except ValueError:
            choices = ", ".join(entry.choices or ())
            raise ValueError(f"{name} must be one of {choices}; got {value!r}") from None
    if kind is Kind.NAMES:
        if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{name} must be one or more non-empty names; got {value!r}")
        if not value:
            raise ValueError(f"{name} must name at least one; got {value!r}")
        return value if isinstance(value, tuple) else tuple(value)
    if kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {value!r}")
        return value
    if kind is Kind.STR:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string; got {value!r}")
        if k.choices is not None and value not in k.choices:
            raise ValueError(f"{name} must be one of {', '.join(k.choices)}; got {value!r}")
        return value
    # bool is an int subclass; `block_size=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        noun = "an integer" if kind is Kind.INT else "a number"
        raise ValueError(f"{name} must be {noun}; got {value!r}")
    if kind is Kind.INT and not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if not _in_bounds(k, value):
        raise ValueError(f"{name} must be {entry.bounds_text()}; got {value}")
    return value


def _in_bounds(k: Knob, value: float) -> bool:
    # Negated comparisons, so that NaN is out of every bound.
    low = k.min if k.min is not None else (1 if k.power_of_two else None)
    if low is not None and not value >= low:
        return False
    if k.above is not None and not value > k.above:
        return False
    if k.max is not None and not value <= k.max:
        return False
    return not k.power_of_two or (int(value) > 0 and int(value) & (int(value) - 1) == 0)


def resolved(value: int | None, name: str) -> int:
    """A derived limit the start-up resolved (``plan_cache``); ``ValueError`` if it did not,
    for a part built from a config that leaves it to be derived."""
    if value is None:
        raise ValueError(f"{name} is derived at start-up: give it to build this part on its own")
    return value


# ---- building a tree from flat names ------------------------------------------------------


def build(cls: type[_C], flat: Mapping[str, Any], *, what: str = "engine arguments") -> _C:
    """``cls`` with the knobs named in ``flat`` set (the others at their defaults);
    ``ValueError`` naming every unknown or derived (``flag=False``) name."""
    known = flags(cls)
    unknown = sorted(set(flat) - set(known))
    if unknown:
        raise ValueError(f"unknown {what}: {', '.join(unknown)}")
    return _build(cls, flat)


def _build(cls: type[_C], flat: Mapping[str, Any]) -> _C:
    kwargs: dict[str, Any] = {}
    for entry in entries(cls):
        if entry.knob.flag and entry.name in flat:
            kwargs[entry.field] = flat[entry.name]
    for name, sub in sections(cls):
        kwargs[name] = _build(sub, flat)
    return cls(**kwargs)


# ---- the command line ---------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """One flag per settable knob of the tree; a set ``QUIRE_<FLAG>`` variable is the flag's
    default (a bad one is a usage error naming it). ``dest`` is the knob's public name."""
    for entry in walk(cls):
        if entry.knob.flag:
            _add_flag(parser, entry)


def _add_flag(parser: argparse.ArgumentParser, entry: Entry) -> None:
    k = entry.knob
    kwargs: dict[str, Any] = {"default": entry.flag_default, "dest": entry.name}
    if entry.kind is Kind.BOOL:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif entry.kind is Kind.NAMES:
        kwargs["nargs"] = "+"
    elif entry.kind is Kind.INT:
        kwargs["type"] = k.parse or int
    elif entry.kind is Kind.FLOAT:
        kwargs["type"] = k.parse or float
    elif k.parse is not None:
        kwargs["type"] = k.parse
    if entry.choices is not None:
        kwargs["choices"] = list(entry.choices)
    if k.metavar is not None:
        kwargs["metavar"] = k.metavar
    kwargs["help"] = f"{k.help} [env {entry.env}]"
    raw = os.environ.get(entry.env)
    if raw is not None:
        kwargs["default"] = _from_env(parser, entry.env, raw, kwargs)
    parser.add_argument(entry.flag, **kwargs)


def _from_env(parser: argparse.ArgumentParser, name: str, raw: str, kwargs: dict[str, Any]) -> Any:
    try:
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            if raw.strip().lower() not in _TRUE | _FALSE:
                raise ValueError("expected true or false")
            return raw.strip().lower() in _TRUE
        if kwargs.get("nargs") == "+":
            return [part for part in re.split(r"[,\s]+", raw) if part]
        convert: Callable[[str], Any] = kwargs.get("type", str)
        value = convert(raw)
    except ValueError as exc:
        parser.error(f"{name}={raw!r}: {exc}")
    if "choices" in kwargs and value not in kwargs["choices"]:
        parser.error(f"{name}={raw!r}: choose from {', '.join(kwargs['choices'])}")
    return value
