"""The client commands in the shell: ``$WQ_BROKER``, ``$WQ_TOKEN`` / ``$WQ_TOKEN_FILE`` and
``$WQ_CA_FILE`` for ``wq`` (every subcommand), ``wq-worker``, ``wq-producer`` and ``wq worker``
(flags winning; ``wq worker``: flag, the App's own, the variable, the default), the switches'
every spelling in every command, and ``wq completion`` run in real bash."""

from __future__ import annotations

import io
import json
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.authkit import ONLY, ROOT, UNKNOWN, TLSFiles, bearer, make_tls_files, write_token_file
from tests.helpers import wait_until_sync
from tests.procs import BrokerProcess, broker_process, env, producer_command, worker_command
from wqbroker import __main__ as wqbroker_main
from wqclient.cli import Connection, admin, connection, producer, run, worker
from wqclient.limits import DEFAULT_URL
from wqclient.models import LIST_STATES

pytestmark = pytest.mark.timeout(60)

VARIABLES = ("WQ_BROKER", "WQ_TOKEN", "WQ_TOKEN_FILE", "WQ_CA_FILE")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def broker(tls: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A broker with TLS and tokens: a command reaches it only with the right three."""
    tokens = write_token_file(tmp_path_factory.mktemp("tokens"))
    with broker_process(
        "-tls-cert", str(tls.cert), "-tls-key", str(tls.key), "-token-file", str(tokens)
    ) as b:
        assert b.url.startswith("https://")
        yield b


def _token_file(directory: Path, token: str, name: str = "token") -> Path:
    path = directory / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _stats(broker: BrokerProcess, tls: TLSFiles) -> Any:
    import ssl

    context = ssl.create_default_context(cafile=str(tls.ca))
    req = urllib.request.Request(broker.url + "/stats", headers=bearer(ROOT))
    with urllib.request.urlopen(req, timeout=10, context=context) as resp:
        return json.loads(resp.read())


def wq(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = admin.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- wq: every variable, flags winning -----------------------------------------------------------


def test_wq_takes_broker_token_and_ca_file_from_the_environment(
    broker: BrokerProcess, tls: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_BROKER", broker.url)
    monkeypatch.setenv("WQ_TOKEN", ROOT)
    monkeypatch.setenv("WQ_CA_FILE", str(tls.ca))
    code, out, err = wq("stats", "-json")
    assert (code, err) == (0, "")
    assert json.loads(out)["totals"] == _stats(broker, tls)["totals"]
    # every subcommand finds them: one that changes something, one of two words
    code, out, err = wq("enqueue", '{"env": 1}', "-queue", "envq", "-json")
    assert (code, err) == (0, ""), err
    task_id = json.loads(out)["id"]
    assert wq("task", task_id, "-json")[0] == 0
    assert wq("dlq", "list", "-json") == (0, "[]\n", "")
    assert wq("queue", "empty", "envq")[0] == 0


def test_wq_reads_the_token_from_wq_token_file(
    broker: BrokerProcess, tls: TLSFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_BROKER", broker.url)
    monkeypatch.setenv("WQ_CA_FILE", str(tls.ca))
    monkeypatch.setenv("WQ_TOKEN_FILE", str(_token_file(tmp_path, ROOT)))
    assert wq("queues", "-json")[0] == 0
    # a token without the admin scope, from the file: refused by the broker (5), so it was sent
    monkeypatch.setenv("WQ_TOKEN_FILE", str(_token_file(tmp_path, ONLY["produce"], "p")))
    assert wq("dlq", "-json")[0] == admin.EXIT_REFUSED


def test_wq_flags_win_over_the_variables(
    broker: BrokerProcess, tls: TLSFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_BROKER", "http://127.0.0.1:9")  # nothing there
    monkeypatch.setenv("WQ_TOKEN", UNKNOWN)
    monkeypatch.setenv("WQ_CA_FILE", str(tmp_path / "no-such-ca.pem"))
    flags = ["-broker", broker.url, "-ca-file", str(tls.ca)]
    assert wq("stats", *flags, "-token", ROOT)[0] == 0
    assert wq("stats", *flags, "-token-file", str(_token_file(tmp_path, ROOT)))[0] == 0
    # without the flags, the variables are used (and fail as they should)
    assert wq("stats", "-broker", broker.url, "-token", ROOT)[0] == admin.EXIT_USAGE  # the CA
    assert wq("stats", *flags)[0] == admin.EXIT_REFUSED  # the unknown token
    assert wq("stats", "-token", ROOT, "-ca-file", str(tls.ca), "-timeout", "2")[0] == (
        admin.EXIT_UNAVAILABLE
    )


def test_both_token_variables_are_one_line_naming_both_unless_a_flag_settles_it(
    broker: BrokerProcess, tls: TLSFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_BROKER", broker.url)
    monkeypatch.setenv("WQ_CA_FILE", str(tls.ca))
    monkeypatch.setenv("WQ_TOKEN", ROOT)
    monkeypatch.setenv("WQ_TOKEN_FILE", str(_token_file(tmp_path, ROOT)))
    code, out, err = wq("stats")
    assert (code, out) == (2, "")
    line = _one_line(err)
    assert line.startswith("wq: ")
    assert "$WQ_TOKEN " in line
    assert "$WQ_TOKEN_FILE" in line
    assert ROOT not in line
    assert wq("stats", "-token", ROOT)[0] == 0
    assert wq("stats", "-token-file", str(tmp_path / "token"))[0] == 0
    code, _, err = wq("stats", "-token", ROOT, "-token-file", str(tmp_path / "token"))
    assert code == 2
    assert "-token or -token-file" in _one_line(err)


@pytest.mark.parametrize("how", ["missing", "directory", "empty", "tokens"])
def test_a_token_file_that_cannot_be_used_is_one_line_naming_it(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    if how == "directory":
        path.mkdir()
    elif how == "empty":
        path.write_text("\n")
    elif how == "tokens":  # the broker's file of TOKEN SCOPES lines
        path.write_text(f"{ROOT} admin\n")
    monkeypatch.setenv("WQ_BROKER", "http://127.0.0.1:9")
    for argv, source in (
        (["stats"], "$WQ_TOKEN_FILE"),
        (["stats", "-token-file", str(path)], "-token-file"),
    ):
        monkeypatch.setenv("WQ_TOKEN_FILE", str(path))
        code, out, err = wq(*argv)
        assert (code, out) == (2, ""), err
        line = _one_line(err)
        assert str(path) in line, line
        assert source in line, line
        assert ROOT not in line
    reason = {"missing": "No such file", "directory": "Is a directory", "empty": "empty"}
    assert reason.get(how, "one token") in line


# -- wq-producer, wq-worker, wq worker: real processes, the variables only -----------------------


def _environment(broker: BrokerProcess, tls: TLSFiles, token_file: Path) -> dict[str, str]:
    return {
        **env(),
        "WQ_BROKER": broker.url,
        "WQ_TOKEN_FILE": str(token_file),
        "WQ_CA_FILE": str(tls.ca),
    }


def _run_until_acked(
    cmd: list[str], environ: dict[str, str], broker: BrokerProcess, tls: TLSFiles, cwd: Path
) -> None:
    before = _stats(broker, tls)["totals"]["acked"]
    produced = subprocess.run(
        producer_command("-n", "3", "-queue", "envw"),
        env=environ,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert produced.returncode == 0, produced.stderr
    assert produced.stdout.startswith("enqueued 3, failed 0")
    with open(cwd / "worker.err", "wb") as err:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=environ, stdin=subprocess.DEVNULL, stdout=err, stderr=err
        )
    try:
        wait_until_sync(
            lambda: _stats(broker, tls)["totals"]["acked"] >= before + 3 or proc.poll() is not None,
            what="3 acks",
            timeout=30,
        )
        assert proc.poll() is None, (cwd / "worker.err").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, (cwd / "worker.err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_wq_producer_and_wq_worker_from_the_environment(
    broker: BrokerProcess, tls: TLSFiles, tmp_path: Path
) -> None:
    environ = _environment(broker, tls, _token_file(tmp_path, ROOT))
    _run_until_acked(
        worker_command("-queue", "envw", "-wait-ms", "200"), environ, broker, tls, tmp_path
    )
    assert (tmp_path / "jobs.log").read_text().count("\n") == 3


def test_wq_worker_subcommand_from_the_environment(
    broker: BrokerProcess, tls: TLSFiles, tmp_path: Path
) -> None:
    environ = _environment(broker, tls, _token_file(tmp_path, ROOT))
    cmd = [sys.executable, "-m", "wqclient.cli.admin", "worker", "-queues", "envw", "-wait-ms"]
    cmd += ["200", "-exec", "true"]
    _run_until_acked(cmd, environ, broker, tls, tmp_path)


@pytest.mark.parametrize("command", ["wq-producer", "wq-worker", "wq worker"])
def test_the_other_commands_refuse_both_token_variables_and_a_bad_token_file(
    command: str, tmp_path: Path
) -> None:
    argv = {
        "wq-producer": producer_command(),
        "wq-worker": worker_command(),
        "wq worker": [sys.executable, "-m", "wqclient.cli.admin", "worker", "-exec", "true"],
    }[command]
    path = _token_file(tmp_path, ROOT)
    base = {**env(), "WQ_BROKER": "http://127.0.0.1:9"}
    for extra, wanted in (
        ({"WQ_TOKEN": ROOT, "WQ_TOKEN_FILE": str(path)}, "$WQ_TOKEN_FILE are both set"),
        ({"WQ_TOKEN_FILE": str(tmp_path / "nope")}, f"cannot read the token file {tmp_path}/nope"),
    ):
        proc = subprocess.run(
            argv, env={**base, **extra}, cwd=tmp_path, capture_output=True, text=True, timeout=30
        )
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        line = _one_line(proc.stderr)
        assert line.startswith(f"{command}: "), line
        assert wanted in line, line
        assert ROOT not in line
    assert not (tmp_path / "jobs.log").exists()


@pytest.mark.parametrize("build", [worker.build_parser, producer.build_parser])
def test_worker_and_producer_flags_win_over_the_variables(
    build: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_BROKER", "grpc://env:1")
    monkeypatch.setenv("WQ_TOKEN", "env-token")
    monkeypatch.setenv("WQ_CA_FILE", "env.pem")
    assert connection(build().parse_args([])) == Connection("grpc://env:1", "env-token", "env.pem")
    args = build().parse_args(["-broker", "http://flag:2", "-token", "t", "-ca-file", "f.pem"])
    assert connection(args) == Connection("http://flag:2", "t", "f.pem")
    path = _token_file(tmp_path, "from-file")
    args = build().parse_args(["-token-file", str(path)])
    assert connection(args).token == "from-file"
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert connection(build().parse_args([])) == Connection(DEFAULT_URL, "", "")


def test_wq_worker_takes_flag_then_the_apps_own_then_the_variable_then_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def resolved(argv: list[str], app: tuple[str | None, str | None, str | None]) -> Connection:
        return run._connection(run.parse([*argv, "-exec", "true"]).args, *app)

    own = ("grpc://app:1", "app-token", "app.pem")
    none = (None, None, None)
    monkeypatch.setenv("WQ_BROKER", "http://env:2")
    monkeypatch.setenv("WQ_TOKEN", "env-token")
    monkeypatch.setenv("WQ_CA_FILE", "env.pem")
    flags = ["-broker", "http://flag:3", "-token", "flag-token", "-ca-file", "flag.pem"]
    assert resolved(flags, own) == Connection("http://flag:3", "flag-token", "flag.pem")
    assert resolved([], own) == Connection(*own)
    assert resolved([], none) == Connection("http://env:2", "env-token", "env.pem")
    # both token variables: an error only when nothing before them settles it
    monkeypatch.setenv("WQ_TOKEN_FILE", str(_token_file(tmp_path, "file-token")))
    assert resolved([], own).token == "app-token"
    with pytest.raises(run._Usage, match=r"\$WQ_TOKEN and \$WQ_TOKEN_FILE"):
        resolved([], none)
    monkeypatch.delenv("WQ_TOKEN")
    assert resolved([], none).token == "file-token"
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert resolved([], none) == Connection(DEFAULT_URL, "", "")


def test_help_names_each_variable() -> None:
    texts = {
        "wq": admin.top_parser().format_help(),
        "wq stats": admin.COMMANDS["stats"].parser().format_help(),
        "wq-worker": worker.build_parser().format_help(),
        "wq-producer": producer.build_parser().format_help(),
        "wq worker": run.build_parser().format_help(),
    }
    for command, text in texts.items():
        flat = " ".join(text.split())
        for name in VARIABLES:
            assert f"${name}" in flat, (command, name)
        assert f"$WQ_BROKER, else {DEFAULT_URL}" in flat, command
        assert "[BOOL]" in flat, command


# -- switches: every spelling, in every command ---------------------------------------------------

TRUE_FORMS = [[], ["=true"], ["=1"], ["=yes"], ["=True"], [" true"], [" 1"], [" yes"]]
FALSE_FORMS = [["=false"], ["=0"], ["=no"], [" false"], [" 0"], [" no"], [" FALSE"]]


def _spelt(flag: str, form: list[str]) -> list[str]:
    """``-json`` with its value in one of its forms: alone, ``=V``, or `` V`` (the next word)."""
    if not form:
        return [flag]
    if form[0].startswith("="):
        return [flag + form[0]]
    return [flag, form[0].strip()]


def _forms() -> list[tuple[list[str], bool]]:
    return [(f, True) for f in TRUE_FORMS] + [(f, False) for f in FALSE_FORMS]


@pytest.mark.parametrize(("form", "value"), _forms())
@pytest.mark.parametrize("dashes", ["-", "--"])
def test_wq_switches_take_every_form(form: list[str], value: bool, dashes: str) -> None:
    def parsed(argv: list[str]) -> Any:
        result = admin.parse(argv, io.StringIO())
        assert not isinstance(result, int), argv
        return result[1]

    json_flag = _spelt(f"{dashes}json", form)
    assert parsed([*json_flag, "stats"]).json is value  # before the command
    assert parsed(["stats", *json_flag]).json is value
    args = parsed(["pause", *json_flag, "myqueue"])  # a word that is no boolean: the next argument
    assert (args.json, args.queue_name) == (value, "myqueue")
    args = parsed(["dlq", "requeue", *_spelt(f"{dashes}all", form), "-queue", "q"])
    assert (args.all, args.queue) == (value, "q")
    args = parsed(["tasks", "q", *_spelt(f"{dashes}all", form)])
    assert (args.all, args.queue_name) == (value, "q")
    assert parsed(["limits", "q", *_spelt(f"{dashes}clear", form)]).clear is value
    argv = ["schedule", "set", "n", *_spelt(f"{dashes}paused", form), "-payload", "{}"]
    assert parsed(argv).paused is value


def test_wq_json_true_before_the_command_runs_it(
    broker: BrokerProcess, tls: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The walkthrough's slip: `wq -json true stats` was "unknown command 'true'".
    monkeypatch.setenv("WQ_TOKEN", ROOT)
    monkeypatch.setenv("WQ_CA_FILE", str(tls.ca))
    code, out, err = wq("-json", "true", "stats", "-broker", broker.url)
    assert (code, err) == (0, "")
    assert "totals" in json.loads(out)
    code, out, err = wq("-json", "false", "stats", "-broker", broker.url)
    assert (code, err) == (0, "")
    assert "since start" in out


@pytest.mark.parametrize(("form", "value"), _forms())
def test_the_other_commands_switches_take_every_form(form: list[str], value: bool) -> None:
    assert worker.build_parser().parse_args(_spelt("-quiet", form)).quiet is value
    assert producer.build_parser().parse_args(_spelt("--fail", form)).fail is value
    inv = run.parse([*_spelt("-quiet", form), "app:tasks"])
    assert (inv.args.quiet, inv.args.target) == (value, "app:tasks")
    inv = run.parse([*_spelt("-reload", form), "-exec", "true"])
    assert inv.args.reload is value
    assert not any(a.split("=")[0] in ("-reload",) and "=" not in a for a in inv.argv)
    args = wqbroker_main.parse_args(_spelt("-access-log", form))
    assert args.access_log is value


def test_a_switch_leaves_a_word_that_is_no_boolean_as_the_next_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    inv = run.parse(["-quiet", "app:tasks"])
    assert (inv.args.quiet, inv.args.target) == (True, "app:tasks")
    with pytest.raises(SystemExit) as exited:
        worker.build_parser().parse_args(["-quiet", "stray"])
    assert exited.value.code == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        producer.build_parser().parse_args(["-fail=maybe"])
    assert "-fail" in capsys.readouterr().err


# -- wq completion --------------------------------------------------------------------------------

BASH = shutil.which("bash")


_SCRIPT: list[str] = []  # the file holding `wq completion bash`'s script, once made


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What ``wq completion bash`` prints, in a file made once (each case sources it in a fresh
    bash, as a user's shell would)."""
    code, out, err = wq("completion", "bash")
    assert (code, err) == (0, "")
    path = tmp_path_factory.mktemp("completion") / "wq.bash"
    path.write_text(out)
    _SCRIPT[:] = [str(path)]
    yield
    _SCRIPT.clear()


def _complete(*words: str) -> list[str]:
    """What bash offers for ``words`` (the last one being completed), with the script that
    ``wq completion bash`` prints sourced, as a user's shell would."""
    assert BASH is not None
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    script = (
        f"source {shlex.quote(_SCRIPT[0])} || exit 9\n"
        f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMPREPLY=()\n"
        "_wq\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    proc = subprocess.run(
        [BASH, "--norc", "--noprofile", "-c", script],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return [line for line in proc.stdout.splitlines() if line]


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_the_bash_completion_registers_itself() -> None:
    proc = subprocess.run(
        [
            BASH or "bash",
            "--norc",
            "-c",
            f"source <({sys.executable} -m wqclient.cli.admin completion bash); complete -p wq",
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.strip() == "complete -F _wq wq"


@pytest.mark.skipif(BASH is None, reason="no bash")
@pytest.mark.usefixtures("bash_script")
def test_the_bash_completion_offers_the_real_commands_and_flags() -> None:
    firsts = list(dict.fromkeys(name.split()[0] for name in admin.COMMANDS))
    assert _complete("wq", "") == [*firsts, "worker", "completion"]
    assert _complete("wq", "sche") == ["schedules", "schedule"]
    assert _complete("wq", "dlq", "") == ["list", "requeue", "purge"]
    assert _complete("wq", "schedule", "") == ["set", "get", "delete", "pause", "resume"]
    assert _complete("wq", "-json", "true", "-broker", "http://x", "qu") == ["queues", "queue"]
    assert _complete("wq", "completion", "") == ["bash", "zsh", "fish"]
    # every command's flags, as its parser has them
    for name, command in admin.COMMANDS.items():
        wanted = sorted(
            n
            for a in command.parser()._actions
            for n in a.option_strings
            if n.startswith("-") and not n.startswith("--")
        )
        assert sorted(_complete("wq", *name.split(), "-")) == wanted, name
    assert _complete("wq", "task", "0123456789abcdef", "-j") == ["-json"]
    assert _complete("wq", "stats", "--que") == ["--queue"]
    assert _complete("wq", "tasks", "q", "-state", "") == list(LIST_STATES)
    assert "-reload" in _complete("wq", "worker", "-")
    assert "-token-file" in _complete("wq", "worker", "-")


def test_completion_scripts_for_each_shell_and_a_bad_one() -> None:
    code, out, err = wq("completion", "zsh")
    assert (code, err) == (0, "")
    assert "bashcompinit" in out
    assert "complete -F _wq wq" in out
    code, out, err = wq("completion", "fish")
    assert (code, err) == (0, "")
    assert "complete -c wq -n '__fish_seen_subcommand_from dlq; and not" in out
    assert "-o json" in out
    code, out, err = wq("completion", "tcsh")
    assert (code, out) == (2, "")
    assert "bash, zsh or fish" in _one_line(err)
    assert wq("completion")[0] == 2
    if shutil.which("zsh"):
        proc = subprocess.run(
            ["zsh", "-n"], input=wq("completion", "zsh")[1], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
