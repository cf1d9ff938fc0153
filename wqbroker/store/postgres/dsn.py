"""The PostgreSQL store's DSN: every connection the store makes goes through :func:`connect` or
:func:`create_pool`, which honour a list of servers and land on one that takes writes.

A DSN may name several servers, as libpq's do: ``postgresql://USER@h1:5432,h2:5432/DB`` or
``postgresql://USER@/DB?host=h1,h2&port=5432,5433``. They are tried in order (asyncpg, as libpq),
and a server is taken only if it has what ``target_session_attrs`` asks. The store writes, so
unless the DSN (or ``$PGTARGETSESSIONATTRS``) says otherwise it asks for ``read-write``: a standby,
or a server with ``default_transaction_read_only``, is passed over for the next server; with one
server listed, a standby is refused (the store is unavailable, with a message that says why)
rather than taken and then failing every write. On PostgreSQL 14 and later the server reports
both settings when the connection starts, so the check costs no round trip.

:func:`redact` takes the password out of a DSN (in the user part or as a ``password``
parameter), whatever its hosts, for logs and messages.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any, Final

import asyncpg

#: What the store asks of the server it connects to, unless the DSN says otherwise.
TARGET: Final = "read-write"
_QUERY_PASSWORD: Final = re.compile(r"(?i)((?:^|&)password=)[^&#]*")


def options(dsn: str) -> dict[str, Any]:
    """What to pass to asyncpg with ``dsn``: ``target_session_attrs`` unless it names one."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query)
    if "target_session_attrs" in query or os.environ.get("PGTARGETSESSIONATTRS"):
        return {}
    return {"target_session_attrs": TARGET}


def hosts(dsn: str) -> list[str]:
    """The servers ``dsn`` lists (``host:port``, as written; the ``host`` parameter's too)."""
    parts = urllib.parse.urlsplit(dsn)
    spec = parts.netloc.rpartition("@")[2]
    found = [h for h in spec.split(",") if h]
    query = urllib.parse.parse_qs(parts.query)
    for value in query.get("host", []):
        found += [h for h in value.split(",") if h]
    return found


async def connect(dsn: str, **kw: Any) -> asyncpg.Connection:
    """A connection to a server of ``dsn`` that takes writes (see the module's docstring)."""
    return await asyncpg.connect(dsn, **options(dsn), **kw)


async def create_pool(dsn: str, **kw: Any) -> asyncpg.Pool:
    """A pool whose every connection is made as :func:`connect` makes one."""
    return await asyncpg.create_pool(dsn, **options(dsn), **kw)


def explain(error: BaseException, dsn: str) -> str | None:
    """What a refusal by ``target_session_attrs`` means (asyncpg's own message names an enum),
    or None for any other error."""
    if not isinstance(error, asyncpg.TargetServerAttributeNotMatched):
        return None
    listed = hosts(dsn)
    if len(listed) <= 1:
        which = f"the server of {redact(dsn)} does not take writes"
    else:
        which = f"none of the {len(listed)} servers of {redact(dsn)} takes writes"
    return f"{which} (a standby, or read-only): wq needs the primary (target_session_attrs)"


def redact(dsn: str) -> str:
    """``dsn`` without its password (for messages), however many hosts it lists."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        return dsn
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        user, at, spec = netloc.rpartition("@")
        name, colon, _ = user.partition(":")
        netloc = f"{name}:***{at}{spec}" if colon else netloc
    path, qmark, query = tail.partition("?")
    if qmark:
        query = _QUERY_PASSWORD.sub(r"\1***", query)
    return f"{scheme}{sep}{netloc}{path}{qmark}{query}"
