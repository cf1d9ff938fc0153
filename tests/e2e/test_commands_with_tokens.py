"""Tokens through the commands, as real processes: ``wqbroker -token-file`` (a bad file, SIGHUP),
``wq-producer`` and ``wq-worker`` with ``-token`` or ``$WQ_TOKEN``, and the new flags."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.authkit import ALL_BUT, ONLY, ROOT, UNKNOWN, bearer, write_token_file
from tests.helpers import wait_until_sync
from tests.procs import (
    BrokerProcess,
    broker_command,
    broker_process,
    env,
    producer_command,
    worker_command,
)
from wqbroker import __main__ as wqbroker_main
from wqbroker.config import config_from_args
from wqclient.cli import producer, worker

pytestmark = pytest.mark.timeout(60)


def request(
    url: str,
    token: str | None = None,
    *,
    method: str = "GET",
    context: ssl.SSLContext | None = None,
) -> tuple[int, Any]:
    """(status, JSON body) of a request with ``Authorization: Bearer token``."""
    headers = bearer(token) if token is not None else {}
    data = b"" if method == "POST" else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def run(
    command: list[str], cwd: Path, extra_env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_secret_kept(text: str) -> None:
    for token in (ROOT, *ONLY.values(), *ALL_BUT.values(), UNKNOWN):
        assert token not in text, text
    assert "Traceback" not in text, text


# -- the broker's flags -------------------------------------------------------------------------


def test_the_broker_flags_reach_the_config() -> None:
    args = wqbroker_main.parse_args(
        ["-token-file", "t.txt", "--tls-cert=c.pem", "-tls-key", "k.pem"]
    )
    config = config_from_args(args)
    assert (config.token_file, config.tls_cert, config.tls_key) == ("t.txt", "c.pem", "k.pem")
    config = config_from_args(wqbroker_main.parse_args([]))
    assert (config.token_file, config.tls_cert, config.tls_key) == (None, None, None)


def test_flags_without_a_default_say_none_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        wqbroker_main.parse_args(["-help"])
    out = capsys.readouterr().out
    assert "-token-file PATH" in out
    assert "(default )" not in out


def test_worker_and_producer_take_token_and_ca_file() -> None:
    w = worker.build_parser().parse_args(["-token", "abc", "--ca-file=ca.pem"])
    assert (w.token, w.ca_file) == ("abc", "ca.pem")
    p = producer.build_parser().parse_args(["--token=abc", "-ca-file", "ca.pem"])
    assert (p.token, p.ca_file) == ("abc", "ca.pem")
    w = worker.build_parser().parse_args([])
    assert (w.token, w.ca_file) == (None, None)  # then $WQ_TOKEN, $WQ_CA_FILE


# -- a bad token file -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"# tokens\n{ROOT} produce\n{UNKNOWN} everything\n", "line 3: unknown scope"),
        (f"{ROOT}\n", "line 1: expected TOKEN SCOPE"),
        (f"{ROOT} produce\n{ROOT} consume\n", "line 2: the same token as line 1"),
        (None, "cannot read token file"),
    ],
    ids=["unknown-scope", "no-scope", "duplicate", "missing"],
)
def test_a_bad_token_file_is_one_line_and_exit_1(
    tmp_path: Path, text: str | None, says: str
) -> None:
    path = tmp_path / "tokens"
    if text is not None:
        path.write_text(text)
    proc = run(broker_command("-token-file", str(path), "-addr", "127.0.0.1:0"), tmp_path)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("wqbroker: ")
    assert says in line
    assert str(path) in line
    assert_secret_kept(proc.stderr + proc.stdout)


# -- SIGHUP ---------------------------------------------------------------------------------------


def test_sighup_reloads_the_token_file(tmp_path: Path) -> None:
    path = write_token_file(tmp_path, f"{ONLY['admin']} admin\n")
    with broker_process("-token-file", str(path)) as broker:
        # (Logged just after the listening lines, which are what broker_process waits for.)
        wait_until_sync(
            lambda: any("bearer tokens required: 1" in line for line in broker.log_lines),
            what="the broker to say how many tokens it holds",
        )
        assert request(broker.url + "/dlq", ONLY["admin"])[0] == 200
        assert request(broker.url + "/dlq", ROOT)[0] == 401
        assert request(broker.url + "/healthz")[0] == 200

        path.write_text(f"{ROOT} admin,produce,consume\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_until_sync(
            lambda: request(broker.url + "/dlq", ROOT)[0] == 200, what="the new token to work"
        )
        assert request(broker.url + "/dlq", ONLY["admin"])[0] == 401  # removed

        # A bad file on reload keeps the tokens in use and says so in one line.
        path.write_text(f"{ROOT} admin\n{UNKNOWN} sudo\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_until_sync(
            lambda: any("ERROR" in line for line in broker.log_lines), what="the reload error"
        )
        assert request(broker.url + "/dlq", ROOT)[0] == 200
        assert request(broker.url + "/dlq", UNKNOWN)[0] == 401
        assert broker.proc.poll() is None  # SIGHUP did not end it
        assert broker.stop() == 0
    errors = [line for line in broker.log_lines if "ERROR" in line]
    assert len(errors) == 1, errors
    assert "line 2: unknown scope 'sudo'" in errors[0]
    assert "keeping the 1 tokens in use" in errors[0]
    assert sum("reloaded" in line for line in broker.log_lines) == 1
    assert_secret_kept("\n".join(broker.log_lines))


# -- wq-producer and wq-worker ------------------------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Any:
    with broker_process("-token-file", str(write_token_file(tmp_path))) as b:
        yield b


def url_for(broker: BrokerProcess, transport: str) -> str:
    return broker.url if transport == "http" else broker.grpc_url


def stats(broker: BrokerProcess) -> dict[str, Any]:
    status, body = request(broker.url + "/stats", ROOT)
    assert status == 200
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_producer_and_worker_with_tokens_from_flag_and_environment(
    broker: BrokerProcess, tmp_path: Path, transport: str
) -> None:
    url = url_for(broker, transport)
    # -token for the producer...
    proc = run(producer_command("-broker", url, "-n", "5", "-token", ONLY["produce"]), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("enqueued 5, failed 0")
    # ... $WQ_TOKEN for the worker, which runs until the queue is drained, then stops on SIGTERM.
    with open(tmp_path / "worker.err", "wb") as err:
        worker_proc = subprocess.Popen(
            worker_command("-broker", url, "-wait-ms", "200"),
            cwd=tmp_path,
            env={**env(), "WQ_TOKEN": ONLY["consume"]},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_until_sync(lambda: stats(broker)["totals"]["acked"] == 5, what="5 acks", timeout=20)
        worker_proc.send_signal(signal.SIGTERM)
        assert worker_proc.wait(10) == 0
    finally:
        if worker_proc.poll() is None:
            worker_proc.kill()
            worker_proc.wait()
    assert (tmp_path / "jobs.log").read_text().count("\n") == 5
    assert_secret_kept((tmp_path / "worker.err").read_text())


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize(
    ("token", "says"),
    [(None, "no token"), (UNKNOWN, "unknown token"), (ONLY["consume"], "produce scope")],
    ids=["none", "unknown", "wrong-scope"],
)
def test_a_refused_producer_stops_at_once_and_exits_1(
    broker: BrokerProcess, tmp_path: Path, transport: str, token: str | None, says: str
) -> None:
    flags = ["-token", token] if token is not None else []
    proc = run(
        producer_command("-broker", url_for(broker, transport), "-n", "1000", *flags), tmp_path
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("wq-producer: the broker refused the token: ")
    assert says in line
    # It stopped at the first refusal (one per concurrent poster) rather than try 1000 times.
    assert proc.stdout.startswith("enqueued 0, failed 1,")
    assert_secret_kept(proc.stdout + proc.stderr)


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize(
    ("token", "says"),
    [(UNKNOWN, "Unauthenticated"), (ALL_BUT["consume"], "consume scope")],
    ids=["unknown", "wrong-scope"],
)
def test_a_refused_worker_says_so_in_one_line_and_exits_1(
    broker: BrokerProcess, tmp_path: Path, transport: str, token: str, says: str
) -> None:
    proc = run(
        worker_command("-broker", url_for(broker, transport), "-concurrency", "3"),
        tmp_path,
        {"WQ_TOKEN": token},
        timeout=20,
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    assert "refused this worker's token" in errors[0]
    assert says in errors[0]
    assert_secret_kept(proc.stdout + proc.stderr)


def test_a_token_that_cannot_be_sent_is_a_usage_error(tmp_path: Path) -> None:
    proc = run(worker_command("-token", "two words"), tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "wq-worker: the token must be printable ASCII without spaces"
    proc = run(producer_command("-token", "two words"), tmp_path)
    assert proc.returncode == 2
    assert "two words" not in proc.stderr
