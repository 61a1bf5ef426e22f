"""A torch.distributed.checkpoint folder: ``.metadata`` plus the data files, written by
torch's ``FileSystemWriter`` (``*.distcp``) or by tensorferry's ``DCPWriter``
(safetensors shards and a manifest whose metadata lists every tensor's chunks, so
that it is read here without torch).

``.metadata`` is a pickle of torch's classes: reading a folder from torch's writer
(or from a DCPWriter older than the chunk list) needs torch, imported only then.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import re
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from ..buffers import byte_view
from ..checkpoint import MANIFEST, open_shard, read_directory_file, read_manifest
from ..dtypes import TORCH_DTYPE_NAMES, to_numpy_dtype
from ..errors import CorruptCheckpointError, TensorferryError
from ..schema import member_path
from . import (OBJECT, Chunk, ChunkSource, Layout, ShardSource, TensorEntry, TensorSource, Verification, file_row,
               size_problems, tensor_entry)
from .tensorferry import verify_against_manifest

DCP_METADATA = ".metadata"
# The key of a DCPWriter manifest's metadata that lists the DCP items: {"tensors": {fqn:
# {"dtype", "shape", "chunks": [[file, key, offsets, sizes], ...]}}, "objects": {fqn: [file, key]}}.
ITEMS_KEY = "dcp_items"
# The metadata a DCP folder's tensors carry into a converted file: torch's, as
# safetensors.torch marks its files (transformers 4.x refuses a file without "format").
TORCH_TENSORS = {"format": "pt"}
# Tensors of at most this many bytes in all are loaded by one dcp.load call.
TORCH_BATCH_BYTES = 64 << 20
# The stream transform DCPWriter's .metadata names for every tensor (the start of the
# adapter's NOT_TORCH_SAVE): torch's own reader does not know it.
RAW_BYTES_TRANSFORM = "tensorferry-raw-bytes"
# What verify checks of a folder of torch's own writer, whose files carry no checksums.
LOADED_BY_TORCH = "that every file is there and long enough, and that every tensor loads (DCP keeps no checksums)"


class ManifestLostError(CorruptCheckpointError):
    """A folder of DCPWriter without its ``tensorferry.json``."""


class UnreadableItemsError(CorruptCheckpointError):
    """Tensors that torch's ``dcp.load`` cannot read from ``files`` (names in the folder)."""

    def __init__(self, message: str, files: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.files = files


def safetensors_name(torch_dtype: Any) -> str:
    """The safetensors name of a torch dtype (by its name: torch need not be imported)."""
    name = str(torch_dtype).removeprefix("torch.")
    if name not in TORCH_DTYPE_NAMES:
        raise CorruptCheckpointError(f"dtype {name} has no safetensors equivalent")
    return TORCH_DTYPE_NAMES[name]


# Callables outside torch.distributed.checkpoint that DCP metadata may name: layouts
# (torch.serialization._get_layout), paths given as checkpoint ids, and the StoredItem
# of DCPWriters before issue 20.
_METADATA_CALLABLES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                       ("tensorferry.adapters.pytorch.dcp", "StoredItem")}
# Paths, by the module each Python pickles them under: Python 3.13 moved pathlib's
# classes into pathlib._local, which a checkpoint written there names and which no
# other Python has (so both names are looked up in pathlib).
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATH_CLASSES = ("PosixPath", "PurePosixPath")
# Its classes are data (Metadata, MetadataIndex, TensorStorageMetadata, ...); other
# modules of torch.distributed.checkpoint have classes that act when made (writers).
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what DCP metadata is made of: the classes of
    ``torch.distributed.checkpoint.metadata``, torch's dtypes, layouts and memory
    formats, ``torch.Size`` and :data:`_METADATA_CALLABLES`. A ``.metadata`` naming
    anything else (``os.system``, say, from a hostile writer: the manifest's checksum
    proves only who sealed it) is refused before anything it names is called."""

    def find_class(self, module: str, name: str) -> Any:
        import torch
        if "." not in name:  # a dotted name reaches through a module to anything
            if (module, name) in _METADATA_CALLABLES:
                return super().find_class(module, name)
            if module in _PATH_MODULES and name in _PATH_CLASSES:
                return getattr(pathlib, name)
            if module == "torch":
                value = getattr(torch, name, None)
                if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                    return value
            if module == _METADATA_MODULE:
                value = super().find_class(module, name)
                if isinstance(value, type) and value.__module__ == module:
                    return value
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata does not hold")


def unpickle_dcp_metadata(data: bytes, path: str) -> Any:
    """torch's ``Metadata`` from the bytes of ``path`` (a ``.metadata`` file), through
    :class:`_MetadataUnpickler`; :class:`CorruptCheckpointError` if it cannot be read."""
    import io
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any error unpickling means the file is unreadable
        raise CorruptCheckpointError(f"{path}: the DCP metadata cannot be read ({type(exc).__name__}: {exc})") from None


def written_by_torch(directory: str) -> bool:
    """Whether ``directory`` is a folder of torch's own FileSystemWriter: a ``.metadata``
    and no tensorferry manifest."""
    return os.path.isfile(os.path.join(directory, DCP_METADATA)) and \
        not os.path.exists(os.path.join(directory, MANIFEST))


def read_dcp_metadata(directory: str) -> Any:
    """The unpickled ``.metadata`` (torch's ``Metadata``)."""
    try:
        import torch  # noqa: F401  (the pickle is of torch's classes)
    except ImportError:
        raise TensorferryError("reading this torch DCP checkpoint needs torch: pip install 'tensorferry[torch]'") \
            from None
    path = os.path.join(directory, DCP_METADATA)
    try:
        data = read_directory_file(directory, DCP_METADATA)  # DCPWriter's: checked against the manifest
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    return unpickle_dcp_metadata(data, path)


def refuse_lost_manifest(directory: str, metadata: Any) -> None:
    """Refuses a folder of DCPWriter whose manifest is gone (copied without it, say), as
    its ``.metadata`` shows: torch's reader, which would read it then, knows none of its
    items and fails on each with advice to use DCPReader, which needs the manifest."""
    for stored in metadata.storage_data.values():
        transforms = getattr(stored, "transform_descriptors", None) or ()
        if hasattr(stored, "key") or any(str(t).startswith(RAW_BYTES_TRANSFORM) for t in transforms):
            raise ManifestLostError(
                f"{directory}: its {MANIFEST} is missing: the folder was written by tensorferry's DCPWriter (its "
                f"{DCP_METADATA} says so), whose {MANIFEST} lists its files, their checksums and where each item "
                f"lies (a copy that left it out?): copy {MANIFEST} back beside {DCP_METADATA} and the shards, then "
                "load it with dcp.load(state_dict, storage_reader=tensorferry.adapters.pytorch.DCPReader(path)) "
                "or convert it with tensorferry convert")


def _where(stored: Any) -> str:
    """The file of a storage_data value: torch's _StorageInfo, or an older DCPWriter's StoredItem."""
    return stored.relative_path if hasattr(stored, "relative_path") else stored.file


class DCPFolder(Layout):
    kind = "torch-dcp"
    title = "torch DCP checkpoint"

    @classmethod
    def recognise(cls, path: str) -> bool:
        return os.path.isdir(path) and any(n == DCP_METADATA or n.endswith(".distcp") for n in os.listdir(path))

    @property
    def ours(self) -> bool:
        """Written by tensorferry's DCPWriter (there is a manifest)."""
        return os.path.isfile(os.path.join(self.path, MANIFEST))

    def _items(self) -> tuple[list[TensorEntry], list[dict[str, Any]], list[str], Any]:
        """Every item (tensors with their chunks, then objects), the files with their
        problems, and torch's Metadata where it had to be read (None otherwise)."""
        if not os.path.exists(os.path.join(self.path, DCP_METADATA)):
            files = [file_row(self.path, n) for n in sorted(os.listdir(self.path)) if n.endswith(".distcp")]
            return [], files, [f"no {DCP_METADATA}: DCP writes it last, so this save did not finish"], None
        if self.ours:
            manifest = read_manifest(self.path)
            files = [file_row(self.path, n, e["size"]) for n, e in manifest["files"].items()]
            others = [file_row(self.path, n, e["size"]) for n, e in manifest.get("other_files", {}).items()]
            problems = size_problems(files + others, by="the manifest")
            items = manifest["metadata"].get(ITEMS_KEY)
            if items is not None:
                return _entries_from_manifest(items), files, problems, None
            metadata = read_dcp_metadata(self.path)
            return _entries_from_torch(metadata), files, problems, metadata
        metadata = read_dcp_metadata(self.path)
        refuse_lost_manifest(self.path, metadata)
        extents: dict[str, int] = {}
        for stored in metadata.storage_data.values():
            member_path(self.path, stored.relative_path)  # torch's reader would open it: never outside
            extents[stored.relative_path] = max(extents.get(stored.relative_path, 0), stored.offset + stored.length)
        files = [file_row(self.path, n, extents[n]) for n in sorted(extents)]
        return _entries_from_torch(metadata), files, size_problems(files, by="the metadata", at_least=True), metadata

    def describe(self) -> dict[str, Any]:
        entries, files, problems, _ = self._items()
        if not os.path.exists(os.path.join(self.path, DCP_METADATA)):
            return {**self.description(entries, files, problems), "total_bytes": None}
        ranks = sorted({int(m.group(1)) for m in (re.match(r"__(\d+)_\d+\.distcp$", f["name"]) for f in files) if m})
        return self.description(entries, files, problems, ranks=ranks or None)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        if self.ours and os.path.exists(os.path.join(self.path, DCP_METADATA)):
            return verify_against_manifest(self.path, progress)
        try:
            entries, files, problems, metadata = self._items()
        except ManifestLostError as exc:
            return Verification([MANIFEST], None, [f"{MANIFEST}: {exc}"], "")
        except CorruptCheckpointError as exc:
            return Verification([DCP_METADATA], None, [f"{DCP_METADATA}: {exc}"], "")
        names = [f["name"] for f in files]
        if problems or metadata is None:
            return Verification(names, None, problems, "that every file is there and long enough (DCP keeps no "
                                "checksums)")
        # Without checksums only a load proves the pickled tensors readable: a flipped bit
        # in one passed for sound, and the conversion or load after failed.
        total = sum(f["size"] for f in files)
        tensors = {e.name: e for e in entries if e.is_tensor}
        problems = _load_problems(_TorchSource(self.path, tensors, metadata, 0), self.path, progress)
        if progress is not None:
            progress(max(0, total - sum(e.nbytes for e in tensors.values())))  # the files' other bytes
        return Verification(names, total, problems, LOADED_BY_TORCH)

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        entries, _, problems, metadata = self._items()
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems))
        tensors = {e.name: e for e in entries if e.is_tensor}
        skipped = len(entries) - len(tensors)
        if self.ours:
            manifest = read_manifest(self.path)

            def open_reader(file: str) -> Any:
                return open_shard(self.path, manifest, file, engine=engine, verify=verify)

            if all(_stored_whole(e) for e in tensors.values()):  # saved by one rank: read (or mapped) as files
                whole = {n: dataclasses.replace(e, file=e.chunks[0].file) for n, e in tensors.items()}
                return ShardSource(whole, open_reader, TORCH_TENSORS, skipped=skipped, where=self.path)
            return ChunkSource(tensors, open_reader, TORCH_TENSORS, skipped=skipped, where=self.path)
        return _TorchSource(self.path, tensors, metadata, skipped)


