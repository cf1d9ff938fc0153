"""The documentation site: ``mkdocs build --strict`` passes, the generated Reference pages hold
everything the code defines (each checked against the code directly, not through the hooks that
generated them), and a broken link or anchor fails the build."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"
# What the build reads besides docs/ and mkdocs.yml: the code the Reference is generated from.
SOURCES = ("wqbroker", "wqclient", "wqwire", "proto")


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr
    return out


def text_of(site: Path, page: str) -> str:
    """A built page's text: tags dropped, entities decoded, spaces collapsed."""
    raw = (site / page / "index.html").read_text()
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", raw)).split())


def ids_of(site: Path, page: str) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', (site / page / "index.html").read_text()))


def test_http_reference_has_every_operation_of_the_openapi_document(site: Path) -> None:
    from wqbroker.http.openapi import DOCUMENT

    text = text_of(site, "reference/http")
    methods = ("get", "head", "post", "put", "patch", "delete")
    operations = [(m, p) for p, item in DOCUMENT["paths"].items() for m in methods if m in item]
    assert len(operations) > 30
    missing = [f"{m.upper()} {p}" for m, p in operations if f"{m.upper()} {p}" not in text]
    assert not missing
    schemas = DOCUMENT["components"]["schemas"]
    ids = ids_of(site, "reference/http")
    assert not [name for name in schemas if f"schema-{name.lower()}" not in ids]
    # every member of every request body is described
    for name in ("EnqueueRequest", "NackRequest", "ScheduleRequest"):
        assert not [f for f in schemas[name]["properties"] if f not in text]


def test_grpc_reference_has_every_rpc_message_and_field_of_the_proto(site: Path) -> None:
    from wqwire.pb import broker_pb2

    text = text_of(site, "reference/grpc")
    ids = ids_of(site, "reference/grpc")
    file = broker_pb2.DESCRIPTOR
    for service in file.services_by_name.values():
        for method in service.methods:
            assert f"rpc-{service.name}-{method.name}".lower() in ids, method.name
            assert f"/{service.full_name}/{method.name}" in text
    assert len(file.message_types_by_name) > 50
    for message in file.message_types_by_name.values():
        assert f"message-{message.name}".lower() in ids, message.name
        assert not [f.name for f in message.fields if f.name not in text], message.name
    # the comments are there: the file's, a method's, a field's
    assert "the gRPC API of the wq job-queue broker" in text
    assert "long-polling up to wait_ms" in text
    assert "Deliveries before the task is buried" in text


def _parsers() -> dict[str, object]:
    import wqbroker.__main__ as broker
    from wqclient.cli import admin, producer, run, worker

    parsers: dict[str, object] = {
        "wqbroker": broker.build_parser(),
        "wq": admin.top_parser(),
        "wq worker": run.build_parser(),
        "wq_worker": worker.build_parser(),
        "wq_producer": producer.build_parser(),
    }
    parsers.update({f"wq {name}": c.parser() for name, c in admin.COMMANDS.items()})
    return parsers


def test_commands_reference_has_every_flag_of_every_parser(site: Path) -> None:
    import argparse

    page = (site / "reference/commands/index.html").read_text()
    # each command's section: from its heading to the next heading of its level or above
    parts = re.split(r'(?=<h[23] id=")', page)
    sections = {re.match(r'<h[23] id="([^"]+)"', s).group(1): s for s in parts[1:]}  # type: ignore[union-attr]
    for name, parser in _parsers().items():
        assert isinstance(parser, argparse.ArgumentParser)
        anchor = name.replace(" ", "-")
        assert anchor in sections, name
        section = html.unescape(sections[anchor])
        for action in parser._actions:
            for spelling in action.option_strings:
                assert spelling in section, (name, spelling)
    assert "WQ_BROKER" in page
    assert "WQ_GRPC_ADDR" in page


def _broker_metric_names() -> set[str]:
    """The families a broker's GET /metrics names, scraped in this process (memory store)."""
    from wqbroker.clock import SystemClock
    from wqbroker.metrics import Metrics
    from wqbroker.service import Service
    from wqbroker.store.memory import MemoryStore

    async def scrape() -> bytes:
        clock = SystemClock()
        metrics = Metrics(clock)
        service = Service(MemoryStore(), clock, events=metrics)
        await service.start()
        try:
            metrics.watch(service)
            return await metrics.exposition()
        finally:
            await service.close()

    text = asyncio.run(scrape()).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def test_metrics_reference_has_every_metric(site: Path) -> None:
    from wqclient.cli.run import Metrics as WorkerMetrics

    text = text_of(site, "reference/metrics")
    broker = _broker_metric_names()
    assert len(broker) > 30
    assert not [name for name in sorted(broker) if name not in text]
    worker = {
        f.name for f in text_string_to_metric_families(WorkerMetrics(lambda: 0).text().decode())
    }
    assert worker
    assert not [name for name in sorted(worker) if name not in text]
    assert "wq_tasks_acked_total" in text


def test_python_reference_has_every_public_name(site: Path) -> None:
    import wqclient

    ids = ids_of(site, "reference/python")
    assert not [name for name in wqclient.__all__ if f"wqclient.{name}" not in ids]
    text = text_of(site, "reference/python")
    # (the docstrings' reST roles were made Markdown)
    assert ":class:" not in text
    assert ":meth:" not in text


@pytest.mark.parametrize(
    "link",
    ["[nowhere](nowhere.md)", "[no anchor](reference/http.md#no-such-anchor)"],
    ids=["page", "anchor"],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    for name in SOURCES:
        (tmp_path / name).symlink_to(ROOT / name)
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + f"\n\nSee {link}.\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    target = re.search(r"\(([^)]+)\)", link).group(1)  # type: ignore[union-attr]
    assert target.split("#")[-1] in done.stderr, done.stderr
