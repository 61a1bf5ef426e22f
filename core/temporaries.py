"""Temporary names of saves in progress, and what is left of them after a crash.

A save writes ``<target>.tmp-<token>`` (a file, or a checkpoint directory) and renames
it into place. The writer holds an exclusive ``flock`` on that temporary for as long as
it writes, so that anyone can tell a live save from the leftover of a killed one: the
lock dies with its process. Leftovers are removed by the next save to the same target
and by :func:`remove_stale_temporaries` (``prune_checkpoints(remove_unfinished=True)``,
``tensorferry clean``).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import sys
import threading
import time
from typing import Callable, Iterable

from .pools import ThreadPool

TMP_MARKER = ".tmp-"
NAME_MAX = 255  # bytes in a name, on Linux's filesystems
# Bytes kept, after a target's name and TMP_MARKER, for the longest tail a temporary
# adds ("replaced-" and a token): a longer name is shortened (temporary_stem).
_TAIL_ROOM = 32
_STEM_ROOM = NAME_MAX - len(TMP_MARKER) - _TAIL_ROOM
_STEM_HASH_DIGITS = 16

# The fixed token of every torch DCP save's temporary, "<path>.tmp-dcp" (adapters/pytorch/dcp.py).
DCP_TOKEN = "dcp"
# Why aside_name sets something aside; "old" is an overwrite's, without an atomic exchange
# (checkpoint.OLD_TAIL).
ASIDE_REASONS = ("replaced", "old", "pruned")
# The tails, after TMP_MARKER, of the names temporary_name gives, and no others: a random
# token (8 hex digits: a file's, ShardWriter; 12: a checkpoint directory's, PendingCheckpoint),
# DCP's fixed token, or a reason and 8 hex digits (aside_name). temporary_name refuses any
# other tail, so that every temporary made is one that is_temporary_name recognises, and a
# user's "report.tmp-final.txt" or "photos.tmp-2024/" is never taken for one.
_TAIL = re.compile(rf"[0-9a-f]{{8}}|[0-9a-f]{{12}}|{DCP_TOKEN}|(?:{'|'.join(ASIDE_REASONS)})-[0-9a-f]{{8}}")
# A token of digits alone may be a user's date ("backup.tmp-20240315"): such a temporary is
# never listed nor loaded as a checkpoint, but only its user removes it. The tokens made here
# have a letter (temporary_token); an earlier version's were all digits 1 time in 43.
_DATE_LIKE = re.compile(r"[0-9]{8}|[0-9]{12}")


def temporary_token(nbytes: int = 4) -> str:
    """A random token of ``2 * nbytes`` hex digits, with a letter among them (see ``_DATE_LIKE``)."""
    while True:
        token = secrets.token_hex(nbytes)
        if not token.isdigit():
            return token


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


def hold_new(path: str) -> int | None:
    """:func:`hold` for a temporary this process has just made; None where a concurrent
    save to the same target took it first, as a leftover, and is removing it (make another
    then). Between being made and being held a temporary is unheld: six threads
    overwriting one checkpoint failed with BlockingIOError and FileNotFoundError."""
    try:
        fd = hold(path)
    except (BlockingIOError, FileNotFoundError):
        return None
    try:
        ours = os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        ours = False
    if not ours:  # removed (and perhaps made again by another) before we held it
        release(fd)
        return None
    return fd


# Fresh temporaries made before one is held (see hold_new): more tries than this means
# something other than a concurrent save's clean-up takes them.
NEW_TEMPORARY_TRIES = 16


def release(fd: int | None) -> None:
    if fd is not None:
        _held_here.pop(fd, None)
        os.close(fd)


# Tries, 10 ms apart, at the lock of a checkpoint that another save holds for a moment: the
# one that has just renamed it into place, or sets it aside between its two renames.
_MOVE_TRIES = 500


def hold_to_move(path: str) -> int | None:
    """The writer's lock (:func:`hold`) on what stands at ``path``, taken before it is
    renamed aside, so that no clean-up takes it for a leftover under its aside name until
    :func:`release`; taken only on what is still at ``path`` once held. None where it
    cannot be held (a link; still held by another save after every try);
    ``FileNotFoundError`` where nothing is at ``path``."""
    for _ in range(_MOVE_TRIES):
        try:
            fd = hold(path)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        except FileNotFoundError:
            raise
        except OSError:  # a link (ELOOP) or something else that cannot be opened to lock
            return None
        try:
            still_there = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            release(fd)
            raise
        if still_there:
            return fd
        release(fd)  # replaced before we held it: hold what is there now
    return None


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
        _remove(path)
        return True
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Removes a file or a folder with all in it; one already gone is no error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def refuse_temporary_marker(target: str) -> None:
    """Refuses a save to a name with ``TMP_MARKER`` in it before anything is written:
    the marker is what tells a save in progress (or a killed one's leftover) from a
    checkpoint, so such a save could not be loaded, and a save to the name before the
    marker would remove it as a leftover."""
    name = os.path.basename(target.rstrip(os.sep))
    if TMP_MARKER in name:
        raise ValueError(f"{target}: a name with {TMP_MARKER!r} in it is taken for an unfinished save; "
                         "choose another name")


def temporary_stem(name: str) -> str:
    """What stands for the name ``name`` in its temporaries' names: the name itself, or,
    where it leaves no room for ``TMP_MARKER`` and a tail within NAME_MAX, its first bytes,
    ``~`` and 16 hex digits of the SHA-256 of all of it (``torch.save`` writes such names,
    and a save of them failed with ENAMETOOLONG). The hash keeps apart names alike in their
    first bytes: with the first 218 bytes alone, two such checkpoints in a folder shared
    their temporaries, and the clean-up of one removed the other set aside."""
    encoded = os.fsencode(name)
    if len(encoded) <= _STEM_ROOM:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:_STEM_HASH_DIGITS]
    return f"{_first_bytes(encoded, _STEM_ROOM - 1 - _STEM_HASH_DIGITS)}~{digest}"


def earlier_stem(name: str) -> str:
    """:func:`temporary_stem` as versions before the hash gave it: the first 218 bytes
    alone, the same for names alike in them; what the asides those versions left begin with."""
    return _first_bytes(os.fsencode(name), _STEM_ROOM)


def _first_bytes(encoded: bytes, nbytes: int) -> str:
    # Whole characters only: a name cut inside one would read, and list, with escapes in it.
    return encoded[:nbytes].decode(sys.getfilesystemencoding(), "ignore")


def temporary_name(target: str, tail: str = "") -> str:
    """``<target>.tmp-<tail>``, the name of a temporary of ``target`` (a path or a name),
    its name cut to :func:`temporary_stem`, the same for every temporary of one target,
    so that :func:`stale_temporaries` finds them all. Without ``tail``: the prefix they share."""
    if tail and not _TAIL.fullmatch(tail):
        raise ValueError(f"{tail!r} cannot end a temporary's name (a leftover of it would not be recognised): "
                         f"a token is 8 or 12 hex digits or {DCP_TOKEN!r}")
    parent, name = os.path.split(target)
    return os.path.join(parent, f"{temporary_stem(name)}{TMP_MARKER}{tail}")


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` is one :func:`temporary_name` gives: its part after the last
    ``TMP_MARKER`` is one of the tails it makes. The last: pruning an old checkpoint set
    aside (``<name>.tmp-old-<hex>``) names it ``<name>.tmp-old-<hex>.tmp-pruned-<hex>``,
    its first part cut where too long (:func:`temporary_stem`)."""
    _, marker, tail = name.rpartition(TMP_MARKER)
    return bool(marker) and _TAIL.fullmatch(tail) is not None


def is_leftover_name(name: str) -> bool:
    """Whether ``name`` is a temporary's that clean-up may remove once nobody holds it:
    :func:`is_temporary_name`, but not a token of digits alone, which may be a user's date."""
    return is_temporary_name(name) and _DATE_LIKE.fullmatch(name.rpartition(TMP_MARKER)[2]) is None


def stale_temporaries(root: str | os.PathLike, target: str | None = None,
                      keep: Iterable[str] | Callable[[], Iterable[str]] = ()) -> list[str]:
    """Temporaries under ``root`` (of ``target``'s name only, if given) that no live
    writer holds, except those in ``keep``. ``keep`` may be a function giving them, asked
    once the temporaries are found: what it names may have been made meanwhile (an old
    checkpoint an overwrite set aside, then killed, which a list made before the scan
    left out)."""
    root = os.fspath(root)
    prefix = temporary_name(target) if target is not None else None
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        if (prefix is not None and not entry.name.startswith(prefix)) or not is_leftover_name(entry.name):
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
    kept = {os.path.abspath(p) for p in (keep() if callable(keep) else keep)}
    return sorted(path for path in found if os.path.abspath(path) not in kept)


def aside_name(path: str, why: str) -> str:
    """A temporary name beside ``path`` for what is about to go (``why``: "replaced", ...)."""
    return temporary_name(path, f"{why}-{temporary_token()}")


def set_aside(path: str) -> str | None:
    """A second, temporary name (a hard link) for the regular file ``path``, so that
    replacing ``path`` frees nothing; :func:`discard_later` removes it. None, and nothing
    done, where ``path`` is not a regular file or the filesystem has no hard links."""
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    aside = aside_name(path, "replaced")
    try:
        os.link(path, aside)
    except OSError:
        return None
    return aside


_discarding: tuple[int, ThreadPool] | None = None
_discarding_lock = threading.Lock()


def discard_later(aside: str) -> concurrent.futures.Future:
    """Removes a temporary (a file or folder, under a name with ``TMP_MARKER``) on a
    background thread. Freeing the blocks of a replaced 2 GiB file held a save's commit
    0.40-0.46 s on this VM's ext4 (0.09 s of CPU); the save returns meanwhile. The
    temporary stays held until it is gone, so no other save's clean-up removes it in the
    foreground. The thread is joined at exit; a process killed first leaves a temporary
    the next save, or ``tensorferry clean``, removes."""
    global _discarding
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    if os.path.islink(aside):  # a link replaced ("latest" naming a checkpoint): the link goes, not what it names
        _remove(aside)
        return done
    try:
        lock: int | None = hold(aside)
    except FileNotFoundError:  # gone already
        return done
    except BlockingIOError:
        # Another name of the same file is held: two saves replaced the file at once and
        # each set it aside. This name is removed all the same.
        lock = None
    with _discarding_lock:
        if _discarding is None or _discarding[0] != os.getpid():  # made anew in a forked child
            _discarding = (os.getpid(), ThreadPool(1, "tensorferry-discard"))
        executor = _discarding[1]

    def remove() -> None:
        try:
            _remove(aside)
        finally:
            release(lock)

    return executor.submit(remove)


def wait_for_discards() -> None:
    """Returns once everything :func:`discard_later` was given is gone."""
    with _discarding_lock:
        executor = _discarding[1] if _discarding is not None and _discarding[0] == os.getpid() else None
    if executor is not None:
        executor.submit(lambda: None).result()


def remove_stale_temporaries(root: str | os.PathLike, target: str | None = None,
                             keep: Iterable[str] | Callable[[], Iterable[str]] = ()) -> list[str]:
    """Removes the leftovers of killed saves under ``root`` (those of ``target``, a name
    in ``root``, only, if given), never a temporary a live writer holds nor one in
    ``keep`` (as :func:`stale_temporaries` takes it); returns what went."""
    return [path for path in stale_temporaries(root, target, keep) if remove_if_stale(path)]


__all__ = ["DCP_TOKEN", "NEW_TEMPORARY_TRIES", "TMP_MARKER", "aside_name", "discard_later", "earlier_stem",
           "held_here", "hold", "hold_new", "hold_to_move", "is_leftover_name", "is_temporary_name",
           "refuse_temporary_marker",
           "release", "remove_if_stale", "remove_stale_temporaries", "set_aside", "stale_temporaries",
           "temporary_name", "temporary_stem", "temporary_token", "wait_for_discards"]
