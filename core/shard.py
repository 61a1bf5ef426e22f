"""Shard files: safetensors-compatible files written and read at drive speed.

Layout: 8-byte little-endian header length, a JSON header padded with spaces so
that tensor data starts on a 4096-byte boundary, then the tensors packed without
holes, largest element size first so each starts aligned to its element size.
The header's metadata holds one xxh3-64 checksum per tensor
(``tensorferry.checksums``); the file's checksum is the xxh3-64 of its whole
header, which therefore covers the data too.
"""

from __future__ import annotations

import functools
import json
import math
import concurrent.futures
import contextlib
import errno
import gc
import io
import mmap
import os
import struct
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, Union

import numpy as np

from . import _native
from .buffers import PinnedPool, byte_view, round_up
from .dtypes import to_numpy_dtype, to_safetensors_dtype
from .engine import Engine, File, IOFuture, default_engine, local_path
from .errors import CorruptCheckpointError, DurabilityWarning, RewrittenFileWarning, TensorferryIOError
from .pools import ThreadPool
from .schema import (ORBAX_STEP_MARKER, ORBAX_TEMPORARY_MARKER, PART_FILE, STEP_NUMBER, STRUCTURE_KEY,
                     check_structure, check_tensor_entry, hub_cache_hint, parse_json)
from .streams import (STREAM_PIECE, fill_from, is_stream, naming_stream_errors, read_exactly, remaining_bytes, require,
                      stream_name, would_block)
from .temporaries import (NEW_TEMPORARY_TRIES, discard_later, hold_new, refuse_temporary_marker, release,
                          remove_stale_temporaries, set_aside, temporary_name, temporary_token)

ALIGNMENT = 4096
_OWN_MAPPING = 1 << 20  # from this size on, aligned_empty maps memory of its own
MAPPED_SLICE = 32 << 20  # a mapped load reads its pages in this many bytes at a time,
MAPPED_AHEAD = 8  # up to this many slices ahead of the checksums
# Staging for small tensors, shared by the shard files of one save: 16 MiB kept too few
# writes in flight when several files are written at once (4096 x 512 KiB, 2 GiB over
# four files: 1.58 GB/s against 1.93 with 64 MiB, fio 1.54, medians of three).
DEFAULT_BUFFER_SIZE = 64 << 20
MAX_HEADER_BYTES = 100 << 20  # the safetensors library refuses larger headers too
CHECKSUMS_KEY = "tensorferry.checksums"
# The xxh3-64 of the whole header (length prefix, JSON, padding) with these 16 digits
# zeroed, so that it is written in place: a file carrying any "tensorferry." key must
# carry it, or it is corrupt (a single file has no manifest to vouch for its header).
HEADER_CHECKSUM_KEY = "tensorferry.header_checksum"
_HEADER_CHECKSUM_MARK = f'"{HEADER_CHECKSUM_KEY}":"'.encode()
CHECKSUM_ALGORITHM = "xxh3_64"
_DIGEST_CHARS = 16
# A box (ShardReader.read_box) that is not one contiguous byte range is read as one
# envelope, from its first element to its last, unless the envelope is more than this
# many times the wanted bytes: then as one read per contiguous run, if there are at
# most MAX_BOX_RUNS (past that, per-request costs outweigh the bytes saved).
ENVELOPE_WASTE = 2
MAX_BOX_RUNS = 256

Source = Union[Any, Callable[[], Any]]


class Deferred(NamedTuple):
    """A tensor whose bytes are made when a writer gets to it (copied off a device, say):
    what :meth:`ShardWriter.add` and :func:`tensorferry.save_checkpoint` take in place
    of an array."""

    dtype: str  # safetensors name
    shape: tuple[int, ...]
    source: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * to_numpy_dtype(self.dtype).itemsize


# Staging between files and host memory only: pageable (device copies use their own pools).
_pool = PinnedPool(lock=False)


