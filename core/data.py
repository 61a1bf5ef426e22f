"""Parallel, read-ahead reads of many files or byte ranges, handed out as numpy arrays."""

from __future__ import annotations

import collections
import errno
import operator
import os
import stat
import threading
import weakref
from typing import Any, Iterable, Sequence, Tuple, Union

import numpy as np

from .buffers import PinnedPool, pool_buffer, round_up
from .engine import Engine, IOFuture, PathLike, default_engine, local_path

Record = Tuple[str, int, int]
Item = Union[PathLike, Tuple[PathLike, int, int]]


# Where each item of a batch starts in the batch's buffer: O_DIRECT needs aligned memory.
SLOT_ALIGNMENT = 4096


class _Shared:
    """What a source and the sources derived from it (shuffle, shard) use together."""

    def __init__(self, engine: Engine | None, pool: PinnedPool | None) -> None:
        self._engine = engine
        # Host arrays by default: pageable (a device's staging pool is passed in).
        self.pool = pool if pool is not None else PinnedPool(lock=False)
        self._lock = threading.Lock()
        # Arrays handed to callers, by id, so that release() refuses strangers and
        # double releases, which would let two later reads share one buffer.
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        # The arrays of a batch share one pool buffer, which goes back once every one of
        # them is given back: the count of those still out, by the buffer's id (forgotten
        # when the buffer itself goes, should some never come back).
        self._out: dict[int, int] = {}
        self._counted: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def lend(self, buffer: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        """Hands ``arrays``, views of the pool's ``buffer``, to the caller."""
        key = id(buffer)
        with self._lock:
            if self._counted.get(key) is not buffer:
                self._counted[key] = buffer
                weakref.finalize(buffer, self._out.pop, key, None)
            self._out[key] = self._out.get(key, 0) + len(arrays)
            for array in arrays:
                self._lent[id(array)] = array

    def give_back(self, array: np.ndarray) -> None:
        """Takes back an array :meth:`lend` handed out; its buffer goes back to the pool
        with the last of the arrays that share it."""
        with self._lock:
            if self._lent.pop(id(array), None) is not array:
                raise ValueError("not an array handed out by this source, or released already")
            buffer = pool_buffer(array)
            left = self._out[id(buffer)] - 1
            if left:
                self._out[id(buffer)] = left
                return
            del self._out[id(buffer)]
        self.pool.release(buffer)

    @property
    def engine(self) -> Engine:
        # Looked up at each read, not at construction: a source made before a fork
        # (DataLoader workers) must not use the parent's engine, whose threads stay behind.
        return self._engine if self._engine is not None else default_engine()


def records_of(items: Iterable[Item]) -> list[Record]:
    """The `(path, offset, length)` record of each item: a path stands for its whole file."""
    records = []
    sizes: dict[str, int | None] = {}
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            path, offset, length = local_path(item), 0, None
        else:
            try:
                path, offset, length = item
            except (TypeError, ValueError):
                raise TypeError(f"a FileSource item is a path or a (path, offset, length) record, "
                                f"got {item!r}") from None
            path, offset, length = local_path(path), operator.index(offset), operator.index(length)
            if offset < 0 or length < 0:
                raise ValueError(f"record {item!r}: offset and length must not be negative")
        if path not in sizes or (length is None and sizes[path] is None):
            sizes[path] = readable_size(path, "give the files in it (sorted(glob.glob('DIR/*')), say)",
                                        whole_file=length is None)
        records.append((path, offset, sizes[path] if length is None else length))
    return records


def readable_size(path: str, directory_hint: str, *, whole_file: bool = True) -> int | None:
    """The size of ``path``, to plan reads of its bytes by, refusing what cannot be read
    that way: IsADirectoryError for a directory (``directory_hint`` says what to give
    instead) and, where the whole file is to be read, ValueError for what is not a regular
    file (a FIFO, socket or device, whose ``st_size`` is not its length; None is its size
    where only given ranges are read). os.stat's OSError (its errno and the path) where
    ``path`` cannot be looked at."""
    mode_and_size = os.stat(path)
    if stat.S_ISDIR(mode_and_size.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"a directory, not a file: {directory_hint}", path)
    if stat.S_ISREG(mode_and_size.st_mode):
        return mode_and_size.st_size
    if whole_file:
        raise ValueError(f"{path!r} is not a regular file (a FIFO, socket or device): its size is not its length, "
                         "so it cannot be read whole")
    return None


class FileSource:
    """The bytes of many files, or of byte ranges in them, read in parallel ahead of use.

    Iterating yields each item's bytes, in order, as a uint8 array from a pinned
    pool, keeping ``window`` reads in flight behind the one being handed out.

    Args:
        items: paths (the whole file, sized by ``os.stat`` now) or
            ``(path, offset, length)`` records. A record that runs past the end
            of its file fails when read, with the engine's TensorferryIOError
            (``errno.ENODATA``).
        engine: the :class:`Engine` to read with (default: :func:`default_engine`,
            looked up at each read, so a source survives a fork into worker processes).
        window: reads kept in flight ahead of the consumer.
        pool: the :class:`PinnedPool` that buffers come from (default: a new one of
            pageable buffers, ``lock=False``, shared with derived sources; pass a locked
            one, registered with the device, for buffers copied to a GPU).

    Buffers: every array handed out belongs to the caller and stays valid for as
    long as it is referenced. Giving it back with :meth:`release` when done lets
    later reads reuse its pinned memory instead of allocating more. The arrays of one
    :meth:`read_batch` share one buffer, which is reused once all of them are given
    back (and kept for as long as any of them is referenced).

    Processes: a source pickles as its items and window (for workers that spawn or a
    forkserver starts), and reads there with that process's own engine and buffers;
    one given an explicit engine cannot be pickled.

    Example::

        source = FileSource(sorted(glob.glob("/data/shard-*.bin"))).shuffle(epoch).shard(rank, world)
        for array in source:
            consume(array)
            source.release(array)
    """

    def __init__(self, items: Iterable[Item], *, engine: Engine | None = None, window: int = 16,
                 pool: PinnedPool | None = None) -> None:
        self._setup(records_of(items), _Shared(engine, pool), window)

    def _setup(self, records: Sequence[Record], shared: _Shared, window: int) -> None:
        window = operator.index(window)
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._records = tuple(records)
        self._shared = shared
        self.window = window

    def _derive(self, records: Sequence[Record]) -> "FileSource":
        source = FileSource.__new__(FileSource)
        source._setup(records, self._shared, self.window)
        return source

    @property
    def records(self) -> tuple[Record, ...]:
        """The items as ``(path, offset, length)``, in reading order."""
        return self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> "FileSourceIterator":
        return FileSourceIterator(self)

    def __getitem__(self, index: int) -> np.ndarray:
        """The bytes of item ``index`` (negative counts from the end), read now."""
        return self.read_batch([index])[0]

    def read_batch(self, indices: Iterable[int]) -> list[np.ndarray]:
        """The bytes of the items at ``indices``, all read at once, in the order asked.

        The items share one buffer from the pool (one allocation, and one request per
        file, however many items): it is freed, or back in the pool, once all of them
        are gone or given back."""
        records = [self._records[self._position(i)] for i in indices]
        if not records:
            return []
        starts, end = [], 0
        for _, _, length in records:
            starts.append(end)
            end += round_up(length, SLOT_ALIGNMENT)
        pool = self._shared.pool
        # Batches are mostly handed away (a DataLoader's): a size class would double the
        # memory of some. A device's registered pool reuses by size class all the same.
        buffer = pool_buffer(pool.acquire(end, exact=not pool.registered))
        arrays = [buffer[start:start + length] for start, (_, _, length) in zip(starts, records)]
        per_file: dict[str, list[tuple[np.ndarray, int]]] = {}
        for array, (path, offset, _) in zip(arrays, records):
            per_file.setdefault(path, []).append((array, offset))
        # An error that kept a file's reads from starting is raised in turn, once the
        # reads started are done.
        reads = self._shared.engine.pread_files(list(per_file.items()))
        errors = [read if isinstance(read, OSError) else read.exception() for read in reads]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            pool.release(buffer)
            raise error
        self._shared.lend(buffer, arrays)
        return arrays

    def shuffle(self, seed: int) -> "FileSource":
        """A source of the same items in a permuted order, the same for the same ``seed``."""
        order = np.random.default_rng(seed).permutation(len(self._records))
        return self._derive([self._records[i] for i in order])

    def shard(self, index: int, count: int) -> "FileSource":
        """Items ``index``, ``index + count``, ...: ``count`` shards cover every item once."""
        if not 0 <= index < count:
            raise ValueError(f"shard index must be in 0 .. {count - 1}, got {index}")
        return self._derive(self._records[index::count])

    def release(self, array: np.ndarray) -> None:
        """Gives an array this source handed out back to the pool; it must not be used after."""
        self._shared.give_back(array)

    def __repr__(self) -> str:
        return f"<tensorferry.FileSource {len(self._records)} items window={self.window}>"

    def __getstate__(self) -> dict[str, Any]:
        # Sent to another process (a DataLoader worker that spawn or forkserver starts):
        # the records travel; buffers and the engine are the receiving process's own.
        if self._shared._engine is not None:
            raise TypeError("a FileSource given an explicit engine cannot be sent to another process: an "
                            "engine's threads and buffers belong to the process that made it; leave "
                            "engine=None so that each process reads with its own default engine")
        return {"records": self._records, "window": self.window}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["records"], _Shared(None, None), state["window"])

    def _position(self, index: int) -> int:
        position = operator.index(index)
        n = len(self._records)
        if not -n <= position < n:
            raise IndexError(f"item {index} out of range for a FileSource of {n} items")
        return position % n

    def _start(self, record: Record) -> tuple[np.ndarray | None, IOFuture | OSError]:
        """Starts one read; an error of the submission is kept to be raised in turn."""
        path, offset, length = record
        buffer = self._shared.pool.acquire(length)
        try:
            return buffer, self._shared.engine.pread(buffer, path, offset, length)
        except OSError as exc:
            self._shared.pool.release(buffer)
            return None, exc

    def _wait(self, buffer: np.ndarray | None, read: IOFuture | OSError) -> OSError | None:
        """Waits for a read from :meth:`_start`; lends out its buffer, or returns its error."""
        if isinstance(read, OSError):
            return read
        error = read.exception()
        if error is not None:
            self._shared.pool.release(buffer)
            return error
        self._shared.lend(pool_buffer(buffer), [buffer])
        return None


