"""An Orbax checkpoint step (or one item of it). Items written by tensorferry's
``FerryCheckpointHandler`` (``process-N.safetensors`` plus the index
``process-N.json``) are listed, verified and read here without JAX; the items of
Orbax's own pytree handlers (``StandardCheckpointHandler``, ``PyTreeCheckpointHandler``)
are listed and read through orbax-checkpoint, when it is installed (so that
``tensorferry convert`` takes a JAX model to safetensors), and not verified: Orbax
keeps no checksums."""

from __future__ import annotations

import glob
import os
from typing import Any, Callable

import numpy as np

from ..buffers import byte_view
from ..checkpoint import open_shard, read_manifest_file, verify_shard
from ..dtypes import to_safetensors_dtype
from ..errors import CorruptCheckpointError, TensorferryError, listed
from ..schema import (NON_FINITE_FLOATS, ORBAX_STEP_MARKER, ORBAX_TEMPORARY_MARKER, non_finite_name, parse_json,
                      read_small_file)
from . import (OBJECT, Chunk, ChunkSource, Layout, TensorEntry, TensorSource, Verification, file_row, size_problems,
               tensor_entry)

ITEM_MARKERS = ("_METADATA", "orbax.checkpoint", "manifest.ocdbt", "_sharding")  # in an item's directory
INDEX_FORMAT = "tensorferry.jax"  # what FerryCheckpointHandler's indexes say they are
INDEX_PATTERN = "process-*.json"


def _is_ferry_item(directory: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), INDEX_PATTERN)))


def index_name(process: int) -> str:
    """The name of process ``process``'s index in a tensorferry JAX item (``INDEX_PATTERN``)."""
    return f"process-{process}.json"


def refuse_missing_indexes(directory: str, indexes: list[tuple[str, Any]]) -> None:
    """Raises :class:`CorruptCheckpointError` naming the ``process-N.json`` that the indexes'
    ``process_count`` calls for and the directory lacks (a step copied or synced in part),
    or an index not at its process's name; ``indexes`` are the ``(path, metadata)`` of those
    present. A restore would otherwise fail on a box the missing chunks leave uncovered, or
    on one process alone, or succeed without a word; ``verify`` would report it sound."""
    counts = set()
    for path, meta in indexes:
        process, count = (meta.get("process"), meta.get("process_count")) if isinstance(meta, dict) else (None, None)
        if process is None or count is None:  # not an index of ours: refused with its leaves
            continue
        if type(process) is not int or type(count) is not int or not 0 <= process < count:
            raise CorruptCheckpointError(f"{path}: records process {process!r} of {count!r}")
        if os.path.basename(path) != index_name(process):
            raise CorruptCheckpointError(f"{path} is the index of process {process}")
        counts.add(count)
    if len(counts) > 1:
        raise CorruptCheckpointError(f"{directory}: the process indexes record different process counts "
                                     f"{sorted(counts)}: they are of different saves")
    present = {os.path.basename(path) for path, _ in indexes}
    missing = [name for name in map(index_name, range(max(counts, default=0))) if name not in present]
    if missing:
        raise CorruptCheckpointError(
            f"{directory}: the step is incomplete, it lacks {listed(missing)} (its indexes record "
            f"{max(counts)} processes, each of which wrote an index and a shard file): copy the whole step, "
            "or restore another")


