"""The task framework's values on the wire (docs/design/tasks.md): one documented encoder, and
decoders driven by a function's type hints.

:func:`encode` turns a Python value into plain JSON values (:func:`dumps`: its compact JSON text)
by one table, the same whether pydantic is installed or not:

=====================  ==============================================================
Python                 JSON
=====================  ==============================================================
``datetime``           ISO 8601 string (``isoformat()``, the offset kept if aware)
``date``, ``time``     ISO 8601 string
``timedelta``          ISO 8601 duration (``P1DT2H3M4.5S``, as pydantic writes it)
``UUID``               string (canonical, lowercase)
``Decimal``            string (exact)
``Enum``               its value, encoded
``bytes``              base64 string (standard alphabet, padded)
dataclass              object of its fields, encoded
pydantic model         ``model_dump(mode="json")``
tuple, list, set       array
dict with str keys     object
=====================  ==============================================================

Anything else (an object of another class, a dict with a key that is not a string, NaN or an
infinity) raises :class:`EncodeError` (a ``TypeError``) saying where in the value it is.

:func:`decoder` compiles a type hint into a :class:`Decoder`, which turns a JSON value back into
what the hint says (``decoder(datetime).decode("2026-12-06T10:00:00+00:00")`` is a datetime) and
checks it: with pydantic's ``TypeAdapter`` when pydantic is installed (:data:`PYDANTIC`, which a
test may set to False), else with the standard types: int, float, str, bool, None,
Optional/Union, Literal, list/tuple/set/frozenset/dict of those, Enum, dataclasses and the
table's types. A hint it cannot check is taken as it is. A value that does not fit raises
:class:`DecodeError` (a ``TypeError``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import importlib.util
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, Final
from uuid import UUID

#: Whether decoders check values with pydantic (True when it is installed). Read when a decoder
#: is made: a test sets it to False (before the tasks are defined) to run the standard path.
PYDANTIC: bool = importlib.util.find_spec("pydantic") is not None

_SCALARS: Final = (str, int, bool, type(None))


class EncodeError(TypeError):
    """A value the encoder cannot write: ``problem``, at ``path`` in the value (``[0].when``)."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.path = path

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


class DecodeError(TypeError):
    """A JSON value that does not fit a hint: ``problem``, at ``path`` in the value."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.path = path

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


# -- encoding -------------------------------------------------------------------------------------


def dumps(value: Any) -> bytes:
    """``value``, encoded (:func:`encode`), as compact JSON text (UTF-8)."""
    return json.dumps(encode(value), separators=(",", ":"), allow_nan=False).encode()


def encode(value: Any) -> Any:
    """``value`` as plain JSON values (dict, list, str, int, float, bool, None), by the table
    above. Raises EncodeError for what it cannot encode."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        raise EncodeError(f"{value!r} is not allowed (JSON has no NaN or infinity)")
    if kind is list or kind is tuple:
        return _sequence(value)
    if kind is dict:
        return _mapping(value)
    return _other(value)


def _sequence(items: Any) -> list[Any]:
    out = []
    for i, item in enumerate(items):
        try:
            out.append(encode(item))
        except EncodeError as e:
            e.path = f"[{i}]{e.path}"
            raise
    return out


def _key(key: Any) -> str:
    if type(key) is str:
        return key
    if isinstance(key, enum.Enum) and isinstance(key.value, str):
        return key.value
    if isinstance(key, str):
        return str(key)
    raise EncodeError(f"a dict key must be a string, got {type(key).__name__} {key!r}")


def _mapping(mapping: Any) -> dict[str, Any]:
    out = {}
    for key, item in mapping.items():
        name = _key(key)
        try:
            out[name] = encode(item)
        except EncodeError as e:
            e.path = f"[{name!r}]{e.path}"
            raise
    return out


def _fields(value: Any) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(value):
        try:
            out[field.name] = encode(getattr(value, field.name))
        except EncodeError as e:
            e.path = f".{field.name}{e.path}"
            raise
    return out


