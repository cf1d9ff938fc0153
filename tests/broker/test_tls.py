"""TLS (``-tls-cert``, ``-tls-key``): HTTPS and gRPC over TLS with certificates made at test time
by trustme; clients that trust the CA (``ca_file``, ``$WQ_CA_FILE``), clients that do not, and
plaintext clients; refusals at start; and the commands end to end against a TLS broker that wants
tokens."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.authkit import ONLY, ROOT, TLSFiles, bearer, make_tls_files, write_token_file
from tests.helpers import running_broker, wait_until_sync
from tests.procs import BrokerProcess, broker_command, broker_process, env, producer_command
from tests.procs import worker_command as worker_cmd
from wqbroker.broker import Broker, StartupError
from wqclient import AsyncClient, CertificateError, Client, Unavailable, Worker, WqError
from wqclient import PermissionDenied as ClientPermissionDenied

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


@pytest.fixture
def tls(tmp_path: Path) -> TLSFiles:
    return make_tls_files(tmp_path)


@pytest.fixture
async def broker(tls: TLSFiles) -> AsyncIterator[Broker]:
    async with running_broker(tls_cert=str(tls.cert), tls_key=str(tls.key)) as b:
        yield b


def url(broker: Broker, transport: str, *, secure: bool = True) -> str:
    if transport == "http":
        return broker.http_url if secure else broker.http_url.replace("https://", "http://")
    return ("grpcs://" if secure else "grpc://") + broker.grpc_target


# -- clients that trust the CA ------------------------------------------------------------------


def test_the_broker_says_https(broker: Broker) -> None:
    assert broker.http_url.startswith("https://127.0.0.1:")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_https_and_grpcs_with_a_ca_file(
    broker: Broker, tls: TLSFiles, transport: str
) -> None:
    async with AsyncClient(url(broker, transport), ca_file=str(tls.ca)) as wq:
        await wq.enqueue({"n": 1})
        await wq.enqueue_many([{"n": 2}, {"n": 3}])
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        assert delivery.payload == {"n": 1}
        await wq.ack(delivery)
        if wq.can_stream:
            stream = await wq.stream(prefetch=2)
            for _ in range(2):
                await stream.ack(await asyncio.wait_for(anext(stream), 5), confirm=True)
            await stream.close()
            assert (await wq.stats()).totals.acked == 3
        else:
            assert (await wq.stats()).totals.acked == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_ca_file_comes_from_wq_ca_file(
    broker: Broker, tls: TLSFiles, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_CA_FILE", str(tls.ca))
    async with AsyncClient(url(broker, transport)) as wq:
        assert (await wq.stats()).ready == 0

    def blocking() -> None:
        with Client(url(broker, transport)) as wq:
            wq.enqueue(1)

    await asyncio.to_thread(blocking)


async def test_raw_https_and_grpc_over_tls(broker: Broker, tls: TLSFiles) -> None:
    context = ssl.create_default_context(cafile=str(tls.ca))
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.http_url + "/healthz", ssl=context) as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}
    credentials = grpc.ssl_channel_credentials(tls.ca.read_bytes())
    async with grpc.aio.secure_channel(broker.grpc_target, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest())
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_tls_and_tokens_together(tmp_path: Path, tls: TLSFiles, transport: str) -> None:
    async with running_broker(
        tls_cert=str(tls.cert),
        tls_key=str(tls.key),
        token_file=str(write_token_file(tmp_path)),
    ) as broker:
        async with AsyncClient(url(broker, transport), ca_file=str(tls.ca), token=ROOT) as wq:
            await wq.enqueue(1)
            assert await wq.claim(wait_ms=0) is not None
        async with AsyncClient(
            url(broker, transport), ca_file=str(tls.ca), token=ONLY["produce"]
        ) as wq:
            with pytest.raises(ClientPermissionDenied):
                await wq.dead_letters()


# -- clients that do not ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_client_without_the_ca_fails_certificate_verification(
    broker: Broker, tmp_path: Path, transport: str
) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    for ca_file in (None, str(other)):  # the system's store; another CA
        async with AsyncClient(url(broker, transport), ca_file=ca_file, timeout=5) as wq:
            with pytest.raises(Unavailable) as e:
                await wq.stats()
        message = e.value.message
        assert "TLS certificate verification failed" in message, message
        assert "CERTIFICATE_VERIFY_FAILED" in message
        assert "ca_file" in message
    assert broker.service.problem() is None  # and the broker serves on


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_certificate_that_fails_verification_is_a_certificate_error(
    broker: Broker, tmp_path: Path, transport: str
) -> None:
    """An Unavailable (what it always was), of its own kind: retrying cannot help."""
    async with AsyncClient(url(broker, transport), timeout=5) as wq:
        with pytest.raises(CertificateError) as e:
            await wq.stats()
    assert isinstance(e.value, Unavailable)
    assert "-ca-file or $WQ_CA_FILE" in e.value.message
    assert "unable to get local issuer certificate" in e.value.message


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_certificate_for_another_host_is_a_certificate_error_that_says_so(
    tmp_path: Path, transport: str
) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("broker.example")  # not 127.0.0.1, which the client connects to
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    issued.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "cert.pem"))
    async with running_broker(
        tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem")
    ) as broker:
        async with AsyncClient(
            url(broker, transport), ca_file=str(tmp_path / "ca.pem"), timeout=5
        ) as wq:
            with pytest.raises(CertificateError) as e:
                await wq.stats()
    message = e.value.message
    assert "TLS certificate verification failed" in message, message
    assert "not issued for the host in the broker URL" in message
    assert "-ca-file" not in message  # (the CA is trusted: another one would not help)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_worker_stops_on_a_certificate_it_cannot_verify(
    broker: Broker, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As on a refused token: said once, and run() raises it, rather than retrying forever."""
    handled: list[object] = []
    async with AsyncClient(url(broker, transport), timeout=5) as wq:
        worker = Worker(wq, handled.append, concurrency=3, wait_ms=200)
        with pytest.raises(CertificateError):
            await asyncio.wait_for(worker.run(), 20)
    said = [r for r in caplog.records if "TLS certificate verification failed" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].levelname == "ERROR"
    assert "-ca-file or $WQ_CA_FILE" in said[0].getMessage()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    assert handled == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_plaintext_client_on_the_tls_port_fails_cleanly(
    broker: Broker, tls: TLSFiles, transport: str
) -> None:
    async with AsyncClient(url(broker, transport, secure=False), timeout=5) as wq:
        with pytest.raises(Unavailable) as e:
            await wq.stats()
    assert "cannot reach the broker" in e.value.message
    async with AsyncClient(url(broker, transport), ca_file=str(tls.ca)) as wq:
        await wq.stats()  # the broker serves on


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_tls_client_on_a_plaintext_broker_fails_cleanly(
    tls: TLSFiles, transport: str
) -> None:
    async with running_broker() as broker:
        target = url(broker, transport, secure=False).replace("http://", "https://")
        target = target.replace("grpc://", "grpcs://")
        async with AsyncClient(target, ca_file=str(tls.ca), timeout=5) as wq:
            with pytest.raises(Unavailable):
                await wq.stats()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_ca_file_that_cannot_be_used_is_refused_at_once(tmp_path: Path, transport: str) -> None:
    scheme = "https" if transport == "http" else "grpcs"
    with pytest.raises(WqError, match=r"cannot use the CA file .*missing\.pem"):
        AsyncClient(f"{scheme}://127.0.0.1:1", ca_file=str(tmp_path / "missing.pem"))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(WqError, match="cannot use the CA file"):
        AsyncClient(f"{scheme}://127.0.0.1:1", ca_file=str(garbage))


