"""Fixtures: a fake clock, a seeded random source, every store backend and a service over it.

Everything else the tests share (helpers, the in-process broker, waiting) is in ``helpers.py``."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests import pg
from tests.helpers import BACKENDS, make_store
from wqbroker.clock import FakeClock
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store import Store


@pytest.fixture(autouse=True)
def _no_client_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # wqclient takes its token and CA file from $WQ_TOKEN and $WQ_CA_FILE (and so do the commands
    # the tests start): a shell that has them set must not change what a test sees.
    monkeypatch.delenv("WQ_TOKEN", raising=False)
    monkeypatch.delenv("WQ_CA_FILE", raising=False)


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
