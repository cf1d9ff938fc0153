"""Real broker processes for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"HTTP API listening on (http://\S+)")


class BrokerProcess:
    def __init__(self, proc: subprocess.Popen[str], url: str, log_lines: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.log_lines = log_lines

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        assert self.proc.stderr is not None
        self.log_lines.extend(self.proc.stderr.read().splitlines())
        return rc


def broker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wqbroker", *args]


def spawn(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        list(cmd),
        cwd=cwd or ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def broker_process(*args: str, timeout: float = 15) -> Iterator[BrokerProcess]:
    """Start ``python -m wqbroker -addr 127.0.0.1:0 ...`` and wait for its listening line."""
    if not any(a.lstrip("-").startswith("addr") for a in args):
        args = ("-addr", "127.0.0.1:0", *args)
    if not any(a.lstrip("-").startswith("grpc-addr") for a in args):
        args = ("-grpc-addr", "127.0.0.1:0", *args)
    proc = spawn(broker_command(*args))
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    url = None
    assert proc.stderr is not None
    while url is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("broker did not start:\n" + "\n".join(lines))
        line = proc.stderr.readline()
        if not line:
            proc.wait()
            raise AssertionError("broker exited at start:\n" + "\n".join(lines))
        lines.append(line.rstrip("\n"))
        match = _LISTEN.search(line)
        if match:
            url = match.group(1)
    broker = BrokerProcess(proc, url, lines)
    try:
        yield broker
    finally:
        broker.stop()
