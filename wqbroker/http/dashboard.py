"""``GET /ui``: the dashboard, served from the broker itself.

Static files shipped as package data in ``wqbroker/http/ui/`` (an HTML page, its script and
style, and a vendored charting library, uPlot, MIT): no build step, nothing fetched from
elsewhere. The page holds no data: it calls the JSON API (``/stats``, ``/queues``, ``/dlq``,
``/jobs/{id}``) from the browser, with the token the user enters when the broker answers 401, so
the files themselves need no token (``wqbroker.auth.NO_TOKEN``).

The files are read once, at import, into a table keyed by their path under ``ui/``: a request
names a key of that table or gets 404, so no path ever reaches the file system. Every answer
carries a ``Content-Security-Policy`` that allows only the broker's own origin (the page has no
inline script or style), an ``ETag`` (a matching ``If-None-Match`` gets 304), and a
``Cache-Control``: revalidate the page and its script each time, keep the versioned vendor files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from wqbroker.errors import NotFound

ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]

ROUTE: Final = "/ui"
"""The page; ``/ui/`` too, and ``/ui/{file}`` for what it loads."""

ROUTES: Final = (ROUTE, ROUTE + "/", ROUTE + "/{file}")
"""The routes as registered (``wqbroker.auth`` names them)."""

INDEX: Final = "index.html"

CONTENT_SECURITY_POLICY: Final = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)

_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}

# Vendor files carry their version in their name: a new version is a new name.
_KEEP: Final = "public, max-age=604800, immutable"
_REVALIDATE: Final = "no-cache"

_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str
    cache_control: str


def _walk(folder: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _walk(entry, f"{prefix}{entry.name}/")
        elif entry.is_file():
            yield f"{prefix}{entry.name}", entry


def load(folder: Traversable | None = None) -> dict[str, Asset]:
    """Every file of a known type under ``folder`` (the package's ``ui/``), by relative path."""
    if folder is None:
        folder = resources.files("wqbroker.http").joinpath("ui")
    assets: dict[str, Asset] = {}
    for name, entry in _walk(folder):
        suffix = name[name.rfind(".") :] if "." in name else ""
        content_type = _TYPES.get(suffix)
        if content_type is None:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        cache = _KEEP if name.startswith("vendor/") else _REVALIDATE
        assets[name] = Asset(body, content_type, etag, cache)
    return assets


ASSETS: Final = load()


def _named(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def _matches(if_none_match: list[str], etag: str) -> bool:
    tags = {tag.strip().removeprefix("W/") for value in if_none_match for tag in value.split(",")}
    return etag in tags or "*" in tags


def handler(assets: dict[str, Asset] = ASSETS) -> Handler:
    """The handler of the three routes: ``/ui`` and ``/ui/`` are the page."""

    async def serve(request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("file", INDEX)
        asset = assets.get(name)
        if asset is None:
            raise NotFound(f"no such file in the dashboard: {_named(request.path)}")
        headers = {**_HEADERS, "ETag": asset.etag, "Cache-Control": asset.cache_control}
        if _matches(request.headers.getall("If-None-Match", []), asset.etag):
            return web.Response(status=304, headers=headers)
        headers["Content-Type"] = asset.content_type
        return web.Response(body=asset.body, headers=headers)

    return serve


def add_routes(router: web.UrlDispatcher, expect_handler: ExpectHandler | None = None) -> None:
    """Register ``GET /ui``, ``GET /ui/`` and ``GET /ui/{file}`` (and their ``HEAD``)."""
    serve = handler()
    router.add_get(ROUTE, serve, expect_handler=expect_handler)
    router.add_get(ROUTE + "/", serve, expect_handler=expect_handler)
    router.add_get(ROUTE + "/{file:.+}", serve, expect_handler=expect_handler)
