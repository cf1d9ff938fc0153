"""The wheel users get, built once per test session from a copy of this tree, and the
virtualenvs it is installed into (tests/e2e/test_packaging.py, tests/e2e/test_newcomer.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT

# What the copy of the tree the wheel is built from leaves out (built or installed things; site:
# the documentation `make docs` builds).
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "node_modules", "__pycache__", "*.egg-info", ".*_cache", "build", "dist"
)
_NOT_SOURCE_HERE = ("site",)


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    """Runs a command that must succeed (600 s at most); its standard output."""
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _ignored(directory: str, names: list[str]) -> set[str]:
    ignored = set(_NOT_SOURCE(directory, names))
    if Path(directory) == ROOT:
        ignored.update(n for n in names if n in _NOT_SOURCE_HERE)
    return ignored


def build_wheel(work: Path) -> Path:
    """``python -m build --wheel`` of a copy of the tree, in ``work``; the wheel's path."""
    source = work / "source"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(ROOT, source, ignore=_ignored)
    # (No isolation: the build backend is this environment's setuptools, nothing downloaded.)
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", work / "dist", source)
    (built,) = (work / "dist").glob("wqueue-*.whl")
    return built


def session_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's wheel: the first caller builds it (half a minute), the others, on any
    pytest-xdist worker, wait for it and share it (a lock in the session's temporary root)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    work = root / "wqueue-wheel"
    with (root / "wqueue-wheel.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            built = sorted((work / "dist").glob("wqueue-*.whl"))
            if built:
                return built[0]
            work.mkdir(exist_ok=True)
            return build_wheel(work)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def virtualenv(where: Path, *requirements: str) -> Path:
    """A fresh virtualenv at ``where`` with ``requirements`` installed; its bin directory."""
    run(sys.executable, "-m", "venv", where)
    if requirements:
        pip = (where / "bin" / "pip", "install", "--quiet", "--disable-pip-version-check")
        run(*pip, *requirements)
    return where / "bin"
