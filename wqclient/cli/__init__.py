"""The commands: ``wq`` (:mod:`wqclient.cli.admin`), ``wq-worker`` (:mod:`wqclient.cli.worker`) and
``wq-producer`` (:mod:`wqclient.cli.producer`), each also ``python -m wqclient.cli.NAME``.

They are built on the public client API only (``AsyncClient``, ``Worker``), follow the flag
conventions of :mod:`wqwire.flags` (one dash or two, the value after a space or ``=``, strict
names, one-line errors with exit status 2), and find their broker, token and CA file the same way
(:func:`add_connection_flags`, :func:`connection`): a flag, else (``wq worker``) the App's own,
else ``$WQ_BROKER``, ``$WQ_TOKEN`` or ``$WQ_TOKEN_FILE``, ``$WQ_CA_FILE``, else the default.
Their entry points are here: a command whose packages are not installed (``pip install wqueue``
is the client alone) says which extra brings them.

A command keeps gRPC's core to its errors (``GRPC_VERBOSITY=ERROR``, unless the variable is set):
the commands say in their own words what went wrong, where the core would write a line at INFO
for every failed attempt (a TLS handshake that failed, at every reconnection).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from wqclient.client import ENV_BROKER, ENV_CA_FILE, ENV_TOKEN
from wqclient.limits import DEFAULT_URL
from wqwire.flags import run_command

__all__ = [
    "ENV_BROKER",
    "ENV_CA_FILE",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "Connection",
    "SettingError",
    "add_auth_flags",
    "add_broker_flag",
    "add_connection_flags",
    "connection",
    "quiet_grpc",
    "wq",
    "wq_producer",
    "wq_worker",
]


ENV_TOKEN_FILE: Final = "WQ_TOKEN_FILE"
"""The variable naming a file that holds the bearer token (instead of ``$WQ_TOKEN``)."""


def quiet_grpc() -> None:
    """Keep gRPC's core to its errors, unless ``$GRPC_VERBOSITY`` says otherwise (a command's
    first act: the core reads it once, when grpc is imported)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def wq() -> int:
    """``wq``: the admin command (needs the ``cli`` extra: rich)."""
    quiet_grpc()
    return run_command("wq", "wqclient.cli.admin", "cli")


def wq_worker() -> int:
    """``wq-worker``: the spec's worker, appending each task to a log file."""
    quiet_grpc()
    return run_command("wq-worker", "wqclient.cli.worker", "cli")


def wq_producer() -> int:
    """``wq-producer``: the spec's producer (needs the ``cli`` extra: rich, for its progress)."""
    quiet_grpc()
    return run_command("wq-producer", "wqclient.cli.producer", "cli")


def add_broker_flag(p: argparse.ArgumentParser, *, app: bool = False) -> None:
    """``-broker URL`` (default: ``$WQ_BROKER``, else DEFAULT_URL; with ``app``, the App's own
    first: ``wq worker``)."""
    first = "the App's own, else " if app else ""
    p.add_argument(
        "-broker",
        "--broker",
        default=None,
        metavar="URL",
        help="broker URL: http://host:port, or grpc://host:port to stream; https://, grpcs:// "
        "for TLS; several brokers as http://a:port,b:port "
        f"(default {first}${ENV_BROKER}, else {DEFAULT_URL})",
    )


def add_auth_flags(p: argparse.ArgumentParser, *, app: bool = False) -> None:
    """``-token``, ``-token-file`` and ``-ca-file`` (with ``app``, the App's own come before
    the variables: ``wq worker``)."""
    first = "the App's own, else " if app else ""
    p.add_argument(
        "-token",
        "--token",
        metavar="TOKEN",
        help=f"bearer token for a broker that wants one (default {first}${ENV_TOKEN}, or the "
        f"contents of ${ENV_TOKEN_FILE}; prefer those: a command line is visible to other users)",
    )
    p.add_argument(
        "-token-file",
        "--token-file",
        metavar="PATH",
        help=f"read the bearer token from this file, instead of -token (default {first}"
        f"${ENV_TOKEN_FILE}; it and ${ENV_TOKEN} both set is an error)",
    )
    p.add_argument(
        "-ca-file",
        "--ca-file",
        metavar="PATH",
        help="PEM CA certificate(s) to verify an https:// or grpcs:// broker with "
        f"(default {first}${ENV_CA_FILE}, else the system's store)",
    )


def add_connection_flags(p: argparse.ArgumentParser, *, app: bool = False) -> None:
    """``-broker``, ``-token``, ``-token-file`` and ``-ca-file``: every client command's."""
    add_broker_flag(p, app=app)
    add_auth_flags(p, app=app)


class SettingError(Exception):
    """A broker, token or CA file that cannot be used: one line to print, and exit status 2."""


@dataclass(frozen=True, slots=True)
class Connection:
    """Where a command's client goes and what it presents. ``token`` and ``ca_file``: ``""``
    for none (so the client does not look at the environment again)."""

    broker: str
    token: str
    ca_file: str


def connection(
    args: argparse.Namespace,
    *,
    broker: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Connection:
    """The broker, token and CA file a command uses, each from the first that says: its flag
    (``args``), its value given here (``wq worker``: the App's own), its variable
    (``$WQ_BROKER``; ``$WQ_TOKEN`` or ``$WQ_TOKEN_FILE``; ``$WQ_CA_FILE``; empty is unset), the
    default (DEFAULT_URL; none). Raises SettingError for ``-token`` with ``-token-file``, for
    ``$WQ_TOKEN`` with ``$WQ_TOKEN_FILE`` when nothing before them settles it, and for a token
    file that cannot be read or does not hold one token."""
    env = os.environ if environ is None else environ

    def var(name: str) -> str | None:
        return env.get(name, "").strip() or None

    url = args.broker or broker or var(ENV_BROKER) or DEFAULT_URL
    return Connection(
        url, _token(args, token, var), args.ca_file or ca_file or var(ENV_CA_FILE) or ""
    )


def _token(args: argparse.Namespace, own: str | None, var: Callable[[str], str | None]) -> str:
    flag_token: str | None = getattr(args, "token", None)
    flag_file: str | None = getattr(args, "token_file", None)
    if flag_token is not None and flag_file is not None:
        raise SettingError("give -token or -token-file, not both")
    if flag_token is not None:
        return flag_token
    if flag_file is not None:
        return read_token_file(flag_file, "-token-file")
    if own is not None:
        return own
    from_env, file = var(ENV_TOKEN), var(ENV_TOKEN_FILE)
    if from_env is not None and file is not None:
        raise SettingError(
            f"${ENV_TOKEN} and ${ENV_TOKEN_FILE} are both set: unset one, or give -token or "
            "-token-file"
        )
    if file is not None:
        return read_token_file(file, f"${ENV_TOKEN_FILE}")
    return from_env or ""


def read_token_file(path: str, source: str) -> str:
    """The token a file holds (around it, white space is ignored); SettingError naming the file
    (and ``source``: where its name came from) if it cannot be read or holds no single token."""
    where = f"the token file {path} (from {source})"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SettingError(f"cannot read {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SettingError(f"{where} is not text: it should hold one token") from None
    token = text.strip()
    if not token:
        raise SettingError(f"{where} is empty: it should hold one token")
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise SettingError(
            f"{where} does not hold one token (printable ASCII without spaces); a broker's "
            "token file, of lines TOKEN SCOPES, is not a client's"
        )
    return token
