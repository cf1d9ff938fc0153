"""The commands as a user runs them: ``python -m wqbroker`` (its flags, the listening line,
signals, a taken port) and the flags of all three commands (wqbroker, wq-worker, wq-producer)."""

from __future__ import annotations

import argparse
import io
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest

from tests.fake_transport import FakeTransport
from tests.procs import broker_command, broker_process, producer_command, worker_command
from wqbroker import __main__ as wqbroker_main
from wqbroker import config as wqbroker_config
from wqbroker.config import Config, parse_addr
from wqbroker.http import DEFAULT_MAX_BODY
from wqclient import AsyncClient
from wqclient.cli import producer, worker
from wqwire.flags import Flag

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
    assert "cannot listen" in lines[0]
    assert str(port) in lines[0]
    assert "Traceback" not in proc.stderr


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
    with pytest.raises(ValueError, match="port"):
        parse_addr(text)


# -- flags: one strict parser for all three commands ---------------------------------------------

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "wqbroker": wqbroker_main.build_parser,
    "wq-worker": worker.build_parser,
    "wq-producer": producer.build_parser,
}

# Flags that are not defined exactly: (command, argv, the name the error names).
UNDEFINED = [
    ("wqbroker", ["-add", ":0"], "-add"),
    ("wqbroker", ["--add", ":0"], "--add"),
    ("wqbroker", ["-grpc", ":0"], "-grpc"),
    ("wqbroker", ["-sweep", "5"], "-sweep"),
    ("wqbroker", ["-add=:0"], "-add"),
    ("wqbroker", ["--sweep=5"], "--sweep"),
    ("wqbroker", ["-a", ":0"], "-a"),
    ("wqbroker", ["-no-such-flag"], "-no-such-flag"),
    ("wqbroker", ["-addr", ":0", "-nope=1"], "-nope"),
    ("wq-worker", ["-conc", "3"], "-conc"),
    ("wq-worker", ["--log", "x.log"], "--log"),
    ("wq-worker", ["-lease=5"], "-lease"),
    ("wq-worker", ["-q"], "-q"),
    ("wq-worker", ["-nope"], "-nope"),
    ("wq-worker", ["-queues", "a"], "-queues"),
    ("wq-worker", ["-que", "a"], "-que"),
    ("wq-producer", ["-max", "3"], "-max"),
    ("wq-producer", ["--delay", "5"], "--delay"),
    ("wq-producer", ["-conc=2"], "-conc"),
    ("wq-producer", ["-nope"], "-nope"),
    ("wq-producer", ["-n5"], "-n5"),
    ("wq-producer", ["-prio", "3"], "-prio"),
    ("wq-producer", ["-key", "k"], "-key"),
]

# Defined flags with values they refuse: (command, argv, the flag the error names).
BAD_VALUES = [
    ("wqbroker", ["-addr", "nonsense"], "-addr"),
    ("wqbroker", ["-addr=:99999"], "-addr"),
    ("wqbroker", ["--grpc-addr", "host:"], "-grpc-addr"),
    ("wqbroker", ["-sweep-interval-ms", "0"], "-sweep-interval-ms"),
    ("wqbroker", ["-sweep-interval-ms=abc"], "-sweep-interval-ms"),
    ("wqbroker", ["-backoff-base-ms", "-1"], "-backoff-base-ms"),
    ("wqbroker", ["-backoff-cap-ms=1.5"], "-backoff-cap-ms"),
    ("wqbroker", ["-max-body-bytes", "0"], "-max-body-bytes"),
    ("wqbroker", ["-sqlite-sync", "off"], "-sqlite-sync"),
    ("wqbroker", ["-log-level=loud"], "-log-level"),
    ("wqbroker", ["--loop", "trio"], "-loop"),
    ("wqbroker", ["-access-log=maybe"], "-access-log"),
    ("wqbroker", ["-addr"], "-addr"),
    ("wq-worker", ["-concurrency", "0"], "-concurrency"),
    ("wq-worker", ["-wait-ms=abc"], "-wait-ms"),
    ("wq-worker", ["--lease-ms", "-5"], "-lease-ms"),
    ("wq-worker", ["-quiet=maybe"], "-quiet"),
    ("wq-worker", ["-queue", "a,,b"], "-queue"),
    ("wq-worker", ["-queue="], "-queue"),
    ("wq-producer", ["-n", "abc"], "-n"),
    ("wq-producer", ["-n=0"], "-n"),
    ("wq-producer", ["-delay-ms", "-5"], "-delay-ms"),
    ("wq-producer", ["-fail=maybe"], "-fail"),
    ("wq-producer", ["--max-attempts=0"], "-max-attempts"),
    ("wq-producer", ["-priority", "10"], "-priority"),
    ("wq-producer", ["-priority=-1"], "-priority"),
    ("wq-producer", ["-priority", "high"], "-priority"),
]


