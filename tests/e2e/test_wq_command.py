"""``wq``, the admin command, against a real broker (a process, HTTP and gRPC on port 0): every
command in table and ``-json`` modes (the JSON compared with the HTTP API's own answers, the tables
read for their numbers), the errors and exit codes, ``wq watch``, tokens; and ``wq-producer``'s
progress bar under a pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.authkit import ONLY, ROOT, UNKNOWN, bearer, write_token_file
from tests.procs import BrokerProcess, broker_process, env, free_port, producer_command
from wqclient import Client, RateLimit
from wqclient.cli import admin

pytestmark = pytest.mark.timeout(60)

ADMIN = [sys.executable, "-m", "wqclient.cli.admin"]


@pytest.fixture(autouse=True)
def _plain_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # What rich reads from the environment: tables 120 columns wide, no forced colours.
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with broker_process() as b:
        yield b


@pytest.fixture(params=["http", "grpc"])
def url(request: pytest.FixtureRequest, broker: BrokerProcess) -> str:
    """The broker's URL over one protocol or the other (the answers are the same)."""
    return broker.url if request.param == "http" else broker.grpc_url


@pytest.fixture
def api(broker: BrokerProcess) -> Iterator[Client]:
    """The client library over HTTP, to set the scene."""
    with Client(broker.url) as client:
        yield client


