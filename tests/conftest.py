"""Fixtures: a fake clock, a seeded random source, every store backend and a service over it;
the tiers' markers; the Hypothesis profiles.

Markers (``--strict-markers``: no other is taken), put on each test here, by where it lives and
what it runs on, so no test has to remember its own:

- ``unit``: in-process, no socket (tests/unit, tests/store, tests/service);
- ``server``: a real broker in this process, on port 0, and real clients (tests/http, tests/grpc,
  tests/client, tests/broker);
- ``e2e``: real processes: brokers, the commands, other languages (tests/e2e);
- ``browser``: the dashboard in Chromium (tests/ui);
- ``pg``: on PostgreSQL (a ``postgres`` parameter, or a test of the PostgreSQL store or cluster);
- ``node``: a client in Node.js, which needs the npm packages of tests/node (``make node-deps``);
- ``slow``: put by hand on the few that take seconds of CPU (``make test-fast`` leaves them out);
- ``serial``: run one after the other, never two at once, on an xdist worker of their own
  (several brokers, processes killed on purpose, a browser: each wants the machine's attention).

Hypothesis: the ``ci`` profile (``make test``, and whenever ``$CI`` is set) runs every property
as written; ``dev`` (``make test-fast``, and plain ``pytest``) a fifth of the examples
(:func:`tests.helpers.examples`).

Everything else the tests share (helpers, the in-process broker, waiting) is in ``helpers.py``."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Final

import pytest
from hypothesis import Phase, settings

from tests import pg
from tests.helpers import BACKENDS, PROFILE, make_store
from wqbroker.clock import FakeClock
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store import Store

# (No "explain" phase: on Python 3.11 it traces every line of a failing example, which made a
# failing PostgreSQL state machine run past its time-out instead of reporting.)
_PHASES = tuple(p for p in Phase if p is not Phase.explain)
settings.register_profile("ci", print_blob=True, phases=_PHASES)
settings.register_profile("dev", max_examples=20, phases=_PHASES)
settings.load_profile(PROFILE)

# The layer of each directory of tests/ (the marker its tests get).
LAYERS: Final = {
    "unit": "unit",
    "store": "unit",
    "service": "unit",
    "http": "server",
    "grpc": "server",
    "client": "server",
    "broker": "server",
    "e2e": "e2e",
    "docs": "e2e",
    "ui": "browser",
}
# Test modules whose every test runs on PostgreSQL.
POSTGRES_MODULES: Final = frozenset(
    {
        "store/test_postgres.py",
        "store/test_postgres_control.py",
        "store/test_postgres_results.py",
        "store/test_postgres_limits.py",
        "e2e/test_postgres_cluster.py",
        "e2e/test_postgres_failover.py",
        "e2e/test_limits_several_brokers.py",
    }
)
NODE_MODULE: Final = "e2e/test_node_client.py"
# Test modules whose tests run one at a time (an xdist group: one worker takes them all).
SERIAL_MODULES: Final = frozenset(
    {
        "e2e/test_sqlite_kill9.py",
        "e2e/test_postgres_cluster.py",
        "e2e/test_postgres_failover.py",
        "e2e/test_limits_several_brokers.py",
        "ui/test_dashboard.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        where = Path(item.fspath).relative_to(root)
        layer = LAYERS.get(where.parts[0])
        if layer is not None:
            item.add_marker(layer)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if where.as_posix() in POSTGRES_MODULES or "postgres" in params.values():
            item.add_marker("pg")
        if where.as_posix() in SERIAL_MODULES:
            item.add_marker("serial")
            item.add_marker(pytest.mark.xdist_group("serial"))  # (one worker runs them all)
        if where.as_posix() == NODE_MODULE:
            item.add_marker("node")


@pytest.fixture(autouse=True)
def _no_client_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # wqclient takes its token and CA file from $WQ_TOKEN and $WQ_CA_FILE (and so do the commands
    # the tests start): a shell that has them set must not change what a test sees.
    monkeypatch.delenv("WQ_TOKEN", raising=False)
    monkeypatch.delenv("WQ_CA_FILE", raising=False)
    # (and wqclient.App, wq worker and the examples their broker from $WQ_BROKER)
    monkeypatch.delenv("WQ_BROKER", raising=False)
    monkeypatch.delenv("WQ_TOKEN_FILE", raising=False)


@pytest.fixture(scope="session", autouse=True)
def _postgres_databases_dropped() -> Iterator[None]:
    # The PostgreSQL tests make their databases on first use (tests/pg.py); dropped at the end.
    yield
    pg.drop_all()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(backend: str, rng: random.Random, tmp_path: Path) -> AsyncIterator[Store]:
    s = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    yield s
    await s.close()


@pytest.fixture
async def service(store: Store, clock: FakeClock) -> AsyncIterator[Service]:
    svc = Service(store, clock)
    await svc.start()
    yield svc
    await svc.close()
