"""MkDocs hook (mkdocs.yml ``hooks:``): the generated parts of the Reference pages.

A page asks for a generated part with a marker comment on a line of its own::

    <!-- wq:generate openapi -->

and the build puts the part in its place, made from the code of this checkout: ``openapi`` (the
HTTP API, from the broker's OpenAPI document), ``proto`` (the gRPC API, from
proto/wqwire/pb/broker.proto and its comments), ``commands`` (every command's flags, from their
parsers), ``metrics`` (every metric, from the broker's and the worker's registries). An unknown
name fails the build. The rest of the page is written by hand."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import ref_commands
import ref_grpc
import ref_http
import ref_metrics
from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- wq:generate ([a-z-]+) -->[ \t]*$", re.M)

GENERATORS: dict[str, Callable[[], str]] = {
    "openapi": ref_http.render,
    "proto": ref_grpc.render,
    "commands": ref_commands.render,
    "metrics": ref_metrics.render,
}


def expand(markdown: str, where: str) -> str:
    """``markdown`` with every marker replaced by its part."""

    def part(m: re.Match[str]) -> str:
        name = m.group(1)
        generate = GENERATORS.get(name)
        if generate is None:
            known = ", ".join(sorted(GENERATORS))
            raise PluginError(f"{where}: unknown generated part {name!r} (known: {known})")
        return generate().strip() + "\n"

    return MARKER.sub(part, markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return expand(markdown, page.file.src_uri)
