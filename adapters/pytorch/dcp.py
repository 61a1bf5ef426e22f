"""torch.distributed.checkpoint storage through the core: DCPWriter and DCPReader.

Each rank writes its items as raw tensor bytes into safetensors shard files (through
:class:`tensorferry.ShardWriter`, several files per rank written concurrently);
the coordinator writes DCP's ``.metadata`` and the tensorferry manifest, then
commits the directory atomically (:class:`tensorferry.PendingCheckpoint`). The
coordinator makes the temporary directory before DCP scatters the global plan, and
every rank writes into it only after, so the protocol rides on DCP's collectives.
Loading reads only the byte ranges each rank's plan asks for, so checkpoints reshard.

``.metadata`` holds torch's classes only (each item's place as torch's own
``_StorageInfo``: file, offset, length), so torch unpickles it where tensorferry is
not installed; the manifest lists every item's chunks (``dcp_items``), so the folder
is read from the safetensors files and the manifest alone. torch's own readers
(``FileSystemReader``, ``dcp.load(checkpoint_id=...)``, ``dcp_to_torch_save``) load
each tensor with ``torch.load``, which raw bytes are not: the tensors' storage
entries name a stream transform that torch does not know, :data:`NOT_TORCH_SAVE`, so
that those readers stop with an error that says what the folder is and how to read it.
The other way round, DCPReader reads torch's folders through torch's FileSystemReader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
import pickle
import threading
import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...checkpoint import (MANIFEST, PendingCheckpoint, default_files_per_process, open_shard, read_manifest,
                           read_other_file, refuse_dcp_folder_without_metadata, refuse_existing, resolve_checkpoint,
                           split_by_size, write_durably)
from ...config import parse_size
from ...engine import Engine, absolute_local_path
from ...errors import CorruptCheckpointError
from ...layouts.dcp import (DCP_METADATA, ITEMS_KEY, RAW_BYTES_TRANSFORM, read_dcp_metadata, refuse_lost_manifest,
                            unpickle_dcp_metadata, written_by_torch)
from ...pools import ThreadPool
from ...shard import (DEFAULT_BUFFER_SIZE, BoxRead, ShardInfo, ShardReader, SharedChunks, default_read_ahead,
                     gc_paused, write_order)
from ...temporaries import DCP_TOKEN, remove_if_stale
from .staging import DeviceToHost, leased, stage_state_dict, staging_pool
from .tensors import FROM_SAFETENSORS, refuse_wrapper_subclass, safetensors_dtype, writable_bytes

# The stream transform named by every tensor's storage entry (no "/": torch splits a
# version off there). torch's readers know no such transform and raise
# "Unknown extension name='<this text>'".
NOT_TORCH_SAVE = (f"{RAW_BYTES_TRANSFORM} (this is a tensorferry checkpoint: its tensors are raw bytes in "
                  "safetensors files, not torch.save streams; read it with dcp.load(state_dict, "
                  "storage_reader=tensorferry.adapters.pytorch.DCPReader(path)), or convert it with "
                  "'tensorferry convert PATH model.safetensors --to safetensors')")


# The temporary directory of every save is "<path>.tmp-dcp": each rank knows it from the
# path, not from the plan, because torch reuses a rank's plan of an earlier save when
# its planner caches plans (DefaultSavePlanner(enable_plan_caching=True)), and a token
# in that plan would name the earlier save's directory.
SAVE_TOKEN = DCP_TOKEN


# The saves this process coordinates, by path: the writer, the thread that planned the
# save, and the save (a writer reused for another path has moved on to another save).
# torch calls no method of the coordinator's writer after another rank's write failed, and
# that writer, kept alive by the error (a training loop's log of errors, a notebook's
# sys.last_value), holds its lock on "<path>.tmp-dcp" until a later save frees it; one
# collected has released it, and its temporary is left for a later save to remove.
_coordinating: dict[str, tuple[weakref.ref, threading.Thread, weakref.ref]] = {}
_coordinating_lock = threading.Lock()


def _forget_coordinating(pending: PendingCheckpoint) -> None:
    with _coordinating_lock:
        entry = _coordinating.get(pending.directory)
        if entry is not None and entry[2]() is pending:
            del _coordinating[pending.directory]


@dataclasses.dataclass
class _Holder:
    """The save a DCPWriter is in: the thread torch calls its steps on, and whether that
    thread is inside one of them now."""

    thread: threading.Thread
    stepping: bool = False


# A writer keeps the state of its save on itself (the path, the pending checkpoint, the files
# written), so it runs one save at a time. Two dcp.async_save calls in flight with one writer took
# each other's state: one committed the other's temporary with its own manifest, or replaced a
# good checkpoint with it. torch says nothing to a writer whose save failed outside its steps (on
# another rank, in the planner), so a save between steps may have ended: a new save takes the
# writer from it, and it fails at its next step, if any, before touching anything; one inside a
# step is saving surely, and a new save is refused.
_holders: weakref.WeakKeyDictionary[DCPWriter, _Holder] = weakref.WeakKeyDictionary()

_ONE_SAVE_AT_A_TIME = ("a DCPWriter keeps its save's state, so it runs one save at a time: make a DCPWriter for "
                       "each save that may run while another does (as FSDPCheckpointer does), or wait for the one "
                       "before")


def _save_step(begins: bool = False, ends: bool = False) -> Callable[[Callable], Callable]:
    """A DCPWriter's step of a save (torch calls a save's steps on one thread: the caller's,
    or dcp.async_save's own). ``begins``: it may be the save's first, which takes the writer;
    ``ends``: the save's last. A step that raises ends the save: torch calls nothing more of it."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def step(self: DCPWriter, *args: Any, **kwargs: Any) -> Any:
            self._enter_step(begins)
            try:
                result = method(self, *args, **kwargs)
            except BaseException:
                self._end_save()
                raise
            finally:
                self._leave_step()
            if ends:
                self._end_save()
            return result

        return step

    return decorate


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """A rank's part of the global plan: the names of its files."""

    prefix: str


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one DCP item lives: a shard file and the tensor's name inside it. What the
    ranks hand the coordinator; kept in ``.metadata`` by DCPWriters before issue 20,
    which this reader still reads."""

    file: str
    key: str


def _item_key(item: WriteItem) -> str:
    """The item's tensor name in its shard file: the FQN, plus the chunk's offsets for
    a shard of a larger tensor (so that a consolidated view can be rebuilt)."""
    index = item.index
    if item.type != WriteItemType.SHARD or index.offset is None:
        # safetensors keeps "__metadata__" for its header's own; "@" and no offsets is no chunk's name.
        return index.fqn if index.fqn != "__metadata__" else f"{index.fqn}@"
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class DCPWriter(StorageWriter):
    """A ``torch.distributed.checkpoint`` StorageWriter that writes at drive speed.

    Use as ``dcp.save(state_dict, storage_writer=DCPWriter(path))`` (or with
    ``dcp.async_save``), with or without a process group; not with
    ``use_collectives=False``, which it refuses (its coordinator commits every rank's part).
    A writer runs one save at a time: ``dcp.async_save`` calls that may be in flight together
    need a writer each (a save begun while the writer writes another is refused).

    Args:
        path: the checkpoint directory; it appears only once complete.
        engine: the :class:`tensorferry.Engine` to write with (default: shared).
        files_per_rank: shard files each rank writes concurrently (default: one per two
            cores of the rank's share of the host, at most 4; see
            :func:`tensorferry.checkpoint.default_files_per_process`).
        overwrite: replace an existing checkpoint at ``path`` (after the new one is whole).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, engine: Engine | None = None,
                 files_per_rank: int | None = None, overwrite: bool = False,
                 buffer_size: int = DEFAULT_BUFFER_SIZE) -> None:
        super().__init__()
        self.path = None if path is None else absolute_local_path(path)
        self.engine = engine
        self.files_per_rank = max(1, files_per_rank or default_files_per_process())
        self.overwrite = overwrite
        self.buffer_size = buffer_size
        self._pending: PendingCheckpoint | None = None
        self._alone = False  # the coordinator of a save of one rank
        self._written: dict[str, ShardInfo] = {}  # the files this process wrote, by name

    @_save_step(begins=True)
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = absolute_local_path(checkpoint_id)
        if self.path is None:
            raise ValueError("DCPWriter needs a path: DCPWriter(path) or dcp.save(..., checkpoint_id=path)")
        self._abandon_failed_save()
        self._written = {}

    def _enter_step(self, begins: bool) -> None:
        """Before a step: one that ``begins`` a save takes this writer, unless another thread
        is inside a step of its own save with it now (refused: that save then completes as if
        this one had not been tried); a later step of a save whose writer another save has
        taken meanwhile fails, before it touches anything."""
        me = threading.current_thread()
        with _coordinating_lock:
            holder = _holders.get(self)
            if holder is None or holder.thread is not me:
                if not begins:
                    raise RuntimeError(f"this save through a DCPWriter (on thread {me.name!r}) was overtaken: "
                                       f"another save took the writer while it ran; {_ONE_SAVE_AT_A_TIME}")
                if holder is not None and holder.stepping:
                    raise RuntimeError(f"this DCPWriter is in a save to {self.path} (on thread "
                                       f"{holder.thread.name!r}) now; {_ONE_SAVE_AT_A_TIME}")
                holder = _holders[self] = _Holder(me)
            holder.stepping = True

    def _leave_step(self) -> None:
        with _coordinating_lock:
            holder = _holders.get(self)
            if holder is not None and holder.thread is threading.current_thread():
                holder.stepping = False

    def _end_save(self) -> None:
        """The save of this thread has ended: a next one takes the writer."""
        with _coordinating_lock:
            holder = _holders.get(self)
            if holder is not None and holder.thread is threading.current_thread():
                del _holders[self]

    def _abandon_failed_save(self) -> None:
        """Removes the temporary of this writer's last save if it failed before finish()
        (torch does not tell its storage writer; it calls reset() only when given a
        checkpoint_id, so the next save's planning comes here too). FSDPCheckpointer calls
        it once dcp.save has failed: where another rank's write failed, nothing else
        released the coordinator's lock on "<path>.tmp-dcp" while the error, whose
        traceback holds this writer, was kept, and a retry of the path failed, "is held"."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.abort()
            _forget_coordinating(pending)

    @staticmethod
    def _abandon_ended_saves() -> None:
        """Frees the temporaries of the saves this process coordinated that have ended
        without finish(), whatever their path: those that failed on another rank (torch
        tells the coordinator's writer nothing; it raises CheckpointException to the
        caller), each left "<path>.tmp-dcp" with the coordinator's files in it, and a
        training loop saving each step to a new path, without a retry of that path to free
        it, filled the disk. Ended: planned on this thread, which runs one save at a time,
        or on a thread that has ended (``dcp.async_save``'s, one per save). One whose
        thread runs on may still be saving (an async save waiting for ranks still writing)
        and keeps its temporary. A save whose writer is gone has released its lock: its
        temporary goes unless another save holds it by now."""
        with _coordinating_lock:
            entries = list(_coordinating.items())
        for directory, entry in entries:
            writer, thread, pending = entry[0](), entry[1], entry[2]()
            if pending is None:
                with _coordinating_lock:
                    if _coordinating.get(directory) is entry:
                        del _coordinating[directory]
                remove_if_stale(PendingCheckpoint(directory, SAVE_TOKEN).tmp_path)
            elif (writer is not None and writer._pending is pending
                  and (thread is threading.current_thread() or not thread.is_alive())):
                writer._abandon_failed_save()

    # torch's AsyncStager protocol: ``dcp.async_save`` snapshots the state through this
    # writer rather than its default stager, which copies into pageable memory.
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        """The state's snapshot for ``dcp.async_save``: CUDA tensors copied into pinned
        memory registered with CUDA, all copies in flight at once (the training stall
        is these copies); CPU tensors cloned; other values deep-copied, as torch's own
        stager copies them."""
        return stage_state_dict(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once its copies are done."""

    def close(self) -> None:
        """Nothing to release: staging buffers go back to their pool when dropped."""

    @_save_step(begins=True)  # the first step of a save given no checkpoint_id: torch calls reset() only with one
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            # Without them each rank plans, writes and commits alone, as the only rank:
            # every rank's files were named as rank 0's and each commit replaced the last.
            raise ValueError(f"{self.path}: DCPWriter saves through DCP's collectives (one checkpoint that every "
                             "rank writes its part of), not with use_collectives=False: leave it at its default, "
                             "or save with torch's FileSystemWriter, which writes a metadata file per rank")
        self.is_coordinator = is_coordinator

    @_save_step()
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Fail on every rank before anything is written.
        if not self.overwrite:
            refuse_existing(self.path, "pass DCPWriter(..., overwrite=True) to replace it")
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                safetensors_dtype(item.tensor_data.properties.dtype, item.index.fqn)
        return plan

    @_save_step()
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._abandon_failed_save()
        self._abandon_ended_saves()
        try:
            self._pending = PendingCheckpoint.begin(self.path, SAVE_TOKEN)
        except FileExistsError:
            raise FileExistsError(
                f"{PendingCheckpoint(self.path, SAVE_TOKEN).tmp_path} is held: another save to {self.path} is "
                "running, or one that was killed left it on a filesystem without file locks (remove it then)") from None
        with _coordinating_lock:
            _coordinating[self._pending.directory] = (weakref.ref(self), threading.current_thread(),
                                                      weakref.ref(self._pending))
        self._alone = len(plans) == 1
        return [dataclasses.replace(plan, storage_data=_RankFiles(f"rank{rank:05d}"))
                for rank, plan in enumerate(plans)]

    @_save_step()
    @gc_paused(main_thread_only=True)  # the writes last as long as the drive takes
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        where: _RankFiles = plan.storage_data
        pending = PendingCheckpoint(self.path, SAVE_TOKEN)
        sizes = {_item_key(item): _planned_bytes(item) for item in plan.items}
        by_key = {_item_key(item): item for item in plan.items}
        groups = split_by_size(sizes, max(1, sum(sizes.values()) // self.files_per_rank + 1), self.files_per_rank)
        # Tensors are copied off the device (if on one) in the order the files write them,
        # each file's in turn, several copies in flight (DeviceToHost).
        tensor_keys = [key for group in groups for key in write_order(
            (k, safetensors_dtype(by_key[k].tensor_data.properties.dtype)) for k in group
            if by_key[k].type != WriteItemType.BYTE_IO)]
        stager = DeviceToHost([_resolver(by_key[k], planner) for k in tensor_keys])
        source_of = {k: stager.source(i) for i, k in enumerate(tensor_keys)}

        def write_file(number: int) -> list[WriteResult]:
            filename = f"{where.prefix}-{number:03d}.safetensors"
            results = []
            with pending.writer(filename, self.engine, buffer_size=self.buffer_size // len(groups)) as writer:
                for key in groups[number]:
                    item = by_key[key]
                    _add_item(writer, key, item, planner, source_of.get(key))
                    results.append(WriteResult(index=item.index, size_in_bytes=sizes[key],
                                               storage_data=StoredItem(filename, key)))
            self._written[filename] = writer.info
            return results

        try:
            with ThreadPool(max_workers=len(groups)) as pool:
                per_file = list(pool.map(write_file, range(len(groups))))
        except BaseException:
            # This rank's files only, the coordinator's too where other ranks write: they may still
            # be writing theirs into the temporary, and removed under them, each failed with ENOENT,
            # as if that were its own error. The temporary goes once the failure is known: at the
            # coordinator's next save (_abandon_ended_saves), or as FSDPCheckpointer abandons it.
            for number in range(len(groups)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(pending.tmp_path, f"{where.prefix}-{number:03d}.safetensors"))
            if self._pending is not None and self._alone:
                self._abandon_failed_save()
            raise
        if not self.is_coordinator:  # its last step of the save; the coordinator's is finish()
            self._end_save()
        return _done([r for results in per_file for r in results])

    @_save_step(ends=True)
    @gc_paused()
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pending = self._pending
        written = [r for rank in results for r in rank]
        headers = {}
        for name in sorted({r.storage_data.file for r in written}):
            if name in self._written:  # written here: what its writer returned, not its header read back
                headers[name] = _WrittenShard(self._written[name])
                continue
            with ShardReader(os.path.join(pending.tmp_path, name), self.engine, verify=False) as reader:
                headers[name] = reader
        items: dict[str, dict[str, Any]] = {"tensors": {}, "objects": {}}
        metadata.storage_data = {}
        for r in written:
            where: StoredItem = r.storage_data
            header = headers[where.file]
            stored = header.tensors[where.key]
            item = metadata.state_dict_metadata[r.index.fqn]
            offset = header.data_start + stored.begin
            if isinstance(item, BytesStorageMetadata):
                items["objects"][r.index.fqn] = [where.file, where.key]
                metadata.storage_data[r.index] = _StorageInfo(where.file, offset, stored.nbytes)
                continue
            entry = items["tensors"].setdefault(r.index.fqn, {
                "dtype": safetensors_dtype(item.properties.dtype), "shape": list(item.size), "chunks": []})
            entry["chunks"].append([where.file, where.key, [int(o) for o in r.index.offset], list(stored.shape)])
            metadata.storage_data[r.index] = _StorageInfo(where.file, offset, stored.nbytes, (NOT_TORCH_SAVE,))
        write_durably(os.path.join(pending.tmp_path, DCP_METADATA), pickle.dumps(metadata))
        self._pending = None
        _forget_coordinating(pending)
        try:
            pending.commit([h.shard_info() for h in headers.values()],
                           {"written_by": "tensorferry.adapters.pytorch.DCPWriter", "dcp_metadata": DCP_METADATA,
                            ITEMS_KEY: items}, overwrite=self.overwrite, other_files=[DCP_METADATA])
        except BaseException:
            pending.abort()
            raise

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _WrittenShard:
    """A shard file this process wrote, as :meth:`DCPWriter.finish` reads its header:
    re-parsing 4096 tensors' header took 0.18 s of a 1 s save."""

    def __init__(self, info: ShardInfo) -> None:
        self._info = info
        self.tensors = info.tensors
        # The data section ends the file, packed from its start without holes.
        self.data_start = info.size - max((t.end for t in info.tensors.values()), default=0)

    def shard_info(self) -> ShardInfo:
        return self._info


def _planned_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _add_item(writer: Any, key: str, item: WriteItem, planner: SavePlanner,
              source: Callable[[], np.ndarray] | None) -> None:
    if item.type == WriteItemType.BYTE_IO:
        data = planner.resolve_data(item)
        payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        writer.add(key, "U8", (len(payload),), payload)
        return
    props = item.tensor_data.properties
    writer.add(key, safetensors_dtype(props.dtype), tuple(item.tensor_data.chunk.sizes), source)


def _resolver(item: WriteItem, planner: SavePlanner) -> Callable[[], torch.Tensor]:
    """The item's tensor, resolved only when its turn comes (resolving can allocate)."""
    props = item.tensor_data.properties
    shape = tuple(item.tensor_data.chunk.sizes)

    def resolve() -> torch.Tensor:
        tensor = planner.resolve_data(item)
        refuse_wrapper_subclass(tensor, _item_key(item))
        if tuple(tensor.shape) != shape or tensor.dtype != props.dtype:
            raise ValueError(f"{_item_key(item)}: planned {props.dtype}{list(shape)}, "
                             f"resolved {tensor.dtype}{list(tensor.shape)}")
        return tensor

    return resolve


class DCPReader(StorageReader):
    """A ``torch.distributed.checkpoint`` StorageReader for checkpoints of :class:`DCPWriter`.

    ``dcp.load(state_dict, storage_reader=DCPReader(path))``. Each rank reads only
    the stored chunks its plan needs, straight into the destination tensors where the
    layout allows, and checks them against their checksums unless ``verify=False``. A
    chunk the rank takes only parts of (a load onto another sharding than the save's) is
    read whole for its checksum, once for all of the rank's parts of it: each rank reads
    every chunk it takes a part of (two ranks taking halves of each chunk read the
    checkpoint twice between them), holding at most ``default_read_ahead()`` bytes of
    such chunks at once; with ``verify=False`` only the parts' bytes are read.

    From ``set_up_storage_reader`` on, while torch plans, the rank's own shard files are
    read ahead into pooled buffers, ``read_ahead`` bytes at most (a count or ``"256M"``;
    by default :func:`~tensorferry.shard.default_read_ahead`, 0 for none): on 4096
    tensors torch's planning and the resolving of destinations leave the drive idle for
    0.2-0.3 s otherwise.

    A folder that torch's own ``FileSystemWriter`` wrote (no manifest) is read too, by
    torch's ``FileSystemReader`` (its ``.metadata`` unpickled here, through the allowlist
    of DCP's classes), so that checkpoints from before a switch to tensorferry still load.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, engine: Engine | None = None,
                 verify: bool = True, read_ahead: int | str | None = None) -> None:
        super().__init__()
        self.path = None if path is None else absolute_local_path(path)
        self.engine = engine
        self.verify = verify
        self.read_ahead = default_read_ahead() if read_ahead is None else parse_size(read_ahead, "read_ahead")
        self._torchs: StorageReader | None = None
        self._metadata_error: Exception | None = None  # why the last read_metadata failed
        # Shard files opened (and read ahead) before read_data; closed by it, by the next
        # load's set-up, or with the reader: torch calls nothing on a load whose planning failed.
        self._opened: dict[str, ShardReader] = {}
        weakref.finalize(self, _close_readers, self._opened)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = absolute_local_path(checkpoint_id)
        if self.path is None:
            raise ValueError("DCPReader needs a path: DCPReader(path) or dcp.load(..., checkpoint_id=path)")
        self._torchs = None
        self._close_opened()

    def _close_opened(self) -> None:
        _close_readers(self._opened)

    def _torch_folder(self) -> StorageReader | None:
        """torch's reader, for a folder of torch's FileSystemWriter (a ``.metadata``, no
        manifest); None for one of DCPWriter's. One of DCPWriter's that lost its manifest is refused."""
        if self._torchs is None and written_by_torch(self.path):
            from torch.distributed.checkpoint import FileSystemReader
            metadata = read_dcp_metadata(self.path)
            refuse_lost_manifest(self.path, metadata)  # DCPWriter's: torch's reader would fail on every item
            reader = FileSystemReader(self.path)
            reader.read_metadata = lambda *args, **kwargs: metadata  # not torch's own unpickling
            self._torchs = reader
        return self._torchs

    @gc_paused()
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._close_opened()  # a new load: what an earlier one read ahead may be stale
        self._metadata_error = None
        try:
            return self._read_metadata()
        except Exception as exc:
            # torch (2.13) keeps only this error's text, in an AssertionError ("metadata is None; global
            # metadata read failed: ..."): FSDPCheckpointer.load raises the error itself.
            self._metadata_error = exc
            raise

    def _read_metadata(self) -> Metadata:
        if self._torch_folder() is not None:
            return self._torchs.read_metadata()
        # Where an interrupted overwrite left the checkpoint aside, it is read there, as load_checkpoint reads it.
        self._folder = resolve_checkpoint(self.path)
        self._manifest = read_manifest(self._folder)
        refuse_dcp_folder_without_metadata(self._folder, self._manifest)  # DCPWriter's, its .metadata lost
        dcp_metadata = os.path.join(self._folder, DCP_METADATA)
        if not os.path.exists(dcp_metadata):
            raise CorruptCheckpointError(f"{self.path} is a tensorferry checkpoint without DCP metadata "
                                         "(not written by DCPWriter): use tensorferry.load_checkpoint")
        data = read_other_file(self._folder, self._manifest, DCP_METADATA)  # checksummed by the manifest
        return unpickle_dcp_metadata(data, dcp_metadata)

    @gc_paused()
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._close_opened()
        if self._torch_folder() is not None:
            return self._torchs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not hasattr(self, "_manifest"):
            self._folder = resolve_checkpoint(self.path)
            self._manifest = read_manifest(self._folder)
        items = self._manifest["metadata"].get(ITEMS_KEY)
        if items is None:  # written before the manifest listed the items: .metadata says where
            self._places = {_place_key(index): (s.file, s.key) for index, s in metadata.storage_data.items()}
            return
        self._places = {(fqn, None): (file, key) for fqn, (file, key) in items["objects"].items()}
        for fqn, entry in items["tensors"].items():
            self._places.update(((fqn, tuple(offsets)), (file, key)) for file, key, offsets, _ in entry["chunks"])
        self._start_read_ahead(kwargs.get("rank"))

    def _start_read_ahead(self, rank: int | None) -> None:
        """Starts reading the shard files this rank will most likely read first: while
        torch plans the load and read_data resolves its thousands of destinations (0.2-0.3 s
        on 4096 tensors), the drive would otherwise stand idle. Here, not in read_metadata,
        which callers also use only to look at a checkpoint. At most ``read_ahead`` bytes,
        in the order read_data reads files: this rank's own, as a save at the same world
        size wrote them (what FSDP reads back), else the order of the saved items. ``rank``
        is this rank's in the load's process group, as torch passes it (else the world's)."""
        if self.read_ahead <= 0:
            return
        files = list(dict.fromkeys(chunk[0] for entry in self._manifest["metadata"][ITEMS_KEY]["tensors"].values()
                                   for chunk in entry["chunks"]))
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            rank = torch.distributed.get_rank() if rank is None else rank
            files = sorted(name for name in files if name.startswith(f"rank{rank:05d}-"))
        budget = self.read_ahead
        for name in files:
            if budget <= 0:
                break
            try:
                reader = open_shard(self._folder, self._manifest, name, engine=self.engine, verify=self.verify)
            except Exception:  # missing or damaged: read_data says so if the plan needs this file
                continue
            self._opened[name] = reader
            try:
                reader.read_ahead(budget)
            except Exception:  # no buffers (ENOMEM): the load reads as it would without
                reader.end_read_ahead()
                break
            budget -= reader.size - reader.data_start

    def _place(self, index: Any) -> tuple[str, str]:
        """The shard file and tensor name of a DCP storage index."""
        try:
            return self._places[_place_key(index)]
        except KeyError:
            raise CorruptCheckpointError(f"{self.path}: the manifest does not say where {index.fqn!r} "
                                         f"at {index.offset} is stored") from None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan if self._torchs is None else self._torchs.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans if self._torchs is None else self._torchs.prepare_global_plan(plans)

    @gc_paused()
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self._torchs is not None:
            return self._torchs.read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._place(item.storage_index)[0], []).append(item)
        readers: dict[str, ShardReader] = {}
        try:
            for name in per_file:
                readers[name] = self._opened.pop(name, None) or open_shard(
                    self._folder, self._manifest, name, engine=self.engine, verify=self.verify)
            started: list[tuple[ReadItem, _Read]] = []
            finished = 0  # of started
            whole: dict[str, dict[str, tuple[ReadItem, torch.Tensor]]] = {}  # file: key: (item, target)
            # Chunks the plan takes parts of, read whole to be verified: those held at once stay
            # within the read-ahead's default bound, beyond which the earliest items are finished first.
            shared, shared_bound = SharedChunks(), default_read_ahead()
            for name, items in per_file.items():
                reader = readers[name]
                for item in items:
                    key = self._place(item.storage_index)[1]
                    target = None if item.type == LoadItemType.BYTE_IO else _resolve(reader, key, item, planner)
                    if (target is not None and key not in whole.get(name, {})
                            and _whole_in_place(reader, key, item, target)):
                        whole.setdefault(name, {})[key] = (item, target)
                    else:
                        started.append((item, _start_read(reader, key, item, planner, target, shared)))
                        while shared.held_bytes > shared_bound and finished < len(started):
                            earlier, read = started[finished]
                            read.finish(earlier, planner)
                            finished += 1
            for name, reader in readers.items():
                if name not in whole:  # box reads only, each served as it started
                    reader.end_read_ahead()
            for name, entries in whole.items():
                # A stored chunk read whole into CPU memory of its dtype (the usual restore):
                # the file's chunks together, in few large requests (ShardReader.read_many).
                readers[name].read_many([], {key: writable_bytes(target) for key, (_, target) in entries.items()})
                for item, target in entries.values():
                    planner.commit_tensor(item, target)
            for item, read in started[finished:]:  # each finished as it lands, later reads still in flight
                read.finish(item, planner)
            # Copies to a device read from pinned buffers that go back to the pool once dropped.
            for device in {read.target.device for _, read in started if read.pinned is not None}:
                torch.cuda.current_stream(device).synchronize()
        finally:
            for reader in readers.values():
                reader.close()
            self._close_opened()  # read ahead for a plan that wanted nothing from them
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), MANIFEST))


def _close_readers(readers: dict[str, ShardReader]) -> None:
    while readers:
        readers.popitem()[1].close()


def _place_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, None if index.offset is None else tuple(int(o) for o in index.offset)


@dataclasses.dataclass
class _Read:
    """One item in flight: its box of the stored chunk and where that goes."""

    box: BoxRead
    dtype: str  # the stored dtype
    target: torch.Tensor | None = None  # the destination (None for bytes)
    in_place: bool = False  # the box lands in the target's own memory
    pinned: np.ndarray | None = None  # the pinned buffer a box for a CUDA target lands in

    def finish(self, item: ReadItem, planner: LoadPlanner) -> None:
        data = self.box.result()
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data.tobytes()))
            return
        if self.pinned is not None:
            source = torch.from_numpy(self.pinned).view(FROM_SAFETENSORS[self.dtype]).reshape(self.target.shape)
            self.target.copy_(source, non_blocking=True)
        elif not self.in_place:
            self.target.copy_(_tensor_over(data, self.dtype))
        planner.commit_tensor(item, self.target)


