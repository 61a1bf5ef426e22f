"""Checkpoint directories: shard files plus a manifest, committed atomically.

Commit protocol: everything is written into a temporary sibling
``<dir>.tmp-<token>/``, which the writer holds locked; shard files are fsynced as they
close; the manifest ``tensorferry.json`` is written and fsynced last; the directory is
renamed to ``<dir>`` (over an existing one: exchanged with it in one atomic step) and
the parent fsynced. A directory without a manifest, or with a temporary's name, is never
loaded nor reported as latest, except the old checkpoint an interrupted overwrite left
aside where no atomic exchange exists (:func:`recoverable_checkpoints`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import gc
import json
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from .buffers import byte_view
from .dtypes import to_numpy_dtype
from .engine import Engine, absolute_local_path, default_engine, local_path
from .errors import (CheckpointNotFoundError, CheckpointSkippedWarning, CorruptCheckpointError,
                     RetentionWarning, TensorferryIOError, missing_names)
from .pools import ThreadPool
from .schema import (MANIFEST_VERSION, STEP_NUMBER, check_index, member_path, parse_json, read_small_file,
                     seal_manifest, unseal_manifest, validate_manifest)
from .shard import (CHECKSUM_ALGORITHM, DEFAULT_BUFFER_SIZE, Deferred, ShardInfo, ShardReader, ShardWriter, digest,
                    first_names, foreign_files_hint, fsync_after_commit, fsync_dir, gc_paused, subfolders_holding)
from .temporaries import (NEW_TEMPORARY_TRIES, TMP_MARKER, aside_name, discard_later, earlier_stem, held_here,
                          hold_new, hold_to_move, is_temporary_name, refuse_temporary_marker, release,
                          remove_stale_temporaries, stale_temporaries, temporary_name, temporary_stem, temporary_token)

MANIFEST = "tensorferry.json"
FORMAT_VERSION = MANIFEST_VERSION
DEFAULT_SHARD_BYTES = 512 << 20
MAX_CONCURRENT_SHARDS = 4


def default_files_per_process() -> int:
    """Shard files one process of a distributed save writes at once, by default.

    Each file's writer thread copies and hashes at about one core's pace, and the engine
    and kernel need about a core per process too: so one file per two cores of this
    process's share of the host (``LOCAL_WORLD_SIZE`` processes, as torchrun sets), at
    most ``MAX_CONCURRENT_SHARDS``. On 2 cores one file beat two and four (median ratios
    to fio 0.91, 0.73, 0.68; docs/architecture.md).
    """
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(MAX_CONCURRENT_SHARDS, len(os.sched_getaffinity(0)) // (2 * local)))


@dataclass
class PendingCheckpoint:
    """A checkpoint being written: the steps of the commit protocol, for one or many writers.

    The coordinator calls :meth:`begin`; every writer (each rank or process) writes
    its shard files under :attr:`tmp_path` (with :meth:`writer`) and hands the
    resulting :class:`ShardInfo` to the coordinator through its framework's
    collective; after the framework's barrier the coordinator calls :meth:`commit`.
    Other writers join with ``PendingCheckpoint(directory, token)``, the token being
    broadcast by the framework.
    """

    directory: str
    token: str
    _lock: int | None = field(default=None, repr=False, compare=False)
    _moved: bool = field(default=False, repr=False, compare=False)  # the temporary has left its name

    @classmethod
    def begin(cls, directory: str | os.PathLike, token: str | None = None) -> "PendingCheckpoint":
        """Creates the temporary directory (the parent must exist), held locked until
        :meth:`commit` or :meth:`abort`; removes what killed saves to the same path left
        (temporaries no live writer holds)."""
        directory = absolute_local_path(directory)
        refuse_temporary_marker(directory)
        _refuse_working_directory(directory)
        parent, name = os.path.split(directory)
        recoverable = functools.partial(_recoverable_paths, parent)
        remove_stale_temporaries(parent, name, keep=recoverable)
        for _ in range(NEW_TEMPORARY_TRIES if token is None else 1):
            pending = cls(directory, token or temporary_token(6))
            try:
                os.makedirs(pending.tmp_path)
            except FileExistsError:
                if not held_here(pending.tmp_path):
                    raise
                # Held by this process: by a save still running, or by a failed one whose
                # holder only the collector frees (the exception that ended that save keeps
                # its frames in a reference cycle). A collection tells them apart.
                gc.collect()
                remove_stale_temporaries(parent, name, keep=recoverable)
                os.makedirs(pending.tmp_path)
            pending._lock = hold_new(pending.tmp_path)
            if pending._lock is not None:
                return pending
        raise FileExistsError(f"{pending.tmp_path} was taken by another save to {directory} as it was made")

    @property
    def tmp_path(self) -> str:
        return temporary_name(self.directory, self.token)

    def writer(self, filename: str, engine: Engine | None = None, **kwargs: Any) -> ShardWriter:
        """A :class:`ShardWriter` for a file inside the temporary directory."""
        if os.sep in filename or filename in (MANIFEST, "", ".", ".."):
            raise ValueError(f"invalid shard file name {filename!r}")
        return ShardWriter(os.path.join(self.tmp_path, filename), engine, **kwargs)

    def commit(self, shards: Iterable[ShardInfo], metadata: Mapping[str, Any] | None = None,
               *, overwrite: bool = False, other_files: Iterable[str] = (),
               superseded: Callable[[], bool] | None = None) -> str:
        """Writes the manifest and renames the directory into place; returns its path.

        With ``overwrite``, an existing checkpoint of the same name is replaced only
        after the new one is complete. ``other_files`` are names of further files in
        the temporary directory (a framework's metadata) that the manifest lists with
        their size and checksum, so that :func:`read_other_file` and verification
        cover them too. ``superseded`` is asked just before the rename: True drops this
        checkpoint (aborted) and leaves what is at the path as it is.
        """
        shards = list(shards)
        others = {}
        for name in other_files:
            data = read_small_file(member_path(self.tmp_path, name))
            others[name] = {"size": len(data), "checksum": digest(data)}
        manifest = encode_manifest(shards, metadata, other_files=others)
        for shard in shards:
            path = os.path.join(self.tmp_path, os.path.basename(shard.path))
            if not os.path.isfile(path) or os.path.getsize(path) != shard.size:
                raise CorruptCheckpointError(f"{path}: missing or of the wrong size before commit")
        write_durably(os.path.join(self.tmp_path, MANIFEST), manifest)
        fsync_dir(self.tmp_path)
        if superseded is not None and superseded():
            self.abort()
            return self.directory
        if not overwrite:
            refuse_existing(self.directory)
        if not occupied(self.directory) and self._rename_into_place():
            self._committed()
        elif not overwrite:
            raise FileExistsError(f"{self.directory} exists; pass overwrite=True to replace it")
        else:
            replaced = self._replace()
            if replaced is not None:
                discard_later(replaced)
        release(self._lock)
        self._lock = None
        remove_stale_temporaries(*os.path.split(self.directory))  # an old one moved aside is one now
        return self.directory

    def _rename_into_place(self) -> bool:
        """Renames the temporary to the free name (over an empty directory, which the
        rename replaces); False where another save took the name meanwhile (then this
        one replaces it, or finds it there)."""
        try:
            os.rename(self.tmp_path, self.directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return False
        self._moved = True
        return True

    def _replace(self) -> str | None:
        """Puts the new checkpoint in place of the one at the path; returns the name the
        old one now has, a fresh one, never this save's temporary name: a token may be
        fixed (DCP's saves all write "<path>.tmp-dcp"), and the old checkpoint left there
        while its files were freed refused the next save to the path. None where nothing
        was left to replace (pruned, or set aside by another save, meanwhile)."""
        # The exchange leaves the old checkpoint under the name the new one had: a fresh
        # one, taken first. The new one stays held meanwhile (the lock is on the folder).
        swapping = aside_name(self.directory, "replaced")
        os.rename(self.tmp_path, swapping)
        self._moved = True
        in_place = False
        try:
            old = self._swap_in(swapping)
            in_place = True
            self._committed()
            return old
        finally:
            if not in_place:  # what abort() removes, under the name it took to be swapped in
                shutil.rmtree(swapping, ignore_errors=True)

    def _swap_in(self, swapping: str) -> str | None:
        try:
            if exchange(swapping, self.directory):
                return swapping
        except FileNotFoundError:  # the old one left since commit found it (pruned)
            return self._into_vacated_name(swapping)
        # No atomic exchange here: between the two renames the old checkpoint lives
        # under a name that list_checkpoints and the loaders find (recoverable_checkpoints),
        # held, so that no clean-up takes it for a leftover before the second is done.
        old = aside_name(self.directory, OLD_REASON)
        try:
            held = hold_to_move(self.directory)
        except FileNotFoundError:  # pruned, or aside between another overwrite's renames
            return self._into_vacated_name(swapping)
        try:
            try:
                os.rename(self.directory, old)
            except FileNotFoundError:
                return self._into_vacated_name(swapping)
            try:
                os.rename(swapping, self.directory)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                discard_later(old)  # the other save's checkpoint is in place: the old one is no more
                raise self._another_save_replaced() from None
        finally:
            release(held)
        return old

    def _into_vacated_name(self, swapping: str) -> None:
        """Commits into the path the old checkpoint left while this save replaced it: a
        plain rename, which puts a directory only where nothing is, or an empty directory."""
        try:
            os.rename(swapping, self.directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise self._another_save_replaced() from None

    def _another_save_replaced(self) -> FileExistsError:
        return FileExistsError(errno.EEXIST, "another save replaced the checkpoint at the same time as this one, "
                               "whose checkpoint is dropped", self.directory)

    def _committed(self) -> None:
        fsync_after_commit(self.directory)

    def abort(self) -> None:
        """Removes the temporary directory and everything in it (once: called again, it
        leaves alone what a later save with the same token made under the name)."""
        if not self._moved:  # else the name may be a later save's temporary by now
            shutil.rmtree(self.tmp_path, ignore_errors=True)
            self._moved = True
        release(self._lock)
        self._lock = None

    def __del__(self) -> None:
        # Dropped neither committed nor aborted (a framework that gave up on the save):
        # the temporary becomes a leftover that the next save or prune removes.
        release(self._lock)
        self._lock = None


def _refuse_working_directory(directory: str) -> None:
    """A checkpoint replaces what stands at its path (an empty directory; anything with
    ``overwrite``): not where that is this process's working directory or holds it, which
    would leave the process in a deleted directory (``save_checkpoint("")``, say)."""
    try:
        here = os.path.realpath(os.getcwd())
    except FileNotFoundError:  # already deleted: nothing left to protect
        return
    target = os.path.realpath(directory)
    if os.path.commonpath([here, target]) == target:
        raise ValueError(f"{directory} is this process's working directory, or holds it: a checkpoint saved there "
                         "would replace it; save into a directory of its own")


def occupied(path: str) -> bool:
    """Whether a save to ``path`` would replace something: anything there but an empty
    directory (one made for the checkpoint beforehand, as ``os.makedirs(path,
    exist_ok=True)`` before ``dcp.save`` does for torch's writer; a rename replaces it)."""
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not os.path.isdir(path):
        return True
    with os.scandir(path) as entries:
        return any(True for _ in entries)


def refuse_existing(directory: str | os.PathLike, hint: str = "pass overwrite=True to replace it") -> None:
    """Raises ``FileExistsError`` if a save to ``directory`` without overwriting could not
    commit: called before anything is written, so that a save bound to fail does not
    write its state first."""
    directory = absolute_local_path(directory)
    if resolve_checkpoint(directory) != directory:
        raise FileExistsError(f"{directory} exists (moved aside by an interrupted overwrite); {hint}")
    if occupied(directory):
        raise FileExistsError(f"{directory} exists; {hint}")


OLD_REASON = "old"  # what aside_name says of an old checkpoint an overwrite moved aside
OLD_TAIL = f"{OLD_REASON}-"
_RENAME_EXCHANGE = 2
_libc = None


def exchange(a: str, b: str) -> bool:
    """Swaps two existing paths in one atomic step (``renameat2(RENAME_EXCHANGE)``);
    False where the kernel or filesystem cannot, raises ``OSError`` for other failures."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    missing = b if err == errno.ENOENT and os.path.lexists(a) else a  # the error names the one not there
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}", missing)


def recoverable_checkpoints(root: str | os.PathLike) -> dict[str, str]:
    """Old checkpoints an overwrite moved aside (``<name>.tmp-old-<token>``, complete)
    whose own name holds nothing, by that name (one too long to fit in a temporary's, by
    what stands for it: :func:`temporary_stem`): an overwrite without an atomic exchange was
    interrupted between its two renames, and this is the checkpoint. A temporary of such
    an aside (``<name>.tmp-old-<token>.tmp-pruned-<token>``: pruned, its files not yet
    freed) is none."""
    root = local_path(root)
    found: dict[str, str] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return found
    # The stems of the names there that hold something, with an earlier version's (its asides' names); not of
    # temporaries: cut to its first 218 bytes, a long name's aside was its own stem, and never recoverable.
    taken = {stem for entry in entries if not is_temporary_name(entry.name)
             for stem in (temporary_stem(entry.name), earlier_stem(entry.name))}
    for entry in entries:
        # The first marker: a stem holds none (refuse_temporary_marker), and a later one
        # makes a temporary of the aside, what its prune left.
        name, _, tail = entry.name.partition(TMP_MARKER)
        if (not name or not tail.startswith(OLD_TAIL) or TMP_MARKER in tail or not is_temporary_name(entry.name)
                or name in taken):
            continue
        if os.path.isfile(os.path.join(entry.path, MANIFEST)):
            found[name] = entry.path
    return found


def _recoverable_paths(root: str) -> list[str]:
    return list(recoverable_checkpoints(root).values())


def _recoverable(path: str) -> bool:
    path = os.path.abspath(path.rstrip(os.sep))
    return path in {os.path.abspath(p) for p in recoverable_checkpoints(os.path.dirname(path)).values()}


def resolve_checkpoint(directory: str | os.PathLike) -> str:
    """``directory``, or where its checkpoint lives while an interrupted overwrite left
    it aside (:func:`recoverable_checkpoints`)."""
    directory = local_path(directory)
    if os.path.lexists(directory):
        return directory
    parent, name = os.path.split(os.path.abspath(directory))
    return recoverable_checkpoints(parent).get(temporary_stem(name), directory)


def encode_manifest(shards: Iterable[ShardInfo], metadata: Mapping[str, Any] | None = None, *,
                    other_files: Mapping[str, Mapping[str, Any]] | None = None) -> bytes:
    """The manifest for these shard files, JSON-encoded: files with size and checksum,
    where each tensor lives, the user's metadata (and ``other_files``, name: size and
    checksum, if any)."""
    shards = list(shards)
    files: dict[str, Any] = {}
    file_of: dict[str, str] = {}
    for shard in shards:
        name = os.path.basename(shard.path)
        if name in files:
            raise ValueError(f"two shards named {name!r}")
        files[name] = {"size": shard.size, "checksum": shard.checksum}
        for tensor_name in shard.tensors:
            if file_of.setdefault(tensor_name, name) != name:
                raise ValueError(f"tensor {tensor_name!r} is in both {file_of[tensor_name]} and {name}")
    # Compact: with an indent json.dumps leaves its C encoder for the Python one, several
    # times slower (people read manifests through `tensorferry inspect`).
    head = json.dumps({"format": "tensorferry", "format_version": FORMAT_VERSION,
                       "checksum_algorithm": CHECKSUM_ALGORITHM, "committed_at": time.time(),
                       "files": files, **({"other_files": dict(other_files)} if other_files else {}),
                       "metadata": dict(metadata or {})}, separators=(",", ":"))
    tensors = ",".join(shard.manifest_entries for shard in shards if shard.tensors)
    return seal_manifest(f'{head[:-1]},"tensors":{{{tensors}}}}}'.encode())


def build_manifest(shards: Iterable[ShardInfo], metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest for these shard files, as :func:`read_manifest` returns it."""
    return json.loads(unseal_manifest(encode_manifest(shards, metadata)))


def write_durably(path: str, data: bytes) -> None:
    """Writes a small file (a manifest, an index) and makes its contents durable;
    a failure raises :class:`TensorferryIOError` naming the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise TensorferryIOError(exc.errno or errno.EIO, f"writing {len(data)} bytes durably failed: "
                                 f"{exc.strerror or exc}", path) from exc


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; raises if ``directory`` is not one."""
    return _located_manifest(directory)[1]


def _located_manifest(directory: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """:func:`read_manifest`, with where the checkpoint was found (``directory``, or where
    an interrupted overwrite left it aside: :func:`resolve_checkpoint`)."""
    directory = os.fspath(directory)
    resolved = resolve_checkpoint(directory)
    if is_temporary_name(os.path.basename(resolved.rstrip(os.sep))) and not _recoverable(resolved):
        raise CheckpointNotFoundError(f"{directory} is an unfinished checkpoint (temporary directory)", directory)
    path = os.path.join(resolved, MANIFEST)
    try:
        return resolved, read_manifest_file(path)
    except FileNotFoundError:
        if os.path.isdir(directory):
            raise CheckpointNotFoundError(f"{directory} has no {MANIFEST}: not a complete checkpoint"
                                          f"{_hint_checkpoints_inside(directory) or foreign_files_hint(directory)}",
                                          directory) from None
        raise CheckpointNotFoundError(f"no checkpoint at {directory}", directory) from None


def _hint_checkpoints_inside(directory: str) -> str:
    """For a directory of checkpoints given as one (a run's root instead of a step of it):
    the checkpoints it holds, by name. Only looks one level down, for a manifest."""
    inside = subfolders_holding(directory, lambda path: os.path.exists(os.path.join(path, MANIFEST)))
    if not inside:
        return ""
    return (f"; it holds checkpoints ({first_names(inside)}): give one of them, "
            f"or tensorferry.latest_checkpoint({directory!r})")


def read_manifest_file(path: str | os.PathLike) -> dict[str, Any]:
    """A manifest file (what :func:`encode_manifest` wrote) once its checksum and every
    field are found sound; raises :class:`CorruptCheckpointError` otherwise, and
    ``FileNotFoundError`` if there is none."""
    data = read_small_file(path)
    body = unseal_manifest(data, path)
    return validate_manifest(parse_json(body, "manifest", path), path, sealed=body is not data)


def split_by_size(sizes: Mapping[str, int], max_shard_bytes: int, max_shards: int | None = None) -> list[list[str]]:
    """Balances named items over the fewest groups of about ``max_shard_bytes`` (at most
    ``max_shards``), largest first; never returns an empty list."""
    count = max(1, -(-sum(sizes.values()) // max_shard_bytes))
    if max_shards is not None:
        count = min(count, max_shards)
    groups: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        i = loads.index(min(loads))
        groups[i].append(name)
        loads[i] += sizes[name]
    return [g for g in groups if g] or [[]]


def _nbytes(name: str, array: Any) -> int:
    if isinstance(array, Deferred):
        return array.nbytes
    try:
        return np.asarray(array).nbytes
    except (TypeError, ValueError, RuntimeError) as exc:  # a framework's tensor numpy cannot take
        raise TypeError(f"{name}: a {type(array).__name__} is no array numpy can hold ({exc}); save a framework's "
                        "tensors through its adapter (tensorferry.adapters.pytorch.save_checkpoint, ...)") from None


@gc_paused(main_thread_only=True)  # the writes last as long as the drive takes
def save_checkpoint(directory: str | os.PathLike, arrays: Mapping[str, Any],
                    metadata: Mapping[str, Any] | None = None, *, engine: Engine | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, buffer_size: int = DEFAULT_BUFFER_SIZE,
                    overwrite: bool = False, shard_metadata: Mapping[str, str] | None = None,
                    hf_index: bool = False, superseded: Callable[[], bool] | None = None) -> str:
    """Saves named arrays (or :class:`~tensorferry.shard.Deferred` tensors, made when
    written) as a checkpoint directory, atomically; returns its path.

    A state larger than ``max_shard_bytes`` is split over several shard files,
    :func:`default_files_per_process` of them written at once (on 2 cores, one: four
    writer threads there cost 0.26 CPU-s/GB against 0.21, at the same speed, in GIL
    contention); together they stage small tensors through at most
    ``2 * buffer_size`` bytes of page-locked memory. ``metadata`` is any
    JSON-serialisable mapping. On any failure (a full disk, say) the temporary
    directory is removed and an existing checkpoint is left as it was.
    ``shard_metadata`` goes into every shard file's own header (``{"format": "pt"}``,
    which transformers asks of safetensors files); ``hf_index`` also writes
    ``model.safetensors.index.json``, so that Hugging Face loaders open the directory.
    ``superseded``: as :meth:`PendingCheckpoint.commit` takes it.
    """
    engine = engine or default_engine()
    json.dumps(dict(metadata or {}))  # fail before writing anything if it cannot be saved
    if not overwrite:
        refuse_existing(directory)
    groups = split_by_size({n: _nbytes(n, a) for n, a in arrays.items()}, max_shard_bytes)
    writers = min(default_files_per_process(), len(groups))
    pending = PendingCheckpoint.begin(directory)
    try:
        planning = threading.Lock()

        def write(index: int) -> ShardInfo:
            with pending.writer(f"shard-{index:05d}.safetensors", engine, metadata=shard_metadata,
                                buffer_size=buffer_size // writers) as w:
                with planning:
                    for name in groups[index]:
                        w.add(name, arrays[name])
                    w.plan()
            w.info.manifest_entries  # encoded now, while the other files are still being written
            return w.info

        with ThreadPool(max_workers=writers) as pool:
            infos = list(pool.map(write, range(len(groups))))
        others = []
        if hf_index:
            from .layouts.huggingface import INDEX, encode_index
            write_durably(os.path.join(pending.tmp_path, INDEX), encode_index(infos))
            others.append(INDEX)  # checksummed by the manifest, so verify covers it too
        return pending.commit(infos, metadata, overwrite=overwrite, other_files=others, superseded=superseded)
    except BaseException:
        pending.abort()
        raise


@gc_paused()
def load_checkpoint(directory: str | os.PathLike, names: Iterable[str] | None = None, *,
                    out: Mapping[str, Any] | None = None, engine: Engine | None = None,
                    verify: bool = True, mmap: bool = False) -> dict[str, np.ndarray]:
    """Loads a checkpoint's arrays (or just ``names``), reading all files in parallel.

    Tensors named in ``out`` are read in place into those buffers (numpy arrays,
    torch CPU tensors, anything on the host with the buffer protocol or DLPack),
    whose shape and dtype must match; the returned dict then holds those objects.
    By default (``names`` None) only the tensors in ``out`` are loaded if ``out`` is
    given, and all of them otherwise. A folder of another layout tensorferry reads (a
    Hugging Face folder, torch's DCP, an Orbax step) is read through :mod:`tensorferry.layouts`.
    With ``mmap``, the arrays are copy-on-write mappings of the files
    (:meth:`ShardReader.map_many`: less CPU, pages shared with the page cache) instead of
    new memory; layouts that store tensors in pieces (Orbax, DCP saved by several ranks)
    cannot be mapped.
    """
    return load_with_manifest(directory, names, out=out, engine=engine, verify=verify, mmap=mmap)[1]


def load_with_manifest(directory: str | os.PathLike, names: Iterable[str] | None = None, *,
                       out: Mapping[str, Any] | None = None, engine: Engine | None = None,
                       verify: bool = True, mmap: bool = False) -> tuple[dict[str, Any] | None, dict[str, np.ndarray]]:
    """:func:`load_checkpoint`, with the manifest the arrays were read by (None for a
    folder of another layout): what an adapter needs to rebuild the saved structure
    from the same checkpoint even if an overwrite replaces it meanwhile."""
    if mmap:
        refuse_out_when_mapped(out)
    directory = local_path(directory)
    foreign = _foreign_layout(resolve_checkpoint(directory))
    if foreign is not None:
        with foreign.open(engine=engine, verify=verify) as source:
            return None, source.read(names, out, mmap=mmap)
    tries = 0
    while True:
        tries += 1
        read_from = None  # where this try found the checkpoint, and which save's it is
        try:
            where, manifest = _located_manifest(directory)
            read_from = where, _identity(manifest)
            return manifest, _load_as_listed(where, manifest, names, out, engine, verify, mmap)
        except (CorruptCheckpointError, OSError):
            # An overwrite may have replaced the checkpoint, or moved it aside, between its
            # manifest and its files: then, and only then, it is read again, where it is now.
            if tries == OVERWRITTEN_READ_TRIES or not _moved_or_replaced(directory, read_from):
                raise


# Reads of a checkpoint that overwrites kept replacing under them (six threads
# overwriting one checkpoint while reading it: a second try failed now and then).
OVERWRITTEN_READ_TRIES = 8
# Looks, 10 ms apart, for a checkpoint that was read a moment ago and is found nowhere: between
# the two renames of an overwrite without exchange, a reader's lookups may each miss it.
_VANISHED_LOOKS = 5


def _identity(manifest: Mapping[str, Any]) -> tuple[Any, Any]:
    return manifest["files"], manifest.get("committed_at")


def _moved_or_replaced(directory: str, read_from: tuple[str, Any] | None) -> bool:
    """Whether the checkpoint at ``directory`` is now elsewhere or another save's than where
    a failed read found it (``read_from``: where, and :func:`_identity`; None where the read
    found no manifest)."""
    for look in range(_VANISHED_LOOKS if read_from is not None else 1):
        if look:
            time.sleep(0.01)
        try:
            where, manifest = _located_manifest(directory)
        except (CorruptCheckpointError, OSError):
            continue
        return (where, _identity(manifest)) != read_from
    return False


def _foreign_layout(directory: str) -> Any:
    """The layout of what ``directory`` holds when it is not one of our checkpoint
    directories but something :mod:`tensorferry.layouts` reads (a single safetensors file,
    a Hugging Face folder, torch's DCP, DCPWriter's too, an Orbax step); None otherwise."""
    if listed_by_manifest(directory):
        return None
    from .layouts import foreign_layout  # the layouts build on this module
    return foreign_layout(directory)


def listed_by_manifest(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds its tensors as its manifest lists them (one of
    :func:`save_checkpoint`'s). A folder of DCPWriter has a manifest too, but what it lists
    are the chunks DCP's items were stored in, each rank's shard of a tensor apart: read
    as listed, a tensor saved by two ranks came back as two pieces named ``w@0,0`` and
    ``w@16,0``, and a pickled object as a tensor of its bytes. Its layout assembles them."""
    from .layouts.dcp import DCP_METADATA  # the layouts build on this module
    return os.path.isfile(os.path.join(directory, MANIFEST)) and \
        not os.path.isfile(os.path.join(directory, DCP_METADATA))


def refuse_dcp_folder_without_metadata(directory: str, manifest: Mapping[str, Any]) -> None:
    """A folder of DCPWriter that lost its ``.metadata`` (copied with ``cp dir/*``, which
    leaves out names starting with a dot) would be read as listed (:func:`listed_by_manifest`):
    DCP's chunks and pickled objects as tensors, with no error."""
    from .layouts.dcp import DCP_METADATA  # the layouts build on this module
    if DCP_METADATA in manifest.get("other_files", {}) and not os.path.isfile(os.path.join(directory, DCP_METADATA)):
        raise CorruptCheckpointError(f"{directory}: its {DCP_METADATA}, which the manifest lists, is missing (a "
                                     f"copy that left out hidden files?): copy {DCP_METADATA} back beside the "
                                     "shards; without it DCP's chunks and objects cannot be told apart")


def refuse_out_when_mapped(out: Mapping[str, Any] | None) -> None:
    """A mapped load (``mmap=True``) makes new arrays over the files: it cannot also read
    into the given ``out``."""
    if out:
        raise ValueError("mmap=True makes new arrays over the files; out= reads into given ones: pass one of them")


def names_to_read(where: str, held: Mapping[str, Any], names: Iterable[str] | None,
                  out: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The tensors a load reads, in order and each once: ``names`` (by default those of
    ``out``, or else every one ``held``), then those of ``out``; and ``out`` without the
    entries tied to others: a destination ``where`` does not hold that is the very memory
    of one it does (``model.state_dict()``'s ``lm_head.weight`` and its tied embedding,
    which ``save_pretrained`` stores once) is filled by that one's read. ``KeyError``
    naming any other that ``where`` does not hold; ``ValueError`` for a destination of
    another shape or dtype than its tensor (:func:`_check_destination`)."""
    out = dict(out)
    wanted = list(dict.fromkeys([*(names if names is not None else out or held), *out]))
    missing = [n for n in wanted if n not in held]
    if missing and out:
        read_into = {_memory_of(out[n]) for n in out if n in held}
        tied = {n for n in missing if n in out and _memory_of(out[n]) in read_into}
        missing = [n for n in missing if n not in tied]
        wanted = [n for n in wanted if n not in tied]
        out = {n: d for n, d in out.items() if n not in tied}
    if missing:
        raise KeyError(missing_names(where, "tensor(s)", missing, held))
    for name, destination in out.items():
        _check_destination(where, name, *_placement(held[name]), destination)
    return wanted, out


def _placement(entry: Any) -> tuple[str, Sequence[int]]:
    """A held tensor's dtype and shape, as a manifest lists it (a dict) or a layout (a ``TensorEntry``)."""
    return (entry["dtype"], entry["shape"]) if isinstance(entry, dict) else (entry.dtype, entry.shape)


def _memory_of(destination: Any) -> tuple[str, int, int]:
    """Where a destination's bytes are (a host array's, or a device tensor's): its device,
    address and size."""
    data_ptr = getattr(destination, "data_ptr", None)
    address = data_ptr() if callable(data_ptr) else byte_view(destination, writable=False).ctypes.data
    return str(getattr(destination, "device", "cpu")), address, int(destination.nbytes)


def _load_as_listed(directory: str, manifest: Mapping[str, Any], names: Iterable[str] | None,
                    out: Mapping[str, Any] | None, engine: Engine | None, verify: bool,
                    mmap: bool = False) -> dict[str, np.ndarray]:
    tensors = manifest["tensors"]
    wanted, out = names_to_read(directory, tensors, names, out or {})
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(tensors[n]["file"], []).append(n)
    readers: list[ShardReader] = []
    try:
        for filename, names_here in by_file.items():
            readers.append(open_shard(directory, manifest, filename, engine=engine, verify=verify, names=names_here))
    except BaseException:
        for r in readers:
            r.close()
        raise

    def read(reader: ShardReader) -> dict[str, np.ndarray]:
        names_here = by_file[os.path.basename(reader.path)]
        if mmap:
            return reader.map_many(names_here)
        return reader.read_many(names_here, {n: out[n] for n in names_here if n in out})

    try:
        with ThreadPool(max_workers=min(MAX_CONCURRENT_SHARDS, max(1, len(readers)))) as pool:
            result: dict[str, np.ndarray] = {}
            with cancelled_on_interrupt(pool, readers):
                for part in pool.map(read, readers):
                    result.update(part)
    finally:
        for r in readers:
            r.close()
    return {n: result[n] for n in dict.fromkeys([*wanted, *out])}


@contextlib.contextmanager
def cancelled_on_interrupt(pool: concurrent.futures.Executor, readers: Iterable[ShardReader]) -> Iterator[None]:
    """Reads of several files on ``pool``'s threads: where this thread is interrupted
    (Ctrl-C), or one file fails, the files not started are dropped and the reads not yet
    issued cancelled, so that the pool, which is waited for, stops soon instead of
    reading every file to its end."""
    try:
        yield
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for reader in readers:
            reader.cancel()
        raise


def read_other_file(directory: str | os.PathLike, manifest: Mapping[str, Any], name: str) -> bytes:
    """The contents of a file the manifest lists among ``other_files`` (a framework's
    metadata), once its size and checksum match; a checkpoint written before
    ``other_files`` existed gives the file as it is. Raises
    :class:`CorruptCheckpointError` for a mismatch or a missing file."""
    path = member_path(directory, name)
    try:
        data = read_small_file(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    entry = manifest.get("other_files", {}).get(name)
    if entry is not None and (len(data) != entry["size"] or digest(data) != entry["checksum"]):
        raise CorruptCheckpointError(f"{path} does not match the size and checksum the manifest gives it: "
                                     "it is damaged")
    return data


def read_directory_file(directory: str | os.PathLike, name: str) -> bytes:
    """A framework's file in ``directory`` (DCP's ``.metadata``, a Hugging Face index):
    in a tensorferry checkpoint once it matches the manifest (:func:`read_other_file`),
    elsewhere as it is (``FileNotFoundError`` if missing)."""
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        return read_other_file(directory, read_manifest(directory), name)
    return read_small_file(member_path(directory, name))


def _check_destination(where: str, name: str, dtype: str, shape: Sequence[int], destination: Any) -> None:
    """Refuses a destination of ``out=`` for tensor ``name`` (of safetensors dtype ``dtype``
    and ``shape``) that has another shape or dtype: a read checks only the byte size, and
    would fill it with the bytes reinterpreted. Every load with ``out=`` comes here
    (:func:`names_to_read`), whatever the layout; it costs a lookup and two comparisons."""
    given_shape = getattr(destination, "shape", None)
    if given_shape is not None and tuple(given_shape) != tuple(shape):
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, the destination {tuple(given_shape)}")
    given = getattr(destination, "dtype", None)
    expected = to_numpy_dtype(dtype)  # first: it makes ml_dtypes' names known to numpy
    as_numpy = None if given is None else _numpy_dtype_of(given)
    if as_numpy is not None and as_numpy != expected:  # not "in (None, ...)": numpy takes None for float64
        raise ValueError(f"{where}: tensor {name!r} is {dtype}, the destination {given}")


@functools.lru_cache(maxsize=64)  # a destination's dtype is one of a few, each asked for per tensor
def _numpy_dtype_of(dtype: Any) -> np.dtype | None:
    """A destination's dtype as numpy's: numpy's and JAX's as they are, torch's by name
    (``torch.float32`` is numpy's ``float32``; bf16 and fp8 through ml_dtypes); None for
    one numpy cannot name (its byte size is still checked)."""
    for candidate in (dtype, str(dtype).rpartition(".")[2]):
        try:
            return np.dtype(candidate)
        except TypeError:
            continue
    return None


def open_shard(directory: str, manifest: Mapping[str, Any], filename: str, *, engine: Engine | None = None,
               verify: bool = True, names: Iterable[str] = (), whole_folder: bool = True) -> ShardReader:
    """A reader for one of a checkpoint's files, checked against the manifest: its size,
    its header checksum, and for each tensor in ``names`` the manifest's entry against
    the header's (:func:`check_index`). The header checksum is checked even without
    ``verify`` (which governs the tensors' checksums): it costs a hash of the header read
    already, and is what tells a file of another save (an overwrite committed since the
    manifest was read) from this one's, whose tensors a load would otherwise mix.
    ``whole_folder=False`` opens the file of a DCPWriter folder that lost its ``.metadata``
    (:func:`refuse_dcp_folder_without_metadata`), which a load refuses, as verify checks it."""
    entry = manifest["files"].get(filename)
    path = os.fspath(member_path(directory, filename))
    if whole_folder:
        refuse_dcp_folder_without_metadata(directory, manifest)
    if entry is None:
        raise CorruptCheckpointError(f"{directory}: {filename} is not listed in the manifest")
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != entry["size"]:
        raise CorruptCheckpointError(f"{path} has {size} bytes, the manifest says {entry['size']}: "
                                     "truncated or replaced")
    reader = ShardReader(path, engine, verify=verify, header_vouched=True)
    try:
        if reader.checksum != entry["checksum"]:
            raise CorruptCheckpointError(f"{path}: header checksum does not match the manifest")
        for name in names:
            check_index(reader.path, manifest["tensors"], name, reader.tensors.get(name))
    except BaseException:
        reader.close()
        raise
    return reader


class Committed(NamedTuple):
    """A complete checkpoint directly under a root: its name there, where it lives (the
    name's own path, or where an interrupted overwrite left it aside), and when its save
    committed (``time.time()``; 0.0 in manifests of before the field)."""

    name: str
    path: str
    committed_at: float


def committed_checkpoints(root: str | os.PathLike) -> list[Committed]:
    """Every complete checkpoint directly under ``root``, in no particular order
    (symbolic links to checkpoints are not counted, nor folders named with ``TMP_MARKER``);
    damaged ones are passed over with a :class:`CheckpointSkippedWarning`."""
    root = local_path(root)  # a URL's "folder" would not exist, and no checkpoint would say "start afresh"
    if not os.path.isdir(root):
        return []
    found = []
    # A link ("latest", "best") names a checkpoint and is none: counted, pruning would remove it, or what it names.
    # No save is made under a name with the marker (refuse_temporary_marker): such a folder is a save's temporary
    # or a user's own (step_2.tmp-2024), no step of the run. Counted, its tail was read as its step (2024).
    candidates = [(e.name, e.path) for e in os.scandir(root)
                  if e.is_dir(follow_symlinks=False) and TMP_MARKER not in e.name]
    for name, path in [*candidates, *recoverable_checkpoints(root).items()]:
        try:
            manifest = read_manifest(path)
        except CheckpointNotFoundError:
            continue  # an unfinished save, or a directory of something else
        except (CorruptCheckpointError, OSError) as exc:
            warnings.warn(f"skipping {path}: {exc}", CheckpointSkippedWarning, stacklevel=3)
            continue
        found.append(Committed(name, path, manifest.get("committed_at", 0.0)))
    return found


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """Complete checkpoints directly under ``root``, oldest first (symbolic links to
    checkpoints are not counted, nor folders whose name has ``.tmp-`` in it: a save's
    temporary, or a user's own, which loads when named).

    Ordered by the number that ends the directory name (``step_1000``) when every
    name has one, else by commit time.
    """
    found = committed_checkpoints(root)
    steps = [STEP_NUMBER.search(c.name) for c in found]
    if all(steps):
        keyed = [(int(m.group(1)), c.committed_at, c.path) for m, c in zip(steps, found)]
    else:
        keyed = [(c.committed_at, 0, c.path) for c in found]
    return [p for *_, p in sorted(keyed)]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under ``root``, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(root: str | os.PathLike, keep_last: int, *, remove_unfinished: bool = False,
                      wait: bool = True) -> list[str]:
    """Deletes all but the newest ``keep_last`` complete checkpoints; returns what was removed.

    With ``remove_unfinished``, what interrupted saves left under ``root`` goes too:
    temporary directories and files that no running save holds (an old checkpoint an
    interrupted overwrite moved aside counts as a checkpoint, not a leftover). With
    ``wait=False``, each pruned checkpoint leaves its name at once and its files are
    freed in the background (a training loop's retention need not wait for the drive).
    One that cannot be removed (a read-only directory, say) stays, with a
    :class:`RetentionWarning`, and is not in the list returned.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    removed = remove_checkpoints(list_checkpoints(root)[:-keep_last], wait=wait)
    if remove_unfinished:
        removed += remove_leftovers(root)
    return removed


def remove_leftovers(root: str | os.PathLike) -> list[str]:
    """Removes what killed saves and prunes left directly under ``root``: temporaries no
    running save holds, but not an old checkpoint an interrupted overwrite moved aside
    (:func:`recoverable_checkpoints`: it is the checkpoint); returns what went."""
    return remove_stale_temporaries(root, keep=functools.partial(_recoverable_paths, root))


def leftovers(root: str | os.PathLike) -> list[str]:
    """What :func:`remove_leftovers` would remove from ``root`` now (``tensorferry clean --dry-run``)."""
    return stale_temporaries(root, keep=functools.partial(_recoverable_paths, root))


def remove_checkpoints(paths: Iterable[str], *, wait: bool = True) -> list[str]:
    """Removes checkpoint directories, each leaving its name at once (renamed aside, its
    files freed in the background unless ``wait``); returns those removed. One that
    cannot be is left whole where it is, with a :class:`RetentionWarning`: a checkpoint
    half deleted would be neither kept nor gone."""
    removed, discarded = [], []
    for path in paths:
        aside = aside_name(path, "pruned")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue  # removed meanwhile (by another process's retention, say)
        except OSError as exc:
            warnings.warn(f"could not remove {path}: {exc.strerror or exc}; it is kept", RetentionWarning,
                          stacklevel=3)
            continue
        removed.append(path)
        discarded.append(discard_later(aside))
    if wait:
        for removal in discarded:
            removal.result()
    return removed


VERIFY_BATCH_BYTES = 256 << 20


def verify_shard(reader: ShardReader, progress: Callable[[int], None] | None = None) -> None:
    """Reads every tensor of a shard file, checking each checksum it carries.

    Tensors are read in batches of about ``VERIFY_BATCH_BYTES`` (memory stays near
    that, whatever the file's size); ``progress``, if given, is called with the
    bytes of each batch once checked. Raises :class:`CorruptCheckpointError`.
    """
    batch: list[str] = []
    batch_bytes = 0
    for name in sorted(reader.tensors, key=lambda n: reader.tensors[n].begin):
        batch.append(name)
        batch_bytes += reader.tensors[name].nbytes
        if batch_bytes >= VERIFY_BATCH_BYTES:
            reader.read_many(batch)
            if progress is not None:
                progress(batch_bytes)
            batch, batch_bytes = [], 0
    if batch:
        reader.read_many(batch)
        if progress is not None:
            progress(batch_bytes)


def verify_checkpoint(directory: str | os.PathLike, *, engine: Engine | None = None,
                      progress: Callable[[int], None] | None = None) -> list[str]:
    """Re-reads every file against the manifest; returns a list of problems (empty if sound).

    Each problem starts with the file's name and ``": "``. ``progress``, if given, is
    called with counts of bytes checked, which add up to the size of every file the
    manifest lists (a missing or bad file counts as checked). What else
    :func:`load_checkpoint` reads (a single safetensors file, a Hugging Face folder,
    torch's DCP, an Orbax step) is checked as ``tensorferry verify`` checks it: against
    the checksums its files carry, else for consistent headers and sizes.
    """
    directory = resolve_checkpoint(directory)
    # Where there is a manifest (DCPWriter's too), every file it lists is checked against it.
    foreign = None if os.path.isfile(os.path.join(directory, MANIFEST)) else _foreign_layout(directory)
    if foreign is not None:
        return foreign.verify(progress).problems
    manifest = read_manifest(directory)
    placed: dict[str, list[str]] = {}
    for name, entry in manifest["tensors"].items():
        placed.setdefault(entry["file"], []).append(name)
    problems = []
    for filename, entry in manifest["files"].items():
        done = 0

        def advance(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if progress is not None:
                progress(nbytes)

        try:
            # The .metadata of a DCPWriter folder is checked below, as the file to blame when it is gone.
            with open_shard(directory, manifest, filename, engine=engine, names=placed.get(filename, ()),
                            whole_folder=False) as reader:
                unlisted = set(reader.tensors) - set(placed.get(filename, ()))
                if unlisted:
                    raise CorruptCheckpointError(f"{reader.path} holds {len(unlisted)} tensor(s) the manifest "
                                                 f"does not list, such as {min(unlisted)!r}")
                advance(reader.data_start)
                verify_shard(reader, advance)
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(f"{filename}: {exc}")
        if progress is not None and entry["size"] > done:
            progress(entry["size"] - done)
    for filename in manifest.get("other_files", {}):
        try:
            read_other_file(directory, manifest, filename)
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(f"{filename}: {exc}")
    return problems


__all__ = ["MANIFEST", "Committed", "PendingCheckpoint", "build_manifest", "committed_checkpoints",
           "encode_manifest", "latest_checkpoint", "leftovers", "list_checkpoints", "load_checkpoint", "open_shard",
           "prune_checkpoints", "read_manifest", "read_manifest_file", "read_other_file", "recoverable_checkpoints",
           "refuse_dcp_folder_without_metadata", "remove_checkpoints", "remove_leftovers", "resolve_checkpoint",
           "save_checkpoint",
           "verify_checkpoint", "verify_shard", "digest", "write_durably"]
