"""What importing a part of wq loads: the broker's core (the service, its events, the metrics
registry) speaks no protocol, the HTTP side does not load gRPC, and neither does the client (nor
anything of the broker's) until a grpc:// URL asks for it. Each import runs in a fresh interpreter
(this one has loaded everything)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "not_loaded"),
    [
        ("wqbroker.metrics", ("grpc", "aiohttp")),
        ("wqbroker.events", ("grpc", "aiohttp")),
        ("wqbroker.service", ("grpc", "aiohttp")),
        ("wqbroker.http.app", ("grpc",)),
    ],
)
def test_a_module_loads_no_protocol_it_does_not_speak(
    module: str, not_loaded: tuple[str, ...]
) -> None:
    code = f"import sys, {module}; print(*(m for m in {not_loaded!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"import {module} loaded {done.stdout.strip()}"


_BROKERS_OWN = ("wqbroker", "asyncpg", "uvloop", "prometheus_client", "rich")


@pytest.mark.parametrize(
    ("code", "not_loaded"),
    [
        ("import wqclient; wqclient.Client('http://127.0.0.1:9').close()", ("grpc", *_BROKERS_OWN)),
        ("import wqwire.defaults, wqwire.scan, wqwire.flags", ("grpc", "aiohttp", "wqclient")),
        ("import wqclient; wqclient.Client('grpc://127.0.0.1:9').close()", _BROKERS_OWN),
    ],
    ids=["http-client", "wire", "grpc-client"],
)
def test_the_client_loads_what_its_url_needs_and_nothing_of_the_broker(
    code: str, not_loaded: tuple[str, ...]
) -> None:
    probe = f"{code}; import sys; print(*(m for m in {not_loaded!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{code} loaded {done.stdout.strip()}"
