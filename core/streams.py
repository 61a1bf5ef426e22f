"""File objects where a path is expected (``load(io.BytesIO(...))``, a stream of
fsspec's), as ``torch.load`` and ``torch.save`` take them. A file opened for reading, at
its start, is read as the file it is, and one just opened for writing is written as the
file it is; any other stream is read once into new memory by
:class:`~tensorferry.shard.StreamReader`, or written directly
(:meth:`~tensorferry.shard.ShardWriter.write_to`)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from typing import Any, Iterator

from .errors import TensorferryError, TensorferryIOError

# A stream is read in pieces of this size, each faulted in just before it is read into.
STREAM_PIECE = 16 << 20


def is_stream(target: Any) -> bool:
    """Whether ``target`` is a file object rather than a path."""
    return not isinstance(target, (str, bytes, os.PathLike)) and (hasattr(target, "read") or hasattr(target, "write"))


def stream_name(stream: Any) -> str:
    """What errors call a stream: its ``name`` where it has one (a file's path)."""
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) else f"<{type(stream).__name__}>"


@contextlib.contextmanager
def naming_stream_errors(stream: Any, doing: str) -> Iterator[None]:
    """An ``OSError`` the caller's ``stream`` raises in the block (a full disk, a dropped
    connection) as a :class:`TensorferryIOError` naming the stream, with its errno (EIO
    where it has none) and the stream's own error as ``__cause__``: alone it named
    nothing ("[Errno 28] No space left on device"). ``io.UnsupportedOperation`` (a stream
    not open for what was asked) keeps its type, the stream named. ``doing`` is what was
    asked of the stream: "reading", "writing to"."""
    try:
        yield
    except TensorferryIOError:
        raise
    except BlockingIOError as exc:  # a buffered stream over a non-blocking one, full or empty for now
        raise would_block(stream, doing) from exc
    except io.UnsupportedOperation as exc:
        raise io.UnsupportedOperation(f"{stream_name(stream)}: {exc}") from exc
    except OSError as exc:
        raise TensorferryIOError(exc.errno or errno.EIO, f"{doing} the stream failed: {exc.strerror or exc}",
                                 stream_name(stream)) from exc


def would_block(stream: Any, doing: str) -> TensorferryIOError:
    """The error for a non-blocking ``stream`` that can take or give no byte now (a socket's
    file after ``setblocking(False)``: None from ``write`` or ``readinto``). Saves and
    loads do not wait for it: what it would block on need not be a descriptor that can
    be polled. ``doing`` is as :func:`naming_stream_errors` takes it."""
    return TensorferryIOError(errno.EAGAIN, f"{doing} the stream would block: it is non-blocking, and a save or "
                              "load needs a blocking one (socket.setblocking(True))", stream_name(stream))


@contextlib.contextmanager
def _errors_naming(stream: Any, path: str) -> Iterator[None]:
    """Errors of the block that name ``path`` (a /proc/self/fd link) name ``stream`` instead."""
    try:
        yield
    except TensorferryIOError as exc:
        if exc.filename == path:
            raise exc.naming(stream_name(stream)) from None
        raise
    except TensorferryError as exc:
        if path in str(exc) and not isinstance(exc, OSError):
            raise type(exc)(str(exc).replace(path, stream_name(stream))) from None
        raise


@contextlib.contextmanager
def file_behind(stream: Any, *, for_write: bool = False) -> Iterator[str | None]:
    """For a load: a path to the file ``stream`` reads, where it is a file object over a
    regular file at its start (``open(path, "rb")``), so that the engine reads that file with
    O_DIRECT as it would by path; the caller then leaves the stream just past what it read,
    where a read through the stream would have left it (another object may follow). None
    for any other stream (:class:`~tensorferry.shard.StreamReader` reads those).
    For a save (``for_write``): a path to the file ``stream`` writes, where it is a file
    opened for writing that is still empty (``open(path, "wb")``, a ``NamedTemporaryFile``),
    so that the engine writes it as it would by path (O_DIRECT, fsynced), in place: the
    file is the caller's, so it is not replaced atomically; the stream is then left at its
    end, just past what was written. Errors of the block that name the path name the stream."""
    own = _regular_file_at_start(stream, for_write)
    if own is None:
        yield None
        return
    with _errors_naming(stream, own):
        yield own
    if for_write:
        stream.seek(0, os.SEEK_END)


