"""The README and every page under docs/ with a runnable block (``<!-- wq:run -->``,
docs/development/docs.md), run as a reader would run it, against real brokers: a command that
stops working, or prints something other than what the page shows, fails here.

The pages are found when the tests are collected (a new page needs no edit here). They run one
after the other on one pytest-xdist worker (the "docs" group: they use the broker's default ports,
8080 and 50051), with the project's venv first on ``PATH``; install blocks are skipped here and
run by the newcomer test (tests/e2e/test_newcomer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import ROOT, pages_with_blocks, run_page

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *pages_with_blocks(DOCS)]

pytestmark = [
    pytest.mark.e2e,  # (real processes: brokers, the commands)
    pytest.mark.slow,  # (seconds of wall time each: make test-fast leaves them out)
    pytest.mark.xdist_group("docs"),  # (one worker, one page at a time: the default ports)
    # (a page is as long as its blocks: each has its own time-out, 60 s unless it says more)
    pytest.mark.timeout(600),
]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_the_page_runs_as_written(page: Path) -> None:
    result = run_page(page)
    assert result.ok, "\n" + result.report()
