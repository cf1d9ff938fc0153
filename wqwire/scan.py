"""Reading JSON while keeping chosen members as their exact text.

A payload crosses wq byte for byte: the broker keeps the JSON text a producer sent and splices it
into its answers; the client hands a worker that same text. Decoding and re-encoding would change
it (``1e400`` would become ``Infinity``, ``1.10`` would become ``1.1``, key order and escapes
would move), so both sides read an object member by member and keep the members they name as
their raw text (:class:`JsonText`), letting the standard library's C scanner find where each
value ends. The broker reads request bodies this way (``wqbroker.codec``), the client the
broker's answers (``wqclient._http``): one reader, two callers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final, cast

Scan = Callable[[str, int], tuple[Any, int]]
"""Parses one JSON value of ``text`` at an index: the value and the index after it (raises
ValueError or StopIteration where there is none)."""


class JsonText(bytes):
    """The bytes of exactly one JSON value, kept as they were received."""

    __slots__ = ()


def scanner(decoder: json.JSONDecoder) -> Scan:
    """The decoder's own scanner (C-accelerated), which parses one value at a given index with
    the decoder's hooks (``parse_int``, ``parse_constant`` ...)."""
    return cast(Scan, getattr(decoder, "scan_once"))  # noqa: B009


scan_string = cast(
    Callable[[str, int], tuple[str, int]],
    getattr(json.decoder, "scanstring"),  # noqa: B009
)
"""The text of a JSON string whose opening quote is just before the index, and the index after
its closing quote."""

_WHITESPACE: Final = re.compile(r"[ \t\n\r]*")


def skip(text: str, idx: int) -> int:
    """The index of the first character at or after ``idx`` that is not JSON white space."""
    match = _WHITESPACE.match(text, idx)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def read_members(
    text: str, idx: int, out: dict[str, Any], raw: frozenset[str], value: Scan, raw_value: Scan
) -> int:
    """Reads the members of the object whose ``{`` is just before ``idx`` into ``out``: a member
    named in ``raw`` as its :class:`JsonText` (checked by ``raw_value``), any other as ``value``
    parses it. Returns the index after the closing ``}``; raises ValueError (naming the index) or
    StopIteration where the text is not such an object."""
    idx = skip(text, idx)
    if text.startswith("}", idx):
        return idx + 1
    while True:
        if not text.startswith('"', idx):
            raise ValueError(f"expected a member name at {idx}")
        key, idx = scan_string(text, idx + 1)
        idx = skip(text, idx)
        if not text.startswith(":", idx):
            raise ValueError(f"expected ':' at {idx}")
        idx = skip(text, idx + 1)
        if key in raw:
            _, end = raw_value(text, idx)
            out[key] = JsonText(text[idx:end].encode("utf-8"))
            idx = end
        else:
            out[key], idx = value(text, idx)
        idx = skip(text, idx)
        if text.startswith(",", idx):
            idx = skip(text, idx + 1)
        elif text.startswith("}", idx):
            return idx + 1
        else:
            raise ValueError(f"expected ',' or '}}' at {idx}")
