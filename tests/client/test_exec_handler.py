"""ExecHandler (wqclient/_exec.py): a Worker handler that runs a program per task. Real programs
(sh, Python, Node.js) written into tmp_path; end to end, a real broker on port 0 and a real
Worker over HTTP and gRPC. Nothing sleeps to let things happen: the programs leave files the
tests wait for."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.helpers import running_broker, wait_until
from wqbroker.broker import Broker
from wqclient import AsyncClient, ParentResult, Task
from wqclient._exec import ERROR_BYTES, MAX_PARENTS_ENV, MAX_STDOUT, ExecHandler, ProgramError
from wqclient.worker import Fail, Worker

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


def make_task(
    payload: bytes = b"{}",
    *,
    task_id: str = "t-1",
    attempts: int = 1,
    max_attempts: int = 3,
    queue: str = "default",
    parents: tuple[ParentResult, ...] | None = None,
) -> Task:
    now = datetime.now(UTC)
    return Task(
        id=task_id,
        payload_json=payload,
        attempts=attempts,
        max_attempts=max_attempts,
        created_at=now,
        available_at=now,
        queue=queue,
        parents=parents,
    )


def script(directory: Path, name: str, text: str) -> str:
    """An executable file in ``directory``; its path."""
    path = directory / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def python(directory: Path, text: str, name: str = "prog.py") -> list[str]:
    return [PY, script(directory, name, text)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is not running)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def text_of(path: Path | str) -> str:
    """The file's text; empty if there is no such file."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def gone(path: str) -> bool:
    return not os.path.exists(path)


async def read_pid(path: Path) -> int:
    """The pid a program wrote into ``path`` (waiting for it)."""
    return int(await wait_until(lambda: text_of(path).strip(), what=f"a pid in {path}"))


# A program that tells what it was given: its stdin (as text) and its WQ_ environment.
TELL = """
import json, os, sys
data = sys.stdin.buffer.read()
env = {k: v for k, v in os.environ.items() if k.startswith("WQ_") or k == "EXTRA"}
if "WQ_PARENTS_FILE" in env:
    with open(env["WQ_PARENTS_FILE"]) as f:
        env["file"] = f.read()
print(json.dumps({"stdin": data.decode(), "env": env}))
"""


# -- what the program is given --------------------------------------------------------------------


async def test_stdin_is_the_payloads_exact_text_and_the_environment_tells_the_task(
    tmp_path: Path,
) -> None:
    handler = ExecHandler(python(tmp_path, TELL), env={"EXTRA": "yes"})
    payload = b'{"task": "billing.charge", "args": [1.10, "\\u00e9"],  "x" : 1e400}'
    task = make_task(payload, task_id="abc", attempts=2, max_attempts=5, queue="emails")
    out = await handler(task)
    assert out is not None
    seen = json.loads(out)
    assert seen["stdin"] == payload.decode()
    assert seen["env"] == {
        "WQ_TASK_ID": "abc",
        "WQ_ATTEMPT": "2",
        "WQ_MAX_ATTEMPTS": "5",
        "WQ_QUEUE": "emails",
        "WQ_TASK_NAME": "billing.charge",
        "EXTRA": "yes",
    }


@pytest.mark.parametrize("payload", [b'"billing.charge"', b'{"task": 3}', b"[1]", b"{}", b"null"])
async def test_no_task_name_unless_the_payload_is_an_object_with_a_string_task(
    tmp_path: Path, payload: bytes
) -> None:
    out = await ExecHandler(python(tmp_path, TELL))(make_task(payload))
    assert out is not None
    seen = json.loads(out)
    assert seen["stdin"] == payload.decode()
    assert "WQ_TASK_NAME" not in seen["env"]
    assert "WQ_PARENTS" not in seen["env"]


async def test_the_parents_and_their_results_are_in_the_environment(tmp_path: Path) -> None:
    parents = (ParentResult("p1", b'{"n": 1.50}'), ParentResult("p2", None))
    out = await ExecHandler(python(tmp_path, TELL))(make_task(parents=parents))
    assert out is not None
    env = json.loads(out)["env"]
    assert json.loads(env["WQ_PARENTS"]) == [
        {"id": "p1", "result": {"n": 1.5}},
        {"id": "p2", "result": None},
    ]
    assert '"result":{"n": 1.50}' in env["WQ_PARENTS"]  # (the result's text as it is)
    assert "WQ_PARENTS_FILE" not in env