async def test_a_ca_file_is_unused_without_tls(tmp_path: Path) -> None:
    # $WQ_CA_FILE may be set for every command; a plaintext URL does not look at it.
    for plain in ("http://127.0.0.1:1", "grpc://127.0.0.1:1"):
        await AsyncClient(plain, ca_file=str(tmp_path / "missing.pem")).close()


# -- refusals at start ----------------------------------------------------------------------------


def _encrypted_key(tls: TLSFiles, path: Path) -> Path:
    key = serialization.load_pem_private_key(tls.key.read_bytes(), None)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    return path


def _bad_pairs(tls: TLSFiles, tmp_path: Path) -> dict[str, tuple[str | None, str | None, str]]:
    (tmp_path / "other").mkdir()
    other = make_tls_files(tmp_path / "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    cert, key = str(tls.cert), str(tls.key)
    return {
        "cert-only": (cert, None, "needs both a certificate (-tls-cert) and its key"),
        "key-only": (None, key, "needs both a certificate (-tls-cert) and its key"),
        "missing-cert": (str(tmp_path / "nope.pem"), key, "cannot read the TLS certificate"),
        "missing-key": (cert, str(tmp_path / "nope.key"), "cannot read the TLS key"),
        "cert-not-pem": (str(garbage), key, "is not in PEM format"),
        "key-not-pem": (cert, str(garbage), "is not in PEM format"),
        "key-is-a-cert": (key, cert, "is not in PEM format"),
        "mismatch": (cert, str(other.key), "does not match the certificate"),
        "encrypted": (cert, str(_encrypted_key(tls, tmp_path / "enc.key")), "is encrypted"),
    }


BAD_PAIRS = [
    "cert-only",
    "key-only",
    "missing-cert",
    "missing-key",
    "cert-not-pem",
    "key-not-pem",
    "key-is-a-cert",
    "mismatch",
    "encrypted",
]


@pytest.mark.parametrize("case", BAD_PAIRS)
async def test_an_unusable_certificate_or_key_stops_the_start(
    tls: TLSFiles, tmp_path: Path, case: str
) -> None:
    cert, key, says = _bad_pairs(tls, tmp_path)[case]
    with pytest.raises(StartupError) as e:
        async with running_broker(tls_cert=cert, tls_key=key):
            pass
    assert says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["key-only", "mismatch"])
