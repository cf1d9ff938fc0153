"""Several brokers in one HTTP URL (``http://a:8080,b:8080``): which of them a request goes to.

Requests are spread over the brokers in turn (round robin), as gRPC's channel spreads its calls
over the addresses of a ``grpc://a:port,b:port`` target. A broker that cannot be connected to
(the connection refused, the host unreachable or unknown, no connection within the time-out: the
request was not sent) is skipped for a while, :data:`SKIP_FIRST` seconds at first, twice as long
after each failure in a row up to :data:`SKIP_MAX`, and the request goes to the next broker. A
request that reached a broker is never sent to another, whatever became of it: an enqueue the
first broker took and whose answer was lost would be enqueued twice. When every broker has
failed to connect, the request fails (``Unavailable``); skipped brokers are tried last, not
never, so a request fails only when none of them can be reached.

The brokers are meant to act as one: several brokers on one PostgreSQL database (a task claimed
from one is acked through whichever the ack goes to, as over gRPC).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit, urlunsplit

from wqclient.clock import Clock
from wqclient.errors import WqError

# How long a broker that could not be connected to is skipped: this at first, twice as long
# after each failure in a row, up to SKIP_MAX.
SKIP_FIRST: Final = 1.0
SKIP_MAX: Final = 30.0


def split_brokers(url: str) -> list[str]:
    """The base URL of each broker a URL names: ``http://a:8080,b:8080/x`` is
    ``http://a:8080/x`` and ``http://b:8080/x``; a URL of one broker is itself. Raises WqError
    for an empty host among several (``http://a:8080,,b:8080``)."""
    parts = urlsplit(url)
    if "," not in parts.netloc:
        bases = [url]
    else:
        hosts = [host.strip() for host in parts.netloc.split(",")]
        if not all(hosts):
            raise WqError(f"broker URL {url!r}: a host is missing between commas (a:port,b:port)")
        bases = [urlunsplit(parts._replace(netloc=host)) for host in hosts]
    for base in bases:
        _check(url, base)
    return bases


def _check(url: str, base: str) -> None:
    """Raises WqError if ``base`` (one broker of ``url``) has no host or a port that is not
    one."""
    parts = urlsplit(base)
    try:
        _ = parts.port  # (ValueError if it is not a port)
    except ValueError:
        raise WqError(f"broker URL {url!r}: {parts.netloc!r} has no valid port") from None
    if not parts.hostname:
        raise WqError(f"broker URL {url!r} has no host")


class Brokers:
    """The brokers of one URL and what is known of them: whose turn it is, and which to skip
    until when (see the module's text)."""

    def __init__(self, bases: Sequence[str], clock: Clock) -> None:
        self.bases = list(bases)
        self._clock = clock
        self._turn = 0
        self._skip_until = [0.0] * len(self.bases)
        self._failures = [0] * len(self.bases)  # failures to connect in a row

    def order(self) -> list[int]:
        """The brokers to try the next request on, in order (by index): from the one whose turn
        it is, those not skipped; then the skipped ones, the soonest back first."""
        count = len(self.bases)
        start = self._turn
        now = self._clock.monotonic()
        turns = [(start + k) % count for k in range(count)]
        ready = [i for i in turns if self._skip_until[i] <= now]
        # (The next turn is the one after the broker this request goes to: the brokers not
        # skipped share the requests evenly.)
        self._turn = ((ready[0] if ready else start) + 1) % count
        if len(ready) == count:
            return ready
        skipped = sorted(
            (i for i in turns if self._skip_until[i] > now), key=self._skip_until.__getitem__
        )
        return ready + skipped

    def unreachable(self, i: int) -> None:
        """Broker ``i`` could not be connected to: skip it for a while."""
        failures = self._failures[i] = min(self._failures[i] + 1, 32)
        skip = min(SKIP_MAX, SKIP_FIRST * 2 ** (failures - 1))
        self._skip_until[i] = self._clock.monotonic() + skip

    def went_on(self, i: int) -> None:
        """A request the broker whose turn it was could not take went on to broker ``i``: the
        next turn is the one after ``i``."""
        self._turn = (i + 1) % len(self.bases)

    def reached(self, i: int) -> None:
        """A request reached broker ``i``: it is skipped no longer."""
        if self._failures[i]:
            self._failures[i] = 0
            self._skip_until[i] = 0.0
