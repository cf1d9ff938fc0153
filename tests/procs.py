"""Real broker, worker and producer processes for end-to-end tests."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import wait_until_sync

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"HTTP API listening on (https?://\S+)")
_GRPC_LISTEN = re.compile(r"gRPC API listening on (\S+)")


class BrokerProcess:
    def __init__(
        self,
        proc: subprocess.Popen[str],
        url: str,
        log_lines: list[str],
        grpc_target: str | None = None,
        reader: threading.Thread | None = None,
    ) -> None:
        self.proc = proc
        self.url = url
        self.log_lines = log_lines  # the broker's log so far (kept up to date while it runs)
        self.grpc_target = grpc_target  # host:port of the gRPC API, None when it is off
        self._reader = reader

    @property
    def grpc_url(self) -> str:
        """The gRPC API as a client URL, ``grpc://host:port``."""
        assert self.grpc_target is not None, "this broker's gRPC API is off"
        return "grpc://" + self.grpc_target

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        assert self.proc.stderr is not None
        if self._reader is not None:
            self._reader.join(timeout)
        else:
            self.log_lines.extend(self.proc.stderr.read().splitlines())
        return rc


def _read_log(proc: subprocess.Popen[str], lines: list[str]) -> threading.Thread:
    """Keep reading the log while the process runs, so a chatty broker never fills the pipe."""
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def broker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wqbroker", *args]


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wqclient.cli.worker", *args]


def producer_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wqclient.cli.producer", *args]


def env() -> dict[str, str]:
    """The environment for a child: unbuffered, and able to import the project from any cwd."""
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""),
    )


def spawn(
    cmd: Sequence[str], cwd: Path | None = None, *, installed: bool = False
) -> subprocess.Popen[str]:
    """Start ``cmd``; with ``installed``, as an installed program (no PYTHONPATH to this tree)."""
    child_env = env()
    if installed:
        del child_env["PYTHONPATH"]
    return subprocess.Popen(
        list(cmd),
        cwd=cwd or ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range() -> tuple[int, int]:
    """The ports this test process hands out: below the kernel's ephemeral range, and under
    pytest-xdist a slice of its own per worker (``gw0``, ``gw1`` ...), so two workers never
    pick the same port for brokers they start at the same moment."""
    low, high = 20000, max(_ephemeral_low(), 20001)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        size = (high - low) // count
        low += int(worker[2:]) * size
        high = low + size
    return low, high


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to (at the moment of asking), for a broker
    started on it later.

    It is taken from below the kernel's ephemeral range, never from it: a port the kernel handed
    out for ``bind(0)`` is one it may give next to any outgoing connection (the tests' own clients
    make hundreds), and a broker then cannot listen on it ("address already in use", seen in CI).
    No port is handed out twice in one test run (nor by two workers: :func:`_port_range`)."""
    rng = random.SystemRandom()
    low, high = _port_range()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise AssertionError("no free port below the ephemeral range")


def _flag_value(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        flag, eq, value = arg.lstrip("-").partition("=")
        if flag == name:
            if eq:
                return value
            return args[i + 1] if i + 1 < len(args) else None
    return None


def _grpc_enabled(args: Sequence[str]) -> bool:
    value = _flag_value(args, "grpc-addr")
    return value is None or value.strip().lower() not in ("", "off", "none")


@contextmanager
def broker_process(
    *args: str, timeout: float = 15, program: Path | None = None
) -> Iterator[BrokerProcess]:
    """Start ``python -m wqbroker -addr 127.0.0.1:0 -grpc-addr 127.0.0.1:0 ...`` and wait for its
    listening lines (HTTP, and gRPC unless it is switched off). ``program``: an installed
    ``wqbroker`` to run instead (from a directory of its own, importing nothing of this tree)."""
    if not any(a.lstrip("-").startswith("addr") for a in args):
        args = ("-addr", "127.0.0.1:0", *args)
    if not any(a.lstrip("-").startswith("grpc-addr") for a in args):
        args = ("-grpc-addr", "127.0.0.1:0", *args)
    want_grpc = _grpc_enabled(args)
    if program is None:
        proc = spawn(broker_command(*args))
    else:
        proc = spawn([str(program), *args], program.parent, installed=True)
    lines: list[str] = []
    reader = _read_log(proc, lines)

    def found(pattern: re.Pattern[str]) -> str | None:
        matches = (pattern.search(line) for line in list(lines))
        return next((m.group(1) for m in matches if m), None)

    def listening() -> bool:
        return found(_LISTEN) is not None and (not want_grpc or found(_GRPC_LISTEN) is not None)

    try:
        wait_until_sync(
            lambda: listening() or proc.poll() is not None,
            what="the broker to say where it listens",
            timeout=timeout,
        )
    except AssertionError:
        proc.kill()
        reader.join(timeout)
        raise AssertionError("broker did not start:\n" + "\n".join(lines)) from None
    url = found(_LISTEN)
    if url is None or not listening():
        proc.kill()
        proc.wait()
        reader.join(timeout)
        raise AssertionError("broker exited at start:\n" + "\n".join(lines))
    broker = BrokerProcess(proc, url, lines, found(_GRPC_LISTEN), reader)
    try:
        yield broker
    finally:
        broker.stop()
