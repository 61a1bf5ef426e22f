"""File objects where a path is expected (``load(io.BytesIO(...))``, a stream of
fsspec's), as ``torch.load`` takes them: the stream is copied in one pass into an
anonymous in-memory file (``memfd_create``) that the engine opens by path, and the load
maps that memory rather than copying it again, so a stream's bytes are held once. A file
opened for reading, at its start, is read as the file it is. (A save to a stream needs
no file: :meth:`ShardWriter.write_to`.)"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from typing import Any, Iterator

from .errors import TensorferryError

# A stream is read in pieces of this size: read whole, it would be held twice.
STREAM_PIECE = 16 << 20


def is_stream(target: Any) -> bool:
    """Whether ``target`` is a file object rather than a path."""
    return not isinstance(target, (str, bytes, os.PathLike)) and (hasattr(target, "read") or hasattr(target, "write"))


def stream_name(stream: Any) -> str:
    """What errors call a stream: its ``name`` where it has one (a file's path)."""
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) else f"<{type(stream).__name__}>"


@contextlib.contextmanager
def _errors_naming(stream: Any, path: str) -> Iterator[None]:
    """Errors of the block that name ``path`` (a /proc/self/fd link) name ``stream`` instead."""
    try:
        yield
    except TensorferryError as exc:
        if path in str(exc) and not isinstance(exc, OSError):
            raise type(exc)(str(exc).replace(path, stream_name(stream))) from None
        raise


@contextlib.contextmanager
def memory_file(stream: Any) -> Iterator[str]:
    """A path to a new, empty file in memory, gone once the block ends and nothing maps
    it. Errors that name it name ``stream`` instead."""
    fd = os.memfd_create("tensorferry-stream", os.MFD_CLOEXEC)
    path = f"/proc/self/fd/{fd}"
    try:
        with _errors_naming(stream, path):
            yield path
    finally:
        os.close(fd)


@contextlib.contextmanager
def stream_as_file(stream: Any) -> Iterator[tuple[str, bool]]:
    """For a load: a path to the bytes of ``stream`` from where it stands to its end, and
    whether they were copied into memory. A file object over a regular file at its start
    (``open(path, "rb")``) is that file, read by the engine with O_DIRECT as a path would
    be, and left at its end, as ``torch.load`` leaves it; any other is copied into a
    :func:`memory_file`."""
    own = _regular_file_at_start(stream)
    if own is not None:
        with _errors_naming(stream, own):
            yield own, False
        stream.seek(0, os.SEEK_END)
        return
    with memory_file(stream) as staged:
        copy_from_stream(stream, staged)
        yield staged, True


def _regular_file_at_start(stream: Any) -> str | None:
    # Only a file's own bytes: a gzip.GzipFile (bz2, lzma alike) answers fileno() with
    # the compressed file's descriptor, so a stream over another object goes by its reads.
    if not isinstance(getattr(stream, "raw", stream), io.FileIO):
        return None
    try:
        fd, position = stream.fileno(), stream.tell()
    except (OSError, ValueError):  # io.UnsupportedOperation is both; a closed file, ValueError
        return None
    return f"/proc/self/fd/{fd}" if position == 0 and stat.S_ISREG(os.fstat(fd).st_mode) else None


def copy_from_stream(stream: Any, path: str) -> None:
    """The rest of ``stream`` (from where it stands, as ``torch.load`` reads) into ``path``."""
    require(stream, "read", "load")
    with open(path, "wb") as out:
        while piece := stream.read(STREAM_PIECE):
            out.write(piece)


def require(stream: Any, method: str, verb: str) -> None:
    """A ``TypeError`` unless ``stream`` has ``method`` (``read`` for a load, ``write`` for a save)."""
    if not hasattr(stream, method):
        raise TypeError(f"{type(stream).__name__} has no {method}(): {verb} takes a path or a file object "
                        f"with {method}()")


__all__ = ["copy_from_stream", "is_stream", "memory_file", "require", "stream_as_file", "stream_name"]