def parse_error(command: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse ``argv`` as ``command`` would; it must exit 2 with one line on stderr, returned."""
    with pytest.raises(SystemExit) as exited:
        PARSERS[command]().parse_args(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{command}: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(("command", "argv", "name"), UNDEFINED)
def test_undefined_or_abbreviated_flag_is_one_line_and_exit_2(
    command: str, argv: list[str], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = parse_error(command, argv, capsys)
    assert line == f"{command}: flag provided but not defined: {name}"


@pytest.mark.parametrize(("command", "argv", "flag"), BAD_VALUES)
def test_bad_value_is_one_line_naming_the_flag_and_exit_2(
    command: str, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = parse_error(command, argv, capsys)
    assert flag in line.split(": ", 1)[1]


@pytest.mark.parametrize("command", list(PARSERS))
def test_a_stray_argument_is_one_line_and_exit_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "stray" in parse_error(command, ["stray"], capsys)


@pytest.mark.parametrize("command", list(PARSERS))
@pytest.mark.parametrize("spelling", ["-h", "-help", "--help"])
def test_help_prints_usage_and_exits_0(
    command: str, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        PARSERS[command]().parse_args([spelling])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: {command} ")
    assert err == ""


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        (broker_command, ["-add", "127.0.0.1:0", "-grpc-addr", "off"]),
        (broker_command, ["--sweep=5", "-addr", "127.0.0.1:0", "-grpc-addr", "off"]),
        (worker_command, ["-conc", "3"]),
        (producer_command, ["-max", "3", "-broker", "http://127.0.0.1:9"]),
    ],
    ids=["wqbroker-add", "wqbroker-sweep", "wq-worker", "wq-producer"],
)
def test_the_commands_refuse_an_abbreviation_before_starting(
    command: Callable[..., list[str]], argv: list[str], tmp_path: Any
) -> None:
    # Were the abbreviation taken for the flag, the broker would serve and this would time out.
    proc = subprocess.run(command(*argv), cwd=tmp_path, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.endswith(f"flag provided but not defined: {argv[0].split('=')[0]}")
    assert list(tmp_path.iterdir()) == []  # the worker opened no log file


def test_broker_defaults() -> None:
    args = wqbroker_main.parse_args([])
    assert wqbroker_config.config_from_args(args) == Config(
        addr=":8080",
        grpc_addr=":50051",
        sweep_interval=0.25,
        backoff_base=1.0,
        backoff_cap=30.0,
        max_body=DEFAULT_MAX_BODY,
        access_log=False,
        store="memory",
        sqlite_sync="full",
    )
    assert (args.log_level, args.loop) == ("info", "uvloop")


def test_every_setting_has_one_flag_and_variable_whose_default_is_the_configs() -> None:
    assert wqbroker_config.config_from_args(wqbroker_main.parse_args([])) == Config()
    assert len({flag.name for flag in wqbroker_config.FLAGS}) == len(fields(Config))
    parser = wqbroker_main.build_parser()
    variables = [parser.env_var(flag) for flag in wqbroker_config.FLAGS]
    assert "WQ_POLL_MS" in variables
    assert "WQ_TLS_KEY" in variables
    assert len(set(variables)) == len(variables)


def test_broker_flags_in_every_spelling_reach_the_config() -> None:
    args = wqbroker_main.parse_args(
        [
            "-addr",
            "127.0.0.1:9000",
            "--grpc-addr=OFF",
            "-sweep-interval-ms=100",
            "--backoff-base-ms",
            "0",
            "-backoff-cap-ms=5000",
            "--max-body-bytes",
            "2048",
            "-store",
            "sqlite:/tmp/wq.db",
            "--sqlite-sync=normal",
            "-log-level",
            "debug",
            "-loop=asyncio",
            "-access-log",
        ]
    )
    assert wqbroker_config.config_from_args(args) == Config(
        addr="127.0.0.1:9000",
        grpc_addr="off",
        sweep_interval=0.1,
        backoff_base=0.0,
        backoff_cap=5.0,
        max_body=2048,
        access_log=True,
        store="sqlite:/tmp/wq.db",
        sqlite_sync="normal",
        log_level="debug",
        loop="asyncio",
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["-access-log"], True),
        (["--access-log=true"], True),
        (["-access-log=f"], False),
    ],
)
def test_broker_access_log_switch(argv: list[str], expected: bool) -> None:
    assert wqbroker_config.config_from_args(wqbroker_main.parse_args(argv)).access_log is expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], True), (["-http-fast-lane"], True), (["-http-fast-lane=false"], False)],
)
def test_broker_http_fast_lane_switch(argv: list[str], expected: bool) -> None:
    config = wqbroker_config.config_from_args(wqbroker_main.parse_args(argv))
    assert config.http_fast_lane is expected


@pytest.mark.parametrize("flag", wqbroker_config.FLAGS, ids=lambda flag: flag.name)
def test_every_broker_flag_takes_every_spelling_of_its_default(flag: Flag) -> None:
    default = vars(wqbroker_main.parse_args([]))[flag.dest]
    assert default == flag.default
    text = str(flag.default)
    for argv in (
        [f"-{flag.name}", text],
        [f"--{flag.name}", text],
        [f"-{flag.name}={text}"],
        [f"--{flag.name}={text}"],
    ):
        assert vars(wqbroker_main.parse_args(argv))[flag.dest] == default, argv


def test_worker_and_producer_flags_parse() -> None:
    w = worker.build_parser().parse_args(
        ["-broker", "grpc://h:1", "--log-file=x.log", "-concurrency=2", "-wait-ms", "5", "-quiet"]
    )
    assert (w.broker, w.log_file, w.concurrency, w.wait_ms, w.lease_ms, w.quiet) == (
        "grpc://h:1",
        "x.log",
        2,
        5,
        30000,
        True,
    )
    p = producer.build_parser().parse_args(
        ["-n", "5", "-fail", "-max-attempts=2", "--delay-ms", "10", "-concurrency=4"]
    )
    assert (p.n, p.fail, p.max_attempts, p.delay_ms, p.concurrency) == (5, True, 2, 10, 4)


def test_the_queue_priority_and_key_flags_parse_and_leave_the_spec_defaults_alone() -> None:
    w = worker.build_parser().parse_args([])
    assert (w.queue, w.lease_ms, w.concurrency, w.wait_ms) == (["default"], 30000, 3, 20000)
    assert worker.build_parser().parse_args(["-queue", "a,b"]).queue == ["a", "b"]
    assert worker.build_parser().parse_args(["--queue=a, b"]).queue == ["a", "b"]
    p = producer.build_parser().parse_args([])
    assert (p.queue, p.priority, p.idempotency_key) == ("default", 0, "")
    assert (p.n, p.fail, p.max_attempts, p.delay_ms, p.concurrency) == (1, False, 3, 0, 1)
    p = producer.build_parser().parse_args(
        ["-queue", "emails", "-priority=9", "--idempotency-key", "order-7"]
    )
    assert (p.queue, p.priority, p.idempotency_key) == ("emails", 9, "order-7")


def test_the_producers_idempotency_keys() -> None:
    assert producer.key_for("", 1, 1) is None
    assert producer.key_for("K", 1, 1) == "K"
    assert [producer.key_for("K", i, 3) for i in (1, 2, 3)] == ["K-1", "K-2", "K-3"]


async def test_a_producer_run_sends_queue_priority_and_keys_and_counts_duplicates() -> None:
    fake = FakeTransport()
    argv = ["-n", "3", "-queue", "emails", "-priority", "4", "-idempotency-key", "batch"]
    args = producer.build_parser().parse_args(argv)
    async with AsyncClient(transport=fake) as client:
        for expected in ("enqueued 3, failed 0,", "enqueued 0, duplicates 3, failed 0,"):
            run = producer._Run(args, client, io.StringIO())
            await run.post()
            out = io.StringIO()
            assert run.report(1.0, out) == 0
            assert out.getvalue().startswith(expected)
    assert [(t.queue, t.priority, t.payload["n"]) for t in fake.tasks.values()] == [
        ("emails", 4, 1),
        ("emails", 4, 2),
        ("emails", 4, 3),
    ]
    assert set(fake.keys) == {("emails", "batch-1"), ("emails", "batch-2"), ("emails", "batch-3")}