_gc_pause_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused(*, main_thread_only: bool = False) -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (as a ``with`` block or a decorator,
    ``@gc_paused()``) while thousands of small, acyclic objects are made: the parsed
    headers, manifests and plans of a checkpoint of many tensors. Their allocation
    triggers full collections that walk every object of the process, torch's
    included: 0.13 of the 0.14 s that unpickling DCP's metadata of 4096 tensors took,
    and a third of ``dcp.save``'s time beside ``DCPWriter``'s own (docs/architecture.md).

    Pauses from several threads overlap: the collector comes back, as it was before the
    first of them, when the last one ends, error or not.

    ``main_thread_only`` is for calls that last as long as the drive takes (a save's
    writes): made from another thread, a background save's, such a pause held back
    collection for the whole process, the training going on meanwhile included, whose
    reference cycles (tensors among them) then piled up until the save ended, to be
    collected at once after it (docs/architecture.md)."""
    global _gc_pausers, _gc_was_enabled
    if main_thread_only and threading.current_thread() is not threading.main_thread():
        yield
        return
    with _gc_pause_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_pause_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def _xxh3():
    try:
        import xxhash
    except ImportError:
        raise ImportError("checksums need the xxhash package: pip install xxhash") from None
    return xxhash.xxh3_64


def digest(data: Any) -> str:
    """The xxh3-64 checksum of a buffer, as 16 hex digits."""
    return _xxh3()(data).hexdigest()


def new_hasher() -> Any:
    """A streaming xxh3-64 hasher (``update(buffer)``, ``hexdigest()``): the same
    checksum as :func:`digest` of the pieces put together."""
    return _xxh3()()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a shard file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_json(self) -> dict[str, Any]:
        entry = {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.begin, self.end]}
        if self.checksum:
            entry["checksum"] = self.checksum
        return entry


@dataclass(frozen=True)
class ShardInfo:
    """What :meth:`ShardWriter.close` returns: enough for a manifest entry."""

    path: str
    size: int
    checksum: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @functools.cached_property
    def manifest_entries(self) -> str:
        """This file's tensors as a manifest lists them (each naming the file), JSON
        members without the braces. Cached, so that each writer of a multi-file save
        encodes its own as its file closes, while the others still write: 4096 tensors'
        entries take about 10 ms to build and encode, all after the last write otherwise."""
        file = os.path.basename(self.path)
        entries = {name: {"file": file, **t.to_json()} for name, t in self.tensors.items()}
        return json.dumps(entries, separators=(",", ":"))[1:-1]


@dataclass
class BoxRead:
    """A box of a stored tensor on its way in, as :meth:`ShardReader.read_box` started it.

    ``future`` covers every read the box needs; ``result()`` waits for them and returns
    the box. ``whole`` tells that the box is the entire tensor, the only case its
    checksum can be checked (when the reader verifies).
    """

    future: IOFuture
    whole: bool
    _assemble: Callable[[], np.ndarray] = field(repr=False)
    _box: np.ndarray | None = field(default=None, repr=False)

    def result(self) -> np.ndarray:
        """The box, of shape ``lengths`` and the stored dtype (over ``out``'s memory when
        one was given). Raises the reads' I/O error, or :class:`CorruptCheckpointError`
        when a whole tensor fails its checksum."""
        if self._box is None:
            self.future.result()
            self._box = self._assemble()
        return self._box


def write_order(specs: Iterable[tuple[str, str]]) -> list[str]:
    """The order in which :class:`ShardWriter` lays out tensors given as ``(name, dtype)``
    in the order they were added: largest element size first, so each tensor starts
    aligned to its element size. Ranks that feed a writer on another rank (one tensor
    at a time, through collectives) follow it too."""
    specs = list(specs)
    return [name for name, dtype in sorted(specs, key=lambda s: -to_numpy_dtype(s[1]).itemsize)]


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: Source


class ShardWriter:
    """Streams named arrays into one safetensors-compatible file.

    ``add`` records arrays (no copy is made); ``close`` lays them out, streams small
    or unaligned ones through a ring of page-locked buffers (copy into one while the
    others are written with O_DIRECT, hashing each piece just copied), writes large
    page-aligned arrays straight from their own memory, fsyncs, and returns a
    :class:`ShardInfo`. Memory stays near ``2 * buffer_size``, plus at most
    ``staging_bytes`` (or one array, if larger) of arrays made by lazy sources whose
    writes are in flight (device tensors copied to the host, say).

    ``path`` may be a writable file object (``io.BytesIO``, an fsspec stream) instead:
    :meth:`close` then writes to it, as :meth:`write_to` does, and :attr:`path` is its
    ``name`` (or its type's), which only labels errors.

    Example::

        with ShardWriter("model.safetensors") as w:
            w.add("weight", np.ones((1024, 1024), np.float32))
        info = w.info
    """

    def __init__(self, path: str | os.PathLike | Any, engine: Engine | None = None,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, *, metadata: Mapping[str, str] | None = None,
                 staging_bytes: int = 256 << 20, atomic: bool = False, keep_on_failure: bool = False,
                 superseded: Callable[[], bool] | None = None) -> None:
        # A stream's name is no path to check or to write: a stream wrapper may name it by
        # its URL ("s3://bucket/model.safetensors"), which a path here would refuse.
        self._stream = path if is_stream(path) else None
        if self._stream is not None:
            require(path, "write", "ShardWriter")
            if atomic:
                raise ValueError(f"{stream_name(path)}: a file object is written in place; atomic needs a path")
        self.path = stream_name(path) if self._stream is not None else local_path(path)
        if atomic:
            refuse_temporary_marker(self.path)
        # With ``atomic``, the file is written under a temporary name and renamed over
        # ``path`` only once complete and durable: a reader never sees half a file.
        self._write_path = _temporary_name(self.path) if atomic else self.path
        # A failed write removes its file, unless the file is the caller's (an open file
        # written through its /proc/self/fd link, which cannot be unlinked either, or a
        # stream, whose name may be some other file's).
        self._keep_on_failure = keep_on_failure or self._stream is not None
        # With ``atomic``: asked just before the rename; True drops the written file and
        # leaves ``path`` as it is (what was put there meanwhile is newer than this write).
        self._superseded = superseded
        self.staging_bytes = staging_bytes
        self.engine = engine or default_engine()
        self.buffer_size = max(ALIGNMENT, round_up(buffer_size, ALIGNMENT))
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        for reserved in (CHECKSUMS_KEY, HEADER_CHECKSUM_KEY):
            if reserved in self.metadata:
                raise ValueError(f"metadata key {reserved!r} is reserved")
        self._entries: dict[str, _Entry] = {}
        self._plan: _Plan | None = None
        self.info: ShardInfo | None = None

    def add(self, name: str, array_or_dtype: Any, shape: Iterable[int] | None = None,
            data: Source | None = None) -> None:
        """Adds a tensor: ``add(name, array)`` or ``add(name, dtype, shape, data)``.

        ``data`` is a bytes-like object or a callable returning one, called when the
        tensor's turn comes (to stage device memory one tensor at a time).
        """
        if self.info is not None:
            raise ValueError(f"{self.path}: add() after close()")
        if name in self._entries:
            raise ValueError(f"{self.path}: tensor {name!r} added twice")
        if name == "__metadata__":
            raise ValueError(f"{self.path}: the name '__metadata__' is the safetensors header's own")
        self._plan = None
        if isinstance(array_or_dtype, Deferred):
            array_or_dtype, shape, data = array_or_dtype
        if shape is None and data is None:
            array = np.asarray(array_or_dtype)
            # Byte order and layout are fixed in _Streamer._bytes_of, one tensor at a
            # time, so a non-contiguous state is never copied whole.
            self._entries[name] = _Entry(name, to_safetensors_dtype(array.dtype), array.shape, array.nbytes, array)
            return
        dtype = to_safetensors_dtype(array_or_dtype)
        dims = tuple(int(d) for d in (shape or ()))
        self._entries[name] = _Entry(name, dtype, dims, math.prod(dims) * to_numpy_dtype(dtype).itemsize, data)

    def plan(self) -> None:
        """Lays out the tensors added so far and encodes the header, as :meth:`close`
        does first unless done before: milliseconds of Python for thousands of tensors,
        which concurrent writers do better one at a time, so that the first file starts
        streaming at once rather than all of them late."""
        order = write_order([(e.name, e.dtype) for e in self._entries.values()])
        entries = [self._entries[name] for name in order]
        layout, offset = {}, 0
        for e in entries:
            layout[e.name] = (offset, offset + e.nbytes)
            offset += e.nbytes
        header = _Header(self.metadata, entries, layout)
        if header.size - 8 > MAX_HEADER_BYTES:  # every reader (ours, safetensors') would refuse the file
            raise ValueError(f"{self.path}: the header of {len(entries)} tensors would be {header.size - 8} bytes, "
                             f"more than the {MAX_HEADER_BYTES} a reader accepts (fewer or shorter names)")
        self._plan = _Plan(entries, layout, offset, header)

    def close(self) -> ShardInfo:
        """Writes the file, makes it durable and returns its :class:`ShardInfo`."""
        if self.info is not None:
            return self.info
        if self._stream is not None:
            self.info = self.write_to(self._stream)
            return self.info
        if self._plan is None:
            self.plan()
        entries, layout, offset, header = self._plan
        file, lock = self._open_for_write()
        try:
            file.reserve(header.size + offset)
            # A small file needs no more staging than its own size (one slot of it).
            staging = min(self.buffer_size, 2 * round_up(max(offset, 1), ALIGNMENT))
            checksums = _Streamer(self.engine, file, header.size, staging, self.staging_bytes).write(entries)
            header_bytes = header.encode(checksums)
            self.engine.write(header_bytes, file, 0)
            file.fsync()
            size = header.size + offset
            file.close()
            if self._write_path != self.path:
                if self._superseded is not None and self._superseded():
                    self.abort()
                else:
                    replaced = set_aside(self.path)  # the replaced file's blocks are freed after the commit
                    os.replace(self._write_path, self.path)
                    fsync_after_commit(self.path)
                    if replaced is not None:
                        discard_later(replaced)
        except BaseException:
            file.close()
            self.abort()
            raise
        finally:
            release(lock)
        tensors = {e.name: TensorInfo(e.dtype, e.shape, *layout[e.name], checksums[e.name]) for e in entries}
        self.info = ShardInfo(self.path, size, digest(header_bytes), tensors)
        return self.info

    def write_to(self, stream: Any) -> ShardInfo:
        """Writes the file to a writable file object (``io.BytesIO``, an fsspec stream)
        instead, from where it stands: the same bytes as :meth:`close` writes; returns
        their :class:`ShardInfo`. The
        checksums go in the header, ahead of the data. Into an ``io.BytesIO``, which can
        be written again behind, the header's place is held (its length does not depend on
        the checksums), each tensor is hashed a piece at a time as the piece is written,
        while it is in the cache, and the header goes in last. Any other stream gets every
        tensor hashed before any is written, then each handed to ``stream.write`` as it
        lies in memory (a lazy source's array is made once and held until then): every
        byte read twice. ``path`` only names the stream."""
        if self._plan is None:
            self.plan()
        entries, layout, offset, header = self._plan
        if _rewritable(stream):
            start = stream.tell()
            stream.write(bytes(header.size))
            checksums = {e.name: _write_hashing(stream, _Streamer._bytes_of(e)) for e in entries}
            end = stream.tell()
            stream.seek(start)
            header_bytes = header.encode(checksums)
            stream.write(header_bytes)
            stream.seek(end)
        else:
            data = [_Streamer._bytes_of(e) for e in entries]
            checksums = {e.name: digest(d) for e, d in zip(entries, data)}
            header_bytes = header.encode(checksums)
            _write_all(stream, header_bytes)
            for d in data:
                if d.nbytes:
                    _write_all(stream, d)
        tensors = {e.name: TensorInfo(e.dtype, e.shape, *layout[e.name], checksums[e.name]) for e in entries}
        return ShardInfo(self.path, header.size + offset, digest(header_bytes), tensors)

    def _open_for_write(self) -> tuple[File, int | None]:
        """The file to write; for an atomic write, its temporary with the lock that holds
        it, after what killed saves to this path left is removed. A fresh temporary that
        a concurrent save's clean-up took first (:func:`hold_new`) is given up for another."""
        if self._write_path == self.path:
            return File(self.path, "w"), None
        parent, name = os.path.split(os.path.abspath(self.path))
        if not os.path.isdir(parent):  # else the error would name a temporary the caller never saw
            if os.path.lexists(parent):
                raise TensorferryIOError(errno.ENOTDIR, f"cannot save {name} into what is not a directory", parent)
            raise TensorferryIOError(errno.ENOENT, f"cannot save {name}: its directory does not exist", parent)
        if os.path.isdir(self.path):  # the rename would fail only once the whole file was written
            raise TensorferryIOError(errno.EISDIR, "cannot save a file over a directory (a checkpoint directory "
                                     "is written by save_checkpoint)", self.path)
        remove_stale_temporaries(parent, name)
        for _ in range(NEW_TEMPORARY_TRIES):
            file = File(self._write_path, "w")
            lock = hold_new(self._write_path)
            if lock is not None:
                return file, lock
            file.close()
            self._write_path = _temporary_name(self.path)
        raise FileExistsError(f"{self._write_path}: taken by another save to {self.path} as it was made")

    def abort(self) -> None:
        """Discards the file (if any was started), unless it is the caller's (``keep_on_failure``)."""
        self.info = None
        if not self._keep_on_failure:
            _remove_quietly(self._write_path)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _rewritable(stream: Any) -> bool:
    """An ``io.BytesIO``, or a subclass that writes and seeks as it does (fsspec's
    ``memory://`` files): one whose header can be written last. A subclass that does its
    own writing (passing each write on, say) gets the bytes in order."""
    kind = type(stream)
    return isinstance(stream, io.BytesIO) and kind.write is io.BytesIO.write and kind.seek is io.BytesIO.seek


def _write_all(stream: Any, data: Any) -> None:
    """``stream.write(data)`` until all of it is written: a raw stream (``io.RawIOBase``,
    a socket's file) may take part and say how much, or None where it is non-blocking and
    could take nothing now (:func:`~tensorferry.streams.would_block`'s error), where a
    buffered one takes it all (or, like many file-likes, returns None)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        with naming_stream_errors(stream, "writing to"):
            taken = stream.write(view)
        if taken is None and isinstance(stream, io.RawIOBase):  # None there is no byte written, not all of them
            raise would_block(stream, "writing to")
        if taken is None or taken >= view.nbytes:
            return
        if taken <= 0:
            raise TensorferryIOError(errno.EIO, f"the stream took none of the {view.nbytes} bytes left to write",
                                     stream_name(stream))
        view = view[taken:]


def _write_hashing(stream: Any, data: np.ndarray) -> str:
    """Writes ``data`` to ``stream`` a piece at a time, each hashed just before it is
    written (while it is in the cache); its checksum."""
    if data.nbytes <= COPY_PIECE:
        checksum = digest(data)
        stream.write(data)
        return checksum
    hasher = new_hasher()
    for at in range(0, data.nbytes, COPY_PIECE):
        piece = data[at:at + COPY_PIECE]
        hasher.update(piece)
        stream.write(piece)
    return hasher.hexdigest()


class _Plan(NamedTuple):
    entries: list[_Entry]  # in file order
    layout: dict[str, tuple[int, int]]  # name: data offsets
    data_bytes: int
    header: "_Header"


class _Header:
    """A shard's JSON header, sized before the data is written and completed after.

    The tensors' part is encoded once; only the checksums, which are fixed-width, wait
    for the data (encoding 1024 tensors' entries takes milliseconds, under the GIL,
    before any byte streams).
    """

    def __init__(self, metadata: Mapping[str, str], entries: list[_Entry],
                 layout: Mapping[str, tuple[int, int]]) -> None:
        self.metadata, self.names = metadata, [e.name for e in entries]
        self.tensors_json = json.dumps(
            {e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": list(layout[e.name])}
             for e in entries}, separators=(",", ":")).encode()
        placeholder = self._json(dict.fromkeys(self.names, "0" * _DIGEST_CHARS))
        self.size = round_up(8 + len(placeholder), ALIGNMENT)  # where the data starts

    def _json(self, checksums: Mapping[str, str]) -> bytes:
        metadata = dict(self.metadata)
        metadata[CHECKSUMS_KEY] = json.dumps({n: checksums[n] for n in self.names}, separators=(",", ":"))
        metadata[HEADER_CHECKSUM_KEY] = "0" * _DIGEST_CHARS
        head = b'{"__metadata__":' + json.dumps(metadata, separators=(",", ":")).encode()
        return head + (b"," + self.tensors_json[1:] if self.names else b"}")

    def encode(self, checksums: Mapping[str, str]) -> bytes:
        """The header with its length prefix, padded with spaces up to the data."""
        body = self._json(checksums)
        header = bytearray(struct.pack("<Q", self.size - 8) + body + b" " * (self.size - 8 - len(body)))
        at = header.rindex(_HEADER_CHECKSUM_MARK) + len(_HEADER_CHECKSUM_MARK)
        header[at:at + _DIGEST_CHARS] = digest(header).encode()
        return bytes(header)


COPY_PIECE = 1 << 20  # hashed, then copied while in the cache
DIRECT_GROUP = 8 << 20  # bytes of destinations read straight into, per engine request


class _Streamer:
    """The write pipeline of one shard: coalesce small tensors, write large ones directly.

    Small tensors are copied into a ring of ``SLOTS`` buffers of ``buffer_size / 2`` each
    (``2 * buffer_size`` in all): while one fills, the others are being written, so the
    drive's queue never drains at a buffer boundary as it would with two halves.

    Invariant: the current slot holds ``fill`` bytes destined for file offsets
    ``[slot_start, position)``.
    """

    SLOTS = 4

    def __init__(self, engine: Engine, file: File, start: int, buffer_size: int, staging_bytes: int) -> None:
        self.engine, self.file = engine, file
        self.staging_bytes = staging_bytes
        self.slot_size = max(ALIGNMENT, round_up(buffer_size // 2, ALIGNMENT))
        self.direct_threshold = buffer_size // 2
        self.slots: list[np.ndarray | None] = [None] * self.SLOTS  # taken from the pool when first filled
        self.slot_futures: list[IOFuture | None] = [None] * self.SLOTS
        self.current = self.fill = 0
        self.slot_start = self.position = start
        self.direct_futures: list[tuple[IOFuture, int]] = []  # (write, bytes a lazy source made)

    def write(self, entries: list[_Entry]) -> dict[str, str]:
        checksums = {}
        try:
            for e in entries:
                data = self._bytes_of(e)
                if data.nbytes >= self.direct_threshold and self._writable_in_place(data):
                    self._flush()
                    produced = data.nbytes if callable(e.source) else 0
                    self.direct_futures.append((self.engine.pwrite(data, self.file, self.position), produced))
                    self.position += data.nbytes
                    self.slot_start = self.position
                    checksums[e.name] = digest(data)  # hashed while the write is in flight
                    self._bound_direct_writes()
                else:
                    checksums[e.name] = self._copy_in(data)
            self._flush()
            for f in self._all_futures():
                f.result()
        finally:
            for f in self._all_futures():
                f.wait()  # the slots go back to the pool only once idle
            for slot in self.slots:
                if slot is not None:
                    _pool.release(slot)
        return checksums

    def _writable_in_place(self, data: np.ndarray) -> bool:
        """Whether ``data`` goes to the drive from its own memory at the current position:
        with O_DIRECT only if its address has the position's phase in a page, so that the
        engine bounces none of its blocks. Memory aligned only to the device's DMA
        alignment (512 bytes on this VM's disk) would pass O_DIRECT, but wrote at 0.77 of
        a page-aligned buffer's speed and 0.08 CPU-s/GB against 0.01, where reading into it
        cost nothing extra (benchmarks/bench_memory_phase.py). Anything else the
        engine would bounce block by block, and the hash would then read it from memory a
        second time; through the ring it is read from memory once."""
        return not self.file.direct or (data.ctypes.data - self.position) % ALIGNMENT == 0

    def _all_futures(self) -> list[IOFuture]:
        return [f for f in self.slot_futures if f is not None] + [f for f, _ in self.direct_futures]

    @staticmethod
    def _bytes_of(e: _Entry) -> np.ndarray:
        source = e.source() if callable(e.source) else e.source
        if isinstance(source, np.ndarray):
            if source.dtype.byteorder == ">":
                source = source.astype(source.dtype.newbyteorder("<"))
            source = np.ascontiguousarray(source)
        data = byte_view(source, writable=False)
        if data.nbytes != e.nbytes:
            raise ValueError(f"tensor {e.name!r}: {e.dtype}{list(e.shape)} needs {e.nbytes} bytes, "
                             f"got {data.nbytes}")
        return data

    def _copy_in(self, data: np.ndarray) -> str:
        """Copies ``data`` into the ring and returns its checksum, 1 MiB at a time: each
        piece is hashed, then copied while it is in the cache, with streaming stores (the
        slot is read next by the drive, not by the CPU). Copying first and hashing the
        copy cost 0.24 CPU-s/GB of a save of 4096 tensors of 512 KiB, this 0.20; hashing
        each tensor whole before copying it read every byte twice (docs/architecture.md).
        A tensor changed while it is saved (which the caller must not do) then fails its
        checksum on load rather than load torn."""
        if data.nbytes <= min(COPY_PIECE, self.slot_size - self.fill):
            # Most small tensors fit in one piece, and one digest call costs less than a hasher.
            checksum = digest(data)
            _copy_out(self._piece(data.nbytes), data)
            self._advance(data.nbytes)
            return checksum
        hasher = new_hasher()
        done = 0
        while done < data.nbytes:
            take = min(self.slot_size - self.fill, data.nbytes - done, COPY_PIECE)
            source = data[done:done + take]
            hasher.update(source)
            _copy_out(self._piece(take), source)
            self._advance(take)
            done += take
        return hasher.hexdigest()

    def _piece(self, nbytes: int) -> np.ndarray:
        """The next ``nbytes`` of the current slot (which must have room for them)."""
        if self.slots[self.current] is None:
            self.slots[self.current] = _pool.acquire(self.slot_size)
        return self.slots[self.current][self.fill:self.fill + nbytes]

    def _advance(self, nbytes: int) -> None:
        """Counts ``nbytes`` just copied into the slot; a full slot goes to the drive."""
        self.fill += nbytes
        self.position += nbytes
        if self.fill == self.slot_size:
            self._flush()

    def _flush(self) -> None:
        """Starts writing the current slot, then waits until the next one is free."""
        if self.fill:
            slot = self.slots[self.current]
            self.slot_futures[self.current] = self.engine.pwrite(slot, self.file, self.slot_start, self.fill)
            self.current = (self.current + 1) % self.SLOTS
            self.fill = 0
            pending = self.slot_futures[self.current]
            if pending is not None:
                pending.result()
                self.slot_futures[self.current] = None
        self.slot_start = self.position

    def _bound_direct_writes(self) -> None:
        """Waits for the oldest direct writes while too many are in flight.

        Arrays made by lazy sources exist only for their write, so their bytes in
        flight are held to ``staging_bytes`` (always allowing one)."""
        budget = self.staging_bytes
        while len(self.direct_futures) > 64 or (
                len(self.direct_futures) > 1 and sum(p for _, p in self.direct_futures) > budget):
            self.direct_futures.pop(0)[0].result()


# The first bytes of files users hand to a safetensors reader by mistake, and what to do instead.
_FOREIGN_FORMATS = [
    (b"PK\x03\x04", "a zip archive, as torch.save and numpy.savez write: tensorferry unpickles nothing; "
                      "load it with torch.load(path, weights_only=True) (numpy.load for .npz) and save what it "
                      "returns"),
    (b"\x93NUMPY", "a numpy .npy file: load it with numpy.load"),
    (b"GGUF", "a GGUF file (llama.cpp's format)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5 weights, say)"),
    (b"|TZR|", "a tensorizer file: read it with tensorizer's TensorDeserializer"),
    *((magic, f"{name}-compressed: decompress it (or pass load() the open {name} stream)")
      for magic, name in ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"),
                          (b"BZh", "bz2"))),
]
_PICKLE = ("a pickle (torch.save's legacy format, or pickle.dump): tensorferry unpickles nothing; "
           "load it with torch.load(path, weights_only=True) and save what it returns")


def foreign_format(prefix: bytes) -> str | None:
    """What a file that begins with ``prefix`` is, where it is a known format other than
    safetensors (torch.save's zip or pickle, .npy, GGUF, HDF5, tensorizer, a compressed
    file), or None."""
    if len(prefix) > 1 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:  # pickle's PROTO opcode, protocol 2-5
        return _PICKLE
    return next((what for magic, what in _FOREIGN_FORMATS if prefix.startswith(magic)), None)


def foreign_files_hint(directory: str) -> str:
    """For a directory that holds no checkpoint: what its files of another known format
    are (``pytorch_model.bin``, a zip of torch.save, say), or which of its snapshots to
    give where it is a Hugging Face cache repository, as a clause to add to the error, or
    ``""``; or which step to give for an Orbax run's directory. Reads the first bytes of
    at most 64 files."""
    run = hub_cache_hint(directory) or _orbax_run_hint(directory)
    if run:
        return run
    found = []
    try:
        entries = sorted((e for e in os.scandir(directory) if e.is_file()), key=lambda e: e.name)[:64]
    except OSError:
        return ""
    for entry in entries:
        try:
            with open(entry.path, "rb") as f:
                foreign = foreign_format(f.read(8))
        except OSError:
            continue
        if foreign is not None:
            found.append((entry.name, foreign))
    if not found:
        return _several_files_hint(entries) or _folders_of_safetensors_hint(directory)
    names = first_names([name for name, _ in found])
    return f"; it holds {names}, not safetensors files: {found[0][0]} is {found[0][1]}"


def first_names(names: Sequence[str], most: int = 3) -> str:
    """``names`` for a message: the first ``most``, then how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def subfolders_holding(directory: str, holds: Callable[[str], bool]) -> list[str]:
    """The names of ``directory``'s subdirectories whose path ``holds`` accepts, sorted;
    none where it cannot be listed (a hint must not hide the error it is added to)."""
    try:
        return sorted(e.name for e in os.scandir(directory) if e.is_dir() and holds(e.path))
    except OSError:
        return []


def _several_files_hint(entries: Sequence[os.DirEntry]) -> str:
    """For a directory of several safetensors files and no index naming them (two models
    side by side, say): which, as a clause, or ``""``."""
    files = [e.name for e in entries if e.name.endswith(".safetensors")]
    if len(files) < 2 or any(PART_FILE.fullmatch(name) for name in files):  # a damaged save's parts: none to give
        return ""
    return f"; it holds {len(files)} safetensors files and no index naming them ({first_names(files)}): give one"


def _orbax_run_hint(directory: str) -> str:
    """For the directory of an Orbax ``CheckpointManager`` (its steps as subdirectories)
    given instead of one of its steps: which step to give (the latest), as a clause, or ``""``."""
    # Not a step Orbax is still writing, <step>.orbax-checkpoint-tmp-<time>: its time, read as
    # its step, made it the latest.
    steps = subfolders_holding(directory, lambda path: os.path.isfile(os.path.join(path, ORBAX_STEP_MARKER))
                               and ORBAX_TEMPORARY_MARKER not in os.path.basename(path))
    if not steps:
        return ""
    latest = max(steps, key=lambda name: (int(m.group(1)) if (m := STEP_NUMBER.search(name)) else -1, name))
    return (f"; it is the directory of an Orbax CheckpointManager with {len(steps)} step(s): give one, "
            f"the latest being {os.path.join(directory, latest)}")


def _folders_of_safetensors_hint(directory: str) -> str:
    """For a directory whose subdirectories hold the tensors (a diffusers pipeline's
    ``unet``, ``vae``, ...; a run's checkpoints): which, as a clause, or ``""``."""
    folders = subfolders_holding(directory, lambda path: any(f.name.endswith(".safetensors")
                                                             for f in os.scandir(path)))
    return f"; its folders {first_names(folders, 4)} hold safetensors files: give one of them" if folders else ""


def fsync_dir(path: str) -> None:
    """Makes a directory's entries (a rename into it, say) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise TensorferryIOError(exc.errno, "fsync of the directory failed", path) from exc
    finally:
        os.close(fd)


def fsync_after_commit(committed: str) -> None:
    """Makes the rename that committed ``committed`` durable. A failure then is a
    :class:`DurabilityWarning`, not an error: the file or checkpoint is in place and
    complete, only its survival of a power cut is in doubt."""
    parent = os.path.dirname(os.path.abspath(committed))
    try:
        fsync_dir(parent)
    except OSError as exc:
        warnings.warn(f"{committed} is committed, but {exc}: the rename may not survive a power cut",
                      DurabilityWarning, stacklevel=3)


def _temporary_name(path: str) -> str:
    """Where an atomic write of ``path`` writes before its rename."""
    return temporary_name(path, temporary_token())


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _copy_items(source: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """Copies ``source`` into ``dest`` (same shape and item size) as raw bytes, so that
    no dtype converts or normalizes a value (bf16, bool) on the way."""
    raw = np.dtype(f"u{source.itemsize}")
    dest.view(raw)[...] = source.view(raw)
    return dest


class _Slabs:
    """Small arrays (under 1 MiB) carved one after another from 16 MiB mappings in huge
    pages, each at the page phase its read needs. Each array of its own was a fresh
    mapping faulted in 4 KiB at a time: a JAX restore of 4096 arrays of 512 KiB spent
    more CPU on those faults than on reading and hashing. A slab lives while any array
    carved from it does."""

    SIZE = 16 << 20

    def __init__(self) -> None:
        self._slab: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, phase: int) -> np.ndarray:
        with self._lock:
            for fresh in (False, True):
                if fresh or self._slab is None:
                    self._slab, self._used = aligned_empty(self.SIZE), 0
                start = self._used + (phase - self._slab.ctypes.data - self._used) % ALIGNMENT
                if start + nbytes <= self.SIZE:
                    self._used = start + nbytes
                    return self._slab[start:start + nbytes]
        raise AssertionError("unreachable: a fresh slab holds any array under 1 MiB")


class _StagedReads:
    """Tensors read into destinations whose memory O_DIRECT cannot fill (a torch
    tensor's, 64 bytes past a page): the file is read in runs of up to ``PIECE`` bytes
    into a ring of ``SLOTS`` pooled, page-aligned buffers, one engine request per
    piece however many tensors it holds; as each piece lands every tensor in it is
    hashed from the buffer and copied out while both are in the cache, and the slot
    takes the next piece.

    Measured (2 GiB, 4096 tensors of 512 KiB into torch tensors, DCPReader): one
    request per tensor, each bounced by the engine and then hashed from memory again,
    cost 0.38-0.43 CPU-s/GB. Eight slots of 8 MiB: 64 x 32 MiB read at 3.8-4.1 GB/s
    (as ``load`` into its own memory, 3.6-4.1), four at 3.2-3.4 (three rounds each)."""

    PIECE = 8 << 20
    SLOTS = 8
    STEP = COPY_PIECE  # hashed then copied in steps that stay in the cache

    def __init__(self, reader: "ShardReader", targets: list[tuple[str, np.ndarray]],
                 ahead: "_ReadAhead | None" = None, from_ahead: list[tuple[str, np.ndarray, int]] = ()) -> None:
        self.reader = reader
        self.targets = sorted(targets, key=lambda nt: reader.tensors[nt[0]].begin)
        self.ahead = ahead
        self.ahead_landings = [] if ahead is None else ahead.parts(from_ahead)
        if ahead is not None:
            ahead.cancel_except(number for number, _ in self.ahead_landings)

    def _pieces(self) -> Iterable[tuple[int, int, list[tuple[str, np.ndarray, int, int, int]]]]:
        """``(file start, file end, parts)``, the start rounded down to a page; each part
        ``(name, destination, its first byte in the tensor, in the piece, length)``."""
        reader, data_start = self.reader, self.reader.data_start
        start = end = None
        parts: list[tuple[str, np.ndarray, int, int, int]] = []
        for name, view in self.targets:
            t = reader.tensors[name]
            done = 0
            while done < t.nbytes:
                at = data_start + t.begin + done
                if start is not None and (at - end > ALIGNMENT or at + 1 - start > self.PIECE):
                    yield start, end, parts
                    start, parts = None, []
                if start is None:
                    start = at - at % ALIGNMENT
                take = min(t.nbytes - done, self.PIECE - (at - start))
                parts.append((name, view, done, at - start, take))
                end = at + take
                done += take
        if parts:
            yield start, end, parts

    def run(self) -> None:
        reader = self.reader
        slots = [_pool.acquire(self.PIECE) for _ in range(self.SLOTS if self.targets else 0)]
        in_flight: list[tuple[IOFuture, np.ndarray, list]] = []
        hashers: dict[str, Any] = {}
        try:
            for number, (start, end, parts) in enumerate(self._pieces()):
                if len(in_flight) == self.SLOTS:
                    self._land_ahead(hashers)  # once, the ring's reads flying meanwhile
                    self._land(*in_flight.pop(0), hashers)
                slot = slots[number % self.SLOTS]
                in_flight.append((reader.engine.pread(slot, reader._file, start, end - start), slot, parts))
            self._land_ahead(hashers)
            while in_flight:
                self._land(*in_flight.pop(0), hashers)
        finally:
            for future, _, _ in in_flight:
                future.wait()  # the slots go back to the pool only once idle
            for slot in slots:
                _pool.release(slot)

    def _land_ahead(self, hashers: dict[str, Any]) -> None:
        """The tensors the read-ahead holds, each piece's buffer given back once landed."""
        landings, self.ahead_landings = self.ahead_landings, []
        for number, parts in landings:
            self._land(*self.ahead.piece(number), parts, hashers)
            self.ahead.drop(number)

    def _land(self, future: IOFuture, slot: np.ndarray, parts: list, hashers: dict[str, Any]) -> None:
        future.result()
        reader = self.reader
        for name, view, first, at, length in parts:
            expected = reader.tensors[name].checksum if reader.verify else None
            if expected is not None and first == 0 and length == view.nbytes and length <= self.STEP:
                # Most tensors: one digest of the buffer, then the copy reads it from the cache.
                source = slot[at:at + length]
                if digest(source) != expected:
                    raise reader._mismatch(name)
                _copy_out(view, source)
                continue
            hasher = None if expected is None else hashers.setdefault(name, new_hasher())
            for step in range(0, length, self.STEP):
                source = slot[at + step:at + min(length, step + self.STEP)]
                if hasher is not None:
                    hasher.update(source)
                _copy_out(view[first + step:first + step + source.nbytes], source)
            if hasher is not None and first + length == view.nbytes and hashers.pop(name).hexdigest() != expected:
                raise reader._mismatch(name)


READ_AHEAD = 512 << 20


def default_read_ahead() -> int:
    """Bytes a DCP load reads ahead of its plan by default: 512 MiB, what 0.25 s of
    planning leaves a 2 GB/s drive to read, and at most an eighth of the memory
    available now (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return min(READ_AHEAD, int(line.split()[1]) * 1024 // 8)
    except (OSError, ValueError, IndexError):
        pass
    return READ_AHEAD


class _ReadAhead:
    """The first bytes of a shard file's data, read into pooled page-aligned buffers
    before anyone knows where they go: a DCP load starts it as soon as it knows its
    files, and the drive works while torch plans and the load resolves its destinations
    (on 4096 tensors, 0.2-0.3 s in which nothing else is read). :meth:`ShardReader.read_many`
    then takes every tensor lying wholly inside it from these buffers, hashed and copied
    out as staged reads are; pieces it needs nothing from are cancelled.

    Measured (2 GiB in 4096 tensors, a 0.25 s gap before the reads, four rounds):
    1.19-1.25 s with 512 MiB read ahead, 1.42-1.55 s without, CPU alike
    (docs/architecture.md)."""

    PIECE = _StagedReads.PIECE

    def __init__(self, reader: "ShardReader", nbytes: int) -> None:
        self.start = reader.data_start - reader.data_start % ALIGNMENT
        self.end = self.start
        stop = min(reader.size, reader.data_start + nbytes)
        self._pieces: list[tuple[IOFuture, np.ndarray] | None] = []
        try:
            for at in range(self.start, stop, self.PIECE):
                length = min(self.PIECE, stop - at)
                slot = _pool.acquire(self.PIECE)
                try:
                    self._pieces.append((reader.engine.pread(slot, reader._file, at, length), slot))
                except BaseException:
                    _pool.release(slot)
                    raise
                self.end = at + length
        except BaseException:
            self.close()
            raise

    def covers(self, begin: int, end: int) -> bool:
        """Whether file bytes ``[begin, end)`` all lie in the read-ahead (and are some)."""
        return self.start <= begin < end <= self.end

    def parts(self, targets: Iterable[tuple[str, np.ndarray, int]]) -> list[tuple[int, list]]:
        """``(piece number, parts)`` in file order, for the ``(name, view, first byte in
        the file)`` targets (all covered), each part as :class:`_StagedReads` lands it."""
        per_piece: dict[int, list[tuple[str, np.ndarray, int, int, int]]] = {}
        for name, view, begin in targets:
            done = 0
            while done < view.nbytes:
                number, at = divmod(begin + done - self.start, self.PIECE)
                take = min(view.nbytes - done, self.PIECE - at)
                per_piece.setdefault(number, []).append((name, view, done, at, take))
                done += take
        return sorted(per_piece.items())

    def cancel_except(self, needed: Iterable[int]) -> None:
        """Cancels the pieces not ``needed`` (their buffers go back with :meth:`close`)."""
        needed = set(needed)
        for number, piece in enumerate(self._pieces):
            if number not in needed and piece is not None:
                piece[0].cancel()

    def piece(self, number: int) -> tuple[IOFuture, np.ndarray]:
        return self._pieces[number]

    def drop(self, number: int) -> None:
        """Gives piece ``number``'s buffer back, once its read is over."""
        piece, self._pieces[number] = self._pieces[number], None
        if piece is not None:
            piece[0].wait()
            _pool.release(piece[1])

    def cancel(self) -> None:
        self.cancel_except(())

    def close(self) -> None:
        """Stops what has not started and gives every buffer back once its read is over."""
        self.cancel()
        for number in range(len(self._pieces)):
            self.drop(number)


def _copy_out(dest: np.ndarray, source: np.ndarray) -> None:
    """``dest[:] = source`` (both contiguous bytes) into memory that is not read again
    soon, a loaded tensor's: with streaming stores, which do not first read the
    destination into the cache. Staged reads of 2 GiB in 512 KiB pieces, each hashed
    then copied: 0.31 s of CPU with numpy's copy, 0.21 s (docs/architecture.md)."""
    if dest.nbytes != source.nbytes:
        raise ValueError(f"copying {source.nbytes} bytes into {dest.nbytes}")
    if not (dest.flags.c_contiguous and source.flags.c_contiguous):
        dest[...] = source
        return
    _native.copy_out(dest.ctypes.data, source.ctypes.data, source.nbytes)


def _slices(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Page-aligned ranges of at most ``MAPPED_SLICE`` bytes covering the byte ranges
    ``spans`` (sorted by start), neighbours merged, in order."""
    merged: list[list[int]] = []
    for start, end in spans:
        start -= start % ALIGNMENT
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(lo, min(hi, lo + MAPPED_SLICE)) for begin, hi in merged for lo in range(begin, hi, MAPPED_SLICE)]


def aligned_empty(nbytes: int, phase: int = 0, *, populate: bool = False) -> np.ndarray:
    """A uint8 array whose address is congruent to ``phase`` modulo 4096, so that a read
    from a file offset with that phase needs no staging copy for O_DIRECT.

    Large ones are mappings of their own in transparent huge pages (fewer, larger DMA
    segments, and freeing one returns its memory to the system at once, where malloc's
    heap could keep it). By default their pages are left for the engine's workers to
    fault in, each the part it reads, in parallel; ``populate`` faults them in here,
    which pays when the caller does it while earlier reads are in flight (measured:
    JAX restores, one box read at a time, 1.1 GB/s populating here, 1.4 leaving it)."""
    if nbytes >= _OWN_MAPPING:
        base, _ = _native.alloc_pinned(nbytes + ALIGNMENT, lock=False)
    else:
        base = np.empty(nbytes + 2 * ALIGNMENT, np.uint8)
    if populate:
        _native.populate(base.ctypes.data, base.nbytes)
    start = (phase - base.ctypes.data) % ALIGNMENT
    return base[start:start + nbytes]


def aligned_copy(array: Any) -> np.ndarray:
    """A C-ordered copy of ``array`` in page-aligned memory (see :func:`aligned_empty`),
    which O_DIRECT writes take without a staging copy."""
    source = np.asarray(array)
    out = aligned_empty(source.nbytes).view(source.dtype).reshape(source.shape)
    np.copyto(out, source)
    return out


def item_aligned(array: np.ndarray) -> np.ndarray:
    """``array``, or where its elements are not aligned to their size (a tensor at an odd
    offset in another writer's file, read with the file's phase) a copy in aligned memory:
    numpy marks such arrays unaligned, and kernels that assume alignment fault on ARM."""
    return array if array.flags.aligned else aligned_copy(array)


def aligned_copies(arrays: Sequence[Any]) -> list[np.ndarray]:
    """:func:`aligned_copy` of each array, several at a time: the copies (and the page
    faults of their new memory) run without the GIL, so they take every core."""
    if len(arrays) < 2:
        return [aligned_copy(a) for a in arrays]
    with ThreadPool(min(len(arrays), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(aligned_copy, arrays))


class WholeReads:
    """Whole tensors of one file read into new memory in few large requests, each
    started when the first of its tensors is asked for, so that a caller keeping a
    bounded window of reads in flight still reads neighbours together.

    A JAX restore of 4096 leaves of 512 KiB cost 0.44-0.50 CPU-s/GB with one request
    per leaf (per-request Python, wake-ups and submissions), 0.33-0.35 this way;
    :meth:`ShardReader.read_many` of the same file, 0.23 (docs/architecture.md).
    """

    def __init__(self, reader: "ShardReader", names: list[str], populate: bool) -> None:
        self.reader, self.populate = reader, populate
        self._runs = reader._chunks(names)
        self._run_of = {n: i for i, run in enumerate(self._runs) for n in run}
        self._started: dict[int, tuple[IOFuture, dict[str, np.ndarray]]] = {}
        self._landed: dict[int, dict[str, np.ndarray | CorruptCheckpointError]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._run_of

    def start(self, name: str) -> Callable[[], np.ndarray]:
        """Starts the request that holds tensor ``name`` (unless it has started); the
        function returned waits for it, verifies the tensor and returns it."""
        number = self._run_of[name]
        if number not in self._started:
            self._started[number] = self.reader._start_run(self._runs[number], self.populate)

        def finish() -> np.ndarray:
            tensor = self._verified_run(number)[name]
            if isinstance(tensor, CorruptCheckpointError):
                raise tensor
            return tensor
        return finish

    def _verified_run(self, number: int) -> dict[str, np.ndarray | CorruptCheckpointError]:
        """The tensors of run ``number``, typed, or for each that fails its checksum the
        error, once the run has landed: all hashed one after another as they lie in
        memory. Hashed leaf by leaf, between the caller's work on each, a JAX restore of
        4096 x 512 KiB spent 0.18-0.20 s in xxh3, against 0.15 for ``read_many``
        (docs/architecture.md)."""
        landed = self._landed.get(number)
        if landed is None:
            future, views = self._started[number]
            future.result()
            landed = {}
            for name, view in views.items():
                try:
                    landed[name] = item_aligned(self.reader._typed(name, self.reader._verified(name, view, True)))
                except CorruptCheckpointError as exc:
                    landed[name] = exc
            self._landed[number] = landed
        return landed


class MappedReads:
    """Tensors :meth:`ShardReader.map_many` mapped, handed out as :class:`WholeReads`
    hands out its reads."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self._arrays = arrays

    def __contains__(self, name: object) -> bool:
        return name in self._arrays

    def start(self, name: str) -> Callable[[], np.ndarray]:
        array = self._arrays[name]
        return lambda: array


class SharedChunks:
    """Stored tensors read whole, each once, for the boxes that take parts of them, so that
    a verifying reader checks their checksums (which cover whole tensors): what a load
    onto another sharding than the save's passes to :meth:`ShardReader.read_box`.

    A tensor's read starts with the first box that takes a part of it; each box's
    ``result()`` copies its part out of the verified tensor, and after the last started
    box's copy the tensor's memory goes. Boxes started before any of them finishes share
    one read; a box started after the last one finished reads the tensor again.
    """

    def __init__(self) -> None:
        self._chunks: dict[tuple[ShardReader, str], _SharedChunk] = {}
        self.started_bytes = 0  # of every tensor read whole here so far
        self.held_bytes = 0  # of those that a started box still needs

    def start(self, reader: "ShardReader", name: str, where: tuple[slice, ...], dest: np.ndarray | None,
              shape: tuple[int, ...]) -> BoxRead:
        """The part ``where`` (of ``shape``) of tensor ``name`` of ``reader``, copied into
        ``dest`` or new memory once the whole tensor, read once for every box, passed its checksum."""
        key = (reader, name)
        shared = self._chunks.get(key)
        if shared is None:
            info = reader.info(name)
            whole = reader.read_box(name, (0,) * len(info.shape), info.shape)
            shared = self._chunks[key] = _SharedChunk(whole, info.nbytes)
            self.started_bytes += info.nbytes
            self.held_bytes += info.nbytes
        shared.boxes_left += 1

        def take() -> np.ndarray:
            try:
                part = shared.read.result()[where]
                return _copy_items(part, np.empty(shape, part.dtype) if dest is None else dest)
            finally:
                shared.boxes_left -= 1
                if shared.boxes_left == 0:
                    shared.read = None  # the tensor's memory goes once no box needs it
                    self.held_bytes -= shared.nbytes
                    if self._chunks.get(key) is shared:
                        del self._chunks[key]

        return BoxRead(shared.read.future, True, take)


@dataclass
class _SharedChunk:
    """A stored tensor read whole for the boxes that take parts of it (:class:`SharedChunks`)."""

    read: BoxRead | None
    nbytes: int
    boxes_left: int = 0


class ShardReader:
    """Reads tensors from a safetensors file, validating the header before trusting it.

    Reads one, some or all tensors in parallel, into new aligned arrays or into
    caller-given destinations, and verifies each tensor's checksum (files written
    by tensorferry carry them) unless ``verify=False``. Truncated, corrupt or
    hostile files raise :class:`CorruptCheckpointError`.
    """

    _ahead: "_ReadAhead | None" = None  # read_ahead's, until read_many takes it
    _ahead_landing: "_ReadAhead | None" = None  # the one read_many is taking from (for cancel)

    def __init__(self, path: str | os.PathLike, engine: Engine | None = None, *, verify: bool = True,
                 chunk_size: int = 64 << 20, header_vouched: bool = False, ends_at_last_tensor: bool = True) -> None:
        self.path = os.fspath(path)
        # A checkpoint's shard (``header_vouched``) has its header checked against the
        # manifest instead, which lets files written before header checksums be read.
        self.header_vouched = header_vouched
        # Bytes after the last tensor are refused, as safetensors refuses them, unless the file
        # is read as a stream is (a file object's, which its caller may have written on after a save).
        self.ends_at_last_tensor = ends_at_last_tensor
        self.engine = engine or default_engine()
        self.verify = verify
        self.chunk_size = chunk_size
        self._slabs = _Slabs()
        self._started: list[IOFuture] = []  # read_many's reads, while it waits for them (cancel)
        self._cancelled = False
        self._file = File(self.path, "r")
        try:
            self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def _corrupt(self, why: str, prefix: bytes = b"") -> CorruptCheckpointError:
        """The error for a file that fails to parse, saying what it is instead where its
        first bytes (``prefix``) are those of another format."""
        foreign = foreign_format(bytes(prefix))
        if foreign is not None:
            return CorruptCheckpointError(f"{self.path}: not a safetensors file but {foreign}")
        return CorruptCheckpointError(f"{self.path}: {why}")

    def _parse_header(self) -> None:
        self.size = self._file.size
        if self.size < 8:
            raise self._corrupt(f"{self.size} bytes is too short for a safetensors header")
        prefix = bytearray(8)
        self.engine.read(prefix, self._file, 0)
        length = self._header_length(prefix, self.size, "file")
        raw = bytearray(8 + length)
        self.engine.read(raw, self._file, 0)
        data_end = self._take_header(bytes(raw), self.size - 8 - length)
        trailing = self.size - self.data_start - data_end
        if trailing and self.ends_at_last_tensor:
            raise self._corrupt(f"the file goes on {trailing} bytes after its last tensor (written in place over "
                                "a longer file, or appended to?): safetensors refuses it too")

    def _header_length(self, prefix: bytes, size: int | None, what: str) -> int:
        """The header length the first 8 bytes give, once it fits a ``size``-byte ``what``."""
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise self._corrupt(f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte cap", prefix)
        if size is not None and 8 + length > size:
            raise self._corrupt(f"header length {length} runs past the end of the {size}-byte {what}", prefix)
        return length

    def _take_header(self, raw: bytes, data_size: int) -> int:
        """Parses the header ``raw`` (its 8-byte length included), for a data section of
        ``data_size`` bytes, which its tensors must lie in; returns where in it the last
        tensor's bytes end."""
        prefix = raw[:8]
        if raw[8:9] != b"{" and foreign_format(prefix) is not None:
            raise self._corrupt("the header is not a JSON object", prefix)
        self.header_bytes = raw
        sealed_with, intact = self._header_checksum()
        try:
            metadata = self._parse_entries(data_size)
        except CorruptCheckpointError:
            if not intact:  # damage to the JSON is named as such
                raise self._corrupt("the header does not match its checksum: it is damaged") from None
            raise
        unsealed = sealed_with is None and not self.header_vouched and any(key.startswith("tensorferry.")
                                                                           for key in metadata)
        if not intact or unsealed:
            if not self._laid_out_by_another_writer(data_size):
                raise self._corrupt("the header does not match its checksum: it is damaged" if not intact else
                                    f"the header has tensorferry keys but no {HEADER_CHECKSUM_KEY}: it is damaged "
                                    "(or was written by an older tensorferry, before files carried one)")
            self._drop_stale_keys(metadata, f"does not match its {HEADER_CHECKSUM_KEY}" if not intact else
                                  f"lacks {HEADER_CHECKSUM_KEY} though it has tensorferry keys")
        elif metadata.pop(HEADER_CHECKSUM_KEY, None) != sealed_with:
            raise self._corrupt(f"{HEADER_CHECKSUM_KEY} is not where the format puts it")
        checksums = metadata.pop(CHECKSUMS_KEY, None)
        if checksums is not None:
            self._attach_checksums(checksums)
        self.metadata: dict[str, str] = metadata
        return max((t.end for t in self.tensors.values() if t.nbytes), default=0)

    def _parse_entries(self, data_size: int) -> dict[str, Any]:
        """Parses the header's JSON into ``self.tensors``, each entry checked against the
        ``data_size``-byte data section; returns its ``__metadata__``."""
        header = parse_json(self.header_bytes[8:], "header", self.path)
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._corrupt("__metadata__ must map strings to strings")
        self.data_start = len(self.header_bytes)
        self.tensors = {name: self._validate(name, entry, data_size) for name, entry in header.items()}
        if self.header_bytes.count(b'"data_offsets"') != len(self.tensors):  # a key, never inside a string
            self._refuse_named_twice()
        spans = sorted((t.begin, t.end, n) for n, t in self.tensors.items() if t.nbytes)
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise self._corrupt(f"tensors {a!r} and {b!r} overlap")
        return metadata

    def _laid_out_by_another_writer(self, data_size: int) -> bool:
        """Whether a header that tensorferry's keys do not vouch for is another writer's
        whole header, not tensorferry's damaged: its data does not start on the 4096-byte
        boundary where tensorferry starts it (damage inside a header leaves its length be),
        and its tensors fill the data section without a hole, to the end of the file (a
        changed length would leave them short of it, or past it). A checkpoint's shard
        is never another writer's: its manifest holds the header's checksum."""
        if self.header_vouched or len(self.header_bytes) % ALIGNMENT == 0:
            return False
        end = 0
        for t in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if t.begin != end:
                return False
            end = t.end
        return end == data_size or data_size == sys.maxsize  # a stream of unknown length: no end to check

    def _drop_stale_keys(self, metadata: dict[str, str], why: str) -> None:
        """Reads a file that another tool rewrote, carrying tensorferry's metadata over (as
        ``metadata = f.metadata(); save_file(tensors, out, metadata=metadata)`` does), as
        the safetensors file it now is: its checksums no longer describe it and are left
        out, and so is its structure where the tensors it names are no longer the file's."""
        for key in (HEADER_CHECKSUM_KEY, CHECKSUMS_KEY):
            metadata.pop(key, None)
        dropped = ""
        if STRUCTURE_KEY in metadata:
            try:
                check_structure(parse_json(metadata[STRUCTURE_KEY], STRUCTURE_KEY, self.path), self.path, self.tensors)
            except CorruptCheckpointError as exc:
                del metadata[STRUCTURE_KEY]
                dropped = f"; its {STRUCTURE_KEY} no longer fits its tensors ({exc}) and is left out"
        warnings.warn(f"{self.path} was rewritten by another tool that carried tensorferry's metadata over: its header "
                      f"{why}, and is another writer's (its data starts at byte {self.data_start}, where tensorferry's "
                      f"starts on a {ALIGNMENT}-byte boundary), with every tensor in place. It is read as a plain "
                      "safetensors file, its tensors unverified: the checksums carried over no longer describe "
                      f"them{dropped}", RewrittenFileWarning, stacklevel=2)

    def _refuse_named_twice(self) -> None:
        """Refuses a header that names a tensor twice, as safetensors does: ``json.loads``
        keeps the last entry, and the bytes of the others would go unnoticed. Called only
        where the header holds more ``"data_offsets"`` keys than it lists tensors."""
        pairs = json.loads(self.header_bytes[8:], object_pairs_hook=lambda pairs: pairs)
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise self._corrupt(f"the header names tensor {name!r} twice")
            seen.add(name)

    def _validate(self, name: str, entry: Any, data_size: int) -> TensorInfo:
        dtype, shape, begin, end = check_tensor_entry(self.path, name, entry)
        if end > data_size:
            raise self._corrupt(f"tensor {name!r}: data_offsets {[begin, end]} fall outside the "
                                f"{data_size}-byte data section")
        return TensorInfo(dtype, shape, begin, end)

    def _header_checksum(self) -> tuple[str | None, bool]:
        """The header checksum the file carries (None if it has none), and whether the
        header matches it (a header without one does)."""
        raw = self.header_bytes
        at = raw.find(_HEADER_CHECKSUM_MARK)
        if at < 0:
            return None, True
        start = at + len(_HEADER_CHECKSUM_MARK)
        stored = raw[start:start + _DIGEST_CHARS]
        zeroed = raw[:start] + b"0" * _DIGEST_CHARS + raw[start + _DIGEST_CHARS:]
        return stored.decode("ascii", "replace"), digest(zeroed).encode() == stored

    def _attach_checksums(self, text: str) -> None:
        digests = parse_json(text, CHECKSUMS_KEY, self.path)
        if not isinstance(digests, dict) or set(digests) != set(self.tensors):
            raise self._corrupt(f"{CHECKSUMS_KEY} does not list exactly the file's tensors")
        for name, d in digests.items():
            if not isinstance(d, str):
                raise self._corrupt(f"checksum of {name!r} is not a string")
            info = self.tensors[name]
            self.tensors[name] = TensorInfo(info.dtype, info.shape, info.begin, info.end, d)

    @property
    def end(self) -> int:
        """Where the last tensor's bytes end: how far into its file or stream the saved object goes."""
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)

    @property
    def checksum(self) -> str:
        """The file's checksum (xxh3-64 of its header, which lists every tensor's checksum)."""
        return digest(self.header_bytes)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shard_info(self) -> ShardInfo:
        """What :meth:`ShardWriter.close` returned for this file, read back from it."""
        return ShardInfo(self.path, self.size, self.checksum, dict(self.tensors))

    def buffer_for(self, name: str, start: int, nbytes: int) -> np.ndarray:
        """A new array that reading ``nbytes`` of tensor ``name`` from byte ``start``
        can fill without a staging copy (small ones carved from shared slabs)."""
        phase = (self.data_start + self.info(name).begin + start) % ALIGNMENT
        if nbytes >= _OWN_MAPPING:
            return aligned_empty(nbytes, phase)
        return self._slabs.take(nbytes, phase)

    def pread(self, name: str, out: Any, start: int = 0) -> IOFuture:
        """Starts reading bytes ``[start, start + len(out))`` of tensor ``name`` into ``out``.

        Partial reads are not checksummed (the checksum covers whole tensors); see
        :meth:`check_checksum`.
        """
        t = self.info(name)
        view = byte_view(out, writable=True)
        if start < 0 or start + view.nbytes > t.nbytes:
            raise ValueError(f"{self.path}: bytes [{start}, {start + view.nbytes}) lie outside tensor "
                             f"{name!r} of {t.nbytes} bytes")
        return self.engine.pread(view, self._file, self.data_start + t.begin + start, view.nbytes)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} holds no tensor {name!r}") from None

    def read_ahead(self, nbytes: int) -> None:
        """Starts reading the first ``nbytes`` of the file's data into pooled buffers, for
        a load that will ask for them but does not yet know where they go. The next
        :meth:`read_many` takes the tensors it asks for into caller-given destinations
        from there, and gives the buffers back; :meth:`close` gives back what no read took."""
        if self._ahead is None and nbytes > 0:
            self._ahead = _ReadAhead(self, nbytes)

    def _take_ahead(self) -> "_ReadAhead | None":
        ahead, self._ahead = self._ahead, None
        return ahead

    def read(self, name: str, out: Any = None) -> np.ndarray:
        """One tensor, into ``out`` if given (it must have the tensor's byte size)."""
        return self.read_many([name], None if out is None else {name: out})[name]

    def read_many(self, names: Iterable[str] | None = None, out: Mapping[str, Any] | None = None,
                  *, populate: bool = True) -> dict[str, np.ndarray]:
        """Several tensors (default: all), read in parallel.

        Tensors named in ``out`` are read into those buffers (any host buffer of the
        right byte size); the others into new arrays that share large aligned blocks,
        faulted in by this thread while earlier blocks are read, unless ``populate`` is
        false: then the engine's workers fault them. Measured on 2 GiB in 4096 tensors
        (six interleaved rounds): files read by one thread each, four at once
        (``load_checkpoint``), 0.12 CPU-s/GB populating here, 0.14 not; one 2 GiB file
        read by the caller (``load``), 0.12-0.76 populating here (median 0.44), 0.11-0.31
        not (median 0.12).
        """
        names = list(self.tensors) if names is None else list(names)
        out = dict(out or {})
        infos = {n: self.info(n) for n in [*names, *out]}
        results: dict[str, np.ndarray] = {}
        pending: list[tuple[IOFuture, list[tuple[str, np.ndarray]]]] = []
        direct: list[tuple[str, np.ndarray]] = []
        staged: list[tuple[str, np.ndarray]] = []
        from_ahead: list[tuple[str, np.ndarray, int]] = []
        ahead = self._ahead  # taken below, once every destination is known good
        for name, target in out.items():
            t = infos[name]
            view = byte_view(target, writable=True)
            if view.nbytes != t.nbytes:
                raise ValueError(f"{self.path}: destination for {name!r} has {view.nbytes} bytes, "
                                 f"the tensor {t.nbytes}")
            results[name] = target
            begin = self.data_start + t.begin
            if ahead is not None and ahead.covers(begin, begin + t.nbytes):
                from_ahead.append((name, view, begin))
            else:
                (direct if self._direct_into(view, begin) else staged).append((name, view))
        # Each read is listed in _started as it starts, so that cancel() from another
        # thread reaches it; one cancelled before it started is not started at all.
        self._started = started = []
        self._ahead_landing = self._take_ahead()
        try:
            for group in self._direct_groups(direct):
                if self._cancelled:
                    break
                future = self.engine.pread_many([(view, self.data_start + infos[n].begin) for n, view in group],
                                                self._file)
                pending.append((future, group))
                started.append(future)
            if (staged or from_ahead) and not self._cancelled:
                _StagedReads(self, staged, ahead, from_ahead).run()
            for run in self._chunks([n for n in names if n not in out]):
                if self._cancelled:
                    break
                # Faulted in now (with ``populate``), while the runs before it are being read.
                future, views = self._start_run(run, populate)
                pending.append((future, list(views.items())))
                started.append(future)
                results.update((n, self._typed(n, v)) for n, v in views.items())
            if self._cancelled:  # the reads started are cancelled below, with those of a failure
                raise TensorferryIOError(errno.ECANCELED, "read cancelled", self.path)
            for future, views in pending:  # verify each block as it lands, while later ones fly
                future.result()
                if self.verify:
                    for n, v in views:
                        self.check_checksum(n, v)
        except OSError:  # a read failed: the rest stop, and are over before the error goes up
            self.cancel()
            for f, _ in pending:
                f.wait()
            raise
        except BaseException:  # interrupted (Ctrl-C), or a checksum failed: what was not issued is not read
            self.cancel()
            raise
        finally:
            self._started, self._cancelled, self._ahead_landing = [], False, None
            if ahead is not None:
                ahead.close()
        return {n: a if n in out else item_aligned(a) for n, a in results.items()}

    def cancel(self) -> None:
        """Stops the reads :meth:`read_many` has started and not yet issued, or is about
        to start, as when its caller is interrupted; it may be called from another thread
        (one that reads several files at once, interrupted itself). Reads in flight finish,
        their buffers held by the engine until then; :meth:`read_many` raises ``ECANCELED``.
        Called between reads, it cancels the next one (a worker about to start it)."""
        self._cancelled = True
        for future in list(self._started):
            future.cancel()
        for ahead in (self._ahead, self._ahead_landing):
            if ahead is not None:
                ahead.cancel()

    def map_many(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Several tensors (default: all) as arrays over one private, copy-on-write mapping
        of the file: their pages are the page cache's, read in by the kernel, so no new
        memory is zeroed and nothing is copied (writes to an array copy only the pages
        written, and never reach the file). About half of :meth:`read_many`'s CPU
        (docs/architecture.md).

        A helper thread reads the pages in (``MADV_POPULATE_READ``), ``MAPPED_SLICE`` bytes
        at a time in file order and up to ``MAPPED_AHEAD`` slices ahead, while this thread
        verifies the tensors already in. A failed read raises here, naming file, offset
        and errno, where touching the mapping would kill the process with SIGBUS; that
        needs Linux 5.14. Tensors the file does not align to their item size (files of
        other writers can) are copied out. The file must not be truncated or rewritten in
        place while the arrays live; files tensorferry writes are replaced whole.
        """
        names = list(self.tensors) if names is None else list(names)
        infos = {n: self.info(n) for n in names}
        now = os.fstat(self._file.fileno()).st_size
        if now < self.size:
            raise self._corrupt(f"{now} bytes now, {self.size} when its header was read: truncated meanwhile")
        mapping = mmap.mmap(self._file.fileno(), self.size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        whole = np.frombuffer(mapping, np.uint8)
        order = sorted((n for n in infos if infos[n].nbytes), key=lambda n: infos[n].begin)
        spans = [(self.data_start + infos[n].begin, self.data_start + infos[n].end) for n in order]
        results = {n: self._typed(n, whole[:0]) for n in infos if not infos[n].nbytes}
        slices = _slices(spans)
        with ThreadPool(1, thread_name_prefix="tensorferry-map") as helper:
            populated: list[concurrent.futures.Future] = []
            try:
                at = 0
                for name, (start, end) in zip(order, spans):
                    while at < len(slices) and slices[at][0] < end:
                        # A bounded look-ahead: pages read far ahead of the hashing could be
                        # evicted again before it reaches them, in files larger than memory.
                        while len(populated) < min(len(slices), at + MAPPED_AHEAD):
                            populated.append(helper.submit(self._populate, whole, *slices[len(populated)]))
                        populated[at].result()
                        at += 1
                    results[name] = self._viewed(name, whole[start:end])
            finally:
                for future in populated:
                    future.cancel()
        return {n: results[n] for n in names}

    def _viewed(self, name: str, raw: np.ndarray) -> np.ndarray:
        """Tensor ``name`` over its bytes ``raw``, verified (and :func:`item_aligned`)."""
        if self.verify:
            self.check_checksum(name, raw)
        return item_aligned(self._typed(name, raw))

    def _populate(self, whole: np.ndarray, begin: int, end: int) -> None:
        """Reads in the mapping's pages of bytes ``[begin, end)`` (``begin`` page-aligned)."""
        err = _native.populate_read(whole.ctypes.data + begin, end - begin)
        if err == errno.EINVAL:
            raise TensorferryIOError(err, "mapped loads need MADV_POPULATE_READ (Linux 5.14 or later) to raise "
                                     "on a failed read: load without mmap", self.path)
        if err:
            raise TensorferryIOError(err, f"reading its pages into a mapping: {os.strerror(err)}",
                                     self.path, begin, end - begin)

    def _direct_groups(self, targets: list[tuple[str, np.ndarray]]) -> list[list[tuple[str, np.ndarray]]]:
        """Destinations read straight into, in file order, grouped into requests of about
        ``DIRECT_GROUP`` bytes, one submission each (``Engine.pread_many``): ``DCPReader``
        of 4096 x 512 KiB into page-aligned tensors, median 0.24 CPU-s/GB against 0.26 with
        one request per tensor (docs/architecture.md)."""
        groups: list[list[tuple[str, np.ndarray]]] = []
        size = 0
        for name, view in sorted(targets, key=lambda nv: self.tensors[nv[0]].begin):
            if not groups or size + view.nbytes > DIRECT_GROUP:
                groups.append([])
                size = 0
            groups[-1].append((name, view))
            size += view.nbytes
        return groups

    def _start_run(self, names: list[str], populate: bool) -> tuple[IOFuture, dict[str, np.ndarray]]:
        """Starts one read of neighbouring tensors (one of :meth:`_chunks`) into one new
        aligned buffer; returns its future and each tensor's bytes, views of the buffer."""
        infos = [self.tensors[n] for n in names]
        begin, end = infos[0].begin, max(t.end for t in infos)
        buffer = aligned_empty(end - begin, (self.data_start + begin) % ALIGNMENT, populate=populate)
        future = self.engine.pread(buffer, self._file, self.data_start + begin) if buffer.nbytes else IOFuture()
        return future, {n: buffer[t.begin - begin:t.end - begin] for n, t in zip(names, infos)}

    def _typed(self, name: str, raw: np.ndarray) -> np.ndarray:
        t = self.tensors[name]
        return raw.view(to_numpy_dtype(t.dtype)).reshape(t.shape)

    def start_whole(self, names: Iterable[str], *, populate: bool = False,
                    mapped: bool = False) -> "WholeReads | MappedReads":
        """Plans reading these tensors whole into new memory as :meth:`read_many` does
        (neighbours together, in requests of up to ``chunk_size``), each request started
        only when the first of its tensors is: see :class:`WholeReads`. With ``mapped``,
        they are mapped (and verified) now, by :meth:`map_many`, and handed out alike."""
        names = [n for n in names if self.info(n).nbytes]
        return MappedReads(self.map_many(names)) if mapped else WholeReads(self, names, populate)

    def _direct_into(self, view: np.ndarray, offset: int) -> bool:
        """Whether reading file bytes from ``offset`` into ``view`` goes to the drive
        straight into ``view``: only then is the memory's phase that of the file offset
        (as O_DIRECT needs); otherwise every block would be bounced by the engine, one
        request per tensor, and hashed from memory a second time."""
        if not self._file.direct or view.nbytes < ALIGNMENT:
            return True  # buffered, or too small to matter: the plain read
        return (view.ctypes.data - offset) % self._file.memory_alignment == 0

    def _chunks(self, names: list[str]) -> list[list[str]]:
        """Groups tensors that lie next to each other into reads of about ``chunk_size``."""
        ordered = sorted(names, key=lambda n: self.tensors[n].begin)
        chunks: list[list[str]] = []
        for n in ordered:
            t = self.tensors[n]
            if chunks:
                first = self.tensors[chunks[-1][0]]
                last_end = self.tensors[chunks[-1][-1]].end
                if t.begin - last_end <= ALIGNMENT and t.end - first.begin <= self.chunk_size:
                    chunks[-1].append(n)
                    continue
            chunks.append([n])
        return chunks

    def read_box(self, name: str, offsets: Sequence[int], lengths: Sequence[int], out: Any = None,
                 shared: SharedChunks | None = None) -> BoxRead:
        """Starts reading the box ``[offsets, offsets + lengths)`` of tensor ``name`` (a
        row-major array), fetching little more than the box's own bytes: how a reader
        with another sharding than the writer's takes its part of a stored chunk.

        A box that is one contiguous byte range is read as such, straight into ``out``
        when that is contiguous memory. Any other box is read as the envelope from its
        first element to its last, or, where that would read far more than the box
        (``ENVELOPE_WASTE``), as one read per contiguous run; then copied into ``out``.
        Without ``out`` the result is a view of what was read (strided for an envelope)
        or, for runs, a new array.

        ``out`` may be an array of shape ``lengths`` whose items have the stored size,
        in any layout (a slice of a larger array, say), or any contiguous writable host
        buffer of the box's bytes (a torch tensor's, say). Checksums cover whole tensors,
        so only a box that is the whole tensor is verified, unless ``shared`` is given:
        then, when the reader verifies, a box that is part of the tensor is copied out of
        the whole tensor, read once for every box that ``shared`` started on it and checked
        (:class:`SharedChunks`). A box that does not fit in the tensor means the caller's
        record of the file and the file disagree: it raises :class:`CorruptCheckpointError`.
        """
        t = self.info(name)
        dtype = to_numpy_dtype(t.dtype)
        shape = t.shape
        offsets, lengths = tuple(int(o) for o in offsets), tuple(int(n) for n in lengths)
        whole_tensor = lengths == shape and t.nbytes and not any(offsets)
        if whole_tensor and self._ahead is not None:
            box = self._whole_from_ahead(name, out, dtype)
            if box is not None:
                return box
        if whole_tensor and out is None:
            # The whole tensor into new memory, the common case of a restore: one read, no
            # box arithmetic (which cost a JAX restore of 4096 leaves more than its reads).
            buffer = self.buffer_for(name, 0, t.nbytes)
            return BoxRead(self.pread(name, buffer), True,
                           lambda: item_aligned(self._verified(name, buffer, True).view(dtype).reshape(shape)))
        if not (len(offsets) == len(lengths) == len(shape)
                and all(o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(offsets, lengths, shape))):
            raise self._corrupt(f"the box at {list(offsets)} of size {list(lengths)} lies outside tensor "
                                f"{name!r} of shape {list(shape)}")
        dest = self._box_destination(name, out, lengths, dtype)
        needed = math.prod(lengths)
        if needed == 0:
            empty = np.empty(lengths, dtype) if dest is None else dest
            whole = t.nbytes == 0
            return BoxRead(IOFuture.completed(0), whole, lambda: self._verified(name, empty, whole))
        if shared is not None and self.verify and t.checksum is not None and not whole_tensor:
            return shared.start(self, name, tuple(slice(o, o + n) for o, n in zip(offsets, lengths)), dest, lengths)
        itemsize = dtype.itemsize
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]  # in elements
        first = sum(o * s for o, s in zip(offsets, strides))
        envelope = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) - first + 1
        whole = envelope == math.prod(shape)  # the box lies inside the tensor: it is all of it
        if envelope == needed and dest is not None and dest.flags.c_contiguous:
            return BoxRead(self.pread(name, dest, first * itemsize), whole,
                           lambda: self._verified(name, dest, whole))
        # Dimensions after k are taken whole, so each index over those before k is one run.
        k = len(shape) - 1
        while k > 0 and lengths[k] == shape[k]:
            k -= 1
        runs = math.prod(lengths[:k])
        if envelope > ENVELOPE_WASTE * needed and 1 < runs <= MAX_BOX_RUNS:
            return self._read_runs(name, first, strides, lengths, k, dtype, dest)
        buffer = self.buffer_for(name, first * itemsize, envelope * itemsize)

        def assemble() -> np.ndarray:
            self._verified(name, buffer, whole)
            box = np.lib.stride_tricks.as_strided(buffer.view(dtype), lengths, [s * itemsize for s in strides])
            return item_aligned(box) if dest is None else _copy_items(box, dest)

        return BoxRead(self.pread(name, buffer, first * itemsize), whole, assemble)

    def _whole_from_ahead(self, name: str, out: Any, dtype: np.dtype) -> BoxRead | None:
        """Tensor ``name`` whole, copied (and verified) now from the read-ahead into ``out``
        or new memory, where the read-ahead holds it and ``out`` is contiguous; else None.
        A box read of a DCP load goes this way: a CUDA target's (through pinned memory), or
        one of another dtype; the pieces stay for the boxes after it."""
        t, ahead = self.tensors[name], self._ahead
        begin = self.data_start + t.begin
        if not ahead.covers(begin, begin + t.nbytes):
            return None
        dest = self._box_destination(name, out, t.shape, dtype)
        if dest is not None and not dest.flags.c_contiguous:
            return None
        buffer = self.buffer_for(name, 0, t.nbytes) if dest is None else byte_view(dest, writable=True)
        staged, hashers = _StagedReads(self, []), {}
        for number, parts in ahead.parts([(name, buffer, begin)]):
            staged._land(*ahead.piece(number), parts, hashers)
        box = item_aligned(buffer.view(dtype).reshape(t.shape)) if dest is None else dest
        return BoxRead(IOFuture.completed(t.nbytes), True, lambda: box)

    def end_read_ahead(self) -> None:
        """Gives back the buffers of :meth:`read_ahead` now, what no read took cancelled
        (as :meth:`close` does; for a load whose remaining reads want nothing from them)."""
        ahead = self._take_ahead()
        if ahead is not None:
            ahead.close()

    def _box_destination(self, name: str, out: Any, lengths: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """``out`` of :meth:`read_box` as an array of shape ``lengths`` and the stored item size."""
        if out is None:
            return None
        if isinstance(out, np.ndarray) and out.shape == lengths:
            if out.dtype.itemsize != dtype.itemsize or not out.flags.writeable:
                raise ValueError(f"{self.path}: the destination for a box of {name!r} must be writable with "
                                 f"{dtype.itemsize}-byte items, not {out.dtype}")
            return out
        view = byte_view(out, writable=True)
        nbytes = math.prod(lengths) * dtype.itemsize
        if view.nbytes != nbytes:
            raise ValueError(f"{self.path}: the destination for a box of {name!r} has {view.nbytes} bytes, "
                             f"the box {nbytes}")
        return view.view(dtype).reshape(lengths)

    def _read_runs(self, name: str, first: int, strides: list[int], lengths: tuple[int, ...], k: int,
                   dtype: np.dtype, dest: np.ndarray | None) -> BoxRead:
        """The box as one read per index over its first ``k`` dimensions."""
        itemsize = dtype.itemsize
        run_shape = lengths[k:]
        run_bytes = math.prod(run_shape) * itemsize
        reads = []
        for outer in np.ndindex(*lengths[:k]):
            start = (first + sum(i * s for i, s in zip(outer, strides))) * itemsize
            buffer = self.buffer_for(name, start, run_bytes)
            reads.append((outer, buffer, self.pread(name, buffer, start)))
        box = np.empty(lengths, dtype) if dest is None else dest

        def assemble() -> np.ndarray:
            for outer, buffer, _ in reads:
                _copy_items(buffer.view(dtype).reshape(run_shape), box[outer])
            return box

        return BoxRead(IOFuture.gather(f for _, _, f in reads), False, assemble)

    def _verified(self, name: str, data: np.ndarray, whole: bool) -> np.ndarray:
        """``data``, once checked against tensor ``name``'s checksum if it is all of it."""
        if whole and self.verify:
            self.check_checksum(name, byte_view(data, writable=False))
        return data

    def check_checksum(self, name: str, data: Any) -> None:
        """Raises :class:`CorruptCheckpointError` if ``data`` (all of tensor ``name``'s
        bytes) does not match its checksum; files without checksums always pass."""
        expected = self.info(name).checksum
        if expected is not None and digest(data) != expected:
            raise self._mismatch(name)

    def _mismatch(self, name: str) -> CorruptCheckpointError:
        return self._corrupt(f"checksum mismatch in tensor {name!r}: the data is corrupt")

    def close(self) -> None:
        self.end_read_ahead()
        self._file.close()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReader(ShardReader):
    """A safetensors file in a file object (``io.BytesIO``, an fsspec stream), read once
    into new memory from where the stream stands through its last tensor, and left there;
    :meth:`map_many` gives the tensors as views of that memory, verified. The memory is
    faulted in a piece ahead of each read and filled by the stream's ``readinto``: 1 GiB in
    64 tensors from an ``io.BytesIO`` cost 0.21-0.32 CPU-s/GB so, against 0.64-0.72 copied
    into an in-memory file and mapped, and ``torch.load``'s 0.53-0.82 (docs/architecture.md).
    Nothing is held twice, but the memory goes back only once every tensor of the file is gone.
    :meth:`map_many` is its read: those by offset (``read_many``, ``read_box``, ``pread``)
    need a file, a :class:`ShardReader`'s."""

    def __init__(self, stream: Any, *, verify: bool = True) -> None:
        self.path = stream_name(stream)
        self.header_vouched = False
        self.verify = verify
        self._started, self._cancelled = [], False  # nothing read through the engine
        available = remaining_bytes(stream)
        prefix = read_exactly(stream, 8)
        if len(prefix) < 8:
            raise self._corrupt(f"{len(prefix)} bytes is too short for a safetensors header")
        length = self._header_length(prefix, available, "stream")
        raw = prefix + read_exactly(stream, length)
        if len(raw) < 8 + length:
            raise self._corrupt(f"header length {length} runs past the end of the {len(raw)}-byte stream", prefix)
        self._take_header(raw, sys.maxsize if available is None else available - len(raw))
        data_size = max((t.end for t in self.tensors.values()), default=0)
        self.size = len(raw) + data_size
        try:
            self._data = aligned_empty(data_size)
        except OSError as exc:  # ENOMEM: a damaged header's sizes, or a file larger than memory
            raise MemoryError(f"{self.path}: its tensors take {data_size} bytes, more memory than could be had "
                              f"({os.strerror(exc.errno or errno.ENOMEM)})") from None
        for at in range(0, data_size, STREAM_PIECE):
            piece = self._data[at:at + STREAM_PIECE]
            _native.populate(piece.ctypes.data, piece.nbytes)
            filled = fill_from(stream, piece)
            if filled < piece.nbytes:
                raise self._corrupt(f"the stream ends {data_size - at - filled} bytes before its last tensor's "
                                    f"(the data section is {data_size} bytes): truncated")

    def map_many(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Several tensors (default: all), as views of the memory the stream was read into."""
        names = list(self.tensors) if names is None else list(names)
        return {n: self._viewed(n, self._data[self.info(n).begin:self.info(n).end]) for n in names}

    def close(self) -> None:
        pass