def _load_problems(source: "_TorchSource", where: str, progress: Callable[[int], None] | None) -> list[str]:
    """Loads every tensor of ``source`` (a batch at a time, dropped once read), each batch
    of tensors stored in the same files, so that a failure names those files alone; a
    problem per file that a failed batch reads."""
    by_files: dict[tuple[str, ...], list[str]] = {}
    for name, entry in source.tensors.items():
        by_files.setdefault(tuple(entry.more["files"]), []).append(name)
    problems: dict[str, str] = {}
    for files, names in by_files.items():
        batch: list[str] = []
        batch_bytes = 0
        for index, name in enumerate(names):
            batch.append(name)
            batch_bytes += source.tensors[name].nbytes
            if batch_bytes < TORCH_BATCH_BYTES and index + 1 < len(names):
                continue
            try:
                source.read(batch)
            except UnreadableItemsError as exc:
                reason = str(exc).removeprefix(f"{where}: ")
                for file in exc.files or ("",):
                    problems.setdefault(file, f"{file}: {reason}" if file else str(exc))
            if progress is not None:
                progress(batch_bytes)
            batch, batch_bytes = [], 0
    return list(problems.values())


def _stored_whole(entry: TensorEntry) -> bool:
    """Whether the tensor is one chunk in one file (as one rank saves it)."""
    return len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape and not any(entry.chunks[0].offsets)


