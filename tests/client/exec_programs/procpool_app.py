"""The app the ProcessRunner tests run in child processes (tests/client/test_procpool.py):
``tests.client.exec_programs.procpool_app:app``. Each function is a sync task that the tests
call by name; synchronisation with the test goes through files (no sleeps asserted)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from wqclient import App, Context, Fail, Retry, current_context

app = App()


class Unpicklable(Exception):
    """An exception whose pickle does not come back (its __init__ wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


@app.task(name="add")
def add(a: int, b: int) -> int:
    return a + b


@app.task(name="noop")
def noop() -> None:
    return None


@app.task(name="pid")
def pid() -> int:
    return os.getpid()


@app.task(name="context")
def context(ctx: Context) -> dict[str, Any]:
    assert current_context() is ctx
    return {
        "task_id": ctx.task_id,
        "name": ctx.name,
        "attempt": ctx.attempt,
        "max_attempts": ctx.max_attempts,
        "queue": ctx.queue,
        "parents": [[p.id, p.result_json] for p in ctx.parents],
        "schedule": ctx.schedule,
        "scheduled_for": ctx.scheduled_for,
        "cwd": os.getcwd(),
        "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
    }


@app.task(name="raise_value_error")
def raise_value_error(text: str) -> None:
    raise ValueError(text)


@app.task(name="raise_unpicklable")
def raise_unpicklable() -> None:
    raise Unpicklable("this", "that")


@app.task(name="raise_retry")
def raise_retry(delay_ms: int | None, error: str | None) -> None:
    raise Retry(delay_ms=delay_ms, error=error)


@app.task(name="raise_fail")
def raise_fail(error: str | None) -> None:
    raise Fail(error)


@app.task(name="exit")
def sys_exit(code: int) -> None:
    sys.exit(code)


@app.task(name="unpicklable_result")
def unpicklable_result() -> Any:
    return threading.Lock()


@app.task(name="progress")
def progress(count: int) -> str:
    ctx = current_context()
    for i in range(count):
        ctx.report_progress({"step": i})
    return "done"


@app.task(name="progress_caught")
def progress_caught() -> str:
    try:
        current_context().report_progress("one")
    except Exception as e:  # (what the parent's context raised, raised here)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _say_pid(path: str) -> None:
    Path(path + ".tmp").write_text(str(os.getpid()))
    os.replace(path + ".tmp", path)


@app.task(name="stuck")
def stuck(path: str) -> None:
    """Say its pid in ``path``, then never return."""
    _say_pid(path)
    while True:
        time.sleep(3600)


@app.task(name="gate")
def gate(path: str) -> str:
    """Say its pid in ``path + ".pid"``, then wait for the file ``path`` to appear."""
    _say_pid(path + ".pid")
    give_up = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > give_up:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.005)
    return "passed"


@app.task(name="die")
def die(code: int) -> None:
    os._exit(code)


@app.task(name="segfault")
def segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


@app.task(name="meet")
def meet(directory: str, count: int) -> int:
    """Leave a file in ``directory``, then wait until ``count`` tasks have: they only all meet
    if ``count`` of them run at once. The pid."""
    here = Path(directory)
    (here / str(os.getpid())).write_text("")
    give_up = time.monotonic() + 30
    while len(list(here.iterdir())) < count:
        if time.monotonic() > give_up:
            raise TimeoutError(f"only {len(list(here.iterdir()))} of {count} met")
        time.sleep(0.005)
    return os.getpid()
