"""The PostgreSQL store's DSN: every connection the store makes goes through :func:`connect` or
:func:`create_pool`, which honour a list of servers and land on one that takes writes.

A DSN may name several servers, as libpq's do: ``postgresql://USER@h1:5432,h2:5432/DB`` or
``postgresql://USER@/DB?host=h1,h2&port=5432,5433``. They are tried in order, as libpq does, and a
server is taken only if it has what ``target_session_attrs`` asks. The store writes, so unless the
DSN (or ``$PGTARGETSESSIONATTRS``) says otherwise it asks for ``read-write``: a standby, or a
server with ``default_transaction_read_only``, is passed over for the next server; with one server
listed, a standby is refused (the store is unavailable, with a message that says why) rather than
taken and then failing every write. On PostgreSQL 14 and later the server reports both settings
when the connection starts, so the check costs no round trip.

Unlike asyncpg's own list (one time-out for all the servers), each server is given its own time
(the caller's, or the DSN's ``connect_timeout`` as libpq's, taken out of the DSN since asyncpg would
send it to the server as a setting), so a server that answers nothing (a machine gone: packets
dropped) does not keep the next from being tried. And the server that was last found to take
writes is tried first (the others then in order): once a failover is over, new connections go
straight to the new primary instead of waiting on the old one each time.

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
_CONNECT_TIMEOUT: Final = re.compile(r"(?i)(^|&)connect_timeout=([^&#]*)")
# What a server of a list may fail with for the next one to be tried (as libpq moves on after a
# failed connection, not after a refused password): refused, unanswered, not taking writes,
# starting or shutting down.
_NEXT: Final = (
    OSError,
    TimeoutError,
    asyncpg.TargetServerAttributeNotMatched,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.ConnectionDoesNotExistError,
)
# The server of each DSN last found to take writes (tried first next time).
_last_good: dict[str, tuple[str, int]] = {}


class NoPrimary(ConnectionError):
    """No server of a DSN that lists several could be used; why, server by server."""


def options(dsn: str) -> dict[str, Any]:
    """What to pass to asyncpg with ``dsn``: ``target_session_attrs`` unless it names one."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query)
    if "target_session_attrs" in query or os.environ.get("PGTARGETSESSIONATTRS"):
        return {}
    return {"target_session_attrs": TARGET}


def servers(dsn: str) -> list[tuple[str, int]]:
    """The servers ``dsn`` lists, as (host, port), in order (ports as libpq pairs them: one
    per host, or one for all, else ``$PGPORT`` or 5432)."""
    parts = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qs(parts.query)
    default = int(os.environ.get("PGPORT", "5432").split(",")[0] or 5432)
    found: list[tuple[str, int | None]] = []
    spec = parts.netloc.rpartition("@")[2]
    for item in (h for h in spec.split(",") if h):
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            written = rest.lstrip(":")
        else:
            host, _, written = item.partition(":")
        found.append((urllib.parse.unquote(host), int(written) if written else None))
    if not found:
        listed = [h for v in query.get("host", []) for h in v.split(",") if h]
        found = [(h, None) for h in listed]
    ports = [int(p) for v in query.get("port", []) for p in v.split(",") if p]
    out = []
    for i, (host, given) in enumerate(found):
        if given is None:
            given = ports[i] if len(ports) == len(found) else ports[0] if ports else default
        out.append((host, given))
    return out


def hosts(dsn: str) -> list[str]:
    """The servers ``dsn`` lists (``host:port``, as written; the ``host`` parameter's too)."""
    parts = urllib.parse.urlsplit(dsn)
    spec = parts.netloc.rpartition("@")[2]
    found = [h for h in spec.split(",") if h]
    query = urllib.parse.parse_qs(parts.query)
    for value in query.get("host", []):
        found += [h for h in value.split(",") if h]
    return found


def split_timeout(dsn: str) -> tuple[str, float | None]:
    """``dsn`` without its ``connect_timeout`` parameter (libpq's: seconds for each server),
    and that time (None if not given, or not a positive number)."""
    parts = urllib.parse.urlsplit(dsn)
    found = _CONNECT_TIMEOUT.search(parts.query)
    if found is None:
        return dsn, None
    query = _CONNECT_TIMEOUT.sub("", parts.query).lstrip("&")
    try:
        seconds: float | None = float(found.group(2))
    except ValueError:
        seconds = None
    if seconds is not None and seconds <= 0:
        seconds = None  # (libpq: 0 waits for ever)
    return urllib.parse.urlunsplit(parts._replace(query=query)), seconds


async def connect(dsn: str, *, timeout: float, **kw: Any) -> asyncpg.Connection:
    """A connection to a server of ``dsn`` that takes writes (see the module's docstring),
    each server given ``timeout`` seconds (or the DSN's ``connect_timeout``)."""
    dsn, each = split_timeout(dsn)
    each = timeout if each is None else each
    listed = servers(dsn)
    if len(listed) <= 1:
        conn: asyncpg.Connection = await asyncpg.connect(dsn, timeout=each, **options(dsn), **kw)
        return conn
    last = _last_good.get(dsn)
    if last in listed:
        listed.remove(last)
        listed.insert(0, last)
    why: list[str] = []
    for host, port in listed:
        try:
            conn = await asyncpg.connect(
                dsn, host=host, port=port, timeout=each, **options(dsn), **kw
            )
        except _NEXT as e:
            why.append(f"{host}:{port}: {_reason(e, each)}")
            continue
        _last_good[dsn] = (host, port)
        return conn
    raise NoPrimary(f"no server of {redact(dsn)} could be used ({'; '.join(why)})")


def _reason(error: BaseException, timeout: float) -> str:
    if isinstance(error, asyncpg.TargetServerAttributeNotMatched):
        return "does not take writes (a standby, or read-only)"
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout:g} s"
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


async def create_pool(dsn: str, **kw: Any) -> asyncpg.Pool:
    """A pool whose every connection is made as :func:`connect` makes one."""
    make: Any = asyncpg.create_pool  # (its stubs list every option; these are the caller's)
    pool: asyncpg.Pool = await make(dsn, connect=_pool_connect, **kw)
    return pool


async def _pool_connect(dsn: str, **kw: Any) -> asyncpg.Connection:
    return await connect(dsn, **kw)


def connect_time(dsn: str, each: float) -> float:
    """The longest :func:`connect` may take with ``each`` seconds for each server of ``dsn``."""
    given = split_timeout(dsn)[1]
    return (each if given is None else given) * max(1, len(servers(split_timeout(dsn)[0])))


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
