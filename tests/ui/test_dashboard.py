"""The dashboard (``GET /ui``): its static routes over HTTP, and the page in a real browser.

The browser is Chromium from Debian's package (``/usr/bin/chromium``, or ``$WQ_CHROMIUM``; ``make
browser`` installs it), driven by Playwright's Python package, which is pointed at it (Playwright's
own browser downloads are not used). Without either, the browser tests skip with the reason, unless
``CI`` is set: then they fail. Each test starts a real broker on port 0 with the system clock, sets
the scene through the API, drives the page, and checks what the page did through the API again.

Screenshots are saved under ``tests/artifacts/`` (not committed). The overview at laptop width is
also written to ``docs/dashboard.png`` (the README shows it) when that file is missing or
``WQ_DOCS_SCREENSHOT=1`` is set (``make screenshot``), so an ordinary run changes no committed file.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.authkit import ONLY, ROOT, UNKNOWN, bearer, write_token_file
from tests.helpers import Http, http_client, running_broker, wait_until
from wqbroker.auth import NO_TOKEN
from wqbroker.broker import Broker
from wqbroker.http.dashboard import ASSETS, CONTENT_SECURITY_POLICY, ROUTES
from wqclient import AsyncClient, EnqueueItem, RateLimit, Unavailable

try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # the static tests still run; the browser tests skip (or fail under CI)
    if os.environ.get("CI"):
        raise

pytestmark = pytest.mark.timeout(120)

CHROMIUM = os.environ.get("WQ_CHROMIUM", "/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
DOCS_SCREENSHOT = REPO / "docs" / "dashboard.png"
LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 375, "height": 812}
NO_FIGURE = "\N{EN DASH}"  # what the page shows before it has a figure
POLL = "?interval=250"  # the page polls /stats four times a second (2 s by default)


def _unavailable() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the browser tests need the playwright package (pip install -e '.[dev]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"the browser tests need Chromium at {CHROMIUM} (make browser installs it)"
    return None


# -- the static routes, over HTTP (no browser) ------------------------------------------------


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


async def _get(
    broker: Broker, path: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, CIMultiDict[str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, broker.http_url + path, headers=headers) as resp,
    ):
        return resp.status, CIMultiDict(resp.headers), await resp.read()


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/index.html"])
async def test_the_page_is_served_with_a_strict_policy(broker: Broker, path: str) -> None:
    status, headers, body = await _get(broker, path)
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Cache-Control"] == "no-cache"
    assert body.startswith(b"<!doctype html>")
    # No inline script, style or event handler: the policy would refuse them.
    assert not re.search(rb"<script(?![^>]*\bsrc=)", body)
    assert not re.search(rb"\son[a-z]+=|\sstyle=|<style", body)


async def test_every_file_the_page_names_is_served_with_its_type(broker: Broker) -> None:
    _, _, page = await _get(broker, "/ui")
    named = set(re.findall(rb'(?:src|href)="(/ui/[^"]+)"', page))
    assert {b"/ui/app.js", b"/ui/style.css", b"/ui/favicon.svg"} <= named
    assert any(n.startswith(b"/ui/vendor/uplot-") for n in named)
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for path in sorted(n.decode() for n in named):
        status, headers, body = await _get(broker, path)
        assert status == 200, path
        assert headers["Content-Type"].startswith(types[Path(path).suffix]), path
        assert body == ASSETS[path.removeprefix("/ui/")].body
        cache = "public, max-age=604800, immutable" if "/vendor/" in path else "no-cache"
        assert headers["Cache-Control"] == cache, path
    # The vendored library ships with its licence.
    status, headers, body = await _get(broker, "/ui/vendor/uplot-LICENSE.txt")
    assert status == 200
    assert b"MIT License" in body
    assert headers["Content-Type"] == "text/plain; charset=utf-8"


async def test_a_file_unchanged_since_the_last_visit_is_not_sent_again(broker: Broker) -> None:
    status, headers, _ = await _get(broker, "/ui/app.js")
    etag = headers["ETag"]
    status, headers, body = await _get(broker, "/ui/app.js", {"If-None-Match": etag})
    assert (status, body) == (304, b"")
    assert headers["ETag"] == etag
    status, _, body = await _get(broker, "/ui/app.js", {"If-None-Match": '"other"'})
    assert status == 200
    assert body
    status, headers, body = await _get(broker, "/ui/app.js", method="HEAD")
    assert (status, body) == (200, b"")
    assert headers["Content-Type"].startswith("text/javascript")


@pytest.mark.parametrize(
    "path",
    [
        "/ui/nothing.js",
        "/ui/vendor",
        "/ui/vendor/",
        "/ui/%2e%2e/wqbroker/auth.py",
        "/ui/..%2fapp.py",
        "/ui/vendor/%2e%2e/%2e%2e/app.py",
        "/ui/__init__.py",
        "/ui//etc/passwd",
    ],
)
async def test_unknown_files_are_a_json_404_and_nothing_is_read_from_disk(
    broker: Broker, path: str
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.http_url + path, skip_auto_headers=()) as resp,
    ):
        # (aiohttp keeps the %2e and %2f as sent)
        assert resp.status == 404, path
        assert resp.content_type == "application/json"
        assert (await resp.json())["error"]


async def test_the_page_needs_no_token_but_every_call_it_makes_does(tmp_path: Path) -> None:
    assert {f"GET {route}" for route in ROUTES} <= set(NO_TOKEN.http)
    async with running_broker(token_file=str(write_token_file(tmp_path))) as broker:
        for path in ("/ui", "/ui/", "/ui/app.js"):
            assert (await _get(broker, path))[0] == 200, path
        status, headers, _ = await _get(broker, "/stats")
        assert status == 401
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert (await _get(broker, "/stats", bearer(ROOT)))[0] == 200


# -- the browser ------------------------------------------------------------------------------


@dataclass
class Console:
    """What the page logged as errors and threw (a refused inline script would show here)."""

    errors: list[str] = field(default_factory=list)

    def check(self) -> None:
        # The browser logs every 4xx answer to fetch as "Failed to load resource"; those the
        # page shows itself (a 401 asks for a token, a 403 or 404 is displayed).
        unexpected = [e for e in self.errors if not e.startswith("Failed to load resource")]
        assert unexpected == [], unexpected


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    expect.set_options(timeout=10_000)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            await b.close()


@contextlib.asynccontextmanager
async def open_page(
    browser: Browser, viewport: dict[str, int] = LAPTOP
) -> AsyncIterator[tuple[Page, Console]]:
    context = await browser.new_context(
        viewport=viewport,  # type: ignore[arg-type]
        locale="en-US",
        timezone_id="UTC",
        device_scale_factor=1,
    )
    page = await context.new_page()
    console = Console()
    page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console.errors.append(f"uncaught: {e}"))
    try:
        yield page, console
    finally:
        await context.close()


def artifact(name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name


async def screenshot(page: Page, name: str) -> Path:
    path = artifact(name)
    await page.screenshot(path=str(path), full_page=True)
    return path


@dataclass
class Scene:
    """A known workload: ids of the tasks each test looks at."""

    dead: list[str]
    held: list[str]
    payloads: dict[str, Any]


async def connected(client: AsyncClient) -> None:
    """Once the client's channel is up. (A gRPC client's first call on a new channel to a
    broker started a moment ago has, rarely, failed as UNAVAILABLE, "tcp handshaker shutdown",
    nothing sent: what a caller retries; the scene is not the place to test it.)"""
    for _ in range(20):
        try:
            await client.stats()
            return
        except Unavailable:
            await asyncio.sleep(0.1)
    await client.stats()


async def set_scene(broker: Broker, http: Http, token: str = "") -> Scene:
    """1,200 tasks in default (200 of them acked, 3 held by a worker), 30 in mail (four of them
    failed for good), 5 in reports, 2 delayed."""
    async with AsyncClient(f"grpc://{broker.grpc_target}", token=token) as client:
        await connected(client)
        await client.enqueue_many([{"n": i} for i in range(1200)])
        await client.enqueue_many([{"to": f"user{i}@example.com"} for i in range(26)], queue="mail")
        await client.enqueue_many([{"report": i} for i in range(5)], queue="reports", priority=5)
        await client.enqueue_many([{"later": i} for i in range(2)], delay_ms=600_000)
    for _ in range(200):
        delivery = await http.claim()
        assert await http.ack(delivery["task"]["id"], delivery["lease_id"]) == 204
    held = [(await http.claim(lease_ms=300_000))["task"]["id"] for _ in range(3)]
    dead, payloads = [], {}
    for i, error in enumerate(
        [
            "smtp: 550 mailbox unavailable",
            "smtp: connection refused",
            'template "welcome" not found',
            "timeout after 30s",
        ]
    ):
        payload = {"to": f"bounce{i}@example.com", "template": "welcome", "vars": {"n": i}}
        task_id = await http.enqueue(payload, queue="mail", max_attempts=1, priority=9)
        status, delivery = await http.request("GET", "/jobs/next?queue=mail&wait_ms=0")
        assert status == 200
        assert delivery["task"]["id"] == task_id
        assert await http.nack(task_id, delivery["lease_id"], error) == 204
        dead.append(task_id)
        payloads[task_id] = payload
    return Scene(dead, held, payloads)


async def goto(page: Page, broker: Broker, view: str) -> None:
    await page.goto(f"{broker.http_url}/ui{POLL}#/{view}")


async def shown(page: Page, selector: str) -> str:
    """The raw number behind a figure the page shows (its data-value)."""
    value = await page.locator(selector).get_attribute("data-value")
    assert value is not None, selector
    return value


@contextlib.asynccontextmanager
async def traffic(broker: Broker) -> AsyncIterator[None]:
    """Producers in waves (20 to 90 tasks a second) and two slower workers that fail one task
    in nine once (retried 0.7 s later), so the charts have something to draw. When the block
    ends, the producer stops and the workers finish every task it sent."""
    stop = asyncio.Event()

    async def produce(client: AsyncClient) -> None:
        step, n = 0, 0
        while not stop.is_set():
            count = max(1, round(0.2 * (55 + 35 * math.sin(step / 8))))
            await client.enqueue_many([{"live": n + i} for i in range(count)], queue="live")
            step, n = step + 1, n + count
            await asyncio.sleep(0.2)

    async def work(client: AsyncClient) -> None:
        while True:
            try:
                delivery = await client.claim(queues="live", wait_ms=100)
            except Unavailable:
                # (Scenery, not what is tested: a connection a fully loaded machine let time out
                # before its first frame -- seen once in a whole-suite run -- is made again, as
                # the Worker makes it.)
                await asyncio.sleep(0.1)
                continue
            if delivery is None:
                if stop.is_set() and not any(await _live(client)):
                    return
                continue
            await asyncio.sleep(0.025)  # the work
            if delivery.payload["live"] % 9 == 0 and delivery.task.attempts == 1:
                await client.nack(delivery, error="upstream timed out", delay_ms=700)
            else:
                await client.ack(delivery)

    async with AsyncClient(f"grpc://{broker.grpc_target}") as client:
        tasks = [asyncio.create_task(produce(client))]
        tasks += [asyncio.create_task(work(client)) for _ in range(2)]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks)


async def _live(client: AsyncClient) -> tuple[int, int, int]:
    stats = await client.stats("live")
    return stats.ready, stats.handed_out, stats.delayed


async def test_the_overview_shows_what_stats_says(broker: Broker, browser: Browser) -> None:
    async with http_client(broker.http_url) as http, open_page(browser) as (page, console):
        await set_scene(broker, http)
        await goto(page, broker, "overview")
        async with traffic(broker):
            await expect(page.locator("#rate-enqueued .num")).not_to_have_text(NO_FIGURE)
            if not DOCS_SCREENSHOT.exists() or os.environ.get("WQ_DOCS_SCREENSHOT") == "1":
                await asyncio.sleep(12)  # some minutes of history, in short, for the picture
                DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
                await page.screenshot(path=str(DOCS_SCREENSHOT))  # the viewport: laptop-sized
        stats = await http.stats()
        assert stats["ready"] == 1000 - 3 + 26 + 5
        assert stats["dead"] == 4
        # Once the page has polled after the traffic stopped, every figure is /stats's.
        for key in ("ready", "handed_out", "delayed", "dead"):
            gauge = page.locator(f"#gauge-{key} .gauge-value")
            await expect(gauge).to_have_attribute("data-value", str(stats[key]))
            await expect(gauge).to_have_text(f"{stats[key]:,}")  # thousands separators
        for key, value in stats["totals"].items():
            total = page.locator(f'#totals dd[data-total="{key}"]')
            await expect(total).to_have_attribute("data-value", str(value))
            await expect(total).to_have_text(f"{value:,}")
        await expect(page.locator("#dead-count")).to_have_text("4")
        # The rates come back to zero once nothing moves (over the last five polls).
        await expect(page.locator("#rate-enqueued .num")).to_have_text("0.0", timeout=15_000)
        await expect(page.locator("#status-text")).to_contain_text("Live")
        assert await page.locator("#chart-gauges canvas").count() == 1
        assert await page.locator("#chart-rates canvas").count() == 1
        assert (await screenshot(page, "overview-laptop.png")).stat().st_size > 0
        console.check()


async def test_requeue_and_purge_dead_tasks_through_the_page(
    broker: Broker, http: Http, browser: Browser
) -> None:
    scene = await set_scene(broker, http)
    first, second, *rest = scene.dead
    async with open_page(browser) as (page, console):
        await goto(page, broker, "dlq")
        rows = page.locator("#dlq-table tbody tr")
        await expect(rows).to_have_count(4)
        row = page.locator(f'#dlq-table tr[data-id="{first}"]')
        await expect(row).to_contain_text("smtp: 550 mailbox unavailable")
        await expect(row).to_contain_text("mail")
        await expect(row).to_contain_text("1 / 1")
        await expect(page.locator("#dlq-summary")).to_contain_text("4 dead tasks")
        await screenshot(page, "dlq-laptop.png")

        # Requeue one: a confirmation, then it leaves the list, and the broker says ready.
        await row.locator("button.requeue").click()
        dialog = page.locator("#confirm-dialog")
        await expect(dialog).to_be_visible()
        await expect(dialog).to_contain_text(first)
        await screenshot(page, "dlq-confirm.png")
        await page.locator("#confirm-ok").click()
        await expect(row).to_have_count(0)
        await expect(rows).to_have_count(3)
        await expect(page.locator("#toasts")).to_contain_text(f"Requeued task {first}")
        status, task = await http.request("GET", f"/jobs/{first}")
        assert (status, task["state"], task["attempts"]) == (200, "ready", 0)
        assert first not in [t["id"] for t in (await http.request("GET", "/dlq"))[1]]
        assert (await http.stats())["totals"]["requeued"] == 1

        # Purge, but think better of it: nothing happens.
        doomed = page.locator(f'#dlq-table tr[data-id="{second}"]')
        await doomed.locator("button.purge").click()
        await page.locator("#confirm-cancel").click()
        await expect(dialog).to_be_hidden()
        assert (await http.request("GET", f"/jobs/{second}"))[1]["state"] == "dead"
        # Purge for real: the task is gone.
        await doomed.locator("button.purge").click()
        await expect(page.locator("#confirm-ok")).to_have_text("Purge")
        await page.locator("#confirm-ok").click()
        await expect(doomed).to_have_count(0)
        assert (await http.request("GET", f"/jobs/{second}"))[0] == 404
        assert (await http.stats())["totals"]["purged"] == 1

        # Requeue all (of the queue mail, chosen in the filter).
        await page.locator("#dlq-queue").select_option("mail")
        await expect(page).to_have_url(re.compile(r"#/dlq\?queue=mail$"))
        await expect(page.locator("#dlq-requeue-all")).to_have_text("Requeue all (2)")
        await page.locator("#dlq-requeue-all").click()
        await expect(dialog).to_contain_text("all 2 dead tasks of queue mail")
        await page.locator("#confirm-ok").click()
        await expect(page.locator("#dlq-empty")).to_be_visible()
        await expect(rows).to_have_count(0)
        await expect(page.locator("#toasts")).to_contain_text("Requeued 2 tasks")
        assert (await http.request("GET", "/dlq"))[1] == []
        for task_id in rest:
            assert (await http.request("GET", f"/jobs/{task_id}"))[1]["state"] == "ready"
        await expect(page.locator("#dead-count")).to_have_text("")
        console.check()


# An error of a few hundred characters: shown whole, not cut at the width of a column.
LONG_ERROR = (
    "upstream payment service refused the charge: HTTP 502 Bad Gateway from "
    "https://payments.internal.example/v2/charges after 3 retries (connection reset by peer); "
    "request id 7f3e9c1a-55b2-4d0e-a1f4-9b8c7d6e5f40, idempotency key order-18231, "
    "see the runbook for payment outages before requeueing -- THE END"
)


async def test_the_dead_letters_show_when_whole_errors_and_payloads(
    broker: Broker, http: Http, browser: Browser
) -> None:
    # A task of the task framework's convention, buried with a long error; a plain payload
    # with markup in it (shown as text); a ready task of the convention in the tasks list.
    call = {"task": "tasks.price", "args": ["mug", 2], "kwargs": {"currency": "EUR"}}
    framework = await http.enqueue(call, queue="shop", max_attempts=1)
    _, body = await http.request("GET", "/jobs/next?queue=shop&wait_ms=0")
    assert await http.nack(framework, body["lease_id"], LONG_ERROR) == 204
    hostile = {"note": "<img src=x onerror=alert(1)>", "n": 1}
    plain = await http.enqueue(hostile, queue="shop", max_attempts=1)
    _, body = await http.request("GET", "/jobs/next?queue=shop&wait_ms=0")
    assert await http.nack(plain, body["lease_id"], "short") == 204
    ready = await http.enqueue({"task": "tasks.ship", "args": [7]}, queue="shop")
    [first, second] = (await http.request("GET", "/dlq"))[1]
    assert first["id"] == framework
    assert first["buried_at"] <= second["buried_at"]
    async with open_page(browser) as (page, console):
        await page.context.grant_permissions(
            ["clipboard-read", "clipboard-write"], origin=broker.http_url
        )
        await goto(page, broker, "dlq")
        row = page.locator(f'#dlq-table tr[data-id="{framework}"]')
        # The burial time, as the API has it (the column the list is ordered by).
        await expect(page.locator("#dlq-table thead")).to_contain_text("Buried")
        await expect(row.locator("td.buried")).to_have_attribute("data-at", first["buried_at"])
        await expect(row.locator("td.buried")).not_to_contain_text("unknown")
        # The payload's preview: the task's name first, then its arguments.
        preview = row.locator(".payload-preview")
        await expect(preview.locator(".task-name")).to_have_text("tasks.price")
        await expect(preview).to_have_text('tasks.price("mug", 2, currency="EUR")')
        other = page.locator(f'#dlq-table tr[data-id="{plain}"] .payload-preview')
        await expect(other).to_have_text(json.dumps(hostile, separators=(",", ":")))
        assert await page.locator("#dlq-table img").count() == 0  # (text, never markup)
        # The error, whole (it wraps: no ellipsis), and copied by its button.
        error = row.locator(".error-body")
        await expect(error).to_have_text(LONG_ERROR)
        assert await error.evaluate("e => e.scrollWidth <= e.clientWidth")
        await row.locator("button.copy").click()
        await expect(page.locator("#toasts")).to_contain_text("Copied the error")
        assert await page.evaluate("navigator.clipboard.readText()") == LONG_ERROR
        await screenshot(page, "dlq-whole-error.png")

        # The dead task's page: when it was buried, not "available since".
        await row.locator("a").first.click()
        card = page.locator("#task-card")
        await expect(card).to_have_attribute("data-state", "dead")
        await expect(card).to_contain_text("Buried")
        await expect(card).not_to_contain_text("Available since")
        await expect(page.locator("#task-buried")).not_to_contain_text("unknown")
        await expect(page.locator("#task-error")).to_have_text(LONG_ERROR)
        await card.locator(".block-wrap button.copy").click()
        assert await page.evaluate("navigator.clipboard.readText()") == LONG_ERROR

        # The ready tasks' list shows the preview too.
        await page.goto(f"{broker.http_url}/ui{POLL}#/tasks?queue=shop&state=ready")
        listed = page.locator(f'#tasks-table tr[data-id="{ready}"] .payload-preview')
        await expect(listed).to_have_text("tasks.ship(7)")
        await expect(listed.locator(".task-name")).to_have_text("tasks.ship")
        console.check()


async def test_a_dead_task_without_a_burial_time_says_unknown(
    broker: Broker, http: Http, browser: Browser
) -> None:
    # A broker that did not keep it (or a task buried before it did) sends no buried_at: the
    # page says so, and nothing breaks. (The answers are the broker's, the member taken out.)
    scene = await set_scene(broker, http)
    dead = scene.dead[0]

    async def without_buried_at(route: Any) -> None:
        response = await route.fetch()
        body = await response.json()
        for task in body if isinstance(body, list) else [body]:
            task.pop("buried_at", None)
        await route.fulfill(response=response, json=body)

    async with open_page(browser) as (page, console):
        await page.route(re.compile(r"/dlq(\?.*)?$"), without_buried_at)
        await page.route(re.compile(r"/jobs/[0-9a-f]{16}$"), without_buried_at)
        await goto(page, broker, "dlq")
        cell = page.locator(f'#dlq-table tr[data-id="{dead}"] td.buried')
        await expect(cell).to_contain_text("unknown")
        await page.locator(f'#dlq-table tr[data-id="{dead}"] a').first.click()
        await expect(page.locator("#task-card")).to_have_attribute("data-state", "dead")
        await expect(page.locator("#task-buried")).to_have_text(
            "unknown (buried by an older broker)"
        )
        console.check()
        # (the page polls on: a fetch still in a handler when the page closes is let go)
        await page.unroute_all(behavior="ignoreErrors")


async def test_pause_and_resume_a_queue_through_the_page(
    broker: Broker, http: Http, browser: Browser
) -> None:
    await set_scene(broker, http)

    async def paused(name: str) -> bool:
        status, queues = await http.request("GET", "/queues")
        assert status == 200
        return bool({q["name"]: q for q in queues}[name]["paused"])

    async with open_page(browser) as (page, console):
        await goto(page, broker, "queues")
        rows = page.locator("#queues-table tbody tr")
        await expect(rows).to_have_count(3)
        _, queues = await http.request("GET", "/queues")
        for q in queues:
            row = page.locator(f'#queues-table tr[data-queue="{q["name"]}"]')
            for key in ("ready", "handed_out", "delayed", "dead"):
                cell = row.locator(f'td[data-field="{key}"]')
                await expect(cell).to_have_attribute("data-value", str(q[key]))
                await expect(cell).to_have_text(f"{q[key]:,}")
        mail = page.locator('#queues-table tr[data-queue="mail"]')
        await expect(mail.locator(".badge")).to_have_text("Active")
        await mail.locator("button.pause").click()
        await expect(mail.locator(".badge")).to_have_text("Paused")
        await expect(page.locator("#queues-summary")).to_have_text("3 queues, 1 paused")
        assert await paused("mail")
        assert not await paused("default")
        await screenshot(page, "queues-laptop.png")
        # Paused means paused: a claim of mail gets nothing.
        status, _ = await http.request("GET", "/jobs/next?queue=mail&wait_ms=0")
        assert status == 204
        await mail.locator("button.resume").click()
        await expect(mail.locator(".badge")).to_have_text("Active")
        assert not await paused("mail")
        console.check()


async def test_look_a_task_up_by_id(broker: Broker, http: Http, browser: Browser) -> None:
    scene = await set_scene(broker, http)
    dead = scene.dead[2]
    async with open_page(browser) as (page, console):
        await goto(page, broker, "task")
        await page.locator("#task-id").fill(dead)
        await page.locator("#task-id").press("Enter")
        await expect(page).to_have_url(re.compile(f"#/task/{dead}$"))
        card = page.locator("#task-card")
        await expect(card).to_have_attribute("data-state", "dead")
        await expect(page.locator("#task-state")).to_have_text("Dead")
        await expect(page.locator("#task-attempts")).to_have_text("1 of 1")
        await expect(page.locator("#task-error")).to_have_text('template "welcome" not found')
        payload = await page.locator("#task-payload").inner_text()
        assert payload == json.dumps(scene.payloads[dead], indent=2)
        await expect(card).to_contain_text("mail")
        await screenshot(page, "task-laptop.png")

        # Requeued from its page: the page follows its state.
        await card.locator("button.requeue").click()
        await page.locator("#confirm-ok").click()
        await expect(card).to_have_attribute("data-state", "ready")
        await expect(page.locator("#task-attempts")).to_have_text("0 of 1")
        assert (await http.request("GET", f"/jobs/{dead}"))[1]["state"] == "ready"

        # A task handed out, by a link from elsewhere.
        held = scene.held[0]
        await page.goto(f"{broker.http_url}/ui{POLL}#/task/{held}")
        await expect(page.locator("#task-state")).to_have_text("Handed out")
        await expect(page.locator("#task-id")).to_have_value(held)

        # No such task: said so, with the broker's answer.
        await page.locator("#task-id").fill("no-such-task")
        await page.locator("button[type=submit]").first.click()
        missing = page.locator("#task-missing")
        await expect(missing).to_contain_text("No such task")
        await expect(missing).to_contain_text("404")
        console.check()


async def test_a_queue_s_tasks_by_state_a_page_at_a_time(
    broker: Broker, http: Http, browser: Browser
) -> None:
    scene = await set_scene(broker, http)
    first = (await http.request("GET", "/jobs?queue=default&limit=50"))[1]
    second = (
        await http.request("GET", f"/jobs?queue=default&limit=50&cursor={first['next_cursor']}")
    )[1]
    async with open_page(browser) as (page, console):
        await goto(page, broker, "queues")
        # A queue's figures lead to its tasks in that state.
        await page.locator(
            '#queues-table tr[data-queue="default"] td[data-field="ready"] a'
        ).click()
        await expect(page).to_have_url(re.compile(r"#/tasks\?queue=default&state=ready$"))
        rows = page.locator("#tasks-table tbody tr")
        await expect(rows).to_have_count(50)
        await expect(rows.first).to_have_attribute("data-id", first["tasks"][0]["id"])
        await expect(rows.last).to_have_attribute("data-id", first["tasks"][-1]["id"])
        ready = page.locator('#tasks-states a[data-state="ready"]')
        await expect(ready).to_have_attribute("aria-current", "page")
        await expect(ready.locator(".count")).to_have_text("997")
        await expect(page.locator("#tasks-page")).to_have_text("Page 1")
        await expect(page.locator("#tasks-prev")).to_be_disabled()
        await screenshot(page, "tasks-laptop.png")

        # The next page, by the cursor, and back.
        await page.locator("#tasks-next").click()
        await expect(page.locator("#tasks-page")).to_have_text("Page 2")
        await expect(rows.first).to_have_attribute("data-id", second["tasks"][0]["id"])
        await expect(rows).to_have_count(50)
        await page.locator("#tasks-prev").click()
        await expect(page.locator("#tasks-page")).to_have_text("Page 1")
        await expect(rows.first).to_have_attribute("data-id", first["tasks"][0]["id"])

        # The other states: the three held, the two delayed, the dead of mail.
        await page.locator('#tasks-states a[data-state="handed_out"]').click()
        await expect(rows).to_have_count(3)
        shown_ids = {await rows.nth(i).get_attribute("data-id") for i in range(3)}
        assert shown_ids == set(scene.held)
        await expect(page.locator("#tasks-when")).to_have_text("Ready since")
        await page.locator('#tasks-states a[data-state="delayed"]').click()
        await expect(rows).to_have_count(2)
        await expect(page.locator("#tasks-when")).to_have_text("Due")
        await page.locator("#tasks-queue").select_option("mail")
        await expect(page).to_have_url(re.compile(r"#/tasks\?queue=mail&state=delayed$"))
        await expect(page.locator("#tasks-none")).to_contain_text("No delayed tasks in mail")
        await page.locator('#tasks-states a[data-state="dead"]').click()
        await expect(rows).to_have_count(4)
        dead = page.locator(f'#tasks-table tr[data-id="{scene.dead[0]}"]')
        await expect(dead).to_contain_text("smtp: 550 mailbox unavailable")
        await expect(dead.locator("button.cancel")).to_have_text("Purge")
        console.check()


async def test_cancel_empty_and_delete_through_the_page(
    broker: Broker, http: Http, browser: Browser
) -> None:
    await set_scene(broker, http)
    reports = [t["id"] for t in (await http.request("GET", "/jobs?queue=reports"))[1]["tasks"]]
    assert len(reports) == 5
    async with open_page(browser) as (page, console):
        await goto(page, broker, "tasks?queue=reports&state=ready")
        rows = page.locator("#tasks-table tbody tr")
        await expect(rows).to_have_count(5)
        row = page.locator(f'#tasks-table tr[data-id="{reports[0]}"]')

        # Cancel, but think better of it: nothing happens.
        await row.locator("button.cancel").click()
        dialog = page.locator("#confirm-dialog")
        await expect(dialog).to_be_visible()
        await expect(dialog).to_contain_text(reports[0])
        await expect(dialog).to_contain_text("never runs")
        await screenshot(page, "tasks-confirm.png")
        await page.locator("#confirm-cancel").click()
        await expect(dialog).to_be_hidden()
        assert (await http.request("GET", f"/jobs/{reports[0]}"))[1]["state"] == "ready"
        # Cancel for real: gone, counted.
        await row.locator("button.cancel").click()
        await expect(page.locator("#confirm-ok")).to_have_text("Cancel task")
        await page.locator("#confirm-ok").click()
        await expect(row).to_have_count(0)
        await expect(rows).to_have_count(4)
        await expect(page.locator("#toasts")).to_contain_text(f"Cancelled task {reports[0]}")
        assert (await http.request("GET", f"/jobs/{reports[0]}"))[0] == 404
        assert (await http.stats())["totals"]["cancelled"] == 1

        # Empty the queue: the four left.
        await page.locator("#tasks-empty-queue").click()
        await expect(dialog).to_contain_text("All 4 ready and delayed tasks of queue reports")
        await page.locator("#confirm-ok").click()
        await expect(page.locator("#toasts")).to_contain_text("Emptied reports: 4 tasks cancelled")
        await expect(page.locator("#tasks-none")).to_be_visible()
        assert (await http.stats())["totals"]["cancelled"] == 5

        # It holds nothing now: it can be deleted.
        delete = page.locator("#tasks-delete-queue")
        await expect(delete).to_be_visible()
        await delete.click()
        await expect(dialog).to_contain_text("holds nothing")
        await page.locator("#confirm-ok").click()
        await expect(page).to_have_url(re.compile(r"#/queues$"))
        await expect(page.locator("#toasts")).to_contain_text("Deleted queue reports")
        await expect(page.locator('#queues-table tr[data-queue="reports"]')).to_have_count(0)
        assert "reports" not in [q["name"] for q in (await http.request("GET", "/queues"))[1]]
        console.check()


async def test_a_running_task_shows_its_progress_and_can_be_cancelled(
    broker: Broker, http: Http, browser: Browser
) -> None:
    task_id = await http.enqueue({"big": "job"}, queue="work", timeout_ms=600_000)
    status, delivery = await http.request("GET", "/jobs/next?queue=work&wait_ms=0&lease_ms=300000")
    assert status == 200
    extend = f"/jobs/{task_id}/extend?lease_id={delivery['lease_id']}"
    progress = {"done": 40, "of": 100, "step": "resizing"}
    assert (await http.request("POST", extend, json={"progress": progress}))[0] == 200
    async with open_page(browser) as (page, console):
        await goto(page, broker, f"task/{task_id}")
        card = page.locator("#task-card")
        await expect(card).to_have_attribute("data-state", "handed_out")
        await expect(page.locator("#task-progress")).to_have_text(json.dumps(progress, indent=2))
        await expect(page.locator("#task-timeout")).to_have_text("10 min 0 s")
        await screenshot(page, "task-progress.png")
        # The progress moves on: the page follows.
        progress["done"] = 80
        assert (await http.request("POST", extend, json={"progress": progress}))[0] == 200
        await expect(page.locator("#task-progress")).to_contain_text('"done": 80')

        # Cancelled from its page: its worker's next extend is refused, saying so.
        await card.locator("button.cancel").click()
        await expect(page.locator("#confirm-dialog")).to_contain_text("A worker holds")
        await page.locator("#confirm-ok").click()
        await expect(page.locator("#toasts")).to_contain_text(f"Cancelling task {task_id}")
        await expect(page.locator("#task-cancelling")).to_have_text("Cancelling")
        await expect(card.locator("button.cancel")).to_have_count(0)
        status, body = await http.request("POST", extend)
        assert (status, body["cancelled"]) == (409, True)

        # In the queue's list of handed-out tasks too.
        await goto(page, broker, "tasks?queue=work&state=handed_out")
        row = page.locator(f'#tasks-table tr[data-id="{task_id}"]')
        await expect(row).to_contain_text("Cancelling")
        await expect(row).to_contain_text('progress {"done":80,"of":100,"step":"resizing"}')
        await expect(page.locator("#tasks-detail")).to_have_text("Progress")
        console.check()


@dataclass
class Flow:
    """A small workflow in the queue flow: two parents (the first succeeded with a result), a
    child waiting for both, and a grandchild waiting for the child."""

    first: str
    second: str
    child: str
    grandchild: str
    result: Any


async def set_flow(broker: Broker) -> Flow:
    result = {"rows": 3, "ok": True, "names": ["a", "b"]}
    async with AsyncClient(broker.http_url) as client:
        first, second, child, grandchild = await client.enqueue_many(
            [
                EnqueueItem(b'{"fetch": 1}'),
                EnqueueItem(b'{"fetch": 2}'),
                EnqueueItem(b'{"join": true}', after=[0, 1]),
                EnqueueItem(b'{"report": true}', after=[2]),
            ],
            queue="flow",
        )
        delivery = await client.claim(queues="flow", wait_ms=0)
        assert delivery is not None
        assert delivery.id == first
        await client.ack(delivery, result=result)
    return Flow(first, second, child, grandchild, result)


async def test_results_and_workflows_on_every_view(
    broker: Broker, http: Http, browser: Browser
) -> None:
    flow = await set_flow(broker)
    stats = await http.stats()
    assert (stats["waiting"], stats["succeeded"]) == (2, 1)
    async with open_page(browser) as (page, console):
        # The overview: the two gauges, as /stats says.
        await goto(page, broker, "overview")
        for key in ("waiting", "succeeded"):
            gauge = page.locator(f"#gauge-{key} .gauge-value")
            await expect(gauge).to_have_attribute("data-value", str(stats[key]))
        await screenshot(page, "overview-results.png")

        # The queues: their columns once a queue has any, leading to the tasks in each state.
        await goto(page, broker, "queues")
        row = page.locator('#queues-table tr[data-queue="flow"]')
        for key, value in (("waiting", 2), ("succeeded", 1), ("ready", 1)):
            await expect(row.locator(f'td[data-field="{key}"]')).to_have_attribute(
                "data-value", str(value)
            )
        await expect(page.locator("#queues-table th.col-results").first).to_be_visible()
        await row.locator('td[data-field="waiting"] a').click()
        await expect(page).to_have_url(re.compile(r"#/tasks\?queue=flow&state=waiting$"))

        # The tasks waiting, each saying for how many of its parents.
        rows = page.locator("#tasks-table tbody tr")
        await expect(rows).to_have_count(2)
        waiting = page.locator('#tasks-states a[data-state="waiting"]')
        await expect(waiting).to_have_attribute("aria-current", "page")
        await expect(waiting.locator(".count")).to_have_text("2")
        child_row = page.locator(f'#tasks-table tr[data-id="{flow.child}"]')
        await expect(child_row).to_contain_text("waiting for 1 of 2 parents")
        await expect(page.locator("#tasks-when")).to_have_text("Enqueued")
        await screenshot(page, "tasks-waiting.png")
        # The succeeded: with their result, and nothing to cancel.
        await page.locator('#tasks-states a[data-state="succeeded"]').click()
        await expect(rows).to_have_count(1)
        done = page.locator(f'#tasks-table tr[data-id="{flow.first}"]')
        await expect(done).to_contain_text('result {"rows":3,"ok":true,"names":["a","b"]}')
        await expect(done.locator("button")).to_have_count(0)
        await expect(page.locator("#tasks-when")).to_have_text("Finished")

        # A waiting task's page: its parents as links, how many it still waits for.
        await done.locator("a").first.click()  # (its page first, by the link)
        await expect(page).to_have_url(re.compile(f"#/task/{flow.first}$"))
        card = page.locator("#task-card")
        await expect(card).to_have_attribute("data-state", "succeeded")
        await expect(page.locator("#task-state")).to_have_text("Succeeded")
        shown_result = await page.locator("#task-result-json").inner_text()
        assert json.loads(shown_result) == flow.result
        assert shown_result == json.dumps(flow.result, indent=2)
        await expect(page.locator("#task-finished")).not_to_be_empty()
        await expect(card.locator("button.cancel")).to_have_count(0)
        children = page.locator("#task-children a")
        await expect(children).to_have_count(1)
        await expect(page.locator("#task-card")).to_contain_text("Children (1)")
        await screenshot(page, "task-succeeded.png")

        await children.first.click()
        await expect(page).to_have_url(re.compile(f"#/task/{flow.child}$"))
        await expect(card).to_have_attribute("data-state", "waiting")
        await expect(page.locator("#task-state")).to_have_text("Waiting")
        await expect(page.locator("#task-waiting-for")).to_have_text("1 of 2 parents")
        parents = page.locator("#task-parents a")
        await expect(parents).to_have_text([flow.first, flow.second])
        await expect(page.locator("#task-children a")).to_have_text([flow.grandchild])
        await screenshot(page, "task-waiting.png")

        # The second parent succeeds meanwhile: the page follows (the child is ready).
        async with AsyncClient(f"grpc://{broker.grpc_target}") as client:
            await connected(client)
            delivery = await client.claim(queues="flow", wait_ms=0)
            assert delivery is not None
            assert delivery.id == flow.second
            await client.ack(delivery, result=[2])
        await expect(card).to_have_attribute("data-state", "ready")
        await expect(page.locator("#task-waiting-for")).to_have_count(0)

        # Cancelled from the grandchild's page: it and what waits for it are gone.
        await page.goto(f"{broker.http_url}/ui{POLL}#/task/{flow.grandchild}")
        await expect(card).to_have_attribute("data-state", "waiting")
        await card.locator("button.cancel").click()
        await expect(page.locator("#confirm-dialog")).to_contain_text("every task waiting for it")
        await page.locator("#confirm-ok").click()
        await expect(page.locator("#task-missing")).to_contain_text("No such task")
        assert (await http.request("GET", f"/jobs/{flow.grandchild}"))[0] == 404
        console.check()


async def test_a_task_whose_parent_died_names_it_on_its_page(
    broker: Broker, http: Http, browser: Browser
) -> None:
    async with AsyncClient(broker.http_url) as client:
        parent, child = await client.enqueue_many(
            [EnqueueItem(b'"parent"', max_attempts=1), EnqueueItem(b'"child"', after=[0])]
        )
        delivery = await client.claim(wait_ms=0)
        assert delivery is not None
        await client.nack(delivery, error="no such file")
    async with open_page(browser) as (page, console):
        await goto(page, broker, f"task/{child}")
        await expect(page.locator("#task-card")).to_have_attribute("data-state", "dead")
        await expect(page.locator("#task-error")).to_have_text(
            f"parent {parent} is dead: no such file"
        )
        await expect(page.locator("#task-parents a")).to_have_text([parent])
        await expect(page.locator("#task-waiting-for")).to_have_count(0)
        console.check()


def authorizations(page: Page) -> list[str | None]:
    """The Authorization header of every API call the page makes from now on (None: none)."""
    seen: list[str | None] = []
    page.on(
        "request",
        lambda r: seen.append(r.headers.get("authorization")) if "/ui" not in r.url else None,
    )
    return seen


async def test_a_token_is_asked_once_kept_and_sent(tmp_path: Path, browser: Browser) -> None:
    async with (
        running_broker(token_file=str(write_token_file(tmp_path))) as broker,
        aiohttp.ClientSession(headers=bearer(ROOT)) as session,
        open_page(browser) as (page, console),
    ):
        http = Http(session, broker.http_url)
        await set_scene(broker, http, ROOT)
        calls = authorizations(page)
        await goto(page, broker, "queues")
        dialog = page.locator("#token-dialog")
        await expect(dialog).to_be_visible()
        await expect(page.locator("#token-reason")).to_contain_text("no token")
        await screenshot(page, "token-dialog.png")

        # A token nobody knows: asked again, saying so.
        await page.locator("#token-input").fill(UNKNOWN)
        await page.locator("#token-ok").click()
        await expect(page.locator("#token-reason")).to_contain_text("unknown token")
        # A real token without the admin scope: the figures show.
        await page.locator("#token-input").fill(ONLY["consume"])
        await page.locator("#token-ok").click()
        await expect(dialog).to_be_hidden()
        mail = page.locator('#queues-table tr[data-queue="mail"]')
        await expect(mail.locator('td[data-field="ready"]')).to_have_text("26")
        stored = await page.evaluate("sessionStorage.getItem('wq.token')")
        assert stored == ONLY["consume"]

        # Pausing needs the admin scope: a 403, named, and nothing paused.
        await mail.locator("button.pause").click()
        alert = page.locator("#alert-action")
        await expect(alert).to_contain_text("needs a token with the “admin” scope")
        await expect(alert).to_have_attribute("data-status", "403")
        await screenshot(page, "token-403.png")
        assert not {q["name"]: q for q in (await http.request("GET", "/queues"))[1]}["mail"][
            "paused"
        ]

        # Another token, from the alert's button: the pause goes through.
        await alert.locator("button", has_text="Use another token").click()
        await page.locator("#token-input").fill(ROOT)
        await page.locator("#token-ok").click()
        await expect(alert).to_have_count(0)
        await mail.locator("button.pause").click()
        await expect(mail.locator(".badge")).to_have_text("Paused")
        assert {q["name"]: q for q in (await http.request("GET", "/queues"))[1]}["mail"]["paused"]

        # After the first answer, every call carried a token; the token survives a reload.
        sent = [c for c in calls if c is not None]
        assert sent
        assert set(sent) <= {f"Bearer {t}" for t in (UNKNOWN, ONLY["consume"], ROOT)}
        assert calls[-1] == f"Bearer {ROOT}"
        await page.reload()
        await expect(page.locator(".gauge-value").first).to_be_attached()
        await goto(page, broker, "overview")
        await expect(page.locator("#gauge-dead .gauge-value")).to_have_text("4")
        await expect(dialog).to_be_hidden()
        console.check()


async def test_a_token_declined_leaves_a_way_back(tmp_path: Path, browser: Browser) -> None:
    async with (
        running_broker(token_file=str(write_token_file(tmp_path))) as broker,
        open_page(browser) as (page, console),
    ):
        await goto(page, broker, "overview")
        await page.locator("#token-cancel").click()
        alert = page.locator("#alert-poll")
        await expect(alert).to_contain_text("This broker needs a token")
        await expect(alert).to_have_attribute("data-status", "401")
        await expect(page.locator("#status-text")).to_have_text("Needs a token")
        await asyncio.sleep(0.6)  # polls go on, without asking again
        await expect(page.locator("#token-dialog")).to_be_hidden()
        await alert.locator("button", has_text="Enter token").click()
        await page.locator("#token-input").fill(ROOT)
        await page.locator("#token-ok").click()
        await expect(page.locator("#gauge-ready .gauge-value")).to_have_text("0")
        await expect(alert).to_have_count(0)
        console.check()


async def test_errors_from_the_api_are_shown(broker: Broker, browser: Browser) -> None:
    async with open_page(browser) as (page, console):
        await goto(page, broker, "overview")
        await expect(page.locator("#gauge-ready .gauge-value")).to_have_text("0")
        await broker.stop()  # the broker goes away
        alert = page.locator("#alert-poll")
        await expect(alert).to_contain_text("Cannot reach the broker")
        await expect(page.locator("#status-text")).to_have_text("Disconnected")
        console.errors[:] = [e for e in console.errors if "ERR_CONNECTION_REFUSED" not in e]
        console.check()


async def test_the_page_fits_a_phone(broker: Broker, http: Http, browser: Browser) -> None:
    await set_scene(broker, http)
    async with open_page(browser, PHONE) as (page, console):
        for view in ("overview", "queues", "tasks", "dlq"):
            await goto(page, broker, view)
            await expect(page.locator(f"#view-{view}")).to_be_visible()
            if view == "overview":
                await expect(page.locator("#gauge-dead .gauge-value")).to_have_text("4")
            elif view == "queues":
                await expect(page.locator("#queues-table tbody tr")).to_have_count(3)
            elif view == "tasks":
                await expect(page.locator("#tasks-table tbody tr")).to_have_count(50)
            else:
                await expect(page.locator("#dlq-table tbody tr")).to_have_count(4)
            # Nothing wider than the screen: no sideways scrolling.
            width = await page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], (view, width)
            await screenshot(page, f"{view}-phone.png")
        # The table rows are cards, each figure labelled.
        cell = page.locator("#dlq-table tbody tr").first.locator("td").nth(2)
        label = await cell.evaluate("e => getComputedStyle(e, '::before').content")
        assert label == '"Attempts"'
        console.check()


# -- schedules and limits (docs/design/schedules.md) -----------------------------------------


async def set_schedules(broker: Broker) -> str:
    """``tick`` (every second, to the queue ticks) once it has fired, and ``nightly`` (02:00 in
    Paris, paused); returns the task tick fired last."""
    async with AsyncClient(broker.http_url) as client:
        await client.put_schedule("tick", every_ms=1000, payload={"tick": True}, queue="ticks")
        await client.put_schedule(
            "nightly",
            cron="0 2 * * *",
            timezone="Europe/Paris",
            payload={"report": "daily"},
            queue="reports",
            paused=True,
        )
        tick = await wait_until(
            lambda: client.get_schedule("tick"), lambda s: s.fires >= 1, what="the first fire"
        )
    assert tick.last_task_id is not None
    return tick.last_task_id


async def test_the_schedules_page_pauses_resumes_and_leads_to_the_tasks(
    broker: Broker, http: Http, browser: Browser
) -> None:
    await set_schedules(broker)

    async def schedule(name: str) -> Any:
        status, body = await http.request("GET", f"/schedules/{name}")
        assert status == 200
        return body

    async with open_page(browser) as (page, console):
        await goto(page, broker, "schedules")
        await expect(page.locator("#tab-schedules")).to_have_attribute("aria-current", "page")
        rows = page.locator("#schedules-table tbody tr")
        await expect(rows).to_have_count(2)
        await expect(rows.first).to_have_attribute("data-schedule", "nightly")  # (by name)
        await expect(page.locator("#schedules-summary")).to_have_text("2 schedules, 1 paused")
        nightly = page.locator('#schedules-table tr[data-schedule="nightly"]')
        await expect(nightly.locator(".badge")).to_have_text("Paused")
        await expect(nightly.locator("td.rule")).to_contain_text("0 2 * * *")
        await expect(nightly.locator("td.rule")).to_contain_text("Europe/Paris")
        await expect(nightly.locator("td.next-fire")).to_have_text(NO_FIGURE)
        await expect(nightly.locator("td.last-task")).to_have_text(NO_FIGURE)
        await expect(nightly.locator('td[data-field="fires"]')).to_have_text("0")
        tick = page.locator('#schedules-table tr[data-schedule="tick"]')
        await expect(tick.locator(".badge")).to_have_text("Active")
        await expect(tick.locator("td.rule")).to_have_text("every 1 s")
        await expect(tick.locator("td.next-fire")).not_to_have_attribute("data-at", "")
        await expect(tick.locator('td[data-field="fires"]')).to_have_attribute(
            "data-value", re.compile(r"^[1-9]\d*$")
        )
        await expect(tick.locator("td.last-task a")).to_have_count(1)
        await expect(tick.locator("a.queue-name")).to_have_text("ticks")
        await screenshot(page, "schedules-laptop.png")

        # Pause tick: the page and the broker say paused, and it fires no more.
        await tick.locator("button.pause").click()
        await expect(tick.locator(".badge")).to_have_text("Paused")
        await expect(page.locator("#toasts")).to_contain_text("Paused schedule tick")
        await expect(tick.locator("td.next-fire")).to_have_text(NO_FIGURE)
        await expect(page.locator("#schedules-summary")).to_have_text("2 schedules, 2 paused")
        paused = await schedule("tick")
        assert (paused["paused"], paused["next_fire_at"]) == (True, None)
        await expect(tick.locator('td[data-field="fires"]')).to_have_attribute(
            "data-value", str(paused["fires"])
        )

        # Its last task, by the link: the task's page names the schedule and the time.
        last = paused["last_task_id"]
        await expect(tick.locator("td.last-task a")).to_have_text(last)
        await tick.locator("td.last-task a").click()
        await expect(page).to_have_url(re.compile(f"#/task/{last}$"))
        await expect(page.locator("#task-schedule")).to_have_text("tick")
        await expect(page.locator("#task-scheduled-for")).to_have_attribute(
            "data-at", paused["last_fire_at"]
        )
        await expect(page.locator("#task-card")).to_contain_text("ticks")
        await screenshot(page, "task-scheduled.png")

        # Back by the schedule's link: its row is the one highlighted; resume it there.
        await page.locator("#task-schedule").click()
        await expect(page).to_have_url(re.compile(r"#/schedules\?name=tick$"))
        await expect(tick).to_have_class(re.compile(r"\bfocus\b"))
        await expect(nightly).not_to_have_class(re.compile(r"\bfocus\b"))
        await tick.locator("button.resume").click()
        await expect(tick.locator(".badge")).to_have_text("Active")
        await expect(page.locator("#toasts")).to_contain_text("Resumed schedule tick")
        assert (await schedule("tick"))["paused"] is False
        await nightly.locator("button.resume").click()
        await expect(nightly.locator(".badge")).to_have_text("Active")
        await expect(nightly.locator("td.next-fire")).not_to_have_attribute("data-at", "")
        resumed = await schedule("nightly")
        assert resumed["paused"] is False
        await expect(nightly.locator("td.next-fire")).to_have_attribute(
            "data-at", resumed["next_fire_at"]
        )
        console.check()

    # At phone width: the rows are cards, nothing wider than the screen.
    async with open_page(browser, PHONE) as (page, console):
        await goto(page, broker, "schedules")
        await expect(page.locator("#schedules-table tbody tr")).to_have_count(2)
        width = await page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], width
        await screenshot(page, "schedules-phone.png")
        console.check()


async def test_no_schedules_is_said_so(broker: Broker, browser: Browser) -> None:
    async with open_page(browser) as (page, console):
        await goto(page, broker, "schedules")
        await expect(page.locator("#schedules-empty")).to_be_visible()
        await expect(page.locator("#schedules-table tbody tr")).to_have_count(0)
        await expect(page.locator("#schedules-summary")).to_have_text("")
        console.check()


async def test_pausing_a_schedule_needs_the_admin_scope(tmp_path: Path, browser: Browser) -> None:
    async with (
        running_broker(token_file=str(write_token_file(tmp_path))) as broker,
        open_page(browser) as (page, console),
    ):
        async with AsyncClient(broker.http_url, token=ROOT) as client:
            await client.put_schedule("hourly", cron="@hourly", payload=1)
        await goto(page, broker, "schedules")
        await page.locator("#token-input").fill(ONLY["consume"])  # (reads: any token)
        await page.locator("#token-ok").click()
        row = page.locator('#schedules-table tr[data-schedule="hourly"]')
        await expect(row.locator(".badge")).to_have_text("Active")
        await row.locator("button.pause").click()
        alert = page.locator("#alert-action")
        await expect(alert).to_contain_text("needs a token with the “admin” scope")
        await expect(alert).to_have_attribute("data-status", "403")
        await expect(row.locator(".badge")).to_have_text("Active")
        async with AsyncClient(broker.http_url, token=ROOT) as client:
            assert not (await client.get_schedule("hourly")).paused
        console.check()


async def test_the_queues_page_shows_each_queue_s_limits(
    broker: Broker, http: Http, browser: Browser
) -> None:
    async with AsyncClient(broker.http_url) as client:
        await client.enqueue_many([{"n": n} for n in range(3)], queue="paced")
        await client.enqueue(1, queue="free")
        await client.set_limits("paced", rate=RateLimit(20, 1000, burst=40), concurrency=2)
        await client.set_limits("slow", rate=RateLimit(5, 500))
        held = await client.claim(queues="paced", wait_ms=0)
        assert held is not None
    async with open_page(browser) as (page, console):
        await goto(page, broker, "queues")
        await expect(page.locator("#queues-table tbody tr")).to_have_count(3)
        headers = page.locator("#queues-table th.col-limits")
        await expect(headers).to_have_text(["Rate limit", "Tokens", "Concurrency"])
        await expect(headers.first).to_be_visible()
        paced = page.locator('#queues-table tr[data-queue="paced"]')
        await expect(paced.locator('td[data-field="rate"]')).to_have_text("20/s (burst 40)")
        await expect(paced.locator('td[data-field="rate"]')).to_have_attribute(
            "data-value", "20/1000"
        )
        await expect(paced.locator('td[data-field="tokens"]')).to_have_text(
            re.compile(r"^(39(\.\d)?|40)$")  # one spent, refilling at 20 a second
        )
        concurrency = paced.locator('td[data-field="concurrency"]')
        await expect(concurrency).to_have_text("1 / 2")
        await expect(concurrency).to_have_attribute("data-value", "1/2")
        slow = page.locator('#queues-table tr[data-queue="slow"]')
        await expect(slow.locator('td[data-field="rate"]')).to_have_text("5 per 500 ms")
        await expect(slow.locator('td[data-field="tokens"]')).to_have_text("5")
        await expect(slow.locator('td[data-field="concurrency"]')).to_have_text(NO_FIGURE)
        free = page.locator('#queues-table tr[data-queue="free"]')
        for key in ("rate", "tokens", "concurrency"):
            await expect(free.locator(f'td[data-field="{key}"]')).to_have_text(NO_FIGURE)
        await screenshot(page, "queues-limits.png")

        # A second hand-out reaches the limit: the page follows (the cell says it is full).
        status, _ = await http.request("GET", "/jobs/next?queue=paced&wait_ms=0")
        assert status == 200
        await expect(concurrency).to_have_text("2 / 2")
        await expect(concurrency).to_have_class(re.compile(r"\bat-limit\b"))
        # Limits taken away: the columns go, as before any queue had limits.
        for name in ("paced", "slow"):
            status, _ = await http.request("DELETE", f"/queues/{name}/limits")
            assert status == 204
        await expect(headers.first).to_be_hidden()
        await expect(paced.locator('td[data-field="rate"]')).to_have_count(0)
        console.check()


def test_screenshots_dir_is_ignored_by_git() -> None:
    ignore = (REPO / ".gitignore").read_text().splitlines()
    assert "tests/artifacts/" in ignore
