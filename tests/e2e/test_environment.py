"""Configuration from the environment (WQ_* for every broker flag, flags winning) and
``-log-format json`` (the broker, its access log, the worker): real processes where it matters."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.helpers import wait_until_sync
from tests.procs import broker_command, spawn, worker_command
from wqbroker.__main__ import build_parser, parse_args
from wqbroker.config import FLAGS, config_from_args
from wqclient import Client
from wqclient.cli import worker as worker_cli
from wqwire.flags import JsonFormatter

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_broker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in FLAGS:
        monkeypatch.delenv("WQ_" + flag.dest.upper(), raising=False)


# -- WQ_* variables -----------------------------------------------------------------------------


def test_every_flag_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_ADDR", "127.0.0.1:9001")
    monkeypatch.setenv("WQ_GRPC_ADDR", "off")
    monkeypatch.setenv("WQ_MAX_TASKS", "5")
    monkeypatch.setenv("WQ_SQLITE_SYNC", "normal")
    monkeypatch.setenv("WQ_METRICS_PUBLIC", "true")
    monkeypatch.setenv("WQ_ACCESS_LOG", "1")
    monkeypatch.setenv("WQ_LOG_FORMAT", "json")
    monkeypatch.setenv("WQ_TOKEN_FILE", "/etc/wq/tokens")
    monkeypatch.setenv("WQ_DEDUP_WINDOW_MS", "1500")
    args = parse_args([])
    assert args.log_format == "json"
    config = config_from_args(args)
    assert config.addr == "127.0.0.1:9001"
    assert config.grpc_addr == "off"
    assert config.max_tasks == 5
    assert config.sqlite_sync == "normal"
    assert config.metrics_public is True
    assert config.access_log is True
    assert config.token_file == "/etc/wq/tokens"
    assert config.dedup_window == 1.5


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_MAX_TASKS", "5")
    monkeypatch.setenv("WQ_ACCESS_LOG", "true")
    monkeypatch.setenv("WQ_ADDR", ":9001")
    assert parse_args(["-max-tasks=7"]).max_tasks == 7
    assert parse_args(["--max-tasks", "8"]).max_tasks == 8
    args = parse_args(["-access-log=false", "-addr", ":9002"])
    assert (args.access_log, args.addr, args.max_tasks) == (False, ":9002", 5)


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_MAX_TASKS", "")
    monkeypatch.setenv("WQ_ADDR", "  ")
    args = parse_args([])
    assert (args.max_tasks, args.addr) == (10_000_000, ":8080")


def test_the_store_still_falls_back_to_wq_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_STORE", "sqlite:/var/lib/wq.db")
    assert config_from_args(parse_args([])).store == "sqlite:/var/lib/wq.db"
    assert config_from_args(parse_args(["-store", "memory"])).store == "memory"
    monkeypatch.delenv("WQ_STORE")
    assert config_from_args(parse_args([])).store == "memory"


@pytest.mark.parametrize(
    ("var", "text", "error"),
    [
        ("WQ_MAX_TASKS", "-1", "environment variable WQ_MAX_TASKS: must not be negative, got -1"),
        ("WQ_POLL_MS", "soon", "environment variable WQ_POLL_MS: 'soon' is not an integer"),
        (
            "WQ_ADDR",
            "nope",
            "environment variable WQ_ADDR: address 'nope' has no port; use host:port or :port",
        ),
        (
            "WQ_LOG_FORMAT",
            "xml",
            "environment variable WQ_LOG_FORMAT: invalid choice: 'xml' (choose from 'text', "
            "'json')",
        ),
        (
            "WQ_METRICS_PUBLIC",
            "maybe",
            "environment variable WQ_METRICS_PUBLIC: 'maybe' is not a boolean (true or false)",
        ),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    var: str,
    text: str,
    error: str,
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"wqbroker: {error}\n"


def test_a_bad_variable_is_no_error_when_its_flag_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WQ_MAX_TASKS", "-1")
    assert parse_args(["-max-tasks", "3"]).max_tasks == 3


def test_help_names_each_variable() -> None:
    text = build_parser().format_help()
    assert "can also be set from the environment" in " ".join(text.split())
    for flag in FLAGS:
        assert f"$WQ_{flag.dest.upper()}" in text, flag.name


def test_the_worker_takes_nothing_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_CONCURRENCY", "9")
    assert worker_cli.build_parser().parse_args([]).concurrency == 3


# -- JSON logs ----------------------------------------------------------------------------------


def test_json_formatter_fields() -> None:
    record = logging.LogRecord(
        "wqbroker.x", logging.WARNING, __file__, 1, "task %s: %s", ("a", 1), None
    )
    record.task_id = "a"
    record.when = object()  # anything JSON cannot hold is given as text
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "warning"
    assert line["logger"] == "wqbroker.x"
    assert line["message"] == "task a: 1"
    assert line["task_id"] == "a"
    assert line["time"].endswith("Z")
    assert isinstance(line["when"], str)
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("w", logging.ERROR, __file__, 1, "oops", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in line["exception"]


class Lines:
    """A process's stderr, read as it comes (so it never fills the pipe)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stderr is not None
        stderr = proc.stderr
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(line.rstrip("\n") for line in stderr), daemon=True
        )
        self._reader.start()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines)]

    def wait_for(self, what: str, holds: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((r for r in self.records() if holds(r)), None)

        record = wait_until_sync(found, what=what)
        assert record is not None
        return record


@contextmanager
def process(cmd: list[str]) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    proc = spawn(cmd)
    lines = Lines(proc)
    try:
        yield proc, lines
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines._reader.join(10)  # (it reads stderr to its end: the process is gone)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_broker_from_the_environment_logs_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_ADDR", "127.0.0.1:0")
    monkeypatch.setenv("WQ_GRPC_ADDR", "off")
    monkeypatch.setenv("WQ_LOG_FORMAT", "json")
    monkeypatch.setenv("WQ_ACCESS_LOG", "true")
    monkeypatch.setenv("WQ_LOOP", "asyncio")
    with process(broker_command()) as (_, broker_log):
        listening = broker_log.wait_for(
            "the broker to say where it listens",
            lambda r: r["message"].startswith("HTTP API listening on "),
        )
        assert listening["level"] == "info"
        assert listening["logger"] == "wqbroker"
        url = listening["message"].removeprefix("HTTP API listening on ")
        client = Client(url)
        try:
            client.stats()
        finally:
            client.close()
        access = broker_log.wait_for(
            "the access log line", lambda r: r["logger"] == "wqbroker.http"
        )
        assert access["first_request_line"] == "GET /stats HTTP/1.1"
        assert access["response_status"] == 200
        assert "GET /stats" in access["message"]
        # Every line is a JSON object with the four fields.
        for record in broker_log.records():
            assert {"time", "level", "logger", "message"} <= set(record), record

        with process(
            worker_command(
                "-broker", url, "-log-format", "json", "-log-file", "/dev/null", "-wait-ms", "200"
            )
        ) as (_, worker_log):
            client = Client(url)
            try:
                task_id = client.enqueue({"fail": True}, max_attempts=1)
            finally:
                client.close()
            failed = worker_log.wait_for(
                "the worker to log the failure", lambda r: r.get("task_id") == task_id
            )
    assert failed["level"] == "warning"
    assert failed["logger"] == "wqclient.worker"
    assert failed["queue"] == "default"
    assert failed["outcome"] == "nack"
    assert (failed["attempts"], failed["max_attempts"]) == (1, 1)
    assert task_id in failed["message"]
