"""The asynchronous I/O engine: positional reads and writes of host buffers (native) and
of CUDA device buffers (kvikio, :mod:`tensorferry.gds`), as futures."""

from __future__ import annotations

import atexit
import collections
import errno
import functools
import os
import re
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np

from . import _native, gds
from .buffers import byte_view
from .config import IOConfig, default_config
from .errors import ConfigError, EngineClosedError, TensorferryError, TensorferryIOError

_native.set_io_error_type(TensorferryIOError)

PathLike = Union[str, "os.PathLike[str]"]
_MODES = ("r", "r+", "w", "w+", "a")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/x``, ``file:///x``) rather than a path."""
    return isinstance(path, str) and _URL.match(path) is not None


def local_path(path: PathLike) -> str:
    """``path`` as a string; a URL (``s3://``, ``gs://``, ...) is refused with a
    ``ValueError``. The engine reads and writes files of local or mounted filesystems, and
    ``os.makedirs("s3://bucket/ckpt")`` would quietly make a local folder ``s3:``."""
    text = os.fspath(path)
    if not text:  # "" would be the working directory, or a file named nothing
        raise FileNotFoundError(errno.ENOENT, "an empty path names no file or directory", text)
    if is_url(text):
        raise ValueError(f"{text!r} is a URL: tensorferry reads and writes files on local or mounted "
                         "filesystems (mount the bucket, with a FUSE driver say, or copy the files)")
    return text


def absolute_local_path(path: PathLike) -> str:
    """:func:`local_path` made absolute as the kernel resolves it. ``os.path.abspath``
    folds ``link/..`` away as text, where the kernel follows the link first (``runs/../c``,
    ``runs`` a link to ``real/runs``, is ``real/c``): a path with ``..`` has its parent
    resolved; the last name stays as given (a link there is the link)."""
    text = local_path(path)
    if os.pardir not in text.split(os.sep):
        return os.path.abspath(text)
    head, tail = os.path.split(text.rstrip(os.sep))
    if tail in ("", os.curdir, os.pardir):
        return os.path.realpath(text)
    return os.path.join(os.path.realpath(head or os.curdir), tail)


class DirectIOFallbackWarning(UserWarning):
    """A filesystem refused O_DIRECT; I/O on it goes through the page cache."""


_warned_filesystems: set[int] = set()
_warn_lock = threading.Lock()


def _direct_refusal(path: str) -> OSError | None:
    """What an O_DIRECT open refused for ``path`` means: a directory (which opens
    read-only but refuses O_DIRECT) is an error to raise, and no news about the
    filesystem, as a warning given now would silence the one for a real refusal;
    anything else, a warning, once per filesystem."""
    if os.path.isdir(path):
        return IsADirectoryError(errno.EISDIR, "is a directory, not a file", path)
    _warn_direct_refused(path)
    return None


def _warn_direct_refused(path: str) -> None:
    try:
        device = os.stat(path).st_dev
    except OSError:
        device = -1
    with _warn_lock:
        if device in _warned_filesystems:
            return
        _warned_filesystems.add(device)
    warnings.warn(f"the filesystem holding {path} does not support O_DIRECT; "
                  "using buffered I/O on it", DirectIOFallbackWarning, stacklevel=4)


