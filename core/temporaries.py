"""Temporary names of saves in progress, and what is left of them after a crash.

A save writes ``<target>.tmp-<token>`` (a file, or a checkpoint directory) and renames
it into place. The writer holds an exclusive ``flock`` on that temporary for as long as
it writes, so that anyone can tell a live save from the leftover of a killed one: the
lock dies with its process. Leftovers are removed by the next save to the same target
and by :func:`remove_stale_temporaries` (``prune_checkpoints(remove_unfinished=True)``,
``tensorferry clean``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from typing import Iterable

TMP_MARKER = ".tmp-"

_held_here: dict[int, str] = {}  # the temporaries this process holds, by descriptor


def hold(path: str) -> int:
    """Takes the writer's lock on a temporary file or directory; returns the descriptor
    to :func:`release` once the temporary is renamed into place or removed."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        pass  # a filesystem without flock: the save goes on, and no one can take it for a leftover
    _held_here[fd] = os.path.abspath(path)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        _held_here.pop(fd, None)
        os.close(fd)


def held_here(path: str) -> bool:
    """Whether this process holds the lock of the temporary ``path``."""
    return os.path.abspath(path) in _held_here.values()


def remove_if_stale(path: str) -> bool:
    """Removes ``path`` unless a live writer holds its lock; True if it went."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:  # a link or something else we did not make: not ours to remove
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a save in progress (or no flock here: then no one can tell)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return True
    finally:
        os.close(fd)


def stale_temporaries(root: str | os.PathLike, target: str | None = None,
                      keep: Iterable[str] = ()) -> list[str]:
    """Temporaries under ``root`` (of ``target``'s name only, if given) that no live
    writer holds, except those in ``keep``."""
    keep = {os.path.abspath(p) for p in keep}
    root = os.fspath(root)
    prefix = f"{target}{TMP_MARKER}" if target is not None else None
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        if ((prefix is not None and not entry.name.startswith(prefix)) or TMP_MARKER not in entry.name
                or os.path.abspath(entry.path) in keep):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            found.append(entry.path)
        except OSError:
            pass  # held by a running save, or no flock on this filesystem
        finally:
            os.close(fd)
    return sorted(found)


def remove_stale_temporaries(root: str | os.PathLike, target: str | None = None,
                             keep: Iterable[str] = ()) -> list[str]:
    """Removes the leftovers of killed saves under ``root`` (those of ``target``, a name
    in ``root``, only, if given), never a temporary a live writer holds nor one in
    ``keep``; returns what went."""
    return [path for path in stale_temporaries(root, target, keep) if remove_if_stale(path)]


__all__ = ["TMP_MARKER", "held_here", "hold", "release", "remove_if_stale", "remove_stale_temporaries",
           "stale_temporaries"]
