"""Bearer tokens and the scope rules, for both protocols.

The broker's ``-token-file`` holds one token a line, with the scopes it grants::

    # comments and blank lines are ignored
    3f9a...c1  produce
    77d0...e4  consume,admin

:class:`Tokens` is that file, read once at start and again on SIGHUP (:meth:`Tokens.reload`). Its
:meth:`~Tokens.check` takes the ``Authorization`` header's value as a client sent it (HTTP header
or gRPC ``authorization`` metadata) and the rule of the route called, and raises
:class:`~wqbroker.errors.Unauthenticated` or :class:`~wqbroker.errors.PermissionDenied`. The rules
are :data:`SCOPES`, :data:`ANY_TOKEN` and :data:`NO_TOKEN` below, for HTTP routes and gRPC methods
side by side; the HTTP middleware (``wqbroker.http.auth``) and the gRPC interceptor
(``wqbroker.grpc.auth``) apply them, once per protocol, to every call.

Tokens are never kept, logged or echoed: the store holds the SHA-256 digest of each, and a
presented token is found by the digest of what was presented. Finding it is a dict lookup on a
digest: how long it takes says nothing about how much of any real token an attacker guessed
(a guess that shares a prefix with a real token shares nothing with its digest), so there is no
early exit to time. Error messages name the line of the file, never its text.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from wqbroker.errors import PermissionDenied, Unauthenticated

log = logging.getLogger("wqbroker.auth")


@dataclass(frozen=True, slots=True)
class Routes:
    """What a rule covers: HTTP routes as ``"METHOD /path"`` (the path as registered, with its
    ``{placeholders}``; HEAD goes as GET) and gRPC methods as ``"/package.Service/Method"``."""

    http: tuple[str, ...] = ()
    grpc: tuple[str, ...] = ()


_BROKER: Final = "/wq.v1.Broker/"

# Each scope a token can be granted, and the routes it opens. A token holds any number of them;
# none implies another. A new scope is one more entry (the token file accepts every key here).
# A route under several scopes is opened by any one of them (listing a queue's tasks: a worker's
# business and an admin's).
SCOPES: Final[Mapping[str, Routes]] = {
    "produce": Routes(
        http=("POST /jobs", "POST /jobs/batch"),
        grpc=(_BROKER + "Enqueue", _BROKER + "EnqueueBatch", _BROKER + "Produce"),
    ),
    # NextJob settles its acks as well as claiming, all of it the consumer's business.
    "consume": Routes(
        http=(
            "GET /jobs/next",
            "POST /jobs/{id}/ack",
            "POST /jobs/{id}/nack",
            "POST /jobs/{id}/extend",
            "POST /jobs/{id}/release",
            "GET /jobs/next/batch",
            "POST /jobs/settle",
            "GET /jobs",
        ),
        grpc=(
            _BROKER + "NextJob",
            _BROKER + "StreamJobs",
            _BROKER + "Ack",
            _BROKER + "Nack",
            _BROKER + "ExtendLease",
            _BROKER + "Release",
            _BROKER + "ListTasks",
        ),
    ),
    "admin": Routes(
        http=(
            "GET /dlq",
            "POST /dlq/{id}/requeue",
            "POST /dlq/requeue",
            "DELETE /dlq/{id}",
            "POST /queues/{name}/pause",
            "POST /queues/{name}/resume",
            "GET /jobs",
            "DELETE /jobs/{id}",
            "POST /queues/{name}/empty",
            "DELETE /queues/{name}",
            # docs/design/schedules.md: changing schedules and limits
            "PUT /schedules/{name}",
            "DELETE /schedules/{name}",
            "POST /schedules/{name}/pause",
            "POST /schedules/{name}/resume",
            "PUT /queues/{name}/limits",
            "DELETE /queues/{name}/limits",
        ),
        grpc=(
            _BROKER + "ListDead",
            _BROKER + "Requeue",
            _BROKER + "RequeueAll",
            _BROKER + "PurgeDead",
            _BROKER + "PauseQueue",
            _BROKER + "ResumeQueue",
            _BROKER + "ListTasks",
            _BROKER + "CancelTask",
            _BROKER + "EmptyQueue",
            _BROKER + "DeleteQueue",
            _BROKER + "PutSchedule",
            _BROKER + "DeleteSchedule",
            _BROKER + "PauseSchedule",
            _BROKER + "ResumeSchedule",
            _BROKER + "SetQueueLimits",
        ),
    ),
    # Prometheus scrapes (the broker's -metrics-public opens it to callers without a token).
    "metrics": Routes(http=("GET /metrics",)),
}

# Routes open to any valid token, whatever its scopes. A task's lookup is here: a producer
# follows the task it enqueued, a worker the one it holds (the DLQ listing, every dead task at
# once, stays the admin's); and so is the wait for its result (docs/design/results.md): a
# producer waits for what it enqueued. Reading schedules (docs/design/schedules.md) is as reading
# the queues: any token.
ANY_TOKEN: Final = Routes(
    http=(
        "GET /stats",
        "GET /queues",
        "GET /jobs/{id}",
        "GET /jobs/{id}/result",
        "GET /schedules",
        "GET /schedules/{name}",
    ),
    grpc=(
        _BROKER + "Stats",
        _BROKER + "GetTask",
        _BROKER + "ListQueues",
        _BROKER + "WaitResult",
        _BROKER + "GetSchedule",
        _BROKER + "ListSchedules",
    ),
)

# Routes open without a token: liveness and readiness probes must work without credentials, and
# the API's description is public, as the .proto is: GET /openapi.json, and gRPC's server
# reflection (both versions), without which generic tools (grpcurl) cannot call the health check
# by name. The dashboard's static files (GET /ui...) hold no data: every call the page makes
# carries the token the user entered.
NO_TOKEN: Final = Routes(
    http=(
        "GET /healthz",
        "GET /readyz",
        "GET /openapi.json",
        "GET /ui",
        "GET /ui/",
        "GET /ui/{file}",
    ),
    grpc=(
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.health.v1.Health/List",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ),
)

# A route that exists but that no rule names needs this scope: a route added without a rule is
# closed to all but admins rather than open to all.
UNLISTED: Final = "admin"


class Access(enum.Enum):
    """The rules that are not a scope."""

    ANY = "any valid token"
    OPEN = "no token"


Rule = str | tuple[str, ...] | Access
"""A scope name; scope names, any of which will do (a route under several scopes, in the order
of :data:`SCOPES`); or one of Access."""


def _rules(kind: str) -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    named: list[tuple[Rule, Routes]] = [
        *SCOPES.items(),
        (Access.ANY, ANY_TOKEN),
        (Access.OPEN, NO_TOKEN),
    ]
    for rule, routes in named:
        for route in getattr(routes, kind):
            held = table.get(route)
            if held is None:
                table[route] = rule
            elif isinstance(rule, str) and not isinstance(held, Access):
                table[route] = (*scopes_of(held), rule)  # (another scope opens it too)
            else:
                raise ValueError(f"{route} has two rules")
    return table


def scopes_of(rule: Rule) -> tuple[str, ...]:
    """The scopes any one of which lets a call through ``rule`` (none for one of Access)."""
    if isinstance(rule, Access):
        return ()
    return (rule,) if isinstance(rule, str) else rule


def describe_rule(rule: Rule) -> str:
    """``rule`` for a person: ``the admin scope``, ``the consume or admin scope``, ``any valid
    token``, ``no token``."""
    if isinstance(rule, Access):
        return rule.value
    return f"the {' or '.join(scopes_of(rule))} scope"


HTTP_RULES: Final[Mapping[str, Rule]] = _rules("http")
"""``"METHOD /path"`` -> rule, for every HTTP route a rule names."""

GRPC_RULES: Final[Mapping[str, Rule]] = _rules("grpc")
"""``"/package.Service/Method"`` -> rule, for every gRPC method a rule names."""


def http_rule(method: str, path: str) -> Rule:
    """The rule for an HTTP route that exists (``path`` as registered)."""
    return HTTP_RULES.get(f"{'GET' if method == 'HEAD' else method} {path}", UNLISTED)


def grpc_rule(method: str) -> Rule:
    """The rule for a gRPC method that exists (``/package.Service/Method``)."""
    return GRPC_RULES.get(method, UNLISTED)


# -- the token file ---------------------------------------------------------------------------


class TokenFileError(Exception):
    """The token file cannot be read or has a bad line. The message is one line and never
    contains a token."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def _valid_token(token: str) -> bool:
    """Printable ASCII without spaces: what an HTTP header and gRPC metadata carry unchanged."""
    return token.isascii() and token.isprintable() and " " not in token