class File:
    """An open file for engine I/O (``tensorferry.open``).

    Holds a buffered descriptor and, where the filesystem allows it and ``direct``
    is set, an O_DIRECT one for aligned ranges. Modes: ``"r"``, ``"r+"``, ``"w"``
    (create, truncate), ``"w+"`` and ``"a"`` (create, keep contents; writes are
    positional, not appended).
    """

    def __init__(self, path: PathLike, mode: str = "r", *, direct: bool | None = None) -> None:
        if mode not in _MODES:
            raise ConfigError(f"mode {mode!r} is not one of {', '.join(_MODES)}")
        self.path = local_path(path)
        self.mode = mode
        want_direct = default_config().direct if direct is None else bool(direct)
        # As bytes: a name need not be UTF-8 (os.listdir gives such a name surrogate-escaped).
        self._native = _native.File(os.fsencode(self.path), mode, want_direct)
        self._closed = False
        if self._native.direct_refused:
            error = _direct_refusal(self.path)
            if error is not None:
                self.close()
                raise error

    @classmethod
    def from_fd(cls, fd: int, label: str | None = None) -> "File":
        """Wraps a descriptor the caller keeps owning (it is not closed here): a regular
        file's or a block device's. A pipe, socket or terminal is refused, since positional
        I/O cannot serve it (io_uring would read and write it wherever it stands). The File
        works through its own duplicate, so the caller may close ``fd`` with I/O still
        queued. Writes are refused through a descriptor opened read-only, and through one
        opened with ``O_APPEND``, which Linux would put at the end whatever their offset."""
        self = cls.__new__(cls)
        self.path = label or f"<fd {fd}>"
        self.mode = "fd"
        self._native = _native.File(int(fd), os.fsencode(self.path))
        self._closed = False
        return self

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is in use for aligned ranges."""
        return not self._closed and self._native.direct

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def size(self) -> int:
        """The file's current size in bytes."""
        self._check_open()
        return self._native.size

    @property
    def alignment(self) -> int:
        """File-offset alignment that O_DIRECT ranges keep (>= the page size)."""
        self._check_open()
        return self._native.offset_align

    @property
    def memory_alignment(self) -> int:
        """Alignment that O_DIRECT needs of memory addresses (the filesystem's
        ``stx_dio_mem_align``: 4 bytes on NVMe, 512 on most other devices)."""
        self._check_open()
        return self._native.mem_align

    def fileno(self) -> int:
        self._check_open()
        return self._native.fileno

    def fsync(self) -> None:
        """Makes everything written so far durable."""
        self._check_open()
        self._native.fsync()

    def truncate(self, size: int) -> None:
        self._check_open()
        self._native.truncate(size)

    def reserve(self, size: int) -> None:
        """Allocates blocks up to ``size`` bytes so later direct writes do not extend the file."""
        self._check_open()
        self._native.reserve(size)

    def close(self) -> None:
        """Closes the file. Requests already submitted keep their descriptors open
        until they finish; new I/O on this object raises."""
        self._closed = True
        self._native = None  # the descriptors close when the last request lets go

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"I/O on closed file {self.path}")

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("direct" if self.direct else "buffered")
        return f"<tensorferry.File {self.path!r} mode={self.mode!r} {state}>"


def open(path: PathLike, mode: str = "r", *, direct: bool | None = None) -> File:  # noqa: A001
    """Opens a file for engine I/O; see :class:`File`."""
    return File(path, mode, direct=direct)