def _entries_from_manifest(items: Mapping[str, Any]) -> list[TensorEntry]:
    entries = []
    for fqn, item in items.get("tensors", {}).items():
        chunks = tuple(Chunk(file, key, tuple(offsets), tuple(sizes)) for file, key, offsets, sizes in item["chunks"])
        entries.append(tensor_entry(fqn, item["dtype"], item["shape"], chunks=chunks,
                                    more={"shards": len(chunks), "files": sorted({c.file for c in chunks})}))
    for fqn, (file, _) in items.get("objects", {}).items():
        entries.append(TensorEntry(fqn, OBJECT, None, None, more={"shards": 1, "files": [file]}))
    return entries


def _entries_from_torch(metadata: Any) -> list[TensorEntry]:
    """The items of torch's Metadata; a tensor's chunks too where they name a shard file's
    tensor (an older DCPWriter's StoredItem), so that the core reads them."""
    stored_at: dict[str, list[tuple[Any, Any]]] = {}
    for index, stored in metadata.storage_data.items():
        stored_at.setdefault(index.fqn, []).append((index, stored))
    entries = []
    for fqn, item in metadata.state_dict_metadata.items():
        places = stored_at.get(fqn, [])
        more = {"shards": len(getattr(item, "chunks", [None])), "files": sorted({_where(s) for _, s in places})}
        if not hasattr(item, "chunks"):  # any other object, which DCP pickles
            entries.append(TensorEntry(fqn, OBJECT, None, None, more=more))
            continue
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in item.chunks}
        chunks = tuple(Chunk(s.file, s.key, tuple(i.offset), sizes[tuple(i.offset)])
                       for i, s in places if hasattr(s, "key"))
        entries.append(tensor_entry(fqn, safetensors_name(item.properties.dtype), item.size, more=more,
                                    chunks=chunks))
    return entries