async def test_parents_past_64_kib_go_in_a_file_removed_afterwards(tmp_path: Path) -> None:
    big = json.dumps("x" * MAX_PARENTS_ENV).encode()
    parents = (ParentResult("p1", big),)
    out = await ExecHandler(python(tmp_path, TELL))(make_task(parents=parents))
    assert out is not None
    env = json.loads(out)["env"]
    assert "WQ_PARENTS" not in env
    assert json.loads(env["file"]) == [{"id": "p1", "result": "x" * MAX_PARENTS_ENV}]
    assert gone(env["WQ_PARENTS_FILE"])


# -- exit statuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdout", "result"),
    [
        ('{"total": 1.10}\n', b'{"total": 1.10}'),
        ("  [1, 2]  \n\n", b"[1, 2]"),
        ("42", b"42"),
        ("", None),
        ("   \n", None),
        ("done, thanks\n", None),  # (not JSON: not a result)
    ],
)
async def test_exit_0_acks_and_json_stdout_is_the_result(
    tmp_path: Path, stdout: str, result: bytes | None
) -> None:
    prog = python(tmp_path, f"import sys; sys.stdout.write({stdout!r})")
    assert await ExecHandler(prog)(make_task()) == result


async def test_exit_100_fails_for_good_with_stderrs_last_lines(tmp_path: Path) -> None:
    prog = python(tmp_path, "import sys; print('no such account', file=sys.stderr); sys.exit(100)")
    with pytest.raises(Fail) as e:
        await ExecHandler(prog)(make_task())
    assert e.value.error == "no such account"
    prog = python(tmp_path, "import sys; sys.exit(100)", "quiet.py")
    with pytest.raises(Fail) as e:
        await ExecHandler(prog)(make_task())
    assert e.value.error == "exit 100"


async def test_another_exit_nacks_with_the_last_20_lines_of_stderr(tmp_path: Path) -> None:
    prog = python(
        tmp_path,
        "import sys\nfor i in range(50): print(f'line {i}', file=sys.stderr)\nsys.exit(3)",
    )
    with pytest.raises(ProgramError) as e:
        await ExecHandler(prog)(make_task())
    assert str(e.value).splitlines() == [f"line {i}" for i in range(30, 50)]
    prog = python(tmp_path, "import sys; sys.exit(3)", "quiet.py")
    with pytest.raises(ProgramError, match=r"^exited with status 3$"):
        await ExecHandler(prog)(make_task())


async def test_a_huge_stderr_keeps_only_its_tail(tmp_path: Path) -> None:
    prog = python(
        tmp_path,
        "import sys\nsys.stderr.write('x' * 5_000_000 + '\\nthe end')\nsys.exit(1)",
    )
    with pytest.raises(ProgramError) as e:
        await ExecHandler(prog)(make_task())
    text = str(e.value)
    assert text.endswith("\nthe end")
    assert len(text.encode()) <= ERROR_BYTES


