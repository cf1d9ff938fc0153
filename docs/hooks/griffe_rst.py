"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): wqclient's docstrings, written
for Sphinx-ish readers, as Markdown for the Python API reference.

- a role, ``:class:`AsyncClient``` or ``:meth:`~wqclient.Client.ack```, becomes a code span,
  linked to its entry when it names one of wqclient's public names (``wqclient.__all__``, all
  rendered on the page); ``~`` shows the last part only, as Sphinx does;
- a doctest (lines from ``>>>`` on, with their ``...`` continuations and output) becomes a
  ``pycon`` code block instead of Markdown block quotes;
- a paragraph ending in ``::`` (a reST literal block follows) ends in ``:``; the indented block
  after it is a Markdown code block already.

The docstrings themselves stay as they are in the code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|obj|exc):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")
_DOCTEST = re.compile(r"^>>> ")


def _public() -> frozenset[str]:
    import wqclient

    return frozenset(wqclient.__all__)


PUBLIC = _public()


def _role(m: re.Match[str]) -> str:
    tilde, text, target = m.group(1), m.group(2).strip(), m.group(3)
    target = (target or text).strip()
    shown = text.rsplit(".", 1)[-1] if tilde else text
    name = target.removeprefix("wqclient.")
    if name in PUBLIC:
        return f"[`{shown}`][wqclient.{name}]"
    return f"`{shown}`"


def _doctests(text: str) -> str:
    """Each run of doctest lines (``>>>`` to the next blank line) fenced as ``pycon``."""
    out: list[str] = []
    inside = False
    for line in text.split("\n"):
        if not inside and _DOCTEST.match(line):
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


def markdown(text: str) -> str:
    """A docstring's text, as Markdown."""
    text = _doctests(text)
    text = re.sub(r"::\n(\n+)", r":\n\1", text)
    return _ROLE.sub(_role, text)


class RstRoles(griffe.Extension):
    """Rewrites every docstring griffe loads (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
