"""``python -m wqbroker`` as a user runs it: flags, the listening line, signals, a taken port."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.procs import broker_command, broker_process
from wqbroker.broker import parse_addr

pytestmark = pytest.mark.timeout(60)


def get(url: str, timeout: float = 10) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = resp.read()
        return resp.status, json.loads(body) if body else None


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = resp.read()
        return resp.status, json.loads(data) if data else None


def test_broker_logs_where_it_listens_and_serves() -> None:
    with broker_process() as broker:
        assert broker.url.startswith("http://127.0.0.1:")
        assert get(broker.url + "/healthz") == (200, {"status": "ok"})
        status, _body = post(broker.url + "/jobs", {"payload": {"line": "hi"}})
        assert status == 201
        status, stats = get(broker.url + "/stats")
        assert stats["ready"] == 1


@pytest.mark.parametrize(
    "spelling",
    [
        ["-addr", "127.0.0.1:0"],
        ["--addr", "127.0.0.1:0"],
        ["-addr=127.0.0.1:0"],
        ["--addr=127.0.0.1:0"],
    ],
)
def test_addr_flag_spellings(spelling: list[str]) -> None:
    with broker_process(*spelling) as broker:
        assert get(broker.url + "/healthz")[0] == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_answers_open_long_polls_and_exits_0(sig: int) -> None:
    with broker_process() as broker:
        results: list[int] = []

        def poll() -> None:
            results.append(get(broker.url + "/jobs/next?wait_ms=30000", timeout=20)[0])

        thread = threading.Thread(target=poll)
        thread.start()
        time.sleep(0.3)  # a real process: give the poll time to park before the signal
        assert broker.stop(sig) == 0
        thread.join(10)
        assert results == [204]
        assert any("shutting down" in line for line in broker.log_lines)


def test_taken_port_is_a_one_line_error_and_nonzero_exit() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            broker_command("-addr", f"127.0.0.1:{port}"), capture_output=True, text=True, timeout=20
        )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "cannot listen" in lines[0] and str(port) in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["-addr", "nonsense"],
        ["-addr", ":99999"],
        ["-sweep-interval-ms", "0"],
        ["-sweep-interval-ms", "abc"],
        ["-no-such-flag"],
    ],
)
def test_bad_flags_are_usage_errors(args: list[str]) -> None:
    proc = subprocess.run(broker_command(*args), capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (":8080", (None, 8080)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:80", ("::1", 80)),
        ("localhost:1234", ("localhost", 1234)),
        ("8080", (None, 8080)),
    ],
)
def test_parse_addr(text: str, expected: tuple[str | None, int]) -> None:
    assert parse_addr(text) == expected


@pytest.mark.parametrize("text", ["nonsense", "host:", ":-1", ":65536", "a:b"])
def test_parse_addr_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_addr(text)