class IOFuture:
    """The pending result of one or more reads or writes.

    ``result(timeout=None)`` waits (without holding the GIL) and returns the bytes
    transferred, or raises :class:`TensorferryIOError` naming file, offset and errno (or
    the error of the check of a :meth:`checked` future).
    """

    __slots__ = ("_requests", "_keepalive", "_paths", "_nbytes", "_check")

    def __init__(self, requests: Iterable[Any] = (), keepalive: Any = None, paths: Iterable[str] = (),
                 check: Callable[[], TensorferryError | None] | None = None) -> None:
        self._requests = list(requests)
        self._keepalive = keepalive  # the buffers must outlive the I/O
        self._paths = list(paths)
        self._nbytes = sum(r.nbytes for r in self._requests)
        self._check = check  # of the data, once the I/O has succeeded (see checked)

    @classmethod
    def completed(cls, nbytes: int = 0) -> "IOFuture":
        """A future that is already done, with ``nbytes`` as its result."""
        future = cls()
        future._nbytes = nbytes
        return future

    @classmethod
    def gather(cls, futures: Iterable["IOFuture"]) -> "IOFuture":
        """One future for several: done when all are, its result their total."""
        parts = list(futures)
        checks = [f._check for f in parts if f._check is not None]
        merged = cls(keepalive=parts, check=functools.partial(_first_error, checks) if checks else None)
        for f in parts:  # the parts hold the buffers
            merged._requests += f._requests
            merged._paths += f._paths
            merged._nbytes += f._nbytes
        return merged

    def checked(self, check: Callable[[], TensorferryError | None]) -> "IOFuture":
        """A future of the same I/O that, once it has succeeded, also asks ``check`` (a
        checksum of the bytes read, say), whose error :meth:`exception` returns and
        :meth:`result` raises. ``check`` is asked at each of those calls, from any thread:
        it must do its work once and give the same answer after."""
        future = IOFuture(self._requests, keepalive=self, paths=self._paths, check=check)
        future._nbytes = self._nbytes
        return future

    def done(self) -> bool:
        """True once every part has finished, successfully or not; the future then lets go
        of its buffers, as :meth:`wait` does, so that a finished future someone keeps (a
        store's record of a key's last write) does not hold the caller's memory."""
        if not all(r.done() for r in self._requests):
            return False
        # A request is done only once its last block has completed (a cancelled one's
        # unissued blocks included): neither the kernel nor an I/O thread touches the
        # buffers any more. Setting None is atomic, and every thread that gets here sets the same.
        self._keepalive = None
        return True

    def cancel(self) -> None:
        """Stops what has not started: blocks not yet handed to the kernel are skipped,
        those in flight finish (the buffers stay held until then). Unless it had
        finished already, :meth:`result` then raises ``ECANCELED``."""
        for r in self._requests:
            r.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for completion; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        for r in self._requests:  # one deadline for all: a gathered future waits no longer than one
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            if not r.wait(left):
                return False
        self._keepalive = None  # the I/O is over: the buffers may go
        return True

    def exception(self, timeout: float | None = None) -> TensorferryError | None:
        """The error of the first failed part (a :class:`TensorferryIOError`), else that of
        the check the future was made with (:meth:`checked`), or None."""
        if not self.wait(timeout):
            raise TimeoutError(f"I/O not finished after {timeout} s")
        for request, path in zip(self._requests, self._paths):
            if request.failed:
                err, what, offset, length = request.error
                return TensorferryIOError(err, f"{what}: {os.strerror(err)}", path, offset, length)
        return self._check() if self._check is not None else None

    def result(self, timeout: float | None = None) -> int:
        """Bytes transferred; raises the I/O error if any part failed."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._nbytes

    def __repr__(self) -> str:
        return f"<IOFuture {self._nbytes} bytes {'done' if self.done() else 'pending'}>"


def _first_error(checks: Iterable[Callable[[], TensorferryError | None]]) -> TensorferryError | None:
    """The first error that ``checks`` return, asked in order; a gathered future's check."""
    return next((error for error in (check() for check in checks) if error is not None), None)


def resolve_backend(name: str) -> str:
    """The backend an engine configured with ``name`` runs: ``"auto"`` settled by what this
    kernel and sandbox allow; ``"io_uring"`` refused (ConfigError) where it cannot run."""
    if name != "auto":
        if name == "io_uring":
            usable, why = io_uring_probe()
            if not usable:
                raise ConfigError(f"backend 'io_uring' is not usable here: {why}")
        return name
    return "io_uring" if io_uring_probe()[0] else "threads"


_probe_result: tuple[bool, str] | None = None


def io_uring_probe() -> tuple[bool, str]:
    """(usable, reason): whether io_uring works in this kernel and sandbox (cached)."""
    global _probe_result
    if _probe_result is None:
        _probe_result = tuple(_native.io_uring_probe())
    return _probe_result


_MAX_END = 2**63 - 1  # the largest file offset (off_t)


