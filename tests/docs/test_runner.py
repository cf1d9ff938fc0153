"""The runner of the documentation's blocks (tests/docs/runner.py), on small pages of its own."""

from __future__ import annotations

import os
import re
import socket
import textwrap
import time
from pathlib import Path

import pytest

from tests.docs import runner
from tests.docs.runner import (
    DocError,
    PageResult,
    matches,
    parse,
    parse_console,
    parse_options,
    run_page,
    substitute_wheel,
)

FENCE = "```"


def page(text: str) -> str:
    """A page's text, written with ~~~ for fences (so these tests can hold it in strings)."""
    return textwrap.dedent(text).replace("~~~", FENCE)


def run(tmp_path: Path, text: str, **kwargs: object) -> PageResult:
    path = tmp_path / "page.md"
    path.write_text(page(text))
    return run_page(path, ports=(), **kwargs)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # (a zombie not yet reaped by its parent counts as gone)
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


# -- reading pages -------------------------------------------------------------------------------


def test_only_marked_fences_are_blocks_with_their_lines_and_options() -> None:
    blocks = parse(
        page("""\
        # A page

        ~~~sh
        echo not marked
        ~~~

        <!-- wq:run -->
        ~~~sh
        echo one
        ~~~

        <!-- wq:run background wait=http://127.0.0.1:8080/readyz timeout=5 -->
        ~~~console
        $ wqbroker
        ~~~

        <!-- wq:run file=tasks.py -->
        ~~~python
        print(1)
        ~~~

        <!-- wq:run retry=10 -->
        ~~~console
        $ curl -s localhost:8080/dlq
        [...]
        ~~~
        """),
        "p.md",
    )
    assert [(b.line, b.lang) for b in blocks] == [
        (8, "sh"),
        (13, "console"),
        (18, "python"),
        (23, "console"),
    ]
    assert blocks[0].text == "echo one\n"
    assert blocks[1].options.background
    assert blocks[1].options.wait_url == "http://127.0.0.1:8080/readyz"
    assert blocks[1].options.timeout == 5
    assert blocks[2].options.file == "tasks.py"
    assert blocks[3].options.retry == 10
    assert blocks[3].commands[0].expected == ("[...]",)


def test_markers_inside_a_fence_are_text_and_indented_blocks_are_read() -> None:
    blocks = parse(
        page("""\
        ````markdown
        <!-- wq:run -->
        ~~~sh
        echo shown, not run
        ~~~
        ````

        === "Tab"

            <!-- wq:run -->
            ~~~sh
            echo in a tab
              indented more
            ~~~
        """)
    )
    assert [b.text for b in blocks] == ["echo in a tab\n  indented more\n"]


def test_hidden_blocks_and_output_blocks() -> None:
    blocks = parse(
        page("""\
        <!-- wq:hidden
        touch ready
        -->
        <!-- wq:hidden sleep 0 -->

        <!-- wq:run -->
        ~~~python
        print("hi")
        ~~~

        <!-- wq:output -->
        ~~~text
        hi
        ~~~
        """)
    )
    assert [(b.hidden, b.text) for b in blocks[:2]] == [
        (True, "\ntouch ready\n\n"),
        (True, " sleep 0 \n"),
    ]
    assert blocks[2].expected_output == "hi\n"
    assert blocks[2].output_line == 12


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- wq:run -->\n\nsome prose\n", "must be right before a fence"),
        ("<!-- wq:run -->\n", "must be right before a fence"),
        ("<!-- wq:run bogus -->\n~~~sh\n~~~\n", "unknown wq:run option 'bogus'"),
        ("<!-- wq:run retry=soon -->\n~~~sh\n~~~\n", "take seconds"),
        ("<!-- wq:run wait=http://x -->\n~~~sh\n~~~\n", "for background blocks"),
        ("<!-- wq:run -->\n~~~yaml\na: 1\n~~~\n", "cannot run a yaml block"),
        ("<!-- wq:run -->\n~~~console\nls\n~~~\n", "starts with a '$ ' command"),
        ("<!-- wq:output -->\n~~~text\nx\n~~~\n", "must follow a python or shell block"),
        ("<!-- wq:hidden\ntrue\n", "never closed"),
    ],
)
def test_a_page_the_runner_cannot_read_is_an_error_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(DocError, match=re.escape(message)) as caught:
        parse(page(text), "p.md")
    assert re.match(r"p\.md:\d+: ", str(caught.value))


