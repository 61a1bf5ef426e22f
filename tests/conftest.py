"""Shared fixtures: every engine test runs over each backend this machine offers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from typing import Iterator

import pytest

import tensorferry

BACKENDS = ["threads", "io_uring"]


def _require_backend(name: str) -> None:
    if name == "io_uring":
        usable, why = tensorferry.io_uring_probe()
        if not usable:
            pytest.skip(f"io_uring is not usable here: {why}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The name of each backend in turn (skipped where the kernel refuses it)."""
    _require_backend(request.param)
    return request.param


@pytest.fixture
def engine(backend: str) -> Iterator[tensorferry.Engine]:
    """An engine with small blocks, so that modest test files are split into many."""
    with tensorferry.Engine(backend=backend, block_size=64 << 10, queue_depth=8, threads=3) as e:
        yield e


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None) -> Iterator[str]:
    """Mounts a fresh filesystem of ``fstype`` on a temporary directory (root only)."""
    target = tempfile.mkdtemp(prefix=f"tensorferry-{fstype}-")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, target]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        os.rmdir(target)
        pytest.skip("the mount command is not installed")
    if result.returncode != 0:
        os.rmdir(target)
        pytest.skip(f"cannot mount {fstype} here ({result.stderr.strip() or 'not root?'})")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", target], capture_output=True)
        os.rmdir(target)


@pytest.fixture
def small_tmpfs() -> Iterator[str]:
    """A 4 MiB tmpfs: a real filesystem that fills up."""
    with mounted("tmpfs", "size=4m") as path:
        yield path