def _tensor_over(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor sharing the memory of a box the core read, strides included (bf16 and
    fp8 too: torch takes them from numpy as signed integers of their size)."""
    return torch.from_numpy(array.view(f"i{array.itemsize}")).view(FROM_SAFETENSORS[dtype])


def _resolve(reader: ShardReader, key: str, item: ReadItem, planner: LoadPlanner) -> torch.Tensor:
    """The tensor the planner gives for a tensor item, checked against the item's box."""
    lengths = tuple(item.lengths)
    target = planner.resolve_tensor(item).detach()
    if tuple(target.shape) != lengths:
        raise CorruptCheckpointError(f"{reader.path}: {key} holds {list(lengths)} for "
                                     f"{item.dest_index.fqn}, the destination is {list(target.shape)}")
    return target


def _whole_in_place(reader: ShardReader, key: str, item: ReadItem, target: torch.Tensor) -> bool:
    """Whether the item is its whole stored chunk, going into plain CPU memory of its dtype."""
    info = reader.info(key)
    return (target.device.type == "cpu" and target.is_contiguous() and tuple(target.shape) == info.shape
            and safetensors_dtype(target.dtype) == info.dtype and not any(item.storage_offsets))


def _start_read(reader: ShardReader, key: str, item: ReadItem, planner: LoadPlanner,
                target: torch.Tensor | None, shared: SharedChunks) -> _Read:
    """Starts reading the item's box of stored chunk ``key``; a part of the chunk through
    ``shared``, which reads the chunk whole where the reader verifies."""
    info = reader.info(key)
    if item.type == LoadItemType.BYTE_IO:
        return _Read(reader.read_box(key, [0] * len(info.shape), info.shape), info.dtype)
    lengths = tuple(item.lengths)
    if target.device.type == "cpu" and target.is_contiguous() and safetensors_dtype(target.dtype) == info.dtype:
        # Plain memory of the stored dtype: the box is read (or, if strided, copied) into it.
        return _Read(reader.read_box(key, item.storage_offsets, lengths, out=writable_bytes(target), shared=shared),
                     info.dtype, target, in_place=True)
    if target.device.type == "cuda" and safetensors_dtype(target.dtype) == info.dtype:
        # Read into pinned memory, copied to the device as soon as it lands.
        pinned = leased(staging_pool(), target.numel() * target.element_size())
        return _Read(reader.read_box(key, item.storage_offsets, lengths, out=pinned, shared=shared), info.dtype,
                     target, pinned=pinned)
    return _Read(reader.read_box(key, item.storage_offsets, lengths, shared=shared), info.dtype, target)