class FileSourceIterator:
    """Iterates a :class:`FileSource`, keeping its ``window`` reads in flight ahead.

    A failed item raises when it is reached; iterating on afterwards goes on with
    the next item. :meth:`close` stops early and takes back the buffers of reads
    already started.
    """

    def __init__(self, source: FileSource) -> None:
        self._source = source
        self._next = 0
        self._pending: collections.deque[tuple[np.ndarray | None, IOFuture | OSError]] = collections.deque()

    @property
    def in_flight(self) -> int:
        """Reads started and not yet handed out."""
        return len(self._pending)

    def __iter__(self) -> "FileSourceIterator":
        return self

    def __next__(self) -> np.ndarray:
        records = self._source._records
        # The item handed out now, and `window` started behind it.
        while len(self._pending) <= self._source.window and self._next < len(records):
            self._pending.append(self._source._start(records[self._next]))
            self._next += 1
        if not self._pending:
            raise StopIteration
        buffer, read = self._pending.popleft()
        error = self._source._wait(buffer, read)
        if error is not None:
            raise error
        return buffer

    def close(self) -> None:
        """Stops: waits for the reads started and returns their buffers to the pool."""
        self._next = len(self._source._records)
        while self._pending:
            buffer, read = self._pending.popleft()
            if self._source._wait(buffer, read) is None:
                self._source.release(buffer)

    def __enter__(self) -> "FileSourceIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
