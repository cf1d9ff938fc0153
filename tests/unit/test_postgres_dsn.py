"""The PostgreSQL store's DSN helper (wqbroker/store/postgres/dsn.py): what it asks of the server,
the servers it lists, and the DSN as logs and messages show it (without its password)."""

from __future__ import annotations

import asyncpg
import pytest

from wqbroker.store.postgres import redact
from wqbroker.store.postgres.dsn import (
    connect_time,
    explain,
    hosts,
    options,
    servers,
    split_timeout,
)


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgres://wq@db:5432/wq", "postgres://wq@db:5432/wq"),
        ("postgres://wq:s3cret@db:5432/wq", "postgres://wq:***@db:5432/wq"),
        (
            "postgresql://wq:s3cret@h1:5432,h2:5433/wq?target_session_attrs=read-write",
            "postgresql://wq:***@h1:5432,h2:5433/wq?target_session_attrs=read-write",
        ),
        ("postgresql://wq:p%40ss@[::1]:5432,h2/wq", "postgresql://wq:***@[::1]:5432,h2/wq"),
        (
            "postgresql:///wq?host=h1,h2&port=5432,5433&password=s3cret&sslmode=require",
            "postgresql:///wq?host=h1,h2&port=5432,5433&password=***&sslmode=require",
        ),
        ("postgresql://wq:a@b@db/wq", "postgresql://wq:***@db/wq"),
        ("memory", "memory"),
    ],
)
def test_redact_takes_out_the_password_whatever_the_hosts(dsn: str, shown: str) -> None:
    assert redact(dsn) == shown


def test_several_hosts_are_listed_in_either_form() -> None:
    assert hosts("postgresql://wq@h1:5432,h2:5433/wq") == ["h1:5432", "h2:5433"]
    assert hosts("postgresql:///wq?host=h1,h2&port=5432,5433") == ["h1", "h2"]
    assert hosts("postgresql://wq@db/wq") == ["db"]


def test_the_store_asks_for_a_server_that_takes_writes_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGTARGETSESSIONATTRS", raising=False)
    assert options("postgresql://wq@h1,h2/wq") == {"target_session_attrs": "read-write"}
    assert options("postgresql://wq@db/wq") == {"target_session_attrs": "read-write"}
    assert options("postgresql://wq@h1,h2/wq?target_session_attrs=primary") == {}
    monkeypatch.setenv("PGTARGETSESSIONATTRS", "any")
    assert options("postgresql://wq@h1,h2/wq") == {}


def test_a_refusal_by_target_session_attrs_is_explained_without_the_password() -> None:
    refused = asyncpg.TargetServerAttributeNotMatched("None of the hosts match")
    one = explain(refused, "postgresql://wq:s3cret@db/wq")
    assert one is not None
    assert one.startswith("the server of postgresql://wq:***@db/wq does not take writes")
    many = explain(refused, "postgresql://wq@h1,h2/wq")
    assert many is not None
    assert many.startswith("none of the 2 servers of")
    assert explain(OSError("refused"), "postgresql://wq@db/wq") is None


def test_servers_pair_hosts_and_ports_as_libpq_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGPORT", raising=False)
    assert servers("postgresql://wq@h1:5433,[::1]:5434,h3/wq") == [
        ("h1", 5433),
        ("::1", 5434),
        ("h3", 5432),
    ]
    assert servers("postgresql:///wq?host=h1,h2&port=6001,6002") == [("h1", 6001), ("h2", 6002)]
    assert servers("postgresql:///wq?host=h1,h2&port=6001") == [("h1", 6001), ("h2", 6001)]


def test_connect_timeout_is_taken_out_of_the_dsn_as_each_servers_time() -> None:
    assert split_timeout("postgresql://wq@h1,h2/wq?connect_timeout=3&sslmode=require") == (
        "postgresql://wq@h1,h2/wq?sslmode=require",
        3.0,
    )
    assert split_timeout("postgresql://wq@h/wq?sslmode=require&connect_timeout=2") == (
        "postgresql://wq@h/wq?sslmode=require",
        2.0,
    )
    assert split_timeout("postgresql://wq@h/wq") == ("postgresql://wq@h/wq", None)
    assert connect_time("postgresql://wq@h1,h2,h3/wq", 2.0) == 6.0
    assert connect_time("postgresql://wq@h1,h2/wq?connect_timeout=1", 2.0) == 2.0