def get(broker: BrokerProcess, path: str, token: str | None = None) -> tuple[int, Any]:
    """The HTTP API's own answer: (status, JSON body)."""
    headers = bearer(token) if token else {}
    req = urllib.request.Request(broker.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wq(*argv: str) -> tuple[int, str, str]:
    """Run ``wq argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = admin.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def wq_json(url: str, *argv: str) -> Any:
    code, out, err = wq(*argv, "-broker", url, "-json")
    assert (code, err) == (0, ""), err
    return json.loads(out)


def row(table: str, first: str) -> list[str]:
    """The cells of the table line whose first cell is ``first`` (split on runs of spaces)."""
    for line in table.splitlines():
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{table}")


def number(table: str, label: str) -> int:
    """The number after ``label`` in a table (``ready  3``), thousands separators allowed."""
    match = re.search(rf"(?m)(?:^|\s){re.escape(label)}\s+([\d,]+)", table)
    assert match, f"no {label!r} in:\n{table}"
    return int(match.group(1).replace(",", ""))


def one_line_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("wq"), lines[0]
    assert "Traceback" not in err
    return lines[0]


def bury(api: Client, queue: str, n: int, error: str = "it broke") -> list[str]:
    """``n`` tasks enqueued to ``queue`` and buried (one attempt each, nacked with ``error``)."""
    ids = [api.enqueue({"n": i}, queue=queue, max_attempts=1) for i in range(n)]
    for _ in ids:
        delivery = api.claim(queues=queue, wait_ms=0)
        assert delivery is not None
        api.nack(delivery, error=error)
    return [str(i) for i in ids]


# -- the commands, in both modes ------------------------------------------------------------------


def test_stats(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"stats-{url[:4]}"
    for i in range(3):
        api.enqueue({"i": i}, queue=queue)
    assert wq_json(url, "stats") == get(broker, "/stats")[1]
    assert wq_json(url, "stats", "-queue", queue) == get(broker, f"/stats?queue={queue}")[1]

    code, table, err = wq("stats", "--queue", queue, "-broker", url)
    assert (code, err) == (0, "")
    assert f"queue {queue}" in table
    assert (number(table, "ready"), number(table, "enqueued"), number(table, "dead")) == (3, 3, 0)
    whole = get(broker, "/stats")[1]
    code, table, _ = wq("stats", "-broker", url)
    assert number(table, "enqueued") == whole["totals"]["enqueued"]
    assert number(table, "handed out") == whole["handed_out"]
    assert "\x1b[" not in table  # no colours into a pipe


def test_queues(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"queues-{url[:4]}"
    api.enqueue({}, queue=queue)
    api.enqueue({}, queue=queue)
    api.pause(queue)
    assert wq_json(url, "queues") == get(broker, "/queues")[1]
    code, table, _ = wq("queues", "-broker", url)
    assert code == 0
    assert row(table, queue) == [queue, "2", "0", "0", "0", "paused"]
    others = [q for q in get(broker, "/queues")[1] if q["name"] != queue]
    for q in others:
        assert row(table, q["name"])[1] == str(q["ready"])
        assert row(table, q["name"])[-1] == ("paused" if q["paused"] else "active")


def test_a_message_into_a_pipe_is_one_line_whatever_the_width(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (rich wrapped them at the width: a script reading the line got half of it)
    monkeypatch.setenv("COLUMNS", "20")
    queue = "a-queue-whose-name-is-longer-than-the-terminal-is-wide"
    code, out, err = wq("pause", queue, "-broker", url)
    assert (code, out, err) == (0, f"paused queue {queue}\n", "")
    code, out, err = wq("resume", queue, "-broker", url)
    assert (code, out, err) == (0, f"resumed queue {queue}\n", "")


def test_queues_and_schedules_on_a_narrow_terminal_are_cards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 80 columns the queues' table (with limits) cut every cell to a letter or two ("re…",
    # "concurre…"): a table wider than the terminal is shown a card per row instead.
    monkeypatch.setenv("COLUMNS", "80")
    queue = "emails-transactional-and-more"
    with broker_process() as b, Client(b.url) as api:
        api.enqueue({}, queue=queue)
        api.set_limits(queue, rate=RateLimit(20, 1000), concurrency=4)
        api.pause(queue)
        api.put_schedule(
            "nightly-report-for-everyone", cron="0 3 * * *", timezone="Europe/Paris", payload={}
        )
        shown = {}
        for command in ("queues", "schedules"):
            code, out, err = wq(command, "-broker", b.url)
            assert (code, err) == (0, ""), err
            assert max(len(line) for line in out.splitlines()) <= 80, out
            shown[command] = " ".join(out.split())
        monkeypatch.setenv("COLUMNS", "200")
        code, wide, _ = wq("queues", "-broker", b.url)
    assert shown["queues"].startswith(f"queues: 1 {queue} ready: 1 handed out: 0 delayed: 0")
    for field in ("rate: 20/s", "tokens: 20", "concurrency: 0/4", "state: paused"):
        assert field in shown["queues"]
    assert shown["schedules"].startswith("schedules: 1 nightly-report-for-everyone rule: 0 3 * * *")
    for field in ("timezone: Europe/Paris", "queue: default", "fires: 0", "state: active"):
        assert field in shown["schedules"]
    assert row(wide, queue) == [queue, "1", "0", "0", "0", "20/s", "20", "0/4", "paused"]


def test_dlq_list_on_a_narrow_terminal_shows_each_error_whole(
    url: str, api: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 80 columns a table left the last error two characters wide; each dead task is a card.
    monkeypatch.setenv("COLUMNS", "80")
    queue = f"narrow-{url[:4]}"
    error = "the mail server said no: 550 5.1.1 mailbox unavailable for ann@example.com"
    ids = bury(api, queue, 2, error=error)
    code, out, err = wq("dlq", "list", "-queue", queue, "-broker", url)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "dead letters: 2"
    assert max(len(line) for line in out.splitlines()) <= 80
    flat = " ".join(out.split())
    for i, task_id in enumerate(ids):
        assert f"{task_id} queue {queue} prio 0 attempts 1/1" in flat
        assert f'payload {{"n": {i}}}' in flat
    assert flat.count(" ".join(error.split())) == 2
    assert flat.count("buried 20") == 2


def test_dlq_list_requeue_and_purge(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"dlq-{url[:4]}"
    ids = bury(api, queue, 3, error="the mail server said no")
    dead = wq_json(url, "dlq", "list", "-queue", queue)
    assert dead == get(broker, f"/dlq?queue={queue}")[1]
    assert [t["id"] for t in dead] == ids
    assert wq_json(url, "dlq", "-queue", queue, "-limit", "1") == dead[:1]  # list: the default

    code, table, _ = wq("dlq", "--queue", queue, "-broker", url)
    assert code == 0
    assert "dead letters: 3" in table
    for task_id in ids:
        cells = row(table, task_id)
        assert cells[1:4] == [queue, "0", "1/1"]
    assert "the mail server said no" in table

    assert wq_json(url, "dlq", "purge", ids[0]) == {"purged": 1, "id": ids[0]}
    assert get(broker, f"/jobs/{ids[0]}")[0] == 404
    assert wq_json(url, "dlq", "requeue", ids[1]) == {"requeued": 1, "id": ids[1]}
    assert get(broker, f"/jobs/{ids[1]}")[1]["state"] == "ready"
    code, out, _ = wq("dlq", "requeue", "-all", "-queue", queue, "-broker", url)
    assert (code, out.strip()) == (0, f"requeued 1 dead task of queue {queue}")
    assert get(broker, f"/jobs/{ids[2]}")[1]["state"] == "ready"
    code, out, _ = wq("dlq", "list", "-queue", queue, "-broker", url)
    assert out.strip() == f"the dead-letter queue of queue {queue} is empty"

    bury(api, queue, 2)
    assert wq_json(url, "dlq", "requeue", "--all", "--queue", queue) == {
        "requeued": 2,
        "queue": queue,
    }


def test_task(url: str, broker: BrokerProcess, api: Client) -> None:
    task_id = api.enqueue({"order": 1742, "to": "ann"}, queue="lookup", priority=7)
    assert wq_json(url, "task", task_id) == get(broker, f"/jobs/{task_id}")[1]
    code, table, _ = wq("task", task_id, "-broker", url)
    assert code == 0
    assert f"task {task_id}" in table
    assert row(table, "state")[1:] == ["ready"]
    assert row(table, "priority")[1:] == ["7"]
    assert row(table, "attempts")[1:] == ["0", "of", "3"]
    assert '"order": 1742' in table


def test_enqueue(url: str, broker: BrokerProcess) -> None:
    answer = wq_json(
        url,
        "enqueue",
        '{"line": "hello", "n": [1, 2.5, null]}',
        "-queue",
        "enq",
        "-priority",
        "6",
        "-delay-ms",
        "60000",
        "-max-attempts",
        "5",
        "-key",
        f"k-{url[:4]}",
    )
    assert set(answer) == {"id", "duplicate"}
    assert answer["duplicate"] is False
    status, task = get(broker, f"/jobs/{answer['id']}")
    assert status == 200
    assert task["payload"] == {"line": "hello", "n": [1, 2.5, None]}
    assert (task["queue"], task["priority"], task["max_attempts"], task["state"]) == (
        "enq",
        6,
        5,
        "delayed",
    )
    again = wq_json(url, "enqueue", "{}", "-queue", "enq", "--idempotency-key", f"k-{url[:4]}")
    assert again == {"id": answer["id"], "duplicate": True}

    code, out, err = wq("enqueue", '"just a string"', "-broker", url)
    assert (code, err) == (0, "")
    task_id = out.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", task_id), out
    assert get(broker, f"/jobs/{task_id}")[1]["payload"] == "just a string"


def test_pause_and_resume(url: str, broker: BrokerProcess) -> None:
    queue = f"pr-{url[:4]}"

    def paused() -> bool:
        return any(q["name"] == queue and q["paused"] for q in get(broker, "/queues")[1])

    assert wq_json(url, "pause", queue) == {"queue": queue, "paused": True}
    assert paused()
    code, out, _ = wq("resume", queue, "-broker", url)
    assert (code, out.strip()) == (0, f"resumed queue {queue}")
    assert not paused()
    code, out, _ = wq("pause", queue, "-broker", url)
    assert (code, out.strip()) == (0, f"paused queue {queue}")
    assert paused()
    assert wq_json(url, "resume", queue) == {"queue": queue, "paused": False}


def test_flags_before_or_after_the_command_and_switch_spellings(
    broker: BrokerProcess, api: Client
) -> None:
    task_id = api.enqueue({"x": 1})
    expected = get(broker, f"/jobs/{task_id}")[1]
    for argv in (
        ["-broker", broker.url, "-json", "task", task_id],
        ["--broker=" + broker.url, "task", "--json", task_id],
        ["task", task_id, "-json=true", "--broker", broker.url],
        ["task", "-json", task_id, "-broker=" + broker.url],
    ):
        code, out, err = wq(*argv)
        assert (code, err) == (0, ""), argv
        assert json.loads(out) == expected, argv
    code, out, _ = wq("task", task_id, "-json=false", "-broker", broker.url)
    assert code == 0
    assert out.startswith(f"task {task_id}")


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.main(["-h"]) == 0
    text = capsys.readouterr().out
    for word in ("stats", "queues", "dlq requeue", "enqueue", "watch", "exit codes", "-json"):
        assert word in text
    assert admin.main(["dlq", "requeue", "--help"]) == 0
    assert "-all" in capsys.readouterr().out


# -- errors ---------------------------------------------------------------------------------------


def test_not_found_is_exit_3_and_one_line(url: str, api: Client) -> None:
    code, out, err = wq("task", "0123456789abcdef", "-broker", url)
    assert (code, out) == (3, "")
    assert "0123456789abcdef" in one_line_error(err)
    task_id = api.enqueue({})  # ready, not dead
    code, _, err = wq("dlq", "purge", task_id, "-broker", url, "-json")
    assert code == 3
    assert "dead-letter queue" in one_line_error(err)
    code, _, err = wq("dlq", "requeue", task_id, "-broker", url)
    assert code == 3
    one_line_error(err)


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_an_unreachable_broker_is_exit_4(scheme: str) -> None:
    where = f"{scheme}://127.0.0.1:{free_port()}"
    for argv in (["stats"], ["queues", "-json"], ["watch", "-count", "2"]):
        code, out, err = wq(*argv, "-broker", where, "-timeout", "5")
        assert (code, out) == (4, ""), argv
        assert "cannot reach the broker" in one_line_error(err)


def test_usage_errors_are_exit_2(broker: BrokerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    url = broker.url
    cases = {
        ("enqueue", "{not json"): "the payload is not valid JSON",
        ("enqueue", "NaN"): "NaN is not JSON",
        ("enqueue", "[" * 100_000): "the payload is nested too deeply",
        ("bogus",): "unknown command 'bogus'",
        ("dlq", "bogus"): "unknown dlq action 'bogus'",
        ("dlq", "requeue"): "give a task id, or -all",
        ("dlq", "requeue", "abc", "-all"): "give a task id, or -all",
        ("dlq", "requeue", "abc", "-queue", "q"): "-queue goes with -all",
        ("pause", "no spaces allowed"): "is not a queue name",
        (): "no command given",
    }
    for argv, message in cases.items():
        code, out, err = wq(*argv, "-broker", url)
        assert (code, out) == (2, ""), argv
        assert message in one_line_error(err), argv
    code, _, err = wq("stats", "-broker", "ftp://example.com")
    assert code == 2
    assert "use http://host:port or grpc://host:port" in one_line_error(err)
    # Flags: the strict parser's one line (on the process's stderr), exit 2.
    for flags in (
        ["stats", "-nope"],
        ["-nope"],
        ["task"],
        ["dlq", "-limit", "0"],
        ["watch", "-interval", "0"],
    ):
        assert admin.main([*flags, "-broker", url]) == 2, flags
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith("wq"), flags
        one_line_error(captured.err)
    assert admin.main(["enqueue", "{}", "-priority", "10", "-broker", url]) == 2
    assert "-priority" in capsys.readouterr().err


def test_errors_as_a_process(broker: BrokerProcess) -> None:
    """The same as a user sees it: one line on stderr, the exit status, never a traceback."""
    cases = [
        (["task", "0123456789abcdef", "-broker", broker.url], 3),
        (["stats", "-broker", f"http://127.0.0.1:{free_port()}"], 4),
        (["enqueue", "{oops", "-broker", broker.url], 2),
        (["stats", "-nope"], 2),
    ]
    for argv, expected in cases:
        proc = subprocess.run(
            [*ADMIN, *argv], capture_output=True, text=True, timeout=30, env=env()
        )
        assert proc.returncode == expected, (argv, proc.stderr)
        assert proc.stdout == ""
        one_line_error(proc.stderr)


# -- wq watch -------------------------------------------------------------------------------------


def test_watch_json_lines(url: str, broker: BrokerProcess) -> None:
    code, out, err = wq("watch", "-broker", url, "-json", "-interval", "0.05", "-count", "3")
    assert (code, err) == (0, "")
    frames = [json.loads(line) for line in out.splitlines()]
    assert len(frames) == 3
    assert all(set(f) == {"time", "stats", "rates", "queues"} for f in frames)
    assert set(frames[0]["rates"]) == set(frames[0]["stats"]["totals"])
    assert all(rate is None for rate in frames[0]["rates"].values())  # nothing to compare with
    for frame in frames[1:]:
        assert all(isinstance(r, float) and r >= 0 for r in frame["rates"].values())
    # Nothing else runs: the last frame is what the API says now.
    assert frames[-1]["stats"] == get(broker, "/stats")[1]
    assert frames[-1]["queues"] == get(broker, "/queues")[1]


def test_watch_tables_show_gauges_and_rates(broker: BrokerProcess, api: Client) -> None:
    api.enqueue({}, queue="watched")
    code, out, err = wq(
        "watch", "-broker", broker.url, "-queue", "watched", "-interval", "0.05", "-count", "2"
    )
    assert (code, err) == (0, "")
    assert out.count("gauges") == 2
    assert out.count("per second") == 2
    stats = get(broker, "/stats?queue=watched")[1]
    first, second = out.split("wq watch ")[1:]
    assert row(first, "rate")[1:] == ["-"] * 6  # the first refresh has no rate yet
    assert all(cell.endswith("/s") for cell in row(second, "rate")[1:])
    assert row(second, "total")[1] == str(stats["totals"]["enqueued"])
    assert row(second, "watched")[1] == str(stats["ready"])


def test_watch_ends_with_ctrl_c(broker: BrokerProcess) -> None:
    proc = subprocess.Popen(
        [*ADMIN, "watch", "-broker", broker.url, "-json", "-interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert json.loads(first)["stats"]["totals"]["enqueued"] >= 0
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert err == ""


# -- terminals -------------------------------------------------------------------------------------


def run_in_pty(argv: Sequence[str], timeout: float = 30) -> tuple[int, str]:
    """Run ``argv`` with its stdin, stdout and stderr on a pseudo-terminal (120 columns):
    (exit status, everything it wrote)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    child_env = {**env(), "TERM": "xterm-256color"}
    for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "CI"):
        child_env.pop(name, None)
    proc = subprocess.Popen(
        list(argv), stdin=follower, stdout=follower, stderr=follower, env=child_env
    )
    os.close(follower)
    chunks: list[bytes] = []
    give_up = time.monotonic() + timeout
    try:
        while time.monotonic() < give_up:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=max(1.0, give_up - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return rc, b"".join(chunks).decode("utf-8", "replace")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_the_producer_draws_a_progress_bar_on_a_terminal(broker: BrokerProcess) -> None:
    rc, text = run_in_pty(producer_command("-broker", broker.url, "-n", "300", "-concurrency", "4"))
    assert rc == 0, text
    plain = _ANSI.sub("", text)
    assert "300/300" in plain
    assert re.search(r"[\d,]+ tasks/s", plain), plain
    assert "100%" in plain
    assert "━" in plain  # the bar
    assert "\x1b[" in text  # drawn with colours: it is a terminal
    assert re.search(r"enqueued 300, failed 0, in [\d.]+s \(\d+ tasks/s\)", plain), plain


def test_the_producer_stays_quiet_without_a_terminal(broker: BrokerProcess) -> None:
    proc = subprocess.run(
        producer_command("-broker", broker.url, "-n", "50"),
        capture_output=True,
        text=True,
        timeout=30,
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0
    assert proc.stderr == ""
    assert re.fullmatch(r"enqueued 50, failed 0, in [\d.]+s \(\d+ tasks/s\)\n", proc.stdout)


def test_watch_on_a_terminal_redraws_in_place(broker: BrokerProcess) -> None:
    rc, text = run_in_pty(
        [*ADMIN, "watch", "-broker", broker.url, "-interval", "0.05", "-count", "3"]
    )
    assert rc == 0, text
    plain = _ANSI.sub("", text)
    assert plain.count("wq watch") >= 1
    assert "gauges" in plain
    assert "\x1b[" in text  # colours and cursor movements: rich.live on a terminal


# -- tokens ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tokens = write_token_file(Path(tmp_path_factory.mktemp("tokens")))
    with broker_process("-token-file", str(tokens)) as b:
        yield b


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_tokens(guarded: BrokerProcess, proto: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = guarded.url if proto == "http" else guarded.grpc_url
    expected = get(guarded, "/stats", ROOT)[1]
    code, out, err = wq("stats", "-json", "-broker", url, "-token", ROOT)
    assert (code, err) == (0, "")
    assert json.loads(out) == expected
    for argv, code_wanted in (
        (["stats"], 5),  # no token
        (["stats", "-token", UNKNOWN], 5),  # a token the broker does not know
        (["dlq", "-token", ONLY["produce"]], 5),  # a token without the admin scope
        (["pause", "q", "-token", ONLY["consume"]], 5),
    ):
        code, out, err = wq(*argv, "-broker", url)
        assert (code, out) == (code_wanted, ""), argv
        line = one_line_error(err)
        assert UNKNOWN not in line
    # $WQ_TOKEN, as the other commands take it; -token wins over it.
    monkeypatch.setenv("WQ_TOKEN", ONLY["admin"])
    assert wq("dlq", "-json", "-broker", url)[0] == 0
    assert wq("dlq", "-json", "-broker", url, "-token", ONLY["produce"])[0] == 5
    task = wq_json(url, "enqueue", "{}", "-token", ONLY["produce"])
    assert wq_json(url, "task", task["id"], "-token", ONLY["produce"])["state"] == "ready"