def test_the_broker_command_refuses_in_one_line_and_exit_1(
    tls: TLSFiles, tmp_path: Path, case: str
) -> None:
    cert, key, says = _bad_pairs(tls, tmp_path)[case]
    flags = [*(["-tls-cert", cert] if cert else []), *(["-tls-key", key] if key else [])]
    proc = subprocess.run(
        broker_command("-addr", "127.0.0.1:0", "-grpc-addr", "127.0.0.1:0", *flags),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("wqbroker: ")
    assert says in line


# -- the commands, end to end ------------------------------------------------------------------


def _without_a_ca(**extra: str) -> dict[str, str]:
    """A child's environment without $WQ_CA_FILE (and $GRPC_VERBOSITY, unless given)."""
    child = {k: v for k, v in env().items() if k not in ("WQ_CA_FILE", "GRPC_VERBOSITY")}
    return {**child, **extra}


@pytest.mark.parametrize("command", ["wq-worker", "wq-producer"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_commands_stop_on_a_certificate_they_cannot_verify(
    broker: Broker, tmp_path: Path, transport: str, command: str
) -> None:
    """A configuration error, not an outage: one clear line naming -ca-file, exit status 1 (as
    for a refused token), at once; not a retry forever, nor gRPC's core's line every retry."""
    given = ["-broker", url(broker, transport)]
    if command == "wq-worker":
        cmd = worker_cmd(*given, "-wait-ms", "200")
    else:
        cmd = producer_command(*given, "-n", "5")
    proc = await asyncio.to_thread(
        subprocess.run,
        cmd,
        cwd=tmp_path,
        env=_without_a_ca(),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 1, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "certificate" in line.lower()]
    assert len(said) == 1, proc.stderr
    assert "TLS certificate verification failed" in said[0]
    assert "give the broker's CA certificate with -ca-file or $WQ_CA_FILE" in said[0]
    assert "Handshake failed" not in proc.stderr
    assert "Traceback" not in proc.stderr
    if command == "wq-producer":
        assert said[0].startswith("wq-producer: cannot reach the broker at ")
        assert proc.stdout.startswith("enqueued 0, failed 1,")  # it stopped at the first
    else:
        assert " wq-worker ERROR cannot reach the broker at " in said[0]
        assert said[0].endswith("; stopping")
    assert broker.service.problem() is None


async def test_grpcs_core_logs_are_shown_when_grpc_verbosity_asks_for_them(
    broker: Broker, tmp_path: Path
) -> None:
    """The commands keep gRPC's core quiet only when $GRPC_VERBOSITY is not set."""
    proc = await asyncio.to_thread(
        subprocess.run,
        worker_cmd("-broker", url(broker, "grpc")),
        cwd=tmp_path,
        env=_without_a_ca(GRPC_VERBOSITY="INFO"),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 1
    assert "Handshake failed" in proc.stderr


def _get(broker: BrokerProcess, path: str, tls: TLSFiles, token: str | None = ROOT) -> Any:
    context = ssl.create_default_context(cafile=str(tls.ca))
    req = urllib.request.Request(broker.url + path, headers=bearer(token) if token else {})
    with urllib.request.urlopen(req, timeout=10, context=context) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize(
    ("produce_over", "work_over"), [("http", "grpc"), ("grpc", "http")], ids=["https", "grpcs"]
)
def test_worker_and_producer_against_a_tls_broker_with_tokens(
    tls: TLSFiles, tmp_path: Path, produce_over: str, work_over: str
) -> None:
    tokens = write_token_file(tmp_path)
    with broker_process(
        "-tls-cert", str(tls.cert), "-tls-key", str(tls.key), "-token-file", str(tokens)
    ) as broker:
        assert broker.url.startswith("https://")
        assert any("(TLS)" in line for line in broker.log_lines)
        urls = {"http": broker.url, "grpc": "grpcs://" + (broker.grpc_target or "")}
        flags = ["-n", "20", "-concurrency", "4", "-ca-file", str(tls.ca)]
        produced = subprocess.run(
            producer_command("-broker", urls[produce_over], *flags, "-token", ONLY["produce"]),
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert produced.returncode == 0, produced.stderr
        assert produced.stdout.startswith("enqueued 20, failed 0")
        with open(tmp_path / "worker.err", "wb") as err:
            worker = subprocess.Popen(
                worker_cmd("-broker", urls[work_over], "-wait-ms", "200"),
                cwd=tmp_path,
                env={**env(), "WQ_TOKEN": ONLY["consume"], "WQ_CA_FILE": str(tls.ca)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            wait_until_sync(
                lambda: _get(broker, "/stats", tls)["totals"]["acked"] == 20,
                what="20 acks",
                timeout=30,
            )
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(10) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert (tmp_path / "jobs.log").read_text().count("\n") == 20
        # Plain HTTP to the HTTPS port: refused cleanly, and the broker serves on.
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(
                broker.url.replace("https://", "http://") + "/healthz", timeout=5
            )
        assert _get(broker, "/healthz", tls, token=None) == {"status": "ok"}
    log = "\n".join(broker.log_lines)
    assert "Traceback" not in log
    assert ROOT not in log
    assert ONLY["consume"] not in log
