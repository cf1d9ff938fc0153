"""``wqbroker -schedule-file FILE`` (docs/design/schedules.md), with real broker processes: the
file's schedules are put at start-up and fire (their tasks carry the schedule's name and
scheduled time); a broker restarted on the same SQLite file with the same file keeps each
schedule's next fire time and fires no time twice; a bad file stops the broker with one line
naming the file, the schedule and the member (no traceback, a non-zero exit status)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_until_sync
from tests.procs import broker_command, broker_process, env

ROOT = Path(__file__).resolve().parent.parent.parent


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def listed(url: str, queue: str) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = get(f"{url}/jobs?queue={queue}&state=ready&limit=1000")["tasks"]
    return tasks


def epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


TOML = """
[schedules.tick]
every_ms = 1000
queue = "ticks"
payload = { kind = "tick", n = 1 }

[schedules.nightly]
cron = "0 3 * * *"
timezone = "Europe/Berlin"
queue = "reports"
payload = "nightly"
"""


def test_the_files_schedules_are_put_and_fire(tmp_path: Path) -> None:
    path = tmp_path / "schedules.toml"
    path.write_text(TOML)
    with broker_process("-schedule-file", str(path)) as broker:
        schedules = get(f"{broker.url}/schedules")["schedules"]
        assert [s["name"] for s in schedules] == ["nightly", "tick"]
        got = wait_until_sync(
            lambda: listed(broker.url, "ticks"), lambda ts: len(ts) >= 2, what="two fires"
        )
        first, second = got[:2]
        assert (first["schedule"], second["schedule"]) == ("tick", "tick")
        assert first["payload"] == {"kind": "tick", "n": 1}
        assert epoch(second["scheduled_for"]) - epoch(first["scheduled_for"]) == pytest.approx(1.0)
        # Each fired at its time, never before it (how soon after: see `python -m bench
        # schedules`; a loaded test machine may take a while).
        for task in got[:2]:
            late = epoch(task["created_at"]) - epoch(task["scheduled_for"])
            assert 0 <= late < 5
        assert listed(broker.url, "reports") == []
        assert broker.stop() == 0


def test_a_restart_with_the_same_file_keeps_the_next_fire(tmp_path: Path) -> None:
    path = tmp_path / "schedules.json"
    path.write_text(
        json.dumps({"schedules": {"slow": {"every_ms": 3_600_000, "queue": "s", "payload": 1}}})
    )
    db = tmp_path / "wq.db"
    with broker_process("-schedule-file", str(path), "-store", f"sqlite:{db}") as broker:
        (before,) = get(f"{broker.url}/schedules")["schedules"]
        assert broker.stop() == 0
    with broker_process("-schedule-file", str(path), "-store", f"sqlite:{db}") as broker:
        (after,) = get(f"{broker.url}/schedules")["schedules"]
        assert after["next_fire_at"] == before["next_fire_at"]
        assert after["updated_at"] == before["updated_at"]
        assert broker.stop() == 0


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        (
            "s.toml",
            '[schedules.tick]\nevery_ms = 10\npayload = "x"\n',
            "schedule 'tick': every_ms must be from 1000",
        ),
        (
            "s.toml",
            '[schedules.nightly]\ncron = "0 3 * * * *"\npayload = "x"\n',
            "schedule 'nightly': cron '0 3 * * * *' has 6 fields",
        ),
        (
            "s.toml",
            '[schedules.n]\ncron = "0 3 * * *"\ntimezone = "Mars/Base"\npayload = 1\n',
            "schedule 'n': timezone 'Mars/Base' is not a known IANA time zone",
        ),
        (
            "s.toml",
            "[schedules.n]\nevery_ms = 1000\n",
            "schedule 'n': payload is required",
        ),
        (
            "s.json",
            '{"schedules": {"n": {"every_ms": 1000, "payload": 1, "qeue": "x"}}}',
            "schedule 'n': unknown member 'qeue'",
        ),
        ("s.json", "{not json", "is not valid JSON"),
    ],
)
def test_a_bad_file_stops_the_broker_naming_the_schedule_and_the_member(
    tmp_path: Path, name: str, text: str, words: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    db = tmp_path / "wq.db"
    proc = subprocess.run(
        broker_command(
            "-addr",
            "127.0.0.1:0",
            "-grpc-addr",
            "127.0.0.1:0",
            "-store",
            f"sqlite:{db}",
            "-schedule-file",
            str(path),
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("wqbroker: ")]
    assert line.startswith(f"wqbroker: {path}")
    assert words in line
