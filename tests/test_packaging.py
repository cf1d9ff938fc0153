"""The distribution as users get it: a wheel built from this tree (``python -m build``), installed
into a fresh virtualenv, run from there with nothing of the tree on its path.

``pip install wqueue`` is the client alone (no broker dependencies, no gRPC loaded for HTTP);
``wqueue[broker]`` adds what the broker needs, and the broker started from it serves the
dashboard and a task end to end, on a store whose migrations are files in the wheel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ROOT, broker_process

# What the copy of the tree the wheel is built from leaves out (built or installed things).
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "node_modules", "__pycache__", "*.egg-info", ".*_cache", "build", "dist"
)
# The broker's dependencies, none of which a client-only install has or loads.
_BROKER_ONLY = ("asyncpg", "uvloop", "prometheus_client", "rich", "grpc_health", "grpc_reflection")


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    # (No isolation: the build backend is this environment's setuptools, nothing downloaded.)
    _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", work / "dist", source)
    (built,) = (work / "dist").glob("wqueue-*.whl")
    return built


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


def test_a_fresh_virtualenv_gets_the_client_alone_then_a_broker_that_serves(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    _run(pip, "install", "--quiet", "--disable-pip-version-check", wheel)

    # The client alone: none of the broker's packages, and no gRPC for an HTTP client.
    check = (
        "import importlib.util, sys, wqclient\n"
        "wqclient.Client('http://127.0.0.1:9')\n"
        f"print([m for m in {_BROKER_ONLY!r} if importlib.util.find_spec(m)])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))\n"
    )
    installed, loaded = _run(python, "-c", check, cwd=tmp_path).splitlines()
    assert (installed, loaded) == ("[]", "[]")
    refused = subprocess.run(
        [venv / "bin" / "wqbroker"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith("pip install 'wqueue[broker]'"), refused.stderr

    _run(pip, "install", "--quiet", "--disable-pip-version-check", f"{wheel}[broker]")
    store = f"sqlite:{tmp_path / 'wq.db'}"
    with broker_process("-store", store, program=venv / "bin" / "wqbroker") as broker:
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
