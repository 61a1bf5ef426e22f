"""The exception hierarchy: one base, and subclasses that are also the builtin they refine."""

from __future__ import annotations

import difflib
import errno as _errno
import os
from typing import Iterable


class TensorferryError(Exception):
    """Base of every error tensorferry raises."""


class TensorferryIOError(TensorferryError, OSError):
    """A failed or short read or write, with the file, offset, length and errno.

    ``except OSError`` catches it; ``.errno``, ``.filename``, ``.offset`` and
    ``.length`` say what failed where.
    """

    def __init__(self, err: int, message: str, path: str | None = None,
                 offset: int = 0, length: int = 0) -> None:
        where = f" at offset {offset} ({length} bytes)" if length else ""
        super().__init__(err, f"{message}{where}", path)
        self.offset = offset
        self.length = length
        self._message = message  # strerror holds the offset too: made again from this, not from it

    def naming(self, path: str) -> "TensorferryIOError":
        """The same error, naming ``path`` as the file."""
        return type(self)(self.errno, self._message, path, self.offset, self.length)

    def __reduce__(self):  # with the attributes set on it since (__notes__, say), as other exceptions keep theirs
        return (type(self), (self.errno, self._message, self.filename, self.offset, self.length), self.__dict__)


class EngineClosedError(TensorferryError, ValueError):
    """I/O was asked of an engine, file or store after its ``close()``."""


class ConfigError(TensorferryError, ValueError):
    """An invalid setting, named with the value that was refused."""


class GDSUnavailableError(TensorferryError, RuntimeError):
    """Device memory was given for I/O (or ``use_gds=True`` asked) where kvikio cannot
    take it; the message names the extra to install or the setting that turned it off."""


class CorruptCheckpointError(TensorferryError, ValueError):
    """A file or checkpoint that is truncated, inconsistent or fails its checksum, or a
    file of another format (torch.save's, say) where a safetensors file was expected."""


class CheckpointNotFoundError(TensorferryError, FileNotFoundError):
    """No complete checkpoint where one was asked for."""

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(_errno.ENOENT, message, None if path is None else os.fspath(path))

    def __str__(self) -> str:  # the message names the path: OSError's "[Errno 2] msg: 'path'" named it twice
        return self.strerror

    def __reduce__(self):  # OSError's own passes (errno, strerror, filename), which __init__ does not take
        return (type(self), (self.strerror, self.filename), self.__dict__)


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint directory was passed over (a damaged manifest, say) while looking
    for the latest: the others remain usable."""


class RetentionWarning(UserWarning):
    """A checkpoint that retention (``keep_last``, :func:`prune_checkpoints`) was to
    remove could not be (a directory without write permission, say): it is kept whole."""


class RewrittenFileWarning(UserWarning):
    """A safetensors file that another tool rewrote from one tensorferry wrote, keeping
    tensorferry's metadata keys, is read as the plain safetensors file it now is: its
    tensors unverified, as the checksums carried over no longer describe them."""


class DurabilityWarning(UserWarning):
    """A committed checkpoint is complete and in place, but making its rename durable
    (fsync of the parent directory) failed."""


def listed(names: Iterable[str], limit: int = 8) -> str:
    """``names`` quoted, the first ``limit`` of them and how many more: an error names
    what it must without printing a whole model's tensor names."""
    names = list(names)
    shown = ", ".join(map(repr, names[:limit]))
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def missing_names(where: str, what: str, missing: Iterable[str], present: Iterable[str]) -> str:
    """The message for names asked of ``where`` that it does not hold, with the held
    names closest to the first one (a renamed module, a prefix added or dropped)."""
    missing = list(missing)
    close = difflib.get_close_matches(missing[0], list(present), n=3, cutoff=0.6)
    hint = f"; closest held: {listed(close)}" if close else ""
    return f"{where} holds no {what} {listed(missing)}{hint}"
