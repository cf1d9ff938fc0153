"""JSON in and out, without re-encoding payloads.

A payload is validated once, when it arrives, and then kept as the exact JSON text the client sent:
``parse_object`` scans a request body's top-level object and returns chosen members as their raw
text, and the renderers splice stored payload bytes straight into responses. So a payload comes back
byte for byte as it was sent, over either protocol.

Standard JSON only: ``NaN`` and ``Infinity`` (which Python's json module would accept) are rejected.

Numbers: a payload is validated without converting its numbers, so any valid JSON number is
accepted, whatever its size (Python refuses to convert an integer of more than 4300 digits, and
the work grows with the square of the length). A number the broker reads (``max_attempts``, a
query's ``wait_ms``) is an integer of the wire contract's int64 range; one outside it is never
converted in full: :func:`parse_int` gives a :class:`BigInt`, the int64 bound of its sign, which
every range check then refuses or clamps as the value it stands for.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

from wqbroker.errors import InvalidArgument
from wqwire.scan import JsonText as JsonText  # (the broker's payloads are such text)
from wqwire.scan import read_members, scanner, skip

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
_INT64_DIGITS: Final = len(str(INT64_MAX))  # 19


class BigInt(int):
    """An integer outside int64, as :func:`parse_int` gives it: its value is the int64 bound of
    its sign, so comparisons treat it as the huge number it stands for; it prints as the number
    it stands for, abbreviated (error messages name what the client sent)."""

    _shown: str

    def __new__(cls, text: str) -> BigInt:
        self = super().__new__(cls, INT64_MIN if text.startswith("-") else INT64_MAX)
        digits = text.lstrip("+-")
        self._shown = text if len(text) <= 40 else f"{text[:16]}... ({len(digits)} digits)"
        return self

    def __repr__(self) -> str:
        return self._shown

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self._shown, spec)


def parse_int(text: str) -> int:
    """An integer from its decimal digits (optionally signed; already checked to be digits),
    converting at most 19 of them: outside int64 it is a :class:`BigInt`."""
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("+-").lstrip("0") or "0"
    if len(digits) <= _INT64_DIGITS:
        value = int(sign + digits)
        if INT64_MIN <= value <= INT64_MAX:
            return value
    return BigInt(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Values the broker reads: integers within int64 (else BigInt), floats as Python floats.
_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_int=parse_int)
# Values kept as text (payloads): checked, numbers never converted (str is the cheapest hook).
_validator = json.JSONDecoder(parse_constant=_reject_constant, parse_int=str, parse_float=str)
# The decoders' own scanners (C-accelerated), which parse one value at a given index.
_scan_value = scanner(_decoder)
_scan_raw = scanner(_validator)
_SPACE: Final = " \t\n\r"


def _diagnose(text: str) -> str | None:
    """Why ``text`` is not one JSON value, in the standard decoder's words; None if it is one."""
    try:
        _validator.decode(text)
    except json.JSONDecodeError as e:
        return f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        return "is nested too deeply"
    except ValueError as e:
        return f"is not valid JSON: {e}"
    return None


def _invalid_json(text: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"{what} {_diagnose(text) or 'is not valid JSON'}")


def decode_text(body: bytes, what: str = "request body") -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{what} is not valid UTF-8 (byte {e.start})") from None


def parse_object(
    body: bytes, raw: frozenset[str] = frozenset(), *, what: str = "request body"
) -> dict[str, Any]:
    """Parse a JSON object. Members named in ``raw`` are returned as their exact JSON text
    (:class:`JsonText`); the others as decoded values. Raises InvalidArgument naming the problem."""
    text = decode_text(body, what)
    idx = skip(text, 0)
    if idx == len(text):
        raise InvalidArgument(f"{what} is empty; expected a JSON object")
    if text[idx] != "{":
        problem = _diagnose(text)
        raise InvalidArgument(f"{what} {problem or 'must be a JSON object'}")
    out: dict[str, Any] = {}
    try:
        idx = read_members(text, idx + 1, out, raw, _scan_value, _scan_raw)
    except (ValueError, StopIteration, RecursionError):
        raise _invalid_json(text, what) from None
    if skip(text, idx) != len(text):
        raise _invalid_json(text, what)
    return out


def parse_objects(
    body: bytes, member: str, raw: frozenset[str] = frozenset(), *, what: str = "request body"
) -> list[dict[str, Any]]:
    """The objects of the array ``member`` of a JSON object (``{"tasks": [{...}, ...]}``), each
    parsed as :func:`parse_object` parses one (members in ``raw`` kept as their text). Other
    members of the outer object are ignored. Raises InvalidArgument naming the problem
    (``tasks[2] must be a JSON object``)."""
    outer = parse_object(body, frozenset({member}), what=what)
    if member not in outer:
        raise InvalidArgument(f"{member} is required")
    text = outer[member].decode("utf-8")  # (JsonText: one JSON value, checked)
    if not text.startswith("["):
        raise InvalidArgument(f"{member} must be an array")
    objects: list[dict[str, Any]] = []
    idx = skip(text, 1)
    if text.startswith("]", idx):
        return objects
    while True:
        if not text.startswith("{", idx):
            raise InvalidArgument(f"{member}[{len(objects)}] must be a JSON object")
        out: dict[str, Any] = {}
        try:
            idx = read_members(text, idx + 1, out, raw, _scan_value, _scan_raw)
        except (ValueError, StopIteration, RecursionError):  # (the whole was checked)
            raise _invalid_json(text, member) from None
        objects.append(out)
        idx = skip(text, idx)
        if text.startswith(",", idx):
            idx = skip(text, idx + 1)
        else:
            return objects  # "]": the whole array was checked as JSON


def validate_json(data: bytes, what: str = "payload") -> JsonText:
    """Check that ``data`` is one JSON value (any type); return it unchanged."""
    text = decode_text(data, what)
    # The usual payload, with no white space around it: one call of the C scanner (what the
    # standard decoder calls after its own Python steps). Anything else is looked at in full.
    if text and text[0] not in _SPACE and text[-1] not in _SPACE:
        try:
            end = _scan_raw(text, 0)[1]
        except (ValueError, StopIteration, RecursionError):
            end = -1
        if end == len(text):
            return JsonText(data)
    if not text.strip(" \t\n\r"):
        raise InvalidArgument(f"{what} is empty; expected JSON")
    problem = _diagnose(text)
    if problem is not None:
        raise InvalidArgument(f"{what} {problem}")
    return JsonText(data)


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# -- timestamps ---------------------------------------------------------------------------------

# The formatted second of recent timestamps: a delivery shows times a lease apart (created,
# available, deadline), so one second's entry would be replaced at every call.
_SECONDS_KEPT: Final = 64
_seconds: dict[int, str] = {}


def rfc3339(ts: float) -> str:
    """Epoch seconds as an RFC 3339 UTC timestamp with microseconds: 2026-11-29T23:07:38.123456Z."""
    second = int(ts // 1)
    micros = round((ts - second) * 1_000_000)
    if micros >= 1_000_000:
        second += 1
        micros -= 1_000_000
    prefix = _seconds.get(second)
    if prefix is None:
        if len(_seconds) >= _SECONDS_KEPT:
            _seconds.clear()
        prefix = _seconds[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{prefix}.{micros:06d}Z"
