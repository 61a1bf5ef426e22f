"""File objects where a path is expected (``load(io.BytesIO(...))``, a stream of
fsspec's), as ``torch.load`` takes them. A file opened for reading, at its start, is read
as the file it is; any other stream is read once into new memory by
:class:`~tensorferry.shard.StreamReader`, and a save writes to a stream directly
(:meth:`~tensorferry.shard.ShardWriter.write_to`)."""

from __future__ import annotations

import contextlib
import io
import os
import stat
from typing import Any, Iterator

from .errors import TensorferryError

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
def _errors_naming(stream: Any, path: str) -> Iterator[None]:
    """Errors of the block that name ``path`` (a /proc/self/fd link) name ``stream`` instead."""
    try:
        yield
    except TensorferryError as exc:
        if path in str(exc) and not isinstance(exc, OSError):
            raise type(exc)(str(exc).replace(path, stream_name(stream))) from None
        raise


@contextlib.contextmanager
def file_behind(stream: Any) -> Iterator[str | None]:
    """For a load: a path to the file ``stream`` reads, where it is a file object over a
    regular file at its start (``open(path, "rb")``), so that the engine reads that file with
    O_DIRECT as it would by path, and then leaves the stream at its end, as ``torch.load``
    does; None for any other stream (:class:`~tensorferry.shard.StreamReader` reads those).
    Errors of the block that name the path name the stream."""
    own = _regular_file_at_start(stream)
    if own is None:
        yield None
        return
    with _errors_naming(stream, own):
        yield own
    stream.seek(0, os.SEEK_END)


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


def require(stream: Any, method: str, verb: str) -> None:
    """A ``TypeError`` unless ``stream`` has ``method`` (``read`` for a load, ``write`` for a save)."""
    if not hasattr(stream, method):
        raise TypeError(f"{type(stream).__name__} has no {method}(): {verb} takes a path or a file object "
                        f"with {method}()")


__all__ = ["STREAM_PIECE", "file_behind", "is_stream", "require", "stream_name"]