def _regular_file_at_start(stream: Any, for_write: bool = False) -> str | None:
    fd = _regular_file(stream)
    try:
        # A file holding bytes goes the stream's way, written over ("r+b") or after ("ab")
        # what it holds, as torch.save writes it; the engine's open would truncate it.
        if fd is None or (for_write and (not stream.writable() or os.fstat(fd).st_size != 0)):
            return None
        at_start = stream.tell() == 0
    except (OSError, ValueError):
        return None
    link = f"/proc/self/fd/{fd}"
    # The engine opens the file again through the link, which the file's mode bits now
    # decide (a file made read-only after it was opened for writing, say): where that
    # open would fail, or /proc is not there, the stream is used as it is.
    effective = os.access in os.supports_effective_ids
    if not at_start or not os.access(link, os.W_OK if for_write else os.R_OK, effective_ids=effective):
        return None
    return link


def _regular_file(stream: Any) -> int | None:
    """The descriptor of the regular file whose own bytes ``stream`` reads, or None. Only
    ``io.FileIO`` streams count: a gzip.GzipFile (bz2, lzma alike) answers fileno() with the
    compressed file's descriptor; a pipe or a socket is no regular file."""
    if not isinstance(getattr(stream, "raw", stream), io.FileIO):
        return None
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError):  # io.UnsupportedOperation is both; a closed file, ValueError
        return None


def remaining_bytes(stream: Any) -> int | None:
    """How many bytes ``stream`` holds past where it stands, where that is known without
    reading them: an ``io.BytesIO``, a regular file, an fsspec file (its ``size``). Other
    streams are not asked, though many can seek from their end: a decompressing one (lzma,
    bz2, a zip member) would decompress itself through to answer, and again to seek back."""
    try:
        if isinstance(stream, io.BytesIO):
            # By seeking: getbuffer() would first copy a BytesIO made over bytes (which
            # shares them until then) whole, 1 GiB copied to learn its length.
            at = stream.tell()
            total = stream.seek(0, io.SEEK_END)
            stream.seek(at)
        elif isinstance(getattr(stream, "size", None), int):
            total = stream.size
        elif (fd := _regular_file(stream)) is not None:
            total = os.fstat(fd).st_size
        else:
            return None
        return total - stream.tell()
    except (OSError, ValueError):
        return None


def fill_from(stream: Any, buffer: Any) -> int:
    """Reads ``stream`` into ``buffer`` (contiguous, writable) until it is full or the
    stream ends, by ``readinto`` where the stream has it; the bytes read. A non-blocking
    stream with no bytes ready raises :func:`would_block`'s error."""
    target = memoryview(buffer).cast("B")
    readinto = getattr(stream, "readinto", None)
    filled = 0
    with naming_stream_errors(stream, "reading"):
        while filled < len(target):
            if readinto is not None:
                n = readinto(target[filled:])
            else:
                piece = stream.read(len(target) - filled)
                n = None if piece is None else len(piece)
                if n:
                    target[filled:filled + n] = piece
            if n is None:  # no bytes yet, where 0 is the end: taken for the end, it read as a truncated file
                raise would_block(stream, "reading")
            if not n:
                break
            filled += n
    return filled


def read_exactly(stream: Any, nbytes: int) -> bytes:
    """The next ``nbytes`` of ``stream`` (fewer where it ends first)."""
    out = bytearray(nbytes)
    return bytes(out[:fill_from(stream, out)])


def require(stream: Any, method: str, verb: str) -> None:
    """A ``TypeError`` unless ``stream`` has ``method`` (``read`` for a load, ``write`` for a save)."""
    if not hasattr(stream, method):
        raise TypeError(f"{type(stream).__name__} has no {method}(): {verb} takes a path or a file object "
                        f"with {method}()")


__all__ = ["STREAM_PIECE", "file_behind", "fill_from", "is_stream", "naming_stream_errors", "read_exactly",
           "remaining_bytes", "require", "stream_name", "would_block"]
