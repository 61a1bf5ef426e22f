"""NVMe swap space for arrays that do not fit in memory: swap_out, swap_in, prefetch."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import itertools
import os
import resource
import shutil
import tempfile
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from .buffers import PinnedPool, byte_view
from .engine import Engine, IOFuture, PathLike, local_path
from .engine import open as open_file
from .errors import CorruptCheckpointError, EngineClosedError, TensorferryIOError
from .shard import CHECKSUM_ALGORITHM, digest
from .temporaries import hold, release, remove_if_stale


@dataclasses.dataclass
class _Staged:
    """A prefetch read of one key into a pooled pinned buffer."""

    buffer: np.ndarray
    future: IOFuture
    charge: int  # pinned bytes it holds: the pool's size class, not the key's size


@dataclasses.dataclass
class _Slot:
    """One key: its backing file and the I/O on it."""

    path: str
    nbytes: int
    checksum: str | None = None  # of the bytes the last write took (verify=True)
    write: IOFuture | None = None
    reads: list[IOFuture] = dataclasses.field(default_factory=list)
    staged: _Staged | None = None

    def write_in_flight(self) -> IOFuture | None:
        return self.write if self.write is not None and not self.write.done() else None

    def in_flight(self) -> list[IOFuture]:
        """Every unfinished request on the file (writes, reads, the prefetch read)."""
        self.reads = [r for r in self.reads if not r.done()]
        busy = list(self.reads)
        if self.write is not None and not self.write.done():
            busy.append(self.write)
        if self.staged is not None and not self.staged.future.done():
            busy.append(self.staged.future)
        return busy

    def write_error(self) -> TensorferryIOError | None:
        """The error of the last write, once it has finished and failed."""
        if self.write is None or not self.write.done():
            return None
        return self.write.exception()


class _Verification:
    """Checks the bytes a swap_in landed against the checksum their swap_out took: once,
    in the first thread that asks (the future's ``result()``); the others get its answer."""

    def __init__(self, landed: np.ndarray, expected: str, key: str, path: str) -> None:
        self._landed: np.ndarray | None = landed
        self._expected = expected
        self._key = key
        self._path = path
        self._error: CorruptCheckpointError | None = None
        self._lock = threading.Lock()

    def __call__(self) -> CorruptCheckpointError | None:
        with self._lock:
            if self._landed is not None:
                actual = digest(self._landed)
                if actual != self._expected:
                    self._error = CorruptCheckpointError(
                        f"{self._path}: the data of offload key {self._key!r} failed its {CHECKSUM_ALGORITHM} "
                        f"checksum on swap_in (written {self._expected}, read {actual}): the file was changed "
                        "underneath the store, or the drive gave back other bytes")
                self._landed = None  # checked: the caller's buffer is theirs again
            return self._error


_STORE_PREFIX = "tensorferry-offload-"


# The forks of this process's line, counted in each child: a store made before the last
# fork is the parent's. Read at every call of a store, where getpid() is a system call.
_forks_seen = 0


def _count_fork() -> None:
    global _forks_seen
    _forks_seen += 1


os.register_at_fork(after_in_child=_count_fork)


def _max_requests_in_flight() -> int:
    """How many requests a store keeps in flight at most. Each holds its file open until it
    ends, with two descriptors (buffered and O_DIRECT): an eighth of the soft RLIMIT_NOFILE
    keeps a store to a quarter of the descriptors, and 1024 is more than an engine has in
    flight (those beyond wait in its queue, gaining nothing)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(1, min(1024, soft // 8))


def _remove_store(path: str, lock: int, owner: int) -> None:
    """The store's clean-up, at close, garbage collection or exit. A forked child inherits
    the store and runs this at its own exit: there it only closes its copy of the lock's
    descriptor (the parent's keeps the lock), and the files, the parent's, stay."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
    release(lock)


def _reclaim_dead_stores(directory: str) -> None:
    """Removes the swap directories of stores whose process died without closing them
    (killed): those whose lock is free and whose process is gone. A store of a running
    process is left alone, even one of an older tensorferry that took no lock."""
    for entry in os.scandir(directory):
        if not entry.name.startswith(_STORE_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name[len(_STORE_PREFIX):].partition("-")[0]
        if pid.isdigit() and _process_alive(int(pid)):
            continue
        remove_if_stale(entry.path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OffloadStore:
    """Swap space on a fast drive for host buffers, keyed by name (ZeRO-Infinity style offload).

    Args:
        directory: an existing directory on the drive. The store works in a fresh
            subdirectory ``tensorferry-offload-<pid>-<random>`` of it, which
            :meth:`close` removes (as does garbage collection or interpreter exit if
            close is never called), so no later run mistakes its files for state. Only
            the process that made the store removes it: a forked child's exit leaves it.
        engine: the :class:`Engine` to use; by default the store creates one and
            closes it in :meth:`close`. Files are opened with O_DIRECT whatever the
            engine's ``direct`` setting (filesystems that refuse it fall back to the
            page cache, with a warning).
        max_pool_bytes: bound on the pinned memory of prefetch buffers, in use and
            idle together. Buffers come in power-of-two size classes, so a key
            charges up to twice its size.
        verify: whether to check what comes back. :meth:`swap_out` takes an xxh3-64
            checksum of the buffer (the checkpoints' checksum), and the future of
            :meth:`swap_in` raises :class:`CorruptCheckpointError` from ``result()``
            (and returns it from ``exception()``) when the bytes read, from the drive
            or from a prefetch, are not those written: a file changed underneath the
            store, or a drive that returned bad data. Each byte is hashed once out and
            once in (the caller's buffer just before its write, the destination when
            ``result()`` is first called, a prefetched key's as it is copied out): 0.07
            CPU-seconds per GB swapped out and back in, 0.035 per GB hashed (timed where
            it runs, 256 MiB swaps, from the drive or prefetched, one core of a 2-core
            VM). ``False`` checks nothing, as DeepSpeed's swapper does not.

    Layout: one file per key. Deleting or resizing a key returns its space to the
    filesystem at once (so an ENOSPC can be cured by deleting keys), the
    filesystem's allocator deals with keys of many sizes, and rewriting a key of
    the same size overwrites its allocated blocks in place. Files are opened per
    request rather than held open, and a request holds its file (two descriptors)
    only while it runs: the store keeps at most an eighth of the soft RLIMIT_NOFILE
    (read when it is made; at most 1024) requests in flight, and a swap_out or
    swap_in past that waits for the oldest to end. So a store of many thousand
    keys, swapped all at once, does not run into the descriptor limit; an open
    costs microseconds against the transfer.

    Buffers given to :meth:`swap_out` must not change until its future is done.
    Calls on different keys may come from different threads at once. The store
    belongs to the process that made it: in a forked child (a DataLoader worker,
    say) every call but :meth:`close` raises :class:`EngineClosedError`, as the
    engine's I/O threads and the files are the parent's, and the child's close and
    exit leave them be.

    Example::

        with tensorferry.OffloadStore("/nvme") as store:
            store.swap_out("layer0.exp_avg", exp_avg).result()
            store.prefetch(["layer0.exp_avg"])
            store.swap_in("layer0.exp_avg", exp_avg).result()
    """

    def __init__(self, directory: PathLike, engine: Engine | None = None, *,
                 max_pool_bytes: int = 256 << 20, verify: bool = True) -> None:
        directory = local_path(directory)
        if max_pool_bytes < 0:
            raise ValueError(f"max_pool_bytes must not be negative, got {max_pool_bytes}")
        if not os.path.exists(directory):
            raise FileNotFoundError(errno.ENOENT, "offload directory does not exist", directory)
        if not os.path.isdir(directory):
            raise NotADirectoryError(errno.ENOTDIR, "offload directory is not a directory", directory)
        _reclaim_dead_stores(directory)
        try:
            self.path = tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-", dir=directory)
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create the offload store's files in {directory}: "
                                       f"{exc.strerror}", directory) from exc
        lock = hold(self.path)  # while held, no other process takes this store for a dead one's
        self._owner = os.getpid()
        self._forks_seen = _forks_seen
        self._cleanup = weakref.finalize(self, _remove_store, self.path, lock, self._owner)
        self.max_pool_bytes = max_pool_bytes
        self.verify = verify
        self._engine = engine if engine is not None else Engine()
        self._owns_engine = engine is None
        self._pool = PinnedPool(max_cached_bytes=max_pool_bytes)
        # How many idle buffers of each size class the pool holds. The pool is the
        # store's alone, so this mirror is exact and tells whether an acquire reuses
        # memory or allocates more.
        self._idle: collections.Counter[int] = collections.Counter()
        self._held = 0  # pinned bytes in staged prefetch buffers
        self._slots: dict[str, _Slot] = {}
        # Every request started, oldest first, until seen done: each holds its file open.
        self._requests: collections.deque[IOFuture] = collections.deque()
        self._max_requests = _max_requests_in_flight()
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = dict.fromkeys(("bytes_out", "bytes_in", "swaps_out", "swaps_in", "prefetch_hits"), 0)

    def swap_out(self, key: str, buffer: Any) -> IOFuture:
        """Starts writing the bytes of ``buffer`` (any host buffer) to the store under ``key``.

        Waits first for I/O still running on ``key``, so writes of one key land in
        call order. A failure (ENOSPC, EIO) raises from the future's ``result()``, or
        at once when the file cannot be allocated; either way ``key`` is no longer in
        the store. A call refused before the key's file is changed (a closed engine,
        a file that cannot be opened) raises at once and leaves the key as it was.
        """
        view = byte_view(buffer, writable=False)
        # Hashed here, while the caller's data is likely still in the CPU caches, and outside
        # the lock, so that calls on other keys go on meanwhile.
        checksum = digest(view) if self.verify else None
        while True:
            with self._lock:
                self._check_open()
                slot = self._slots.get(key)
                busy = slot.in_flight() if slot is not None else []
                if not busy:
                    oldest = self._request_to_wait_for()
                    if oldest is None:
                        return self._start_write(key, slot, view, checksum)
                    busy = [oldest]
            for future in busy:
                future.wait()

    def _start_write(self, key: str, slot: _Slot | None, view: np.ndarray, checksum: str | None) -> IOFuture:
        if self._engine.closed:  # refused here, before "w" truncates the key's file
            raise EngineClosedError(f"the engine of the OffloadStore in {self.path} is closed")
        if slot is not None:
            self._unstage(slot)
            if slot.write_error() is not None:
                self._drop_failed(key)
                slot = None
        if slot is None:
            path, mode = os.path.join(self.path, f"{next(self._names)}.swap"), "w"
        else:
            # "w" truncates: a new size gives back the old blocks, and the engine allocates the new.
            path, mode = slot.path, "r+" if slot.nbytes == view.nbytes else "w"
        file = open_file(path, mode, direct=True)  # a failed open leaves the file as it was
        try:
            future = self._engine.pwrite(view, file, 0, view.nbytes)
        except BaseException:
            if slot is None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            elif mode == "w":  # truncated: whatever the key held is gone
                self._drop_failed(key)
            raise
        if slot is None:
            slot = self._slots[key] = _Slot(path, view.nbytes)
        slot.nbytes = view.nbytes
        slot.write = future
        slot.checksum = checksum
        self._requests.append(future)
        self._stats["bytes_out"] += view.nbytes
        self._stats["swaps_out"] += 1
        return future

    def swap_in(self, key: str, into: Any) -> IOFuture:
        """Starts reading the bytes of ``key`` into the first ``nbytes(key)`` bytes of ``into``.

        Sees the data of a swap_out still in flight (waits for it first). For a key
        that :meth:`prefetch` staged, waits for the prefetch read if it is still
        running, copies from memory and returns a finished future. With ``verify``,
        the future's ``result()`` checks the bytes read against the checksum taken at
        swap_out and raises :class:`CorruptCheckpointError` if they differ.

        Raises:
            KeyError: ``key`` is not in the store (or its last write failed).
            ValueError: ``into`` is smaller than the key's data.
        """
        view = byte_view(into, writable=True)
        while True:
            staged = hit = None
            try:
                with self._lock:
                    self._check_open()
                    slot = self._live_slot(key)
                    if view.nbytes < slot.nbytes:
                        raise ValueError(f"buffer too small for {key!r}: {view.nbytes} bytes, "
                                         f"the key holds {slot.nbytes}")
                    pending = slot.write_in_flight()
                    if pending is None and slot.staged is not None and not slot.staged.future.done():
                        # Left on the slot until it is over: a swap_out of the key, which waits
                        # for the slot's I/O, must not write the file under it.
                        pending = slot.staged.future
                    if pending is None and slot.staged is None:
                        pending = self._request_to_wait_for()
                        if pending is None:
                            return self._start_read(key, slot, view)
                    if pending is None:
                        staged, slot.staged = slot.staged, None
                        nbytes, path, checksum = slot.nbytes, slot.path, slot.checksum
                if pending is not None:
                    pending.wait()
                    continue
                if staged.future.exception() is None:
                    np.copyto(view[:nbytes], staged.buffer)
                    copied = self._checked(IOFuture.completed(nbytes), view[:nbytes], checksum, key, path)
                    copied.exception()  # checks now, as the copy has just brought the bytes into the caches
                    hit = copied
            finally:
                if staged is not None:  # the buffer goes back to the pool, whatever happened
                    with self._lock:
                        if not self._closed:
                            self._release(staged.buffer, staged.charge)
                        if hit is not None:
                            self._stats["bytes_in"] += nbytes
                            self._stats["swaps_in"] += 1
                            self._stats["prefetch_hits"] += 1
            if hit is not None:
                return hit
            # Waited, or the prefetch read failed (read again from the drive, whose future says why).

    def _start_read(self, key: str, slot: _Slot, view: np.ndarray) -> IOFuture:
        future = self._engine.pread(view, open_file(slot.path, "r", direct=True), 0, slot.nbytes)
        slot.reads.append(future)  # not the checked future, which holds `into` until checked
        self._requests.append(future)
        self._stats["bytes_in"] += slot.nbytes
        self._stats["swaps_in"] += 1
        return self._checked(future, view[:slot.nbytes], slot.checksum, key, slot.path)

    def prefetch(self, keys: Iterable[str]) -> int:
        """Starts reading ``keys``, in order, into pooled pinned buffers for later :meth:`swap_in`.

        Stops at the first key whose buffer would take the prefetch memory past
        ``max_pool_bytes``, or whose read would take the store's requests in flight
        past their bound: it never waits for room and never allocates beyond the
        bound. Keys already staged, and keys with a write in flight, are passed
        over. Returns how many reads it started.

        Raises:
            KeyError: one of ``keys`` is not in the store (before any read starts).
        """
        if isinstance(keys, str):
            raise TypeError("prefetch takes a list of keys, not one key")
        with self._lock:
            self._check_open()
            slots = [self._live_slot(key) for key in keys]
            started = 0
            for slot in slots:
                if slot.staged is not None or slot.write_in_flight() is not None:
                    continue
                if self._request_to_wait_for() is not None:
                    break
                taken = self._take_buffer(slot.nbytes)
                if taken is None:
                    break
                buffer, charge = taken
                try:
                    future = self._engine.pread(buffer, open_file(slot.path, "r", direct=True), 0, slot.nbytes)
                except BaseException:
                    self._release(buffer, charge)
                    raise
                slot.staged = _Staged(buffer, future, charge)
                self._requests.append(future)
                started += 1
            return started

    def delete(self, key: str) -> None:
        """Removes ``key`` and its file, after the I/O running on it has finished."""
        while True:
            with self._lock:
                self._check_open()
                slot = self._live_slot(key)
                busy = slot.in_flight()
                if not busy:
                    self._drop(key)
                    return
            for future in busy:
                future.wait()

    def keys(self) -> list[str]:
        """The keys in the store, including those whose write is still in flight."""
        with self._lock:
            self._check_open()
            return [key for key in list(self._slots) if self._settle(key) is None]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            self._check_open()
            return key in self._slots and self._settle(key) is None

    def nbytes(self, key: str) -> int:
        """The size in bytes of what ``key`` holds."""
        with self._lock:
            self._check_open()
            return self._live_slot(key).nbytes

    def stats(self) -> dict[str, int]:
        """Counters: bytes_out, bytes_in, swaps_out, swaps_in, prefetch_hits, files,
        disk_bytes (bytes the backing files hold) and pool_bytes (pinned prefetch
        memory, in use and idle)."""
        with self._lock:
            self._check_open()
            for key in list(self._slots):
                self._settle(key)
            return {**self._stats, "files": len(self._slots),
                    "disk_bytes": sum(slot.nbytes for slot in self._slots.values()),
                    "pool_bytes": self._held + self._pool.cached_bytes}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Waits for the I/O in flight, then frees the buffers and removes the store's files.

        Errors of that I/O are left to the futures that report them. Later calls
        raise :class:`EngineClosedError`. Interrupted (Ctrl-C while it waits), the
        store stays closed to use and a later close() finishes the job.
        """
        with self._lock:
            if not self._cleanup.alive:
                return
            self._closed = True
            busy = [future for slot in self._slots.values() for future in slot.in_flight()]
        for future in busy:
            future.wait()
        with self._lock:
            self._slots.clear()
            self._requests.clear()
            self._held = 0
            self._pool.clear()
            self._idle.clear()
        if self._owns_engine:
            self._engine.close()
        self._cleanup()

    def __enter__(self) -> "OffloadStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)} keys"
        return f"<tensorferry.OffloadStore {self.path!r} {state}>"

    @staticmethod
    def _checked(read: IOFuture, landed: np.ndarray, checksum: str | None, key: str, path: str) -> IOFuture:
        """``read``, checked against ``checksum`` once it has succeeded (as is, with no checksum)."""
        return read if checksum is None else read.checked(_Verification(landed, checksum, key, path))

    # The helpers below run with self._lock held.

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("use of a closed OffloadStore")
        if _forks_seen != self._forks_seen:
            # Even a look would settle keys whose write was in flight at the fork (failed
            # here, ECANCELED) and remove their files, which are the parent's.
            raise EngineClosedError(f"this OffloadStore belongs to process {self._owner}, which forked this one: "
                                    "its files and I/O are the parent's (make a new store in the child)")

    def _request_to_wait_for(self) -> IOFuture | None:
        """None while one more request may start; at the bound on requests in flight (and
        so on open files), the oldest one still running, for the caller to wait for."""
        requests = self._requests
        while requests and requests[0].done():
            requests.popleft()
        if len(requests) < self._max_requests:
            return None
        self._requests = requests = collections.deque(r for r in requests if not r.done())
        return requests[0] if len(requests) >= self._max_requests else None

    def _settle(self, key: str) -> TensorferryIOError | None:
        """Drops ``key`` if its last write failed, and returns that write's error."""
        error = self._slots[key].write_error()
        if error is not None:
            self._drop_failed(key)
        return error

    def _live_slot(self, key: str) -> _Slot:
        if key not in self._slots:
            raise KeyError(key)
        error = self._settle(key)
        if error is not None:
            raise KeyError(f"{key!r}: its last swap_out failed ({error})") from error
        return self._slots[key]

    def _drop(self, key: str) -> None:
        slot = self._slots.pop(key)
        self._unstage(slot)
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass

    def _drop_failed(self, key: str) -> None:
        """:meth:`_drop` of a key whose write failed. Removing its file may fail too (on a
        filesystem gone read-only, say): that error must not take the place of the write's
        own, and the file goes with the store's folder at close all the same."""
        with contextlib.suppress(OSError):
            self._drop(key)

    def _unstage(self, slot: _Slot) -> None:
        """Frees the slot's prefetch buffer; its read must have finished."""
        if slot.staged is not None:
            self._release(slot.staged.buffer, slot.staged.charge)
            slot.staged = None

    def _take_buffer(self, nbytes: int) -> tuple[np.ndarray, int] | None:
        """A pooled buffer and its charge, or None if it would break ``max_pool_bytes``."""
        charge = PinnedPool.size_class(nbytes)
        if self._held + charge > self.max_pool_bytes:
            return None
        if self._idle[charge]:
            self._idle[charge] -= 1
        elif self._held + self._pool.cached_bytes + charge > self.max_pool_bytes:
            # Idle buffers of other sizes give way to the one needed now.
            self._pool.clear()
            self._idle.clear()
        self._held += charge
        return self._pool.acquire(nbytes), charge

    def _release(self, buffer: np.ndarray, charge: int) -> None:
        cached = self._pool.cached_bytes
        self._pool.release(buffer)
        if self._pool.cached_bytes > cached:
            self._idle[charge] += 1
        self._held -= charge