def _scopes(text: str) -> frozenset[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError("an empty scope in the list (write SCOPE,SCOPE)")
    unknown = sorted(set(names) - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r} (scopes: {', '.join(SCOPES)})")
    return frozenset(names)


def parse_tokens(lines: Iterable[str], source: str) -> dict[bytes, frozenset[str]]:
    """``TOKEN SCOPE[,SCOPE...]`` lines -> {SHA-256 of the token: scopes}. Blank lines and lines
    starting with ``#`` are skipped, as is a ``# comment`` after the scopes. Raises
    TokenFileError naming ``source`` and the line number."""
    found: dict[bytes, frozenset[str]] = {}
    seen_on: dict[bytes, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 1)
        try:
            if len(fields) < 2:
                raise ValueError("expected TOKEN SCOPE[,SCOPE...]")
            token, rest = fields[0], fields[1].split("#", 1)[0]
            if not _valid_token(token):
                raise ValueError("a token must be printable ASCII")
            scopes = _scopes(rest)
        except ValueError as e:
            raise TokenFileError(f"{source}, line {number}: {e}") from None
        key = _digest(token)
        if key in found:
            raise TokenFileError(f"{source}, line {number}: the same token as line {seen_on[key]}")
        found[key], seen_on[key] = scopes, number
    return found


def read_token_file(path: str) -> dict[bytes, frozenset[str]]:
    """The token file at ``path``, parsed (see :func:`parse_tokens`)."""
    source = f"token file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            return parse_tokens(f.read().splitlines(), source)
    except OSError as e:
        raise TokenFileError(f"cannot read {source}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TokenFileError(f"{source} is not UTF-8 text") from None


# -- checking a call --------------------------------------------------------------------------

_BEARER: Final = "bearer"


class Tokens:
    """The known tokens (as digests) and their scopes; :meth:`check` judges one call."""

    __slots__ = ("_scopes", "path")

    def __init__(self, scopes: Mapping[bytes, frozenset[str]], path: str | None = None) -> None:
        self._scopes: Mapping[bytes, frozenset[str]] = dict(scopes)
        self.path = path

    @classmethod
    def load(cls, path: str) -> Tokens:
        """Read the token file; raises TokenFileError."""
        tokens = cls(read_token_file(path), path)
        if not tokens:
            log.warning("%s has no tokens: every call but health checks is refused", path)
        return tokens

    def __len__(self) -> int:
        return len(self._scopes)

    def __repr__(self) -> str:
        return f"<Tokens: {len(self)} from {self.path}>"

    def reload(self) -> bool:
        """Read the file again and take its tokens (calls after this see only them). A file that
        cannot be read or has a bad line changes nothing: one error line is logged, and False
        returned."""
        if self.path is None:
            return False
        try:
            scopes = read_token_file(self.path)
        except TokenFileError as e:
            log.error("%s; keeping the %d tokens in use", e, len(self))
            return False
        self._scopes = scopes
        log.info("reloaded %s: %d tokens", self.path, len(scopes))
        return True

    def check(self, authorization: str | None, rule: Rule, what: str) -> None:
        """Let a call with this ``Authorization`` value (None: none sent) through ``rule``, or
        raise Unauthenticated (no token, or one unknown) or PermissionDenied (a token without
        the scope). ``what`` names the call in the messages."""
        if rule is Access.OPEN:
            return
        scopes = self._scopes.get(_digest(_bearer(authorization, what)))
        if scopes is None:
            raise Unauthenticated(f"unknown token: {what} needs a valid bearer token")
        if rule is Access.ANY:
            return
        if isinstance(rule, str):
            if rule in scopes:
                return
        elif isinstance(rule, tuple) and not scopes.isdisjoint(rule):
            return
        raise PermissionDenied(f"{what} needs a token with {describe_rule(rule)}")


def _bearer(authorization: str | None, what: str) -> str:
    """The token of ``Bearer TOKEN``; raises Unauthenticated for anything else."""
    if authorization is None:
        raise Unauthenticated(f"no token: {what} needs Authorization: Bearer TOKEN")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != _BEARER or not token:
        raise Unauthenticated("Authorization must be Bearer TOKEN")
    if not _valid_token(token):
        raise Unauthenticated("unknown token: a token is printable ASCII")
    return token