def _scalar_fields(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A scalar leaf's entry fields: its value; a NaN or an infinity, which JSON has no
    number for, as ``adapters.pytorch.save``'s structure marks it, ``{"float": "nan" | "inf" | "-inf"}``
    (the index's record of kind "float" holds that name; indexes written before it, a bare NaN)."""
    value = record["value"]
    if record["kind"] == "float":
        if value not in NON_FINITE_FLOATS:
            raise CorruptCheckpointError(f"{where}: a float leaf holds {value!r}, not one of {NON_FINITE_FLOATS}")
        return {"float": value}
    float_name = non_finite_name(value)
    return {"value": value} if float_name is None else {"float": float_name}


class OrbaxStep(Layout):
    kind = "orbax"
    title = "Orbax checkpoint"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._trees: dict[str, Any] = {}  # Orbax's metadata tree of each of its own items, read once

    @classmethod
    def recognise(cls, path: str) -> bool:
        if not os.path.isdir(path):
            return False
        # A step holds its items as subdirectories, or is one item; a CheckpointManager's
        # directory, whose subdirectories are steps, is not a step (see shard._orbax_run_hint).
        subdirs = [os.path.join(path, n) for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
        return os.path.exists(os.path.join(path, ORBAX_STEP_MARKER)) or any(
            _is_ferry_item(d) or any(os.path.exists(os.path.join(d, m)) for m in ITEM_MARKERS)
            for d in [path, *subdirs])

    def _items(self) -> list[str]:
        """The item directories: the path itself if it is one, else its subdirectories that are."""
        if _is_ferry_item(self.path) or os.path.exists(os.path.join(self.path, "_METADATA")):
            return [self.path]
        recorded = _recorded_handlers(self.path)
        if not isinstance(recorded, dict):
            recorded = {}
        # An item of older Orbax's ArrayCheckpointHandler has no _METADATA: the step's record names it.
        return [d for d in sorted(os.path.join(self.path, n) for n in os.listdir(self.path))
                if os.path.isdir(d) and (_is_ferry_item(d) or os.path.exists(os.path.join(d, "_METADATA"))
                                         or os.path.basename(d) in recorded)]

    def _prefix(self, item: str) -> str:
        return "" if item == self.path else os.path.basename(item) + "/"

    def _indexes(self, item: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Each shard file of a tensorferry item with the process index that lists it, and
        the item's problem where it lacks a process's index (as a JAX restore refuses it)."""
        indexes, metadata = {}, []
        for path in sorted(glob.glob(os.path.join(glob.escape(item), INDEX_PATTERN))):
            index = read_manifest_file(path)
            if index["metadata"].get("format") != INDEX_FORMAT:
                raise CorruptCheckpointError(f"{path} is not a tensorferry JAX index")
            metadata.append((path, index["metadata"]))
            for file in index["files"]:
                indexes[file] = index
        try:
            refuse_missing_indexes(item, metadata)
        except CorruptCheckpointError as exc:
            return indexes, [str(exc)]
        return indexes, []

    def _ferry_entries(self, item: str, indexes: dict[str, dict[str, Any]]) -> list[TensorEntry]:
        leaves: dict[str, dict[str, Any]] = {}
        chunks: dict[str, list[Chunk]] = {}
        prefix = self._prefix(item)  # the chunks' files are named relative to the step
        for index in {id(i): i for i in indexes.values()}.values():
            for name, rec in index["metadata"]["leaves"].items():
                leaves.setdefault(name, rec)
                chunks.setdefault(name, []).extend(Chunk(prefix + rec["file"], key, tuple(offsets), tuple(sizes))
                                                   for key, offsets, sizes in rec.get("chunks", []))
        return [tensor_entry(prefix + name, rec["dtype"], rec["shape"], chunks=tuple(chunks[name]))
                if rec["kind"] == "array"
                else TensorEntry(prefix + name, OBJECT, None, None, more=_scalar_fields(rec, f"{item}: {name}"))
                for name, rec in leaves.items()]

    def _orbax_entries(self, item: str) -> list[TensorEntry]:
        """The leaves of an item of Orbax's own pytree handlers, as its metadata lists
        them: arrays and numbers as tensors of their dtype (Orbax stores numbers as 0-d
        arrays); leaves of dtypes safetensors has no name for (int4, say) and others as
        objects."""
        if item not in self._trees:
            self._trees[item] = _orbax_tree(self.path, item)
        entries = []
        for name, leaf in _orbax_leaves(self._prefix(item), self._trees[item]):
            dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
            try:
                if dtype is None:  # np.dtype(None) would be float64
                    raise TypeError(f"{name} has no dtype")
                entries.append(tensor_entry(name, to_safetensors_dtype(np.dtype(dtype)), shape or ()))
            except TypeError:  # no dtype, or one without a safetensors name
                entries.append(TensorEntry(name, OBJECT, None if shape is None else tuple(shape), None,
                                           more={"orbax_dtype": str(dtype)}))
        return entries

    def _pytree_items(self) -> list[str]:
        """The items of Orbax's own handlers that are read (as pytrees); those the step
        records as written by another handler (``ArrayCheckpointHandler``, say) are not."""
        return [i for i in self._items() if not _is_ferry_item(i) and _written_as_pytree(i)]

    def _survey(self) -> tuple[list[TensorEntry], list[str], dict[str, tuple[str, dict[str, Any]]],
                               dict[str, tuple[str, str, Any] | None]]:
        """Every leaf, the problems, each tensorferry shard file (relative to the step)
        with its item directory and index, and the tensors that can be read: for those
        of Orbax's own items, what :func:`_restore_orbax_item` takes (None: the core reads it)."""
        entries, problems, shards, readable = [], [], {}, {}
        pytrees = self._pytree_items()
        for item in self._items():
            if not _is_ferry_item(item):
                if item not in pytrees:
                    continue
                try:
                    own = self._orbax_entries(item)
                except CorruptCheckpointError as exc:  # Orbax could not read its metadata
                    problems.append(str(exc))
                    continue
                entries += own
                readable.update((e.name, (item, self._prefix(item), self._trees[item])) for e in own if e.is_tensor)
                continue
            indexes, incomplete = self._indexes(item)
            problems += incomplete
            ferried = self._ferry_entries(item, indexes)
            entries += ferried
            readable.update((e.name, None) for e in ferried if e.is_tensor)
            for file, index in indexes.items():
                shards[self._prefix(item) + file] = (item, index)
                row = file_row(self.path, self._prefix(item) + file, index["files"][file]["size"])
                problems += size_problems([row], by="its index")
        if ORBAX_TEMPORARY_MARKER in os.path.basename(os.path.normpath(self.path)):
            problems.append("a temporary directory: this save did not finish")
        return entries, problems, shards, readable

    def describe(self) -> dict[str, Any]:
        entries, problems, _, _ = self._survey()
        files = [file_row(self.path, os.path.relpath(os.path.join(root, n), self.path))
                 for root, _, names in sorted(os.walk(self.path)) for n in sorted(names)]
        return self.description(entries, files, problems)

    def _open_shard(self, shards: dict[str, tuple[str, dict[str, Any]]], file: str, **kw: Any) -> Any:
        item, index = shards[file]
        return open_shard(item, index, os.path.basename(file), **kw)

    def verify(self, progress: Callable[[int], None] | None = None) -> Verification:
        _, problems, shards, _ = self._survey()
        total = 0
        for file in shards:
            try:
                with self._open_shard(shards, file) as reader:
                    total += reader.size
                    verify_shard(reader, progress)
            except (CorruptCheckpointError, OSError) as exc:
                problems.append(f"{file}: {exc}")
        # Orbax keeps no checksums: its own items are read whole through Orbax, which finds
        # data files missing, short or failing to decompress.
        pytrees = self._pytree_items()
        others = [i for i in self._items() if not _is_ferry_item(i) and i not in pytrees]
        read_by_orbax: dict[str, int] = {}  # files checked too: Orbax reads them all
        for item in pytrees:
            if item not in self._trees:  # its metadata did not read: a problem already
                continue
            files = self._item_files(item)
            read_by_orbax.update(files)
            total += sum(files.values())
            try:
                restored = _restore_orbax_item(item, self._prefix(item), self._trees[item])
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            if progress is not None:
                progress(sum(a.nbytes for a in restored.values()))
        checked = "; ".join(
            (["the checksums of the tensorferry items"] if shards else []) +
            ([f"{len(pytrees)} item(s) of Orbax's own handlers read whole through Orbax (it keeps no checksums)"]
             if pytrees else []) +
            ([f"{len(others)} item(s) of other Orbax handlers not checked"] if others else []))
        return Verification(list(shards) + list(read_by_orbax), total, list(dict.fromkeys(problems)),
                            checked or "nothing to check")

    def _item_files(self, item: str) -> dict[str, int]:
        """Every file of an item, by its name in the step, with its size: what Orbax reads of it."""
        return {os.path.relpath(os.path.join(root, name), self.path): os.path.getsize(os.path.join(root, name))
                for root, _, names in sorted(os.walk(item)) for name in sorted(names)}

    def open(self, *, verify: bool = True, engine: Any = None) -> TensorSource:
        entries, problems, shards, readable = self._survey()
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems))
        tensors = {e.name: e for e in entries if e.name in readable}
        return _StepSource(tensors, lambda file: self._open_shard(shards, file, engine=engine, verify=verify),
                           skipped=len(entries) - len(tensors), where=self.path,
                           orbax_items={name: item for name, item in readable.items() if item is not None})


PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")


def _recorded_handlers(where: str) -> Any:
    """``item_handlers`` of Orbax's record in ``where`` (``_CHECKPOINT_METADATA``): for a
    step, each item's handler class by item name; for an item, its own. None without one."""
    try:
        return parse_json(read_small_file(os.path.join(where, ORBAX_STEP_MARKER)), "step metadata",
                          where).get("item_handlers")
    except (OSError, CorruptCheckpointError, AttributeError):
        return None


def _written_as_pytree(item: str) -> bool:
    """Whether Orbax's record of the step (``_CHECKPOINT_METADATA``: the item's handler,
    by class, in the step's directory or the item's own) names a pytree handler; an
    item without that record is taken for one."""
    for where, key in ((item, None), (os.path.dirname(os.path.abspath(item)), os.path.basename(item))):
        handlers = _recorded_handlers(where)
        if handlers is None:
            continue
        handler = handlers if key is None else handlers.get(key) if isinstance(handlers, dict) else None
        if isinstance(handler, str):
            return handler.rsplit(".", 1)[-1] in PYTREE_HANDLERS
    return True


def _with_orbax_handler(step: str, item: str, call: Callable[[Any, Any], Any]) -> Any:
    """``call(handler, path)`` with Orbax's ``PyTreeCheckpointHandler`` and the item's
    path as Orbax takes it; Orbax's and tensorstore's errors, whatever their class,
    become :class:`CorruptCheckpointError` naming the item."""
    try:
        import orbax.checkpoint as ocp
        from etils import epath
    except ImportError:
        raise TensorferryError(f"{step} looks like an Orbax checkpoint: unsupported: install "
                               "orbax-checkpoint (pip install 'tensorferry[jax]') to inspect it") from None
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return call(handler, epath.Path(os.path.abspath(item)))  # Orbax refuses relative paths
    except (MemoryError, TensorferryError):
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{item}: Orbax could not read it ({type(exc).__name__}: {exc})") from exc
    finally:
        handler.close()


def _orbax_tree(step: str, item: str) -> Any:
    """The metadata tree of an item of Orbax's own pytree handlers."""
    metadata = _with_orbax_handler(step, item, lambda handler, path: handler.metadata(path))
    # Orbax 0.11 and later wrap the tree in a TreeMetadata; earlier ones return the tree itself.
    return metadata.tree if hasattr(type(metadata), "tree") else metadata


def _orbax_leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
    """The leaves of an Orbax tree (metadata or arrays), each by its name in the step."""
    import jax

    return [(prefix + jax.tree_util.keystr(keys), leaf) for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _restore_orbax_item(item: str, prefix: str, tree: Any) -> dict[str, np.ndarray]:
    """Every leaf of an item of Orbax's own pytree handlers (``tree``: its metadata),
    restored by Orbax as numpy arrays (whole, whatever mesh they were saved from), by
    name in the step."""
    import jax
    import orbax.checkpoint as ocp

    # Arrays and numbers as numpy arrays; the rest (strings, say) as Orbax restores them.
    restore_args = jax.tree.map(lambda leaf: ocp.RestoreArgs(restore_type=np.ndarray)
                                if getattr(leaf, "dtype", None) is not None else ocp.RestoreArgs(), tree)
    restored = _with_orbax_handler(item, item, lambda handler, path: handler.restore(
        path, args=ocp.args.PyTreeRestore(restore_args=restore_args)))
    return {name: np.asarray(leaf, order="C") for name, leaf in _orbax_leaves(prefix, restored)
            if isinstance(leaf, (np.ndarray, np.generic))}


class _StepSource(ChunkSource):
    """A step's tensors: those of tensorferry's items read by the core, those of Orbax's
    own items (``orbax_items``: name -> item directory, prefix and metadata) restored through
    orbax-checkpoint a whole item at a time, each array held until it is handed out."""

    def __init__(self, tensors: dict[str, TensorEntry], open_reader: Callable[[str], Any], *, skipped: int,
                 where: str, orbax_items: dict[str, tuple[str, str, Any]]) -> None:
        super().__init__(tensors, open_reader, skipped=skipped, where=where)
        self._orbax_items = orbax_items
        self._restored: dict[str, np.ndarray] = {}

    def _read(self, names: list[str], out: dict[str, Any]) -> dict[str, np.ndarray]:
        results = super()._read([n for n in names if n not in self._orbax_items], out)
        for name in names:
            if name not in self._orbax_items:
                continue
            if name not in self._restored:
                restored = _restore_orbax_item(*self._orbax_items[name])
                self._restored.update((n, a) for n, a in restored.items() if n in self._orbax_items)
            array, entry = self._restored.pop(name), self.tensors[name]
            if to_safetensors_dtype(array.dtype) != entry.dtype or array.shape != entry.shape:
                raise CorruptCheckpointError(f"{self._where}: Orbax restored {name} as {array.dtype}"
                                             f"{list(array.shape)}, its metadata says {entry.dtype}{list(entry.shape)}")
            if name in out:
                byte_view(out[name], writable=True)[...] = byte_view(array)
                array = out[name]
            results[name] = array
        return {n: results[n] for n in names}

    def close(self) -> None:
        self._restored.clear()
        super().close()
