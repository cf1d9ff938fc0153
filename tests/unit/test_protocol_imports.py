"""What importing a part of the broker loads: the core (the service, its events, the metrics
registry) speaks no protocol, and the HTTP side does not load gRPC. Each import runs in a fresh
interpreter (this one has loaded everything)."""

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