def test_console_commands_continuations_and_exit_statuses() -> None:
    commands = parse_console(
        "$ echo a \\\n    b\na b\n$ wq nothing  # exit 2\nerror: ...\n$ true\n\n",
        first_line=10,
    )
    assert [(c.line, c.text, c.expected, c.status) for c in commands] == [
        (10, "echo a \\\n    b", ("a b",), 0),
        (13, "wq nothing  # exit 2", ("error: ...",), 2),
        (15, "true", None, 0),
    ]


def test_options_are_shell_words() -> None:
    options = parse_options(' background wait-output="listening on http" ')
    assert options.background
    assert options.wait_output == "listening on http"


# -- matching ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        (["a", "b"], ["a", "b"], True),
        (["a", "b"], ["a", "c"], False),
        (["a"], ["a", "b"], False),
        (["a  "], ["a", "", ""], True),  # (trailing whitespace and blank lines)
        (["a", "...", "z"], ["a", "b", "c", "z"], True),
        (["a", "...", "z"], ["a", "z"], True),
        (["a", "...", "z"], ["a", "b"], False),
        (["..."], [], True),
        (['{"id":"...","state":"ready"}'], ['{"id":"0a1b","state":"ready"}'], True),
        (['{"id":"...","state":"ready"}'], ['{"id":"0a1b","state":"leased"}'], False),
        (["took ... ms (... tasks)"], ["took 12 ms (3 tasks)"], True),
        (["a.b"], ["axb"], False),  # (the rest of a line is literal)
        (["..."], ["anything", "at all"], True),
    ],
)
def test_wildcards(expected: list[str], actual: list[str], ok: bool) -> None:
    assert matches(expected, actual) is ok


def test_the_wheel_replaces_the_requirement_on_pip_install_lines_only() -> None:
    text = (
        "python3 -m venv .venv\n"
        "pip install 'wqueue[broker,cli]'\n"
        'pip install --quiet wqueue "wqueue[cli]"\n'
        "pip show wqueue\n"
        "pip install wqueue-extra ./wqueue\n"
    )
    assert substitute_wheel(text, "/w/wqueue-1-py3-none-any.whl") == (
        "python3 -m venv .venv\n"
        "pip install '/w/wqueue-1-py3-none-any.whl[broker,cli]'\n"
        'pip install --quiet /w/wqueue-1-py3-none-any.whl "/w/wqueue-1-py3-none-any.whl[cli]"\n'
        "pip show wqueue\n"
        "pip install wqueue-extra ./wqueue\n"
    )


# -- running pages -------------------------------------------------------------------------------


def test_a_page_runs_in_one_shell_in_a_directory_of_its_own(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run -->
        ~~~bash
        GREETING=hello
        mkdir sub && cd sub
        ~~~

        <!-- wq:run file=data.txt -->
        ~~~text
        some data
        ~~~

        <!-- wq:run -->
        ~~~console
        $ echo $GREETING; cat data.txt
        hello
        some data
        $ pwd
        /.../work/sub
        $ export GREETING
        $ ls ..
        sub
        ~~~

        <!-- wq:run -->
        ~~~python
        import os
        print(os.environ["GREETING"], open("data.txt").read().strip(), os.getcwd().endswith("sub"))
        ~~~

        <!-- wq:output -->
        ~~~text
        hello some data True
        ~~~
        """,
    )
    assert result.ok, result.report()
    assert result.passed == 4


def test_a_failing_command_fails_its_block_and_the_page_goes_on(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run -->
        ~~~sh
        echo before
        ls /no/such/place
        echo after
        ~~~

        <!-- wq:run -->
        ~~~sh
        f() { false; echo not reached; }
        f
        ~~~

        <!-- wq:run -->
        ~~~sh
        false || echo handled
        if false; then :; fi
        ~~~
        """,
    )
    assert result.passed == 1
    first, second = result.failures
    assert first.where.endswith("page.md:2")
    assert "at line 4: ls /no/such/place" in first.what
    assert first.actual is not None
    assert first.actual.startswith("before\n")
    assert "after" not in first.actual
    assert "at line 10: false" in second.what
    assert "not reached" not in (second.actual or "")


