"""Shared fixtures: every engine test runs over each backend this machine offers, and
no test leaves anything in the temporary directory."""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Iterator, Mapping, Sequence

import pytest

import tensorferry

BACKENDS = ["threads", "io_uring"]


@pytest.fixture(scope="session", autouse=True)
def session_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A temporary directory of this session's own, made the default (``TMPDIR`` too, so
    child processes use it) for everything but pytest's ``tmp_path``, which stays where
    pytest keeps its recent runs. It is removed at the end."""
    tmp_path_factory.getbasetemp()
    # multiprocessing's directory of this process (a forkserver's socket lives there until
    # exit, when multiprocessing removes it) is made first, outside the session's.
    multiprocessing.util.get_temp_dir()
    root = tempfile.mkdtemp(prefix="tensorferry-tests-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = root
    try:
        yield root
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(root, ignore_errors=True)


# What frameworks keep there for the whole process, on purpose: TensorFlow's autograph
# its generated code (removed at exit), torch's inductor its cache. The session's
# directory takes them with it at the end.
KEPT_FOR_THE_SESSION = ("__autograph_generated_file", "torchinductor_")


def _stray_multiprocessing_dir(parent: str, name: str) -> bool:
    """An empty ``pymp-*`` directory: multiprocessing's own, which a DataLoader worker
    leaves now and then when it exits while its queue's feeder thread still pickles a
    batch (torch alone does it: 2 to 9 times in 200 ``next(iter(loader))`` with a
    ``TensorDataset`` and two forked workers). Or one holding only torch's
    ``_remote_module_non_scriptable.py``, which torch 2.7 writes at import of
    ``torch.distributed.nn`` and removes at exit, which our ranks skip (``os._exit``)."""
    path = os.path.join(parent, name)
    if not os.path.isdir(path):
        return False
    inside = os.listdir(path)
    return (name.startswith("pymp-") and not inside) or (
        name.startswith("tmp") and inside == ["_remote_module_non_scriptable.py"])


@pytest.fixture(autouse=True)
def leaves_no_temp_files(session_temp_dir: str) -> Iterator[None]:
    """Fails (at teardown) a test that leaves files or directories in the temporary
    directory, naming them, and removes them so the next test starts clean."""
    yield
    left = sorted(n for n in os.listdir(session_temp_dir)
                  if not n.startswith(KEPT_FOR_THE_SESSION) and not _stray_multiprocessing_dir(session_temp_dir, n))
    for name in left:
        path = os.path.join(session_temp_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    if left:
        pytest.fail(f"the test left {', '.join(left)} in the temporary directory")


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


def requires_cuda(test: Callable) -> Callable:
    """Skipped without a CUDA device; marked ``cuda`` so that ``pytest -m cuda`` (what
    benchmarks/gpu_check.sh runs) selects it."""
    import torch

    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


def free_ports(count: int) -> list[int]:
    """Ports free now, for the coordinator or workers of a multi-process test."""
    ports = []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def run_processes(script: str, runs: Sequence[tuple[Sequence[str], Mapping[str, str]]], timeout: float) -> list[str]:
    """Runs ``python -c script`` once per ``(args, env)`` of ``runs``, all at once (the
    processes of one distributed job); asserts that each exits 0 and returns their
    outputs (stdout and stderr together). None is left running."""
    procs = [subprocess.Popen([sys.executable, "-c", script, *args], env=dict(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args, env in runs]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.fixture
def small_tmpfs() -> Iterator[str]:
    """A 4 MiB tmpfs: a real filesystem that fills up."""
    with mounted("tmpfs", "size=4m") as path:
        yield path


@pytest.fixture
def discards_held_up() -> Iterator[Callable[[], None]]:
    """The background thread that frees what saves replaced (``temporaries.discard_later``)
    kept busy until the test calls the function given, as freeing a checkpoint of many
    GB keeps it busy for seconds: what a save must not wait for is then surely still
    being freed, not only on the runs where the thread happens to lag."""
    from tensorferry import temporaries

    # The pool is made at the first discard: one of a temporary of no save's.
    temporaries.discard_later(tempfile.mkdtemp(suffix=temporaries.TMP_MARKER + "gate"))
    gate = threading.Event()
    temporaries._discarding[1].submit(gate.wait)
    try:
        yield gate.set
    finally:
        gate.set()
        temporaries.wait_for_discards()


def ctrl_c() -> None:
    """SIGINT to the main thread, as a user's Ctrl-C: a KeyboardInterrupt wherever it is."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@contextlib.contextmanager
def once_blocked_in(function: Callable, then: Callable[[], None]) -> Iterator[None]:
    """Calls ``then()`` (from another thread) once the main thread, in the body, is blocked
    waiting (in ``threading``'s ``Condition.wait``) somewhere inside ``function``; not at all
    if it never is. A program's Ctrl-C (``then=ctrl_c``) lands there surely, not by timing."""
    main, code, finished = threading.main_thread(), function.__code__, threading.Event()

    def blocked() -> bool:
        frame = sys._current_frames().get(main.ident)
        if frame is None or frame.f_code is not threading.Condition.wait.__code__:
            return False
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame is not None

    def watch() -> None:
        while not finished.wait(0.001):
            if blocked():
                then()
                return

    watcher = threading.Thread(target=watch, name="once_blocked_in")
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
