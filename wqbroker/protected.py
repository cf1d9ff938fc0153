"""Protected mode (Redis's is the model): a broker started without a token file serves only
clients on this machine.

Without ``-token-file`` nothing asks a caller who it is, so anyone who can reach the ports could
enqueue, purge, requeue and pause. Unless ``-public`` says that is wanted, such a broker serves
only **loopback** peers (127.0.0.0/8, ``::1``, IPv4-mapped ``::ffff:127.x.y.z``; a Unix socket's),
and answers every other peer with :data:`REFUSAL` (HTTP 403, gRPC PERMISSION_DENIED), which says
what to do. With a token file every address is served: the tokens protect the broker.

The health probes (:data:`PROBES`: ``GET /healthz``, ``GET /readyz``, gRPC health checking) are
answered for every peer, as they are without a token when there is a token file: a kubelet's
liveness and readiness probes come from the node's address, not loopback, and a broker whose
clients share its pod (loopback) must not be restarted for failing them. They tell whether the
broker is up and ready, nothing more.

This module is the rule, once, for both protocols: the HTTP server (``wqbroker.http.server``)
checks a connection's peer once, when it is accepted; the gRPC interceptor
(``wqbroker.grpc.protected``) checks the peer of each call (gRPC gives no hook on a connection;
the answer is remembered per peer address and port, that is, per connection).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Final
from urllib.parse import unquote

from wqbroker.auth import Routes

__all__ = [
    "PROBES",
    "REFUSAL",
    "RefusalLog",
    "describe_peer",
    "grpc_peer_is_local",
    "is_loopback",
    "local_peer",
]

log = logging.getLogger("wqbroker")

#: The answer to a peer that is not on this machine, on every route and method but PROBES.
REFUSAL: Final = (
    "this broker has no token file (-token-file), so it serves only loopback clients; "
    "give it -token-file, or -public to serve anyone without authentication"
)

#: What every peer is answered, in protected mode too: liveness and readiness probes.
PROBES: Final = Routes(
    http=("GET /healthz", "GET /readyz"),
    grpc=(
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.health.v1.Health/List",
    ),
)
# (Each of them needs no token with a token file either: NO_TOKEN has them all.)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address as text, IPv6 with or without brackets or a ``%zone``) is
    a loopback address: 127.0.0.0/8, ``::1``, or an IPv4-mapped IPv6 address of 127.0.0.0/8.
    Anything else, a name or text that is no address included, is not."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.partition("%")[0]  # (a zone: fe80::1%eth0)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def local_peer(peername: object) -> bool:
    """Whether a socket's peer (``transport.get_extra_info("peername")``) is on this machine: an
    address tuple whose host is loopback, or a Unix socket's (a path, or ``""`` for an unnamed
    one). None (the peer is gone, or unknown) is not."""
    if isinstance(peername, (str, bytes)):
        return True  # (a Unix socket: only this machine can connect to one)
    if isinstance(peername, tuple) and peername and isinstance(peername[0], str):
        return is_loopback(peername[0])
    return False


def grpc_peer_is_local(peer: str | None) -> bool:
    """Whether a gRPC call's peer (``context.peer()``: ``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``, ``unix:/path``, percent-encoded by newer gRPC versions) is on this
    machine."""
    if not peer:
        return False
    text = unquote(peer)
    scheme, sep, rest = text.partition(":")
    if not sep:
        return False
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme not in ("ipv4", "ipv6"):
        return False
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return False
    return is_loopback(host)


def describe_peer(peername: object) -> str:
    """A socket's peer for a log line: ``host:port`` (``[v6]:port``), else as it is."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host = str(peername[0])
        return f"[{host}]:{peername[1]}" if ":" in host else f"{host}:{peername[1]}"
    return str(peername)


# A refused peer is logged at INFO at most once in this many seconds; the others at DEBUG.
REPORT_EVERY: Final = 10.0


class RefusalLog:
    """Logs refused peers for the operator: one line at INFO at most every REPORT_EVERY seconds
    (saying how many more were refused since), the others at DEBUG. ``now`` is the caller's
    clock (the event loop's time)."""

    def __init__(self, protocol: str) -> None:
        self._protocol = protocol
        self._next = 0.0
        self._quiet = 0

    def refused(self, now: float, peer: object) -> None:
        if now < self._next:
            self._quiet += 1
            log.debug(
                "refused %s client %s: not loopback, and no -token-file", self._protocol, peer
            )
            return
        also = f" (and {self._quiet} more since)" if self._quiet else ""
        log.info(
            "refused %s client %s%s: this broker has no -token-file, so it serves only loopback "
            "clients (-public serves anyone)",
            self._protocol,
            peer,
            also,
        )
        self._next = now + REPORT_EVERY
        self._quiet = 0