def _other(value: Any) -> Any:  # noqa: C901 (the table, one row a branch)
    """The table's rows past the plain JSON values."""
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return duration(value)
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise EncodeError(f"Decimal {value} is not allowed (only finite numbers)")
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, bool | str | int | float):  # (subclasses of the plain ones)
        return encode(_plain(value))
    if isinstance(value, list | tuple | set | frozenset):
        return _sequence(value)
    if isinstance(value, dict):
        return _mapping(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields(value)
    if _is_model(value):
        return encode(value.model_dump(mode="json"))
    raise EncodeError(
        f"a value of type {_type_name(value)} cannot be encoded (see wqclient.codec's table)"
    )


def _plain(value: bool | str | int | float) -> Any:
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    return value  # pragma: no cover (one of them always matches)


def _is_model(value: Any) -> bool:
    pydantic = sys.modules.get("pydantic")  # (a model exists only if pydantic was imported)
    return pydantic is not None and isinstance(value, pydantic.BaseModel)


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def duration(value: timedelta) -> str:
    """A timedelta as an ISO 8601 duration, as pydantic writes it: ``P1DT2H3M4.5S``, ``PT0S``,
    ``-PT1S`` (the sign before it), a year for each 365 days (``P1Y35D``)."""
    sign = "-" if value < timedelta(0) else ""
    value = abs(value)
    days, seconds, micros = value.days, value.seconds, value.microseconds
    text = sign + "P"
    if days:
        years, days = divmod(days, 365)
        text += (f"{years}Y" if years else "") + (f"{days}D" if days else "")
    if seconds or micros:
        hours, rest = divmod(seconds, 3600)
        minutes, secs = divmod(rest, 60)
        text += "T" + (f"{hours}H" if hours else "") + (f"{minutes}M" if minutes else "")
        if secs or micros:
            fraction = f".{micros:06d}".rstrip("0") if micros else ""
            text += f"{secs}{fraction}S"
    elif not days:
        text += "T0S"
    return text


_DURATION: Final = re.compile(
    r"(?P<sign>[-+])?P(?:(?P<Y>\d+(?:\.\d+)?)Y)?(?:(?P<mo>\d+(?:\.\d+)?)M)?(?:(?P<W>\d+(?:\.\d+)?)W)?"
    r"(?:(?P<D>\d+(?:\.\d+)?)D)?(?:T(?:(?P<H>\d+(?:\.\d+)?)H)?(?:(?P<mi>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<S>\d+(?:\.\d+)?)S)?)?"
)
_UNITS: Final = {
    "Y": timedelta(days=365),
    "mo": timedelta(days=30),
    "W": timedelta(weeks=1),
    "D": timedelta(days=1),
    "H": timedelta(hours=1),
    "mi": timedelta(minutes=1),
}


def parse_duration(text: str) -> timedelta:
    """An ISO 8601 duration (as :func:`duration` writes it, and as pydantic reads it: a year
    is 365 days, a month 30) as a timedelta. Raises ValueError for anything else."""
    match = _DURATION.fullmatch(text)
    if match is None or text.rstrip("T").endswith("P") or text.endswith("T"):
        raise ValueError(f"{text!r} is not an ISO 8601 duration (such as P1DT2H3M4.5S)")
    total = timedelta(0)
    for unit, span in _UNITS.items():
        if match[unit]:
            total += span * float(match[unit]) if "." in match[unit] else span * int(match[unit])
    if match["S"]:
        whole, _, fraction = match["S"].partition(".")
        total += timedelta(seconds=int(whole), microseconds=int((fraction + "000000")[:6]))
    return -total if match["sign"] == "-" else total


# -- decoding -------------------------------------------------------------------------------------

Convert = Callable[[Any], Any]


class Decoder:
    """A JSON value turned into what a hint says, and checked (see :func:`decoder`).
    ``identity``: the hint takes any value as it is (no hint, ``Any``, ``object``)."""

    __slots__ = ("convert", "hint", "identity", "kind")

    def __init__(self, hint: Any, convert: Convert | None, kind: type | None = None) -> None:
        self.hint = hint
        self.convert = convert
        self.identity = convert is None
        # A plain type (int, str, bool, float) a value of which is taken as it is (the fast path).
        self.kind = kind

    def __repr__(self) -> str:
        return f"Decoder({self.hint!r})"

    def decode(self, value: Any) -> Any:
        if self.convert is None or type(value) is self.kind:
            return value
        return self.convert(value)


def decoder(hint: Any, *, pydantic: bool | None = None) -> Decoder:
    """The decoder of a type hint: with pydantic if ``pydantic`` (default :data:`PYDANTIC`)
    and it can build one for the hint, else the standard types'."""
    use = PYDANTIC if pydantic is None else pydantic
    if _any(hint):
        return Decoder(hint, None)
    kind = hint if hint in (int, str, bool) else None
    if use:
        convert = _adapter(hint)
        if convert is not None:
            return Decoder(hint, convert, kind)
    return Decoder(hint, _standard(hint), kind)


def _any(hint: Any) -> bool:
    return hint is Any or hint is object or isinstance(hint, typing.TypeVar)


def _adapter(hint: Any) -> Convert | None:
    """A pydantic TypeAdapter's validation of a hint (bytes as base64), or None if pydantic
    cannot build one (the standard decoder then takes the hint)."""
    import pydantic

    config = pydantic.ConfigDict(val_json_bytes="base64", ser_json_bytes="base64")
    try:
        if isinstance(hint, type) and issubclass(hint, pydantic.BaseModel):
            return _validated(pydantic.TypeAdapter(hint).validate_python)
        try:
            adapter: Any = pydantic.TypeAdapter(hint, config=config)
        except pydantic.PydanticUserError:  # (a dataclass or TypedDict: wrapped, for the config)
            wrapped: Any = pydantic.TypeAdapter(list[hint], config=config)
            validate = wrapped.validate_python
            return _validated(lambda value: validate([value])[0], wrapped=True)
        return _validated(adapter.validate_python)
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError):
        return None


