"""File objects where a path is expected (``save(state, io.BytesIO())``, a stream of
fsspec's), as ``torch.save`` and ``torch.load`` take them: the file is made or read in
an anonymous in-memory file (``memfd_create``) that the engine opens by path, and
copied to or from the stream in one pass. A load then maps that memory rather than
copying it again, so a stream's bytes are held once."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from .errors import TensorferryError

# Copied between a stream and memory in pieces of this size (a stream of fsspec's
# buffers what it is given: one piece the size of the file would be held twice).
STREAM_PIECE = 16 << 20


def is_stream(target: Any) -> bool:
    """Whether ``target`` is a file object rather than a path."""
    return not isinstance(target, (str, bytes, os.PathLike)) and (hasattr(target, "read") or hasattr(target, "write"))


def stream_name(stream: Any) -> str:
    """What errors call a stream: its ``name`` where it has one (a file's path)."""
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) else f"<{type(stream).__name__}>"


@contextlib.contextmanager
def memory_file(stream: Any) -> Iterator[str]:
    """A path to a new, empty file in memory, gone once the block ends and nothing maps
    it. Errors that name it name ``stream`` instead."""
    fd = os.memfd_create("tensorferry-stream", os.MFD_CLOEXEC)
    path = f"/proc/self/fd/{fd}"
    try:
        yield path
    except TensorferryError as exc:
        if path in str(exc) and not isinstance(exc, OSError):
            raise type(exc)(str(exc).replace(path, stream_name(stream))) from None
        raise
    finally:
        os.close(fd)


def copy_from_stream(stream: Any, path: str) -> None:
    """The rest of ``stream`` (from where it stands, as ``torch.load`` reads) into ``path``."""
    if not hasattr(stream, "read"):
        raise TypeError(f"{type(stream).__name__} has no read(): load takes a path or a readable file object")
    with open(path, "wb") as out:
        while piece := stream.read(STREAM_PIECE):
            out.write(piece)


def copy_to_stream(path: str, stream: Any) -> None:
    """The file at ``path`` written to ``stream`` (from where it stands, as ``torch.save`` writes)."""
    if not hasattr(stream, "write"):
        raise TypeError(f"{type(stream).__name__} has no write(): save takes a path or a writable file object")
    with open(path, "rb") as source:
        while piece := source.read(STREAM_PIECE):
            stream.write(piece)


__all__ = ["copy_from_stream", "copy_to_stream", "is_stream", "memory_file", "stream_name"]