def _check_range(offset: int, nbytes: int) -> None:
    if offset < 0:
        raise ValueError(f"offset must not be negative, got {offset}")
    # Past it the native end offset would wrap around 2**64, and the request do nothing.
    if offset + nbytes > _MAX_END:
        raise ValueError(f"offset {offset} + {nbytes} bytes ends past 2**63-1, the largest file offset")


def _host_segments(parts: Sequence[tuple[Any, int]], verb: str) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
    """The writable byte views of ``(buffer, offset)`` parts and their native segments
    ``(address, nbytes, offset)``; host buffers only."""
    views = []
    for buffer, offset in parts:
        if not isinstance(buffer, np.ndarray) and gds.is_device_buffer(buffer):
            raise TypeError(f"{verb} takes host buffers; read a device buffer with pread")
        views.append(byte_view(buffer, writable=True))
        _check_range(offset, views[-1].nbytes)
    return views, [(v.ctypes.data, v.nbytes, offset) for v, (_, offset) in zip(views, parts)]


class Engine:
    """Asynchronous positional I/O between buffers and files.

    ``Engine(config=None, **overrides)`` takes an :class:`IOConfig` (default:
    :func:`default_config`) and field overrides. Host buffers go through the native
    backend: requests larger than ``block_size`` are split and kept ``queue_depth``
    deep in flight; the GIL is released while I/O runs and while waiting. CUDA device
    buffers (``__cuda_array_interface__`` or a DLPack CUDA device) go through kvikio,
    as :attr:`gds_mode` says; ``use_gds=True`` makes the constructor raise where
    GPUDirect Storage cannot run.

    Example::

        with tensorferry.Engine() as engine:
            engine.write(array, "/data/x.bin")
            engine.pread(out, "/data/x.bin", offset=4096).result()
    """

    def __init__(self, config: IOConfig | None = None, **overrides: Any) -> None:
        self.config = (config or default_config()).replace(**overrides)
        self.backend = resolve_backend(self.config.backend)
        self._native = _native.Engine(self.backend, self.config.block_size,
                                      self.config.queue_depth, self.config.threads)
        self._inflight: collections.deque[IOFuture] = collections.deque()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        self._gds_mode: str | None = None
        self._cufiles: gds.CuFileCache | None = None
        if self.config.use_gds:
            self._gds_mode = gds.resolve_mode(True)  # required: refused now, not at the first device buffer

    @property
    def gds_mode(self) -> str:
        """How device buffers are read and written: ``"gds"`` (kvikio with cuFile),
        ``"compat"`` (kvikio's compatibility mode) or ``"off"`` (refused). Probed on
        first use, which imports kvikio where it is installed."""
        if self._gds_mode is None:
            self._gds_mode = gds.resolve_mode(self.config.use_gds)
        return self._gds_mode

    def pwrite(self, buffer: Any, file: PathLike | File | int, offset: int = 0,
               nbytes: int | None = None) -> IOFuture:
        """Starts writing ``buffer`` (or its first ``nbytes``) at ``offset`` of ``file``.

        ``file`` is a path (created if missing, never truncated), a :class:`File`
        or a raw descriptor (host buffers only: kvikio opens files by path; see
        :meth:`File.from_fd`).
        """
        return self._submit(buffer, file, offset, nbytes, is_write=True)

    def pread(self, buffer: Any, file: PathLike | File | int, offset: int = 0,
              nbytes: int | None = None) -> IOFuture:
        """Starts reading ``len(buffer)`` (or ``nbytes``) bytes at ``offset`` into ``buffer``.

        Reading past the end of the file fails with ``errno.ENODATA``.
        """
        return self._submit(buffer, file, offset, nbytes, is_write=False)

    def pread_many(self, parts: Sequence[tuple[Any, int]], file: PathLike | File | int) -> IOFuture:
        """Starts reading each ``(buffer, offset)`` of ``parts``: ``len(buffer)`` bytes
        from ``offset`` of ``file``, all as one request, submitted at once (many tensors
        read into memory that is already theirs, say). Host buffers only."""
        self._check_usable()
        views, segments = _host_segments(parts, "pread_many")
        handle = self._file_handle(file, False)
        request = self._native.submit_many(handle, False, segments)
        future = IOFuture([request], keepalive=(list(parts), views), paths=[handle.path])
        self._track(future)
        return future

    def pread_files(self, reads: Sequence[tuple[PathLike, Sequence[tuple[Any, int]]]]) -> list[IOFuture | OSError]:
        """Starts the reads of several files, each ``(path, parts)`` of ``reads`` as
        :meth:`pread_many` reads ``parts`` of ``path``: the files are opened and their reads
        submitted in one call, without the GIL, which for a batch of small files (images,
        say) costs less than a call each. Returns, per file in order, its future, or the
        error that kept its reads from starting (for the caller to raise in turn)."""
        self._check_usable()
        paths, segments, keepalive = [], [], []
        for path, parts in reads:
            views, file_segments = _host_segments(parts, "pread_files")
            paths.append(local_path(path))
            segments.append(file_segments)
            keepalive.append((list(parts), views))
        submitted = self._native.submit_reads([os.fsencode(p) for p in paths], self.config.direct, segments)
        started: list[IOFuture | OSError] = []
        for path, kept, (request, direct_refused) in zip(paths, keepalive, submitted):
            if isinstance(request, OSError):
                started.append(request)
                continue
            future = IOFuture([request], keepalive=kept, paths=[path])
            self._track(future)
            error = _direct_refusal(path) if direct_refused else None
            if error is not None:  # as File() raises it, once the read has ended
                future.wait()
            started.append(future if error is None else error)
        return started

    def write(self, buffer: Any, file: PathLike | File | int, offset: int = 0,
              nbytes: int | None = None) -> int:
        """Synchronous :meth:`pwrite`: returns the bytes written."""
        return self.pwrite(buffer, file, offset, nbytes).result()

    def read(self, buffer: Any, file: PathLike | File | int, offset: int = 0,
             nbytes: int | None = None) -> int:
        """Synchronous :meth:`pread`: returns the bytes read."""
        return self.pread(buffer, file, offset, nbytes).result()

    def _submit(self, buffer: Any, file: PathLike | File | int, offset: int, nbytes: int | None,
                *, is_write: bool) -> IOFuture:
        self._check_usable()
        if not isinstance(buffer, np.ndarray) and gds.is_device_buffer(buffer):
            return self._submit_device(buffer, file, offset, nbytes, is_write=is_write)
        view = byte_view(buffer, writable=not is_write)
        if nbytes is None:
            nbytes = view.nbytes
        elif nbytes < 0 or nbytes > view.nbytes:
            raise ValueError(f"buffer too small: {view.nbytes} bytes, asked to "
                             f"{'write' if is_write else 'read'} {nbytes}")
        _check_range(offset, nbytes)
        handle = self._file_handle(file, is_write)
        request = self._native.submit(handle, is_write, view.ctypes.data, nbytes, offset)
        future = IOFuture([request], keepalive=(buffer, view), paths=[handle.path])
        self._track(future)
        return future

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosedError("I/O on a closed Engine")
        if self._pid != os.getpid():
            raise EngineClosedError("this Engine was made in the parent of a fork and has no I/O threads "
                                    "here; make a new one in the child (default_engine() does)")

    def _submit_device(self, buffer: Any, file: PathLike | File | int, offset: int, nbytes: int | None,
                       *, is_write: bool) -> IOFuture:
        mode = self.gds_mode
        if mode == "off":
            why = ("this engine has use_gds=False" if self.config.use_gds is False
                   else f"kvikio is not installed: {gds.GDS_EXTRA}")
            raise gds.refusal(why)
        address, size = gds.device_nbytes(buffer)
        if nbytes is None:
            nbytes = size
        elif nbytes < 0 or nbytes > size:
            raise ValueError(f"buffer too small: {size} bytes, asked to {'write' if is_write else 'read'} {nbytes}")
        _check_range(offset, nbytes)
        if isinstance(file, int):
            raise TypeError("kvikio opens files by path: give a device buffer's I/O a path or a tensorferry.File")
        if isinstance(file, File):
            file._check_open()
            if is_write and file.mode == "r":
                raise EngineClosedError(f"{file.path} is open read-only")
        path = file.path if isinstance(file, File) else local_path(file)
        with self._lock:
            if self._cufiles is None:
                self._cufiles = gds.CuFileCache(gds.load_kvikio())
        handle = self._cufiles.handle(path, is_write)
        device_bytes = gds.DeviceBytes(buffer, address, size)
        if is_write:
            request = gds.CuFileRequest(lambda: handle.pwrite(device_bytes, nbytes, offset), nbytes, offset,
                                        f"kvikio pwrite ({mode})")
        else:
            request = gds.CuFileRequest(lambda: handle.pread(device_bytes, nbytes, offset), nbytes, offset,
                                        f"kvikio pread ({mode})")
        future = IOFuture([request], keepalive=device_bytes, paths=[path])
        self._track(future)
        return future

    def _file_handle(self, file: PathLike | File | int, is_write: bool) -> Any:
        if isinstance(file, File):
            file._check_open()
            return file._native
        if isinstance(file, int):
            return File.from_fd(file)._native
        # The native handle outlives this wrapper for as long as the request needs it.
        return File(file, "a" if is_write else "r", direct=self.config.direct)._native

    def _track(self, future: IOFuture) -> None:
        # Futures the caller dropped still hold their buffers until the I/O ends.
        with self._lock:
            self._inflight.append(future)
            self._forget_finished()

    def _forget_finished(self) -> None:
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft()

    def close(self) -> None:
        """Waits for outstanding I/O, then stops the backend. Later I/O raises."""
        if self._closed:
            return
        self._closed = True
        self._native.close()
        if self._cufiles is not None:
            for future in list(self._inflight):
                future.wait()  # kvikio's threads may still use the handles
            self._cufiles.close()
        self._inflight.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        # Dropped without close(): the native destructor would wait for the queued I/O with
        # the GIL held (nanobind's dealloc), stopping every other thread until it is done.
        native = getattr(self, "_native", None)
        if native is not None:
            native.close()  # releases the GIL while it waits

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"<tensorferry.Engine backend={self.backend} block_size={c.block_size} "
                f"queue_depth={c.queue_depth} threads={c.threads} direct={c.direct}>")


_shared_engine: Engine | None = None
_shared_engine_pid = -1
_shared_lock = threading.Lock()


def default_engine() -> Engine:
    """A process-wide engine with :func:`default_config`, made on first use.

    A forked child (a DataLoader worker, say) gets its own, since the parent's I/O
    threads do not survive a fork.
    """
    global _shared_engine, _shared_engine_pid
    with _shared_lock:
        if _shared_engine is None or _shared_engine.closed or _shared_engine_pid != os.getpid():
            _shared_engine = Engine()
            _shared_engine_pid = os.getpid()
        return _shared_engine


@atexit.register
def _release_default_engine() -> None:
    """At exit, the shared engine lets go of the requests it finished and is no longer
    held here: it kept its last request, and left to the interpreter's teardown the two
    outlived the native module (nanobind reported them as leaked). It is not closed: an
    exit handler that runs after this one (an async save being finished) may still hold
    it, and a later default_engine() makes a new one."""
    global _shared_engine
    with _shared_lock:
        engine, _shared_engine = _shared_engine, None
    if engine is not None and _shared_engine_pid == os.getpid():  # a forked child's copy: left as it was
        with engine._lock:
            engine._forget_finished()