def test_an_output_not_as_shown_fails_with_expected_and_actual(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        Some prose.

        <!-- wq:run -->
        ~~~console
        $ echo 1
        1
        $ printf 'ready: 3\\nleased: 0\\n'
        ready: ...
        leased: 1
        $ echo not run
        ~~~
        """,
    )
    (failure,) = result.failures
    assert failure.where.endswith("page.md:7")
    assert failure.command == "printf 'ready: 3\\nleased: 0\\n'"
    assert failure.expected == "ready: ...\nleased: 1"
    assert failure.actual == "ready: 3\nleased: 0\n"
    text = str(failure)
    assert "--- expected ---" in text
    assert "--- actual ---" in text


def test_exit_statuses(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run -->
        ~~~console
        $ sh -c 'echo no >&2; exit 2'  # exit 2
        no
        $ true  # exit 1
        ~~~

        <!-- wq:run -->
        ~~~console
        $ sh -c 'exit 3'
        ~~~

        <!-- wq:run -->
        ~~~python
        raise SystemExit(4)
        ~~~
        """,
    )
    assert [f.what for f in result.failures] == ["exited 0, not 1", "exited 3, not 0", "exited 4"]


def test_retry_runs_a_block_again_until_it_passes(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run retry=10 -->
        ~~~console
        $ echo x >> tries; wc -l < tries
        3
        ~~~

        <!-- wq:run retry=1 -->
        ~~~console
        $ echo never
        always
        ~~~
        """,
    )
    assert result.passed == 1
    (failure,) = result.failures
    assert "tried" in failure.what


def test_background_blocks_wait_for_a_url_or_an_output(tmp_path: Path) -> None:
    port = free_port()
    result = run(
        tmp_path,
        f"""\
        <!-- wq:run -->
        ~~~sh
        echo served > hello.txt
        ~~~

        <!-- wq:run background wait=http://127.0.0.1:{port}/hello.txt -->
        ~~~console
        $ python -m http.server {port} --bind 127.0.0.1
        ~~~

        <!-- wq:run background wait-output="started" -->
        ~~~sh
        sleep 0.5; echo started; sleep 600
        ~~~

        <!-- wq:run -->
        ~~~console
        $ curl -s http://127.0.0.1:{port}/hello.txt
        served
        ~~~
        """,
    )
    assert result.ok, result.report()
    assert result.passed == 4


def test_a_background_block_that_dies_or_never_gets_ready_fails_with_its_output(
    tmp_path: Path,
) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run background wait-output="ready" -->
        ~~~sh
        echo "no can do"; exit 3
        ~~~

        <!-- wq:run background wait-output="ready" timeout=1 -->
        ~~~sh
        echo "still thinking"; sleep 600
        ~~~

        <!-- wq:run -->
        ~~~sh
        false
        ~~~
        """,
    )
    died, slow, after = result.failures
    assert died.what == "exited (3) before it was ready"
    assert died.actual == "no can do"
    assert "not ready after 1 s" in slow.what
    assert slow.actual == "still thinking"
    # (a later failure names the background block that had exited)
    assert any("page.md:2 has exited (3)" in note for note in after.notes)


