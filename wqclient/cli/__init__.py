"""The commands: ``wq`` (:mod:`wqclient.cli.admin`), ``wq-worker`` (:mod:`wqclient.cli.worker`) and
``wq-producer`` (:mod:`wqclient.cli.producer`), each also ``python -m wqclient.cli.NAME``.

They are built on the public client API only (``AsyncClient``, ``Worker``), follow the flag
conventions of :mod:`wqwire.flags` (one dash or two, the value after a space or ``=``, strict
names, one-line errors with exit status 2), and take a token and a CA file the same way (below).
Their entry points are here: a command whose packages are not installed (``pip install wqueue``
is the client alone) says which extra brings them.

A command keeps gRPC's core to its errors (``GRPC_VERBOSITY=ERROR``, unless the variable is set):
the commands say in their own words what went wrong, where the core would write a line at INFO
for every failed attempt (a TLS handshake that failed, at every reconnection).
"""

from __future__ import annotations

import argparse
import os

from wqclient.client import ENV_CA_FILE, ENV_TOKEN
from wqwire.flags import run_command

__all__ = ["add_auth_flags", "quiet_grpc", "wq", "wq_producer", "wq_worker"]


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


def add_auth_flags(p: argparse.ArgumentParser) -> None:
    """``-token`` and ``-ca-file``, for wq-worker and wq-producer."""
    p.add_argument(
        "-token",
        "--token",
        metavar="TOKEN",
        help=f"bearer token for a broker that wants one (default ${ENV_TOKEN}; prefer it: "
        "a command line is visible to other users)",
    )
    p.add_argument(
        "-ca-file",
        "--ca-file",
        metavar="PATH",
        help="PEM CA certificate(s) to verify an https:// or grpcs:// broker with "
        f"(default ${ENV_CA_FILE}, else the system's store)",
    )