class _TorchSource(TensorSource):
    """Tensors of a DCP folder from torch's own writer (torch.save'd items), loaded by
    ``dcp.load`` in batches of about ``TORCH_BATCH_BYTES``: the metadata is unpickled
    once, not once per call (which made a conversion quadratic)."""

    def __init__(self, path: str, tensors: Mapping[str, TensorEntry], metadata: Any, skipped: int) -> None:
        super().__init__(tensors, TORCH_TENSORS, skipped, where=path)
        import torch.distributed.checkpoint as dcp

        self._reader = dcp.FileSystemReader(path)
        self._reader.read_metadata = lambda *args, **kwargs: metadata  # read once, above

    def _read(self, names: list[str], out: dict[str, Any]) -> dict[str, np.ndarray]:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        results: dict[str, np.ndarray] = {}
        batch: dict[str, torch.Tensor] = {}
        batch_bytes = 0

        def load() -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                try:
                    dcp.load(batch, storage_reader=self._reader, no_dist=True)
                except CheckpointException as exc:
                    failure = _failure_in(exc)
                    if not isinstance(failure, Exception) or isinstance(failure, (OSError, MemoryError)):
                        raise failure from None  # an interruption, the drive, the memory: not damage
                    files = tuple(sorted({f for name in batch for f in self.tensors[name].more.get("files", ())}))
                    raise _unreadable(failure, self._where, files) from failure
            for name, tensor in batch.items():
                entry = self.tensors[name]
                raw = tensor.reshape(-1).view(torch.uint8).numpy()
                array = raw.view(to_numpy_dtype(entry.dtype)).reshape(entry.shape)
                if name in out:
                    byte_view(out[name], writable=True)[...] = raw
                    array = out[name]
                results[name] = array
            batch.clear()

        for name in names:
            entry = self.tensors[name]
            batch[name] = torch.empty(entry.shape, dtype=getattr(torch, _torch_name(entry.dtype)))
            batch_bytes += entry.nbytes
            if batch_bytes >= TORCH_BATCH_BYTES:
                load()
                batch_bytes = 0
        if batch:
            load()
        return {n: results[n] for n in names}


def _failure_in(exc: BaseException) -> BaseException:
    """What failed inside torch's ``CheckpointException`` (a BaseException, which ``except
    Exception`` misses): the first rank's exception it wraps (one rank, without a process group)."""
    for failure in getattr(exc, "failures", {}).values():
        failure = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(failure, BaseException):
            return failure
    return exc


def _unreadable(failure: Exception, where: str, files: tuple[str, ...]) -> UnreadableItemsError:
    """The error for tensors that torch's ``dcp.load`` failed to read from ``files`` (a
    damaged pickle, a truncated stream)."""
    text = str(failure)
    # torch's refusal of a pickle's global opens with advice to unpickle with weights_only=False: not for damage
    weights_only = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    detail = (weights_only.group(1) if weights_only else text).strip().split("\n")[0].split(". ")[0][:300]
    shown = ", ".join(files) or "its files"
    return UnreadableItemsError(f"{where}: torch's dcp.load cannot read the tensors stored in {shown} "
                                f"({type(failure).__name__}: {detail}): damaged, or not as {DCP_METADATA} describes",
                                files)


def _torch_name(dtype: str) -> str:
    return next(name for name, st in TORCH_DTYPE_NAMES.items() if st == dtype)


__all__ = ["DCPFolder", "DCP_METADATA", "ITEMS_KEY", "ManifestLostError", "RAW_BYTES_TRANSFORM", "UnreadableItemsError",
           "read_dcp_metadata", "refuse_lost_manifest", "safetensors_name", "written_by_torch"]