def _validated(validate: Convert, *, wrapped: bool = False) -> Convert:
    import pydantic

    def convert(value: Any) -> Any:
        try:
            return validate(value)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            loc = first["loc"][1:] if wrapped else first["loc"]
            path = "".join(f"[{part!r}]" if isinstance(part, str) else f"[{part}]" for part in loc)
            raise DecodeError(first["msg"], path) from None

    return convert


# The standard types' decoders.


def _standard(hint: Any) -> Convert | None:
    """A hint's decoder without pydantic (None: values are taken as they are)."""
    if _any(hint):
        return None
    if hint is None or hint is type(None):
        return _none
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _standard(typing.get_args(hint)[0])
    if origin is typing.Union or origin is types.UnionType:
        return _union(typing.get_args(hint))
    if origin is typing.Literal:
        return _literal(typing.get_args(hint))
    if origin is not None:
        return _generic(hint, origin, typing.get_args(hint))
    supertype = getattr(hint, "__supertype__", None)  # (a NewType)
    if supertype is not None:
        return _standard(supertype)
    if isinstance(hint, type):
        return _class(hint)
    return None


def _none(value: Any) -> None:
    if value is not None:
        raise DecodeError(f"expected null, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if type(value) in names:
        return names[type(value)]
    if type(value) in (int, float):
        return f"the number {value!r}"
    return "null" if value is None else f"a {type(value).__name__}"


def _union(members: tuple[Any, ...]) -> Convert | None:
    converts = [_standard(member) for member in members]
    if any(convert is None for convert in converts):
        return None
    checked = [c for c in converts if c is not None]
    names = " | ".join(getattr(m, "__name__", repr(m)) for m in members)

    def convert(value: Any) -> Any:
        for each in checked:
            try:
                return each(value)
            except DecodeError:
                continue
        raise DecodeError(f"expected {names}, got {_json_type(value)}")

    return convert


def _literal(choices: tuple[Any, ...]) -> Convert:
    def convert(value: Any) -> Any:
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return choice
            if isinstance(choice, enum.Enum) and choice.value == value:
                return choice
        raise DecodeError(f"expected one of {list(choices)!r}, got {value!r}")

    return convert


def _generic(hint: Any, origin: Any, args: tuple[Any, ...]) -> Convert | None:
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is ...):
        item = _standard(args[0]) if args else None
        return _array(origin, item)
    if origin is tuple:
        return _fixed(args)
    if origin is dict:
        value = _standard(args[1]) if len(args) == 2 else None
        return _object(value)
    if isinstance(origin, type) and origin in (type(None), type):
        return None
    return None  # (a generic it cannot check: taken as it is)


def _array(origin: type, item: Convert | None) -> Convert:
    def convert(value: Any) -> Any:
        if type(value) is not list:
            raise DecodeError(f"expected an array, got {_json_type(value)}")
        if item is None:
            return origin(value) if origin is not list else value
        out = []
        for i, each in enumerate(value):
            try:
                out.append(item(each))
            except DecodeError as e:
                e.path = f"[{i}]{e.path}"
                raise
        return out if origin is list else origin(out)

    return convert