async def test_a_program_killed_by_a_signal_nacks_naming_it(tmp_path: Path) -> None:
    prog = python(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(ProgramError, match=r"^killed by signal SIGSEGV$"):
        await ExecHandler(prog)(make_task())


async def test_a_shell_only_when_given_one(tmp_path: Path) -> None:
    handler = ExecHandler(["sh", "-c", 'read -r line; echo "[\\"$WQ_QUEUE\\", $line]"'])
    assert await handler(make_task(b'{"a": 1}\n', queue="q")) == b'["q", {"a": 1}]'
    # without one, the arguments are the program's, as they are
    handler = ExecHandler([PY, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", "$HOME"])
    assert await handler(make_task()) == b'["$HOME"]'


async def test_a_program_in_node(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed")
    prog = script(
        tmp_path,
        "prog.js",
        """
let data = "";
process.stdin.on("data", (chunk) => (data += chunk));
process.stdin.on("end", () => {
  const call = JSON.parse(data);
  if (call.args[0] < 0) { console.error("negative!"); process.exit(100); }
  console.log(JSON.stringify({sum: call.args.reduce((a, b) => a + b, 0),
                              task: process.env.WQ_TASK_NAME}));
});
""",
    )
    handler = ExecHandler([node, prog])
    out = await handler(make_task(b'{"task": "add", "args": [1, 2, 3]}'))
    assert out is not None
    assert json.loads(out) == {"sum": 6, "task": "add"}
    with pytest.raises(Fail, match="negative!"):
        await handler(make_task(b'{"task": "add", "args": [-1]}'))


async def test_a_program_that_does_not_read_its_stdin_is_no_error(tmp_path: Path) -> None:
    prog = python(tmp_path, "print('[]')")
    payload = json.dumps({"big": "x" * 2_000_000}).encode()
    assert await ExecHandler(prog)(make_task(payload)) == b"[]"


# -- limits ----------------------------------------------------------------------------------------


async def test_stdout_past_16_mib_fails_the_task_and_is_not_kept(tmp_path: Path) -> None:
    prog = python(
        tmp_path,
        f"import sys\nfor _ in range({MAX_STDOUT // 65536 + 2}): sys.stdout.write('x' * 65536)",
    )
    with pytest.raises(Fail, match="more than 16 MiB to stdout"):
        await ExecHandler(prog)(make_task())


async def test_stdout_past_the_cap_does_not_hide_a_failing_status(tmp_path: Path) -> None:
    prog = python(
        tmp_path,
        f"import sys\nsys.stdout.write('x' * {MAX_STDOUT + 10})\nsys.stdout.flush()\n"
        "print('broke', file=sys.stderr)\nsys.exit(2)",
    )
    with pytest.raises(ProgramError, match=r"^broke$"):
        await ExecHandler(prog)(make_task())


# -- stopping --------------------------------------------------------------------------------------


def with_a_child(directory: Path) -> str:
    """A program that starts a child (``sleep``) and waits for it, writing the child's pid into
    ``directory``/child and its own into ``directory``/pid."""
    return script(
        directory,
        "prog.sh",
        f"""#!/bin/sh
sleep 1000 &
echo $! > {directory}/child.tmp && mv {directory}/child.tmp {directory}/child
echo $$ > {directory}/pid.tmp && mv {directory}/pid.tmp {directory}/pid
wait
""",
    )


async def test_cancelling_kills_the_programs_process_group_its_children_too(
    tmp_path: Path,
) -> None:
    prog = with_a_child(tmp_path)
    run = asyncio.ensure_future(ExecHandler([prog], kill_grace=30)(make_task()))
    pid = await read_pid(tmp_path / "pid")
    child = await read_pid(tmp_path / "child")
    assert alive(pid)
    assert alive(child)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not alive(pid)  # (reaped before the CancelledError came out)
    await wait_until(lambda: not alive(child), what="the program's child to be gone")


async def test_a_program_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    prog = python(
        tmp_path,
        f"""
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: open({str(tmp_path / "termed")!r}, "w").close())
with open({str(tmp_path / "pid.tmp")!r}, "w") as f:
    f.write(str(os.getpid()))
os.replace({str(tmp_path / "pid.tmp")!r}, {str(tmp_path / "pid")!r})
while True:
    time.sleep(3600)
""",
    )
    run = asyncio.ensure_future(ExecHandler(prog, kill_grace=0.2)(make_task()))
    pid = await read_pid(tmp_path / "pid")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert (tmp_path / "termed").exists()  # it was asked first
    assert not alive(pid)


async def test_a_program_that_ends_on_sigterm_is_not_waited_for(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        "prog.sh",
        f"#!/bin/sh\necho $$ > {tmp_path}/pid.tmp && mv {tmp_path}/pid.tmp {tmp_path}/pid\n"
        "exec sleep 1000\n",
    )
    run = asyncio.ensure_future(ExecHandler([prog], kill_grace=3600)(make_task()))
    pid = await read_pid(tmp_path / "pid")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 30)  # (a safety bound: the grace is an hour)
    assert not alive(pid)


# -- programs that cannot run ----------------------------------------------------------------------


def test_a_missing_or_unrunnable_program_is_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="program not found on PATH: 'no-such-wq-prog'"):
        ExecHandler(["no-such-wq-prog"])
    with pytest.raises(FileNotFoundError, match="program not found: "):
        ExecHandler([str(tmp_path / "nothing.sh")])
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError, match="program is not executable: "):
        ExecHandler([str(plain)])
    with pytest.raises(PermissionError, match="program is not executable: "):
        ExecHandler([str(tmp_path)])
    with pytest.raises(ValueError, match="argv is empty"):
        ExecHandler([])
    with pytest.raises(TypeError, match="a sequence of strings"):
        ExecHandler("./handle.sh")


async def test_a_program_gone_since_fails_its_task_saying_so(tmp_path: Path) -> None:
    prog = script(tmp_path, "prog.sh", "#!/bin/sh\n")
    handler = ExecHandler([prog])
    assert await handler(make_task()) is None
    os.unlink(prog)
    with pytest.raises(ProgramError, match=r"cannot run '.*prog.sh': No such file or directory"):
        await handler(make_task())


# -- end to end: a real broker, a real Worker ------------------------------------------------------

TRANSPORTS = ["http", "grpc"]

# The end-to-end program: does what the payload's "do" says.
E2E = """
import json, os, sys
call = json.load(sys.stdin)
do = call.get("do")
if do == "ok":
    parents = json.loads(os.environ.get("WQ_PARENTS", "[]"))
    print(json.dumps({"got": call["n"], "attempt": int(os.environ["WQ_ATTEMPT"]),
                      "parents": [p["result"] for p in parents]}))
elif do == "fail":
    print("the account is closed", file=sys.stderr)
    sys.exit(100)
elif do == "crash":
    print("Traceback: something broke", file=sys.stderr)
    sys.exit(1)
elif do == "hang":
    open(os.environ["WQ_TASK_ID"] + ".pid", "w").write(str(os.getpid()))
    import time
    time.sleep(3600)
"""


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


async def test_end_to_end_acked_with_a_result_buried_retried_and_cancelled(
    broker: Broker, transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    handler = ExecHandler(python(tmp_path, E2E))
    async with AsyncClient(url_for(broker, transport)) as client:
        worker = Worker(client, handler, concurrency=2, wait_ms=200, lease_ms=1000)
        running = asyncio.ensure_future(worker.run())
        try:
            ok = (await client.enqueue({"do": "ok", "n": 7}, result_ttl_ms=60_000)).id
            child = (
                await client.enqueue({"do": "ok", "n": 8}, after=[ok], result_ttl_ms=60_000)
            ).id
            failed = (await client.enqueue({"do": "fail"}, max_attempts=5)).id
            crashed = (await client.enqueue({"do": "crash"}, max_attempts=5)).id
            hung = (await client.enqueue({"do": "hang"})).id

            done = await client.wait_result(ok, timeout=30)
            assert done is not None
            assert done.state == "succeeded"
            assert done.result == {"got": 7, "attempt": 1, "parents": []}
            done = await client.wait_result(child, timeout=30)
            assert done is not None
            assert done.state == "succeeded"
            assert done.result == {
                "got": 8,
                "attempt": 1,
                "parents": [{"got": 7, "attempt": 1, "parents": []}],
            }

            dead = await client.wait_result(failed, timeout=30)
            assert dead is not None
            assert dead.state == "dead"
            assert dead.last_error == "the account is closed"

            retried = await wait_until(
                lambda: client.get_task(crashed),
                lambda t: t.last_error is not None,
                what="the crashed task to be nacked",
            )
            assert retried.state in ("delayed", "ready", "handed_out")
            assert retried.last_error == "Traceback: something broke"

            pid = await read_pid(tmp_path / f"{hung}.pid")
            assert await client.cancel(hung) == "cancelling"
            # (the nack that ends it may come before a result wait could start: counted)
            await wait_until(
                client.stats, lambda s: s.totals.cancelled == 1, what="the task's cancel"
            )
            await wait_until(lambda: not alive(pid), what="the cancelled program to be killed")
        finally:
            worker.stop()
            await asyncio.wait_for(running, 30)


def group_members(pgid: int) -> list[int]:
    """The live processes whose process group is ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


async def test_a_cancel_while_the_program_is_being_started_still_ends_its_whole_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cancel that lands while the program is being spawned (before its pipes are connected)
    # used to go to asyncio's own clean-up, which SIGKILLs the program's pid alone: a child it
    # had started by then lived on, holding the pipes (seen once in CI, under load). Here the
    # spawn is held, once the program has started its child, until the cancel has been made.
    prog = with_a_child(tmp_path)
    loop = asyncio.get_running_loop()
    spawned = loop.subprocess_exec
    started: asyncio.Future[None] = loop.create_future()
    cancelled = asyncio.Event()

    async def slow_spawn(*args: object, **kwargs: object) -> object:
        result: object = await spawned(*args, **kwargs)  # type: ignore[arg-type]
        started.set_result(None)
        await cancelled.wait()
        return result

    monkeypatch.setattr(loop, "subprocess_exec", slow_spawn)
    run = asyncio.ensure_future(ExecHandler([prog], kill_grace=30)(make_task()))
    await started
    child = await read_pid(tmp_path / "child")
    pgid = os.getpgid(child)
    run.cancel()
    await asyncio.sleep(0)  # (the cancel lands in the spawn)
    cancelled.set()
    with pytest.raises(asyncio.CancelledError):
        await run
    await wait_until(lambda: not group_members(pgid), what="the program's group to be gone")
