"""A short script as users write it: a client (blocking, or asyncio in ``asyncio.run``; or an
App's ``enqueue_sync`` / ``await enqueue``) made from ``$WQ_BROKER`` and never closed. It must
find the broker from the environment and end quietly: the clients a program leaves open are
closed at exit (or with their event loop), not collected with aiohttp's "Unclosed client
session" warnings on stderr. A real broker process on port 0, the script in a process of
its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT, broker_process

pytestmark = pytest.mark.timeout(60)

TASKS = """
from wqclient import App

app = App()


@app.task
def add(x: int, y: int) -> int:
    return x + y
"""

SCRIPTS = {
    "client": """
from wqclient import Client

wq = Client()
print(wq.enqueue({"n": 1}).id, wq.stats().ready)
""",
    "app": """
from tasks import add

handle = add.enqueue_sync(2, 3)
print(handle.id, handle.status().state)
""",
    # (asyncio.run closes the loop; the client's session is closed with it)
    "async-client": """
import asyncio
from wqclient import AsyncClient

async def main():
    wq = AsyncClient()
    print((await wq.enqueue({"n": 1})).id, (await wq.stats()).ready)

asyncio.run(main())
""",
    "async-app": """
import asyncio
from tasks import add

async def main():
    handle = await add.enqueue(2, 3)
    print(handle.id, (await handle.status()).state)

asyncio.run(main())
""",
}


@pytest.mark.parametrize("scheme", ["http", "grpc"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_script_that_never_closes_its_client_ends_quietly(
    tmp_path: Path, script: str, scheme: str
) -> None:
    (tmp_path / "tasks.py").write_text(TASKS)
    (tmp_path / "script.py").write_text(SCRIPTS[script])
    with broker_process() as broker:
        url = broker.url if scheme == "http" else f"grpc://{broker.grpc_target}"
        env = {**os.environ, "WQ_BROKER": url, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
        done = subprocess.run(
            # (ResourceWarnings shown; not -X dev, whose asyncio debug mode reports slow
            # callbacks under load)
            [sys.executable, "-W", "always::ResourceWarning", "script.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    task_id, second = done.stdout.split()
    assert len(task_id) == 16
    assert second == ("1" if script.endswith("client") else "ready")
    assert done.stderr == ""
