"""The distribution as users get it: a wheel built from this tree (``python -m build``), installed
into a fresh virtualenv, run from there with nothing of the tree on its path.

``pip install wqueue`` is the client alone (no broker dependencies, no gRPC loaded for HTTP);
``wqueue[broker]`` adds what the broker needs, and the broker started from it serves the
dashboard and a task end to end, on SQLite and on PostgreSQL, whose schemas are made from the
migration files in the wheel.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests import pg
from tests.procs import ROOT, broker_process
from tests.wheel import run, session_wheel, virtualenv

pytestmark = [
    pytest.mark.slow,  # (seconds of wall time each: make test-fast leaves them out)
    # One xdist worker takes them all: the wheel and the virtualenvs (module fixtures, half a
    # minute each) are made once, not once per worker that draws one of these tests.
    pytest.mark.xdist_group("packaging"),
]

# The broker's dependencies, none of which a client-only install has or loads.
_BROKER_ONLY = ("asyncpg", "uvloop", "prometheus_client", "rich", "grpc_health", "grpc_reflection")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # (Built once per session, shared with the newcomer test: tests/wheel.py.)
    return session_wheel(tmp_path_factory)


def test_the_wheel_holds_the_dashboard_the_proto_and_the_sql(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for ui in ("index.html", "app.js", "style.css"):
        assert f"wqbroker/http/ui/{ui}" in names
    assert "wqwire/pb/broker.proto" in names
    proto = zipfile.ZipFile(wheel).read("wqwire/pb/broker.proto")
    assert proto == (ROOT / "proto/wqwire/pb/broker.proto").read_bytes()
    sql = {name for name in names if name.endswith(".sql")}
    assert sql == {str(path.relative_to(ROOT)) for path in (ROOT / "wqbroker").rglob("*.sql")}, (
        "every .sql file of the tree is in the wheel"
    )
    assert not any(name.startswith("tests/") for name in names)


def test_the_client_alone_has_and_loads_nothing_of_the_broker(wheel: Path, tmp_path: Path) -> None:
    bin_dir = virtualenv(tmp_path / "venv", str(wheel))
    check = (
        "import importlib.util, sys, wqclient\n"
        "wqclient.Client('http://127.0.0.1:9')\n"
        f"print([m for m in {_BROKER_ONLY!r} if importlib.util.find_spec(m)])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))\n"
    )
    installed, loaded = run(bin_dir / "python", "-c", check, cwd=tmp_path).splitlines()
    assert (installed, loaded) == ("[]", "[]")
    refused = subprocess.run(
        [bin_dir / "wqbroker"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith("pip install 'wqueue[broker]'"), refused.stderr


@pytest.fixture(scope="module")
def broker_bin(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return virtualenv(tmp_path_factory.mktemp("venv") / "venv", f"{wheel}[broker]")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_installed_broker_serves_the_dashboard_and_a_task(
    broker_bin: Path, backend: str, tmp_path: Path
) -> None:
    # (Each store makes its schema from the migration files the wheel carries.)
    if backend == "sqlite":
        store = f"sqlite:{tmp_path / 'wq.db'}"
    else:
        store = asyncio.run(pg.create_database("wheel"))
    with broker_process("-store", store, program=broker_bin / "wqbroker") as broker:
        page = _get(broker.url + "/ui/")
        assert b"<html" in page.lower()
        assert _get(broker.url + "/ui/app.js")
        task_id = _json("POST", broker.url + "/jobs", {"payload": {"n": 1}})["id"]
        delivery = _json("GET", broker.url + "/jobs/next?wait_ms=1000")
        assert delivery["task"]["id"] == task_id
        assert delivery["task"]["payload"] == {"n": 1}
        ack = f"{broker.url}/jobs/{task_id}/ack?lease_id={delivery['lease_id']}"
        assert _json("POST", ack) is None
        assert _json("GET", broker.url + "/stats")["totals"]["acked"] == 1


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        body: bytes = answer.read()
        return body


def _json(method: str, url: str, body: object = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read()
    if not text:
        return None
    return json.loads(text)
