"""A newcomer's first hour, as CI can have it: a fresh virtualenv with nothing of this tree,
the Getting-started page followed from its first command to its last, with the wheel users get
in place of ``pip install 'wqueue[...]'`` (the page's install blocks, run here and only here),
each command printing what the page says it prints.

The page runs with the runner of the documentation's blocks (tests/docs/runner.py) from a
temporary directory, ``PATH`` starting with a bare virtualenv's bin (for ``python3 -m venv``; then
the page's own ``.venv``, which it activates), no ``PYTHONPATH``: the repository is not
importable, only what the wheel installed is. It uses the broker's default ports, so it is in the
"docs" xdist group with the other pages (one at a time, on one worker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import ROOT, parse, run_page
from tests.wheel import session_wheel, virtualenv

PAGE = ROOT / "docs" / "getting-started.md"

pytestmark = [
    pytest.mark.slow,  # (a wheel, two virtualenvs, a pip install from the index: a minute or more)
    pytest.mark.xdist_group("docs"),  # (the default ports, like the other pages)
    pytest.mark.timeout(900),  # (pip install from the index, on a slow day)
]


def test_a_fresh_virtualenv_follows_getting_started(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    blocks = parse(PAGE.read_text(), PAGE)
    installs = [b for b in blocks if b.options.install]
    assert installs, "Getting started installs wq in a block marked <!-- wq:run install -->"
    assert any("wqueue[" in b.text for b in installs), "...with pip install 'wqueue[...]'"
    wheel = session_wheel(tmp_path_factory)
    bare = virtualenv(tmp_path / "python")  # (its python3 makes the page's .venv; no packages)
    result = run_page(PAGE, bin_dir=bare, wheel=wheel, verbose=True)
    assert result.ok, "\n" + result.report()
    assert (result.passed, result.skipped) == (len(blocks), 0)
