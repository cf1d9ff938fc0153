"""The metrics reference (docs/reference/metrics.md): every metric family of a broker's
registry (:class:`wqbroker.metrics.Metrics`, over a service on the memory store, scraped once in
this process as ``GET /metrics`` would) and of ``wq worker -metrics-addr``'s
(:class:`wqclient.cli.run.Metrics`): name as scraped, type, labels and help."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from ref_markdown import code, inline, table

# What a family of each type is scraped as (the text format's sample names).
_SERIES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


@dataclass(frozen=True)
class Family:
    name: str  # as registered: "wq_tasks_acked"
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def scraped(self) -> tuple[str, ...]:
        """The names its samples are scraped under (``wq_tasks_acked_total``)."""
        return tuple(self.name + suffix for suffix in _SERIES.get(self.type, ("",)))


def _labels(family: object) -> tuple[str, ...]:
    # (prometheus_client keeps a family's label names, and a metric's, in _labelnames)
    return tuple(getattr(family, "_labelnames", ()))


def broker_families() -> list[Family]:
    """Every family a broker exports, read from its registry after one scrape."""
    from wqbroker.clock import SystemClock
    from wqbroker.metrics import Metrics
    from wqbroker.service import Service
    from wqbroker.store.memory import MemoryStore

    async def scrape() -> list[Family]:
        clock = SystemClock()
        metrics = Metrics(clock)
        service = Service(MemoryStore(), clock, events=metrics)
        await service.start()
        try:
            metrics.watch(service)
            await metrics.exposition()  # (the store's state is read: its families appear)
            return [
                Family(f.name, f.type, _labels(f), f.documentation)
                for f in metrics.registry.collect()
            ]
        finally:
            await service.close()

    return asyncio.run(scrape())


def worker_families() -> list[Family]:
    """Every family ``wq worker -metrics-addr`` exports."""
    from wqclient.cli.run import Metrics

    metrics = Metrics(lambda: 0)
    collectors = list(metrics.registry._collector_to_names)
    return [
        Family(
            getattr(c, "_name"),  # noqa: B009 (the library's metric objects keep these private)
            getattr(c, "_type"),  # noqa: B009
            _labels(c),
            getattr(c, "_documentation"),  # noqa: B009
        )
        for c in collectors
    ]


def _table(families: Iterable[Family]) -> str:
    rows = [
        [
            "<br>".join(code(n) for n in f.scraped),
            f.type,
            ", ".join(code(label) for label in f.labels)
            + (", `le`" if f.type == "histogram" else ""),
            inline(f.help),
        ]
        for f in families
    ]
    return table(["Metric", "Type", "Labels", "Help"], rows)


def render() -> str:
    """The page's generated body."""
    broker = broker_families()
    worker = worker_families()
    return "\n".join(
        [
            "## The broker's metrics { #broker }",
            "",
            f"{len(broker)} families, served at `GET /metrics`.",
            "",
            _table(broker),
            "",
            "## The worker's metrics { #worker }",
            "",
            f"{len(worker)} families, served by `wq worker -metrics-addr HOST:PORT` at "
            "`http://HOST:PORT/metrics`.",
            "",
            _table(worker),
            "",
        ]
    )
