"""The broker's configuration, declared once.

Each setting is one field of :class:`Config`: its default (a constant of the module that owns
the rule, never a literal repeated here), and, in the same line, its command-line flag: the help
text, how the flag's text is read, and its unit. The flags of ``wqbroker`` (:data:`FLAGS`), their
``WQ_*`` environment variables (``-grpc-addr`` is ``$WQ_GRPC_ADDR``: ``wqwire.flags`` derives
them) and :func:`config_from_args` are all made from the fields, so a new setting is one field.

Durations are seconds in the config and milliseconds on the command line (``-poll-ms 1000`` is
``poll_interval=1.0``); a path or certificate left unset is ``None`` in the config and ``""`` as
a flag's default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Final

from wqbroker.http.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_READ_HEADER_TIMEOUT
from wqbroker.http.transport import DEFAULT_READ_BODY_TIMEOUT
from wqbroker.limits import (
    DEFAULT_DEDUP_WINDOW_MS,
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_MAX_QUEUES,
    DEFAULT_MAX_SCHEDULES,
    DEFAULT_MAX_TASKS,
    DEFAULT_MAX_WAITERS,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_RESULT_TTL_MS,
    DEFAULT_SWEEP_INTERVAL,
    MAX_RESULT_TTL_MS,
)
from wqbroker.retry import DEFAULT_BASE, DEFAULT_CAP
from wqbroker.store.postgres.pool import DEADLINE as DB_DEADLINE
from wqwire.defaults import GRPC_PORT, HTTP_PORT
from wqwire.flags import LOG_FORMATS, Flag, non_negative_int, positive_int

__all__ = ["FLAGS", "Config", "config_from_args", "disabled", "parse_addr"]


def parse_addr(addr: str) -> tuple[str | None, int]:
    """``host:port``, ``:port`` (every interface), ``[v6]:port`` or a bare port."""
    text = addr.strip()
    host: str | None
    if text.isdigit():
        host, port_text = None, text
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"address {addr!r} has no port; use host:port or :port")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        host = host or None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {addr!r} has an invalid port")
    return host, int(port_text)


def disabled(addr: str | None) -> bool:
    """An address of "off" (or empty) switches that server off."""
    return addr is None or addr.strip().lower() in ("", "off", "none")


def _address(text: str) -> str:
    if disabled(text):
        return "off"
    try:
        parse_addr(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_FLAG: Final = "wq.flag"  # (the key of a field's metadata that holds its flag)


@dataclass(frozen=True, slots=True)
class _Flag:
    """What a field's flag is beyond its default (which is the field's)."""

    help: str
    name: str | None  # None: the field's name, "-" for "_"
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None
    metavar: str | None
    millis: bool  # the flag is in milliseconds, the field in seconds


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    millis: bool = False,
) -> Any:
    """A field of :class:`Config` and its flag (typed ``Any``, as ``dataclasses.field`` is)."""
    spec = _Flag(help, flag, parse, choices, metavar, millis)
    return field(default=default, metadata={_FLAG: spec})


def _result_ttl_ms(text: str) -> int:
    value = non_negative_int(text)
    if value > MAX_RESULT_TTL_MS:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_RESULT_TTL_MS} (a year), got {value}"
        )
    return value


def _ms(help: str, default_seconds: float, *, flag: str | None = None, **kw: Any) -> Any:
    """A duration: seconds in the config, whole milliseconds on the command line."""
    return setting(default_seconds, help, flag=flag, millis=True, metavar="MS", **kw)


@dataclass
class Config:
    """Everything a broker is started with (``wqbroker -help`` lists the flags)."""

    addr: str | None = setting(
        f":{HTTP_PORT}",
        "HTTP address to listen on: host:port or :port (every interface); off to disable",
        parse=_address,
        metavar="ADDR",
    )
    grpc_addr: str | None = setting(
        f":{GRPC_PORT}", "gRPC address to listen on; off to disable", parse=_address, metavar="ADDR"
    )
    sweep_interval: float = _ms(
        "how often the sweeper ticks at the latest",
        DEFAULT_SWEEP_INTERVAL,
        flag="sweep-interval-ms",
        parse=positive_int,
    )
    # With a shared store (PostgreSQL): how often a broker with waiting consumers polls for ready
    # tasks it was not told about (wake-ups between brokers come by LISTEN/NOTIFY).
    poll_interval: float = _ms(
        "with a store shared by several brokers (PostgreSQL), how often a broker with waiting "
        "consumers looks for ready tasks it was not told about (a lost wake-up costs at most "
        "this)",
        DEFAULT_POLL_INTERVAL,
        flag="poll-ms",
        parse=positive_int,
    )
    backoff_base: float = _ms(
        "first retry delay; doubles with each attempt",
        DEFAULT_BASE,
        flag="backoff-base-ms",
        parse=non_negative_int,
    )
    backoff_cap: float = _ms(
        "longest retry delay", DEFAULT_CAP, flag="backoff-cap-ms", parse=non_negative_int
    )
    max_body: int = setting(
        DEFAULT_MAX_PAYLOAD,
        "largest request body accepted",
        flag="max-body-bytes",
        parse=positive_int,
        metavar="N",
    )
    # HTTP time-outs: a request's line and headers, from its first byte (or the connection's
    # start); its body, once a handler reads it; an idle keep-alive connection.
    read_header_timeout: float = _ms(
        "HTTP: time to send a request's line and headers, from its first byte",
        DEFAULT_READ_HEADER_TIMEOUT,
        flag="read-header-timeout-ms",
        parse=positive_int,
    )
    read_body_timeout: float = _ms(
        "HTTP: time to send a request's body",
        DEFAULT_READ_BODY_TIMEOUT,
        flag="read-body-timeout-ms",
        parse=positive_int,
    )
    idle_timeout: float = _ms(
        "HTTP: how long an idle keep-alive connection is kept open",
        DEFAULT_IDLE_TIMEOUT,
        flag="idle-timeout-ms",
        parse=positive_int,
    )
    store: str = setting(
        "memory",
        "memory (lost on restart), sqlite:PATH (durable) or postgres://USER@HOST:PORT/DB "
        "(durable, shared by brokers; several HOST:PORT, comma-separated, for a failover: the "
        "broker uses the one that takes writes)",
        metavar="STORE",
    )
    db_timeout: float = _ms(
        "PostgreSQL: the longest any database call may take (the server's statement_timeout, "
        "and the broker's own deadline on the answer); past it the call fails with 503 / "
        "UNAVAILABLE, and the broker probes the database at once",
        DB_DEADLINE,
        flag="db-timeout-ms",
        parse=positive_int,
    )
    sqlite_sync: str = setting(
        "full",
        "full: every answer is on disk; normal: survives kill -9, not power loss",
        choices=("full", "normal"),
    )
    log_level: str = setting("info", "log verbosity", choices=("debug", "info", "warning", "error"))
    loop: str = setting("uvloop", "event loop implementation", choices=("uvloop", "asyncio"))
    log_format: str = setting(
        "text",
        "text: a line per record; json: one JSON object per line (level, time, message, "
        "logger and the record's fields: task_id, queue ...)",
        choices=LOG_FORMATS,
    )
    access_log: bool = setting(False, "log every HTTP request (JSON with -log-format json)")
    http_fast_lane: bool = setting(
        True,
        "serve the hot HTTP requests (enqueue, claim, ack ...) without aiohttp's per-request "
        "machinery, with the same answers; false: every request through aiohttp",
    )
    max_tasks: int = setting(
        DEFAULT_MAX_TASKS,
        "tasks held (ready, delayed, handed out, waiting, and results kept) before enqueues get "
        "429; 0: no limit",
        parse=non_negative_int,
        metavar="N",
    )
    max_waiters: int = setting(
        DEFAULT_MAX_WAITERS,
        "parked long-polls and open streams before more get 429; 0: no limit",
        parse=non_negative_int,
        metavar="N",
    )
    max_queues: int = setting(
        DEFAULT_MAX_QUEUES,
        "named queues kept before an enqueue (or pause) to a new one gets 429; 0: no limit",
        parse=non_negative_int,
        metavar="N",
    )
    max_schedules: int = setting(
        DEFAULT_MAX_SCHEDULES,
        "schedules kept before a put of a new one gets 429; 0: no limit",
        parse=non_negative_int,
        metavar="N",
    )
    # How long an idempotency key is remembered (five minutes by default, as SQS FIFO's).
    dedup_window: float = _ms(
        "how long an idempotency key is remembered: an enqueue with the same key and queue "
        "within it is answered with the first task's id and creates nothing",
        DEFAULT_DEDUP_WINDOW_MS / 1000,
        flag="dedup-window-ms",
        parse=non_negative_int,
    )
    # docs/design/results.md: how long a result (an ack's) is kept, unless the task says.
    result_ttl: float = _ms(
        "how long a task acked with a result keeps it (GET /jobs/{id}/result), unless the task "
        "gives result_ttl_ms; 0: keep none",
        DEFAULT_RESULT_TTL_MS / 1000,
        flag="result-ttl-ms",
        parse=_result_ttl_ms,
    )
    # docs/design/schedules.md: schedules put at start-up (wqbroker/schedulefile.py).
    schedule_file: str | None = setting(
        None,
        "put these schedules at start-up: a TOML file ([schedules.NAME] tables, if named .toml) "
        'or JSON ({"schedules": {NAME: {...}}}), each with the members of PUT '
        "/schedules/{name}; a schedule of that name is replaced (one unchanged keeps its next "
        "fire time), others are left alone",
        metavar="FILE",
    )
    token_file: str | None = setting(
        None,
        "require bearer tokens: a file of lines TOKEN SCOPE[,SCOPE...] (scopes produce, "
        "consume, admin, metrics), read again on SIGHUP; unset, no token is needed",
        metavar="PATH",
    )
    metrics_public: bool = setting(
        False, "GET /metrics needs no token even with -token-file (else: the metrics scope)"
    )
    # wqbroker/protected.py: without a token file, only loopback clients, unless this.
    public: bool = setting(
        False,
        "without -token-file, serve clients from every address (else only loopback ones: "
        "127.0.0.0/8, ::1); anyone who can reach the ports can then enqueue, purge, requeue "
        "and pause. With -token-file every address is served anyway (tokens protect it)",
    )
    tls_cert: str | None = setting(
        None,
        "serve HTTPS and gRPC over TLS with this PEM certificate chain (with -tls-key)",
        metavar="PATH",
    )
    tls_key: str | None = setting(None, "the PEM private key of -tls-cert", metavar="PATH")


def _spec(f: Field[Any]) -> _Flag:
    spec = f.metadata[_FLAG]
    assert isinstance(spec, _Flag)
    return spec


def _flag(f: Field[Any]) -> Flag:
    """The command-line flag of one field of Config."""
    spec = _spec(f)
    assert f.default is not MISSING
    default: Any = f.default
    if spec.millis:
        default = round(default * 1000)
    elif default is None:
        default = ""  # (unset)
    return Flag(
        spec.name or f.name.replace("_", "-"),
        default=default,
        help=spec.help,
        parse=spec.parse,
        choices=spec.choices,
        metavar=spec.metavar,
    )


_FIELDS: Final = tuple(fields(Config))

#: The broker's flags, one per field of Config, in its order.
FLAGS: Final[tuple[Flag, ...]] = tuple(_flag(f) for f in _FIELDS)


def _value(f: Field[Any], given: Any) -> Any:
    """A field's value from its flag's: milliseconds as seconds, "" as unset."""
    if _spec(f).millis:
        return given / 1000.0
    if f.default is None and given == "":
        return None
    return given


def config_from_args(args: argparse.Namespace) -> Config:
    """The config the parsed flags (:data:`FLAGS`) give."""
    values = {
        f.name: _value(f, getattr(args, flag.dest)) for f, flag in zip(_FIELDS, FLAGS, strict=True)
    }
    return Config(**values)
