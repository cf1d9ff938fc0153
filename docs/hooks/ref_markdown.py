"""Markdown helpers shared by the generated reference pages: table cells that cannot break the
table or inject HTML, anchors, tables."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_SLUG = re.compile(r"[^a-z0-9]+")


def slug(*parts: str) -> str:
    """An anchor made of ``parts``: lower case, runs of other characters as one ``-``."""
    return _SLUG.sub("-", "-".join(parts).lower()).strip("-")


def _plain(text: str) -> str:
    """Text outside code spans: no HTML (``<``, ``>``, ``&`` as entities), no table breaks."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|")


def inline(text: str) -> str:
    """``text`` (Markdown with code spans) safe for one table cell or one line: HTML and ``|``
    escaped outside code spans (Python-Markdown's tables do not split a cell on a ``|`` inside
    one, and show a ``\\|`` there as written), line breaks as ``<br>``."""
    out: list[str] = []
    last = 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_plain(text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(_plain(text[last:]))
    paragraphs = "".join(out).split("\n\n")
    return "<br><br>".join(" ".join(p.split("\n")) for p in paragraphs)


_LIST_AFTER_TEXT = re.compile(r"(?m)^((?![-*] ).+)\n([-*] )")


def block(text: str) -> str:
    """``text`` (Markdown) as paragraphs of its own: HTML escaped outside code spans, the rest
    (lists, emphasis, code spans) left to Markdown."""
    out: list[str] = []
    last = 0
    for m in _CODE_SPAN.finditer(text):
        out.append(text[last : m.start()].replace("<", "&lt;").replace(">", "&gt;"))
        out.append(m.group(0))
        last = m.end()
    out.append(text[last:].replace("<", "&lt;").replace(">", "&gt;"))
    # (Python-Markdown, unlike CommonMark, starts no list inside a paragraph: a blank line first.)
    return _LIST_AFTER_TEXT.sub("\\1\n\n\\2", "".join(out)).strip()


def code(text: str) -> str:
    """``text`` as one code span (longer backtick fences when it holds backticks)."""
    fence = "`"
    while fence in text:
        fence += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; cells are taken as written (escape them with :func:`inline`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines)