def _fixed(args: tuple[Any, ...]) -> Convert:
    items = [_standard(a) for a in args] if args != ((),) else []

    def convert(value: Any) -> Any:
        if type(value) is not list:
            raise DecodeError(f"expected an array, got {_json_type(value)}")
        if len(value) != len(items):
            raise DecodeError(f"expected an array of {len(items)} items, got {len(value)}")
        out = []
        for i, (each, item) in enumerate(zip(value, items, strict=True)):
            try:
                out.append(each if item is None else item(each))
            except DecodeError as e:
                e.path = f"[{i}]{e.path}"
                raise
        return tuple(out)

    return convert


def _object(item: Convert | None) -> Convert:
    def convert(value: Any) -> Any:
        if type(value) is not dict:
            raise DecodeError(f"expected an object, got {_json_type(value)}")
        if item is None:
            return value
        out = {}
        for key, each in value.items():
            try:
                out[key] = item(each)
            except DecodeError as e:
                e.path = f"[{key!r}]{e.path}"
                raise
        return out

    return convert


def _class(hint: type) -> Convert | None:  # noqa: C901 (one branch a class of the table)
    if hint is bool:
        return _exact(bool, "a boolean")
    if hint is int:
        return _int
    if hint is float:
        return _float
    if hint is str:
        return _exact(str, "a string")
    if issubclass(hint, enum.Enum):
        return _enum(hint)
    parse = _PARSERS.get(hint)
    if parse is not None:
        return _from_text(hint, parse)
    if hint in (list, tuple, set, frozenset):
        return _array(hint, None)
    if hint is dict:
        return _object(None)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint)
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(hint, pydantic.BaseModel):
        model: Any = hint
        return _validated(model.model_validate)
    return None


def _exact(kind: type, name: str) -> Convert:
    def convert(value: Any) -> Any:
        if type(value) is not kind:
            raise DecodeError(f"expected {name}, got {_json_type(value)}")
        return value

    return convert


def _int(value: Any) -> int:
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    raise DecodeError(f"expected an integer, got {_json_type(value)}")


def _float(value: Any) -> float:
    if type(value) in (int, float):
        return float(value)
    raise DecodeError(f"expected a number, got {_json_type(value)}")


def _enum(hint: type[enum.Enum]) -> Convert:
    def convert(value: Any) -> Any:
        try:
            return hint(value)
        except ValueError:
            choices = [member.value for member in hint]
            raise DecodeError(
                f"expected one of {choices!r} ({hint.__name__}), got {value!r}"
            ) from None

    return convert


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(f"not base64: {e}") from None


_PARSERS: Final[dict[type, Callable[[str], Any]]] = {
    datetime: datetime.fromisoformat,
    date: date.fromisoformat,
    time: time.fromisoformat,
    timedelta: parse_duration,
    UUID: UUID,
    Decimal: Decimal,
    bytes: _b64,
}


def _from_text(hint: type, parse: Callable[[str], Any]) -> Convert:
    def convert(value: Any) -> Any:
        if type(value) is not str:
            raise DecodeError(f"expected {hint.__name__} as a string, got {_json_type(value)}")
        try:
            parsed = parse(value)
        except (ValueError, ArithmeticError) as e:
            raise DecodeError(f"{value!r} is not a {hint.__name__} ({e})") from None
        if hint is date and isinstance(parsed, datetime):
            raise DecodeError(f"{value!r} is not a date")
        if hint is Decimal and not parsed.is_finite():
            raise DecodeError(f"{value!r} is not a finite Decimal")
        return parsed

    return convert


def _dataclass(hint: type) -> Convert:
    fields = {f.name: f for f in dataclasses.fields(hint) if f.init}
    hints = typing.get_type_hints(hint)
    converts = {name: _standard(hints.get(name, Any)) for name in fields}
    required = {
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }

    def convert(value: Any) -> Any:
        if type(value) is not dict:
            raise DecodeError(f"expected an object ({hint.__name__}), got {_json_type(value)}")
        unknown = value.keys() - converts.keys()
        if unknown:
            raise DecodeError(f"{hint.__name__} has no field {sorted(unknown)[0]!r}")
        missing = required - value.keys()
        if missing:
            raise DecodeError(f"{hint.__name__}'s field {sorted(missing)[0]!r} is missing")
        kwargs = {}
        for name, each in value.items():
            item = converts[name]
            try:
                kwargs[name] = each if item is None else item(each)
            except DecodeError as e:
                e.path = f".{name}{e.path}"
                raise
        return hint(**kwargs)

    return convert