def test_hidden_blocks_run_unseen(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:hidden
        echo made > made.txt
        -->

        <!-- wq:run -->
        ~~~console
        $ cat made.txt
        made
        ~~~

        <!-- wq:hidden false -->
        """,
    )
    assert result.passed == 2
    (failure,) = result.failures
    assert failure.where.endswith("page.md:11")


def test_a_hung_block_is_killed_at_its_timeout_and_the_page_stops(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run(
        tmp_path,
        """\
        <!-- wq:run timeout=1 -->
        ~~~sh
        echo waiting; sleep 600
        ~~~

        <!-- wq:run -->
        ~~~sh
        echo never run
        ~~~
        """,
    )
    assert time.monotonic() - started < 15
    (failure,) = result.failures
    assert failure.what == "timed out after 1 s"
    assert failure.actual == "waiting\n"
    assert result.skipped == 1


def test_a_hung_python_block_is_killed_and_the_page_goes_on(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """\
        <!-- wq:run timeout=1 -->
        ~~~python
        import time
        time.sleep(600)
        ~~~

        <!-- wq:run -->
        ~~~sh
        true
        ~~~
        """,
    )
    (failure,) = result.failures
    assert failure.what == "timed out after 1 s"
    assert result.passed == 1


def test_everything_a_page_started_is_killed_when_it_ends(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    result = run(
        tmp_path,
        f"""\
        <!-- wq:run -->
        ~~~sh
        sleep 600 &
        echo $! >> {pids}
        (sleep 600 & echo $! >> {pids}; wait) &
        ~~~

        <!-- wq:run background -->
        ~~~sh
        echo $$ >> {pids}
        sleep 600
        ~~~

        <!-- wq:hidden
        while [ "$(wc -l < {pids})" -lt 3 ]; do sleep 0.05; done
        -->

        <!-- wq:run -->
        ~~~sh
        exit 0
        ~~~
        """,
    )
    assert result.passed == 3
    assert "the page's shell exited" in result.failures[0].what
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3
    assert not [pid for pid in started if alive(pid)]


def test_the_ports_must_be_free_before_a_page_and_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "PORTS_WAIT", 1.0)
    path = tmp_path / "page.md"
    path.write_text(page("<!-- wq:run -->\n~~~sh\ntrue\n~~~\n"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        result = run_page(path, ports=[port])
    assert time.monotonic() - started < 5
    (failure,) = result.failures
    assert f"port(s) [{port}] in use before the page started" in failure.what
    assert result.passed == 0


def test_install_blocks_run_only_with_a_wheel_and_install_it(tmp_path: Path) -> None:
    text = """\
        <!-- wq:run install -->
        ~~~sh
        echo pip install 'wqueue[broker,cli]'
        ~~~

        <!-- wq:output -->
        ~~~text
        pip install /tmp/wqueue-0.1.0-py3-none-any.whl[broker,cli]
        ~~~

        <!-- wq:run -->
        ~~~sh
        true
        ~~~
        """
    normal = run(tmp_path, text)
    assert (normal.ok, normal.passed, normal.skipped) == (True, 1, 1)
    newcomer = run(tmp_path, text, wheel=Path("/tmp/wqueue-0.1.0-py3-none-any.whl"))
    assert (newcomer.ok, newcomer.passed, newcomer.skipped) == (True, 2, 0), newcomer.report()


def test_the_page_gets_the_bin_directory_first_and_none_of_the_callers_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "wq").write_text("#!/bin/sh\necho the fake wq\n")
    (bin_dir / "wq").chmod(0o755)
    monkeypatch.setenv("WQ_BROKER", "http://elsewhere:1")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    result = run(
        tmp_path,
        """\
        <!-- wq:run -->
        ~~~console
        $ wq
        the fake wq
        $ echo "[${WQ_BROKER-unset}] [${PYTHONPATH-unset}]"
        [unset] [unset]
        ~~~
        """,
        bin_dir=bin_dir,
    )
    assert result.ok, result.report()
