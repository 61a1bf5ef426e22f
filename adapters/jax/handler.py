"""An Orbax checkpoint handler that writes and reads through the core.

Layout of the directory Orbax hands the handler (Orbax owns the temporary
directory, the finalize step and the commit): each process ``i`` writes
``process-{i}.safetensors`` (its addressable shards with ``replica_id == 0``,
named ``"<leaf keypath>@<offsets>"``) and then ``process-{i}.json``, an index in
the shape of a tensorferry manifest (file size and checksum, and per leaf the
global shape, dtype and the chunks this process saved). Process 0 also records
the tree structure, numpy arrays and Python scalars. Restore reads every index
and, for each device of the target sharding, the stored chunks that overlap the
device's box: whole, to verify them (once for every box that takes a part), or
without verification only the bytes of the box.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import inspect
import json
import math
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint._src.futures import future as ocp_future
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from ...checkpoint import encode_manifest, load_checkpoint, open_shard, read_manifest_file, write_durably
from ...dtypes import to_numpy_dtype, to_safetensors_dtype
from ...engine import Engine, local_path
from ...errors import CorruptCheckpointError, listed, missing_names
from ...layouts.orbax import index_name, refuse_missing_indexes
from ...schema import (MAX_SMALL_FILE_BYTES, MAX_STRUCTURE_DEPTH, MAX_TENSOR_NAME_CHARS, NON_FINITE_FLOATS,
                       non_finite_name, walk_structure)
from ...shard import (DEFAULT_BUFFER_SIZE, MappedReads, ShardReader, ShardWriter, SharedChunks, WholeReads,
                      aligned_copies, gc_paused)

INDEX_FORMAT = "tensorferry.jax"
_SCALARS = (bool, int, float, str)
# Bytes of reads kept in flight ahead of the leaves being finished on restore.
RESTORE_WINDOW = 512 << 20


def _key_entry(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            value = getattr(entry, attr)
            return value if isinstance(value, (str, int)) else str(value)
    return str(entry)


def _shown(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _encode_structure(node: Any, path: tuple, leaves: dict[str, Any], depth: int = 1) -> Any:
    """JSON for the tree's containers; leaves become ``{"leaf": name}``. Refuses a tree
    deeper than a restore reads (``_check_structure``), each node and leaf one level."""
    if depth > MAX_STRUCTURE_DEPTH:
        raise ValueError(f"{_shown(jax.tree_util.keystr(path))}: the tree nests more than {MAX_STRUCTURE_DEPTH} "
                         "levels deep, which a restore refuses")
    if node is None:
        return {"none": None}
    if isinstance(node, dict):
        return {"dict": [[k if isinstance(k, (str, int)) else str(k),
                          _encode_structure(v, path + (jax.tree_util.DictKey(k),), leaves, depth + 1)]
                         for k, v in node.items()]}
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode_structure(v, path + (jax.tree_util.SequenceKey(i),), leaves, depth + 1)
                       for i, v in enumerate(node)]}
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(children) == 1 and children[0][0] == ():
        name = jax.tree_util.keystr(path)
        leaves[name] = node
        return {"leaf": name}
    # A custom pytree node (dataclass, namedtuple): restored without a target as a dict.
    return {"node": type(node).__name__,
            "children": [[_key_entry(p[0]), _encode_structure(c, path + tuple(p), leaves, depth + 1)]
                         for p, c in children]}


def _decode_structure(spec: Any, leaf: Any) -> Any:
    if "none" in spec:
        return None
    if "leaf" in spec:
        return leaf(spec["leaf"])
    if "dict" in spec:
        return {k: _decode_structure(v, leaf) for k, v in spec["dict"]}
    if "list" in spec:
        return [_decode_structure(v, leaf) for v in spec["list"]]
    if "tuple" in spec:
        return tuple(_decode_structure(v, leaf) for v in spec["tuple"])
    return {k: _decode_structure(v, leaf) for k, v in spec["children"]}


def _check_structure(structure: Any, where: str, leaves: Mapping[str, Any]) -> None:
    """Raises :class:`CorruptCheckpointError` unless ``structure`` is a tree as
    :func:`_encode_structure` writes it, naming only saved leaves, at most
    ``MAX_STRUCTURE_DEPTH`` deep (:func:`tensorferry.schema.walk_structure`)."""

    def children_of(node: Any) -> Iterable[Any]:
        kind = next(iter(node), None) if isinstance(node, dict) else None
        value = node.get(kind) if kind is not None else None
        if kind == "none" and node == {"none": None} or kind == "leaf" and len(node) == 1 and isinstance(value, str) \
                and value in leaves:
            return ()
        if kind in ("list", "tuple") and len(node) == 1 and type(value) is list:
            return value
        pairs = node.get("children") if kind == "node" and len(node) == 2 else value if kind == "dict" \
            and len(node) == 1 else None
        # A dict's bool keys are JSON's true and false, no integers there.
        if type(pairs) is list and all(type(p) is list and len(p) == 2 and type(p[0]) in (str, int, bool)
                                       for p in pairs):
            return [p[1] for p in pairs]
        shown = json.dumps(node)[:80] if isinstance(node, (dict, list, str, int, float, bool)) else repr(node)[:80]
        raise CorruptCheckpointError(f"{where}: unreadable tree structure node {shown}")

    walk_structure(structure, where, "tree structure", children_of)


def _chunk_key(name: str, offsets: Iterable[int]) -> str:
    key = f"{name}@{','.join(str(int(o)) for o in offsets)}"
    if len(key) > MAX_TENSOR_NAME_CHARS:  # the index would be refused on restore
        raise ValueError(f"{_shown(name)}: stored as a name of {len(key)} characters (key path and offsets), "
                         f"more than the {MAX_TENSOR_NAME_CHARS} a restore accepts")
    return key


_ALL = slice(None)


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the box ``index`` (a tuple of slices) selects in ``shape``."""
    if all(s == _ALL for s in index):  # the whole array: one device, or replicated
        return (0,) * len(shape), tuple(shape)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    starts, sizes = [], []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"strided index {s} is not supported")
        starts.append(start)
        sizes.append(max(0, stop - start))
    return tuple(starts), tuple(sizes)


@dataclasses.dataclass
class _Leaf:
    """What was saved of one leaf, merged over every process's index."""

    kind: str  # "array" (jax.Array or numpy) or "scalar"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    was_jax: bool = False
    value: Any = None
    sharding: dict[str, Any] | None = None  # the NamedSharding it was saved with (_sharding_fields)
    device: int | None = None  # the device id of the SingleDeviceSharding it was saved with
    prng_impl: str | None = None  # a typed PRNG key array: its implementation; the stored array is its key data
    chunks: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=list)


class _Checkpoint:
    """The merged indexes of a saved directory, with shard readers opened on demand."""

    def __init__(self, directory: str, engine: Engine | None, verify: bool, mapped: bool = False) -> None:
        self.directory, self.engine, self.verify, self.mapped = directory, engine, verify, mapped
        paths = sorted(glob.glob(os.path.join(glob.escape(directory), "process-*.json")))
        if not paths:
            orbax_own = any(os.path.exists(os.path.join(directory, n)) for n in ("_METADATA", "manifest.ocdbt"))
            raise FileNotFoundError(
                f"{directory} holds no tensorferry JAX checkpoint (no process-*.json)" + (
                    "; it holds Orbax's own format: restore it with the handler that saved it "
                    "(ocp.StandardCheckpointHandler or PyTreeCheckpointHandler), then save it with "
                    "FerryCheckpointHandler" if orbax_own else ""))
        self.manifests: dict[str, dict[str, Any]] = {}
        self.leaves: dict[str, _Leaf] = {}
        self.structure = None
        indexes = [(path, read_manifest_file(path)) for path in paths]
        # Before anything a process could do otherwise: every process reads the same indexes.
        refuse_missing_indexes(directory, [(path, index.get("metadata", {})) for path, index in indexes])
        for path, index in indexes:
            meta = index.get("metadata", {})
            if meta.get("format") != INDEX_FORMAT:
                raise CorruptCheckpointError(f"{path} is not a tensorferry JAX index")
            if "structure" in meta:
                self.structure = meta["structure"]
            for filename in index["files"]:
                self.manifests[filename] = index
            try:
                for name, rec in meta["leaves"].items():
                    leaf = self.leaves.get(name)
                    if leaf is None:
                        kind, value = rec["kind"], rec.get("value")
                        if kind == "float":  # a NaN or an infinity, which JSON has no number for
                            if value not in NON_FINITE_FLOATS:
                                raise ValueError(f"the float of {name!r} is {value!r}, not one of {NON_FINITE_FLOATS}")
                            kind, value = "scalar", float(value)
                        prng_impl = rec.get("prng_impl")
                        if prng_impl is not None and not isinstance(prng_impl, str):
                            raise TypeError(f"prng_impl of {name!r} is not a string")
                        prng_impl = _PRNG_NAMES_BY_TAG.get(prng_impl, prng_impl)
                        sharding, device = rec.get("sharding"), rec.get("device")
                        if sharding is not None and not isinstance(sharding, dict):
                            raise TypeError(f"the sharding of {name!r} is not an object")
                        if device is not None and type(device) is not int:
                            raise TypeError(f"the device of {name!r} is not an integer")
                        leaf = self.leaves[name] = _Leaf(kind, tuple(rec.get("shape", ())), rec.get("dtype", ""),
                                                         rec.get("was_jax", False), value, sharding, device,
                                                         prng_impl)
                    for key, offsets, sizes in rec.get("chunks", []):
                        leaf.chunks.append((rec["file"], key, tuple(offsets), tuple(sizes)))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # sealed, yet not as written
                raise CorruptCheckpointError(f"{path}: a leaf record is malformed ({type(exc).__name__}: "
                                             f"{exc})") from None
        if self.structure is None:
            raise CorruptCheckpointError(f"{directory}: no process index holds the tree structure")
        # Refused when a restore asks for the leaf, not here, so that partial_restore can leave it out.
        self.saved_twice: dict[str, str] = {}
        for name, leaf in self.leaves.items():
            by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[str, str]] = {}
            for filename, key, offsets, sizes in leaf.chunks:
                first = by_box.setdefault((offsets, sizes), (filename, key))
                if first != (filename, key):
                    self.saved_twice[name] = (
                        f"{directory}: leaf {_shown(name)} has its box at offsets {list(offsets)} of size "
                        f"{list(sizes)} saved twice, as {first[1]!r} in {first[0]} and as {key!r} in {filename}: "
                        "a process-local array that each process saved as its own (a save of this version "
                        "refuses it), of which a restore cannot tell which to give; each process's value is in "
                        "its process-i.safetensors, and FerryRestore(partial_restore=True) with a target "
                        "lacking the leaf restores the others")
                    break
        _check_structure(self.structure, directory, self.leaves)
        self._readers: dict[str, ShardReader] = {}
        self._whole: dict[str, WholeReads | MappedReads] = {}
        self._whole_boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[WholeReads | MappedReads, str]] = {}
        # Chunks read whole, to be verified, for the boxes that take parts of them (when verifying).
        self.shared_chunks = SharedChunks()

    def restorable(self, name: str) -> _Leaf:
        """The saved leaf ``name``; a ``KeyError`` where none was saved, and a
        :class:`CorruptCheckpointError` where processes saved a box of it twice."""
        leaf = self.leaves.get(name)
        if leaf is None:
            raise KeyError(missing_names(self.directory, "leaf", [name], self.leaves))
        if name in self.saved_twice:
            raise CorruptCheckpointError(self.saved_twice[name])
        return leaf

    def reader(self, filename: str) -> ShardReader:
        if filename not in self.manifests:
            raise CorruptCheckpointError(f"{self.directory}: a leaf lies in {filename!r}, which no index lists")
        if filename not in self._readers:
            self._readers[filename] = open_shard(self.directory, self.manifests[filename], filename,
                                                 engine=self.engine, verify=self.verify)
        return self._readers[filename]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._whole.clear()
        self._whole_boxes.clear()
        self.shared_chunks = SharedChunks()

    def read_whole_chunks_together(self, boxes: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Of the boxes ``(leaf, offsets, sizes)`` a restore is about to start, those that
        are a whole stored chunk (the sharding it was saved with) are then read with their
        neighbours in the file, in few large requests, not one request each (or mapped,
        with ``mapped``: :meth:`ShardReader.map_many`)."""
        per_file: dict[str, list[str]] = collections.defaultdict(list)
        box_keys = {}
        for name, offsets, sizes in boxes:
            for filename, key, c_off, c_size in self.leaves[name].chunks:
                if c_off == offsets and c_size == sizes:
                    per_file[filename].append(key)
                    box_keys[name, offsets, sizes] = filename, key
                    break
        for filename, keys in per_file.items():
            self._whole[filename] = self.reader(filename).start_whole(keys, mapped=self.mapped)
        for box, (filename, key) in box_keys.items():
            whole = self._whole[filename]
            if key in whole:  # not an empty chunk
                self._whole_boxes[box] = whole, key

    def start_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> Callable[[], np.ndarray]:
        """Starts reading the box ``[offsets, offsets + sizes)`` of leaf ``name`` from the
        stored chunks that overlap it; the function returned waits for the reads and
        returns the box. Without ``verify`` only the bytes needed are read. With it, a
        chunk the box takes a part of is read whole, once for all boxes taking parts, so that
        its checksum (which covers the whole chunk) is checked: see :class:`SharedChunks`. A
        restore starts every box of a leaf before it finishes any, so a chunk is read once
        per leaf and held no longer."""
        whole_chunk = self._whole_boxes.get((name, tuple(offsets), tuple(sizes)))
        if whole_chunk is not None:  # the usual restore, settled by read_whole_chunks_together
            whole, key = whole_chunk
            return whole.start(key)
        leaf = self.leaves[name]
        dtype = to_numpy_dtype(leaf.dtype)
        if math.prod(sizes) == 0:
            return lambda: np.empty(sizes, dtype)
        for filename, key, c_off, c_size in leaf.chunks:
            if all(c <= o and o + s <= c + n for o, s, c, n in zip(offsets, sizes, c_off, c_size)):
                # One stored chunk holds the whole box (the same sharding as at save time,
                # say): a contiguous box comes back in its own aligned buffer, uncopied;
                # a strided one is made compact so the envelope read need not stay alive.
                rel = [o - c for o, c in zip(offsets, c_off)]
                read = self.reader(filename).read_box(key, rel, sizes, shared=self.shared_chunks)

                def one_chunk() -> np.ndarray:
                    box = read.result()
                    return box if box.flags.c_contiguous else box.copy()
                return one_chunk
        out = np.empty(sizes, dtype)
        covered = 0
        reads = []
        for filename, key, c_off, c_size in leaf.chunks:
            lo = [max(o, c) for o, c in zip(offsets, c_off)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, c_off, c_size)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            rel = [l - c for l, c in zip(lo, c_off)]
            lengths = [h - l for l, h in zip(lo, hi)]
            dest = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
            reads.append(self.reader(filename).read_box(key, rel, lengths, out=out[dest], shared=self.shared_chunks))
            covered += math.prod(lengths)
        if covered != out.size:
            raise CorruptCheckpointError(f"{self.directory}: the saved chunks of {name!r} do not cover "
                                         f"the box at {offsets} of size {sizes}")

        def assembled() -> np.ndarray:
            for read in reads:
                read.result()
            return out
        return assembled


def _on_accelerator(array: Any) -> bool:
    return isinstance(array, jax.Array) and any(d.platform != "cpu" for d in array.devices())


def _to_host(arrays: list[tuple[str, Any]]) -> list[tuple[str, np.ndarray]]:
    """The arrays in host memory. Shards on an accelerator all start their device-to-host
    copies before any is waited for, so the copies overlap one another (one at a time,
    each waited for, the link idles between them); CPU shards are zero-copy views."""
    for _, array in arrays:
        if _on_accelerator(array):
            array.copy_to_host_async()
    return [(key, np.asarray(array)) for key, array in arrays]


def _index_path(directory: str, process: int) -> str:
    return os.path.join(directory, index_name(process))


def _refuse_index_over_cap(directory: str, process: int, size: int, bound: str = "") -> None:
    """Refuses an index of ``size`` bytes (``bound``: "at least ") over read_small_file's cap;
    with no index, Orbax commits no step."""
    if size > MAX_SMALL_FILE_BYTES:
        raise ValueError(f"{directory}: process {process}'s index of {bound}{size} bytes, more than the "
                         f"{MAX_SMALL_FILE_BYTES} a reader accepts (fewer leaves, shorter names or strings)")


class FerryCheckpointHandler(async_checkpoint_handler.AsyncCheckpointHandler):
    """An Orbax ``AsyncCheckpointHandler`` for pytrees of ``jax.Array``, numpy arrays
    and Python scalars, writing through :class:`tensorferry.ShardWriter`.

    Use it in ``ocp.CheckpointManager(item_handlers={"state": FerryCheckpointHandler()})``
    with ``FerrySave(state)`` / ``FerryRestore(abstract_state)``, or with
    ``ocp.Checkpointer`` / ``ocp.AsyncCheckpointer`` directly. Device data is copied
    to host memory before ``async_save`` returns, every shard's copy started before
    any is waited for (a donated buffer could not be read later); the file writes run
    in Orbax's commit thread. Restored arrays are put on their devices box by box as
    the reads land, later reads still in flight.

    Args:
        engine: the :class:`tensorferry.Engine` to use (default: the shared one).
        verify: check every stored chunk a restore reads from against its checksum
            (a chunk the target's boxes take only parts of is read whole for it).
        buffer_size: the ShardWriter's staging buffer.
        copy_host_arrays: copy numpy arrays before ``async_save`` returns, so that
            mutating them while the write is in flight is safe (a synchronous ``save``
            never copies them: nothing runs while it writes). ``False`` writes straight
            from their memory and requires the caller not to mutate them until the save
            is finished. ``jax.Array`` shards on CPU devices are never copied: the save
            holds a zero-copy numpy view of each, and while such a view lives XLA
            neither donates nor frees the buffer (a donated call allocates anew, as
            Orbax relies on too; tested). Arrays on accelerators are always copied
            to the host.
    """

    def __init__(self, *, engine: Engine | None = None, verify: bool = True, buffer_size: int = DEFAULT_BUFFER_SIZE,
                 copy_host_arrays: bool = True) -> None:
        self.engine = engine
        self.verify = verify
        self.buffer_size = buffer_size
        self.copy_host_arrays = copy_host_arrays

    # ---- save -------------------------------------------------------------------
    def _stage(self, directory: str, item: Any, copy_host_arrays: bool) -> tuple[dict[str, Any], ShardWriter]:
        """Copies this process's part of ``item`` to the host (host arrays only if
        ``copy_host_arrays``); returns the index's metadata and the writer of the shard
        file in ``directory``, its header planned. What a reader would refuse (a tree too
        deep, a name too long, a header over its cap, metadata alone over the index's cap)
        is refused here, in the caller's thread: an async save raises from the save call,
        not at ``wait_until_finished``. Copies land in page-aligned memory, written with
        O_DIRECT without a staging copy."""
        process = jax.process_index()
        primary = process == 0
        filename = f"process-{process}.safetensors"
        found: dict[str, Any] = {}
        structure = _encode_structure(item, (), found)
        records: dict[str, Any] = {}
        arrays: list[tuple[str, Any]] = []
        to_copy: list[int] = []  # indices into arrays
        for name, value in found.items():
            prng_impl = None
            if isinstance(value, jax.Array):
                _refuse_process_local(name, value)
            if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                # A typed PRNG key (jax.random.key) has no dtype numpy knows: its key data
                # (uint32, one more dimension) is stored, with the implementation's name.
                prng_impl, value = _prng_impl_name(value), jax.random.key_data(value)
            if isinstance(value, jax.Array):
                chunks = []
                for shard in value.addressable_shards:
                    if shard.replica_id != 0:
                        continue
                    offsets, sizes = _box(shard.index, value.shape)
                    key = _chunk_key(name, offsets)
                    # A CPU shard is written from a view of its buffer (see copy_host_arrays).
                    arrays.append((key, shard.data))
                    chunks.append([key, offsets, sizes])
                records[name] = {"kind": "array", "was_jax": True, "shape": list(value.shape),
                                 "dtype": _stored_dtype(name, value.dtype), "file": filename,
                                 "chunks": chunks, **_sharding_fields(value.sharding)}
                if prng_impl is not None:
                    records[name]["prng_impl"] = prng_impl
            elif isinstance(value, (np.ndarray, np.generic)):
                array = np.asarray(value)
                record = {"kind": "array", "was_jax": False, "shape": list(array.shape),
                          "dtype": _stored_dtype(name, array.dtype), "file": filename, "chunks": []}
                if primary:
                    key = _chunk_key(name, [0] * array.ndim)
                    arrays.append((key, array))
                    if copy_host_arrays:
                        to_copy.append(len(arrays) - 1)
                    record["chunks"] = [[key, [0] * array.ndim, list(array.shape)]]
                records[name] = record
            elif isinstance(value, _SCALARS):
                float_name = non_finite_name(value)
                records[name] = ({"kind": "scalar", "value": value} if float_name is None
                                 else {"kind": "float", "value": float_name})  # an older reader refuses the kind
            else:
                raise TypeError(f"{name or 'the item'}: cannot save a {type(value).__name__} "
                                "(jax.Array, numpy arrays and Python scalars can be saved)")
        metadata = {"format": INDEX_FORMAT, "process": process, "process_count": jax.process_count(),
                    "leaves": records}
        if primary:
            metadata["structure"] = structure
        # The index holds this and each chunk's entry, whose size is known once the file is
        # written: over the cap with the metadata alone, it is refused now (_write checks it whole).
        _refuse_index_over_cap(directory, process, len(json.dumps(metadata, separators=(",", ":"), allow_nan=False)),
                               "at least ")
        for i, copy in zip(to_copy, aligned_copies([arrays[i][1] for i in to_copy])):
            arrays[i] = (arrays[i][0], copy)
        writer = ShardWriter(os.path.join(directory, filename), self.engine, buffer_size=self.buffer_size)
        for key, array in _to_host(arrays):
            writer.add(key, array)
        writer.plan()  # refuses a header over the readers' cap
        return metadata, writer

    @gc_paused(main_thread_only=True)  # the writes last as long as the drive takes
    def _write(self, directory: str, metadata: dict[str, Any], writer: ShardWriter) -> None:
        process = metadata["process"]
        os.makedirs(directory, exist_ok=True)
        index = encode_manifest([writer.close()], metadata)
        _refuse_index_over_cap(directory, process, len(index))
        write_durably(_index_path(directory, process), index)

    async def async_save(self, directory: Any, item: Any = None, args: "FerrySave | None" = None
                         ) -> list[ocp_future.Future]:
        """Copies the item's data to the host, then returns a commit future that writes it."""
        if isinstance(item, checkpoint_args.CheckpointArgs):
            raise ValueError("pass FerrySave as args=, not as item")
        if args is not None:
            item = args.item
        # Orbax creates the directory meanwhile; a path awaiting its creation names it already.
        path = local_path(directory.path if hasattr(directory, "await_creation") else directory)
        try:
            metadata, writer = self._stage(path, item, self.copy_host_arrays)
        except BaseException:
            _await_orbax_directory_creation()
            raise

        async def commit() -> None:
            if hasattr(directory, "await_creation"):
                await directory.await_creation()
            self._write(path, metadata, writer)

        return [ocp_future.CommitFutureAwaitingContractedSignals(commit(), name="tensorferry_jax_save")]

    def save(self, directory: Any, item: Any = None, args: "FerrySave | None" = None) -> None:
        """Writes the item and returns once it is durable. Nothing runs while this does,
        so host arrays are written from their own memory, without a copy."""
        if args is not None:
            item = args.item
        path = local_path(directory)
        metadata, writer = self._stage(path, item, copy_host_arrays=False)
        self._write(path, metadata, writer)

    # ---- restore ----------------------------------------------------------------
    @gc_paused()
    def restore(self, directory: Any, item: Any = None, args: "FerryRestore | None" = None) -> Any:
        """Restores into the shapes, dtypes and shardings of ``args.item`` (an abstract
        tree of ``jax.ShapeDtypeStruct`` or concrete arrays, its leaves matched to the saved
        ones by key names, as Orbax matches them); without one, arrays come back in the
        saved structure as they were saved, as Orbax's own handlers restore: ``jax.Array``
        leaves as ``jax.Array`` on their saved mesh (onto this process's first device where
        this run lacks that mesh's devices), numpy arrays as numpy arrays. A process
        holding no device of a sharding reads nothing of that leaf and gets the global
        array without a shard of it (a step saved by one process restored without a
        target by two: the second holds nothing of an array saved on a mesh).
        ``args.mmap``, ``args.partial_restore``: see :class:`FerryRestore`."""
        mapped = partial = False
        if args is not None:
            item, mapped, partial = args.item, args.mmap, args.partial_restore
        ckpt = _Checkpoint(local_path(directory), self.engine, self.verify, mapped)
        try:
            if item is None:
                names: list[str] = []
                _decode_structure(ckpt.structure, names.append)
                values = dict(zip(names, _restore_leaves(ckpt, [_as_saved(ckpt, name) for name in names])))
                return _decode_structure(ckpt.structure, values.__getitem__)
            leaves, treedef = jax.tree_util.tree_flatten_with_path(item)
            names = _saved_names(ckpt, [path for path, _ in leaves])
            reads = [_leaf_for(ckpt, name, target) for name, (_, target) in zip(names, leaves)]
            wanted = set(names)
            left_out = [] if partial else [name for name in ckpt.leaves if name not in wanted]
            if left_out:
                raise ValueError(f"{ckpt.directory}: the target lacks {len(left_out)} saved leaves: "
                                 f"{listed(left_out)}; give it those, or pass FerryRestore(partial_restore=True) "
                                 "to restore the target's leaves alone")
            return jax.tree_util.tree_unflatten(treedef, _restore_leaves(ckpt, reads))
        finally:
            ckpt.close()

    def metadata(self, directory: Any) -> Any:
        """The saved tree with ``jax.ShapeDtypeStruct`` for arrays (``jax.Array`` leaves
        with the sharding a restore without a target gives them, numpy leaves and typed
        PRNG keys with none) and the values of scalars: a restore target, whose shardings
        may be changed."""
        ckpt = _Checkpoint(local_path(directory), self.engine, self.verify)

        def describe(name: str) -> Any:
            leaf = ckpt.leaves[name]
            if leaf.kind == "scalar":
                return leaf.value
            if leaf.prng_impl is not None:
                return _abstract_keys(leaf)
            return jax.ShapeDtypeStruct(leaf.shape, to_numpy_dtype(leaf.dtype),
                                        sharding=_saved_sharding(name, leaf) if leaf.was_jax else None)

        return _decode_structure(ckpt.structure, describe)

    def finalize(self, directory: Any) -> None:
        """Checks that every process's index was written (Orbax then commits)."""
        count = jax.process_count()
        directory = os.fspath(directory)
        missing = [i for i in range(count) if not os.path.exists(_index_path(directory, i))]
        if missing:
            raise CorruptCheckpointError(f"{directory}: processes {missing} wrote no index")

    def close(self) -> None:
        pass


async def _nothing() -> None:
    pass


def _await_orbax_directory_creation() -> None:
    """Waits for the directory creation Orbax started in its threads before calling
    ``async_save`` (a refused save drops their futures). A program that ends on the
    refusal otherwise hangs at exit for Orbax's coordination timeout (300 s): the step
    directory's thread fails once the interpreter shuts down (its executor takes no more
    work) and never signals, and the item directory's thread, which the interpreter joins,
    waits for that signal. Returns at once where Orbax awaits no signal."""
    ocp_future.CommitFutureAwaitingContractedSignals(_nothing(), name="tensorferry_jax_refused").result()


def _refuse_process_local(name: str, value: jax.Array) -> None:
    """Refuses, in a job of several processes, an array on the devices of one process
    alone: a process-local array (``jnp.full(3, pid)``, a key folded with the process
    index, pmap's outputs) is that on every process, and each process would save its
    own under the same chunk names, of which a restore gives every process one. Orbax
    refuses these too ("Cannot serialize host local jax.Array", where
    ``jax.process_count() > 1`` and the array ``is_fully_addressable``): on the process
    holding the array that test is this one. This one refuses the array on a process
    holding none of it as well (a pipeline stage on another process's devices), which
    would otherwise go on to wait in Orbax's barrier for the process that refused it."""
    count = jax.process_count()
    if count == 1:
        return
    owners = {device.process_index for device in value.sharding.device_set}
    if len(owners) != 1:
        return
    (owner,) = owners
    where = "this process's devices" if owner == jax.process_index() else f"the devices of process {owner}"
    raise ValueError(
        f"{name or 'the item'}: a jax.Array on {where} alone ({repr(value.sharding)[:200]}) in a job of {count} "
        "processes, which a save cannot tell from a process-local array (each process's own, which every "
        "process would save as the whole array and a restore could not tell apart; Orbax refuses these too: "
        "\"Cannot serialize host local jax.Array\"). Save one global array over every process's devices "
        "instead: jax.make_array_from_process_local_data(NamedSharding(Mesh(np.array(jax.devices()).reshape("
        "jax.process_count(), -1), ('p', 'd')), P('p')), x[None]) keeps each process's value as a row of it; a "
        "value the same on every process can be saved as a numpy array (process 0's is written)")


def _stored_dtype(name: str, dtype: Any) -> str:
    """The safetensors name of leaf ``name``'s dtype; the refusal names the leaf."""
    return to_safetensors_dtype(np.dtype(dtype), name or "the item")


def _in_window(starts: Iterable[Callable[[], tuple[int, Callable[[], Any]]]]) -> list[Any]:
    """Calls each start (which begins a leaf's reads and returns their byte count and
    a function that finishes the leaf), keeping about ``RESTORE_WINDOW`` bytes of
    reads in flight, and returns the finished leaves in order. Read one at a time,
    leaves of up to a block (1 MiB) kept a single request in flight and larger ones a
    short queue; the window bounds the host memory that reads ahead take."""
    pending: collections.deque[tuple[int, Callable[[], Any]]] = collections.deque()
    finished: list[Any] = []
    in_flight = 0
    for start in starts:
        nbytes, finish = start()
        pending.append((nbytes, finish))
        in_flight += nbytes
        while in_flight > RESTORE_WINDOW:
            nbytes, finish = pending.popleft()
            finished.append(finish())
            in_flight -= nbytes
    finished.extend(finish() for _, finish in pending)
    return finished


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclasses.dataclass
class _LeafRead:
    """One leaf of a restore: the distinct boxes of it to read, and how the boxes, once
    started, become the leaf."""

    ckpt: _Checkpoint
    name: str
    boxes: list[Box]
    nbytes: int
    finish: Callable[[dict[Box, Callable[[], np.ndarray]]], Any]

    def start(self) -> tuple[int, Callable[[], Any]]:
        """Starts the boxes' reads; returns the bytes in flight (the boxes, and the chunks
        read whole to verify the parts the boxes take of them) and what finishes the leaf."""
        chunk_bytes_before = self.ckpt.shared_chunks.started_bytes
        started = {box: self.ckpt.start_box(self.name, *box) for box in self.boxes}
        return self.nbytes + self.ckpt.shared_chunks.started_bytes - chunk_bytes_before, lambda: self.finish(started)


def _restore_leaves(ckpt: _Checkpoint, reads: list[_LeafRead]) -> list[Any]:
    ckpt.read_whole_chunks_together((r.name, *box) for r in reads for box in r.boxes)
    return _in_window(r.start for r in reads)


def _host_value(ckpt: _Checkpoint, name: str) -> _LeafRead:
    leaf = ckpt.leaves[name]
    if leaf.kind == "scalar":
        return _LeafRead(ckpt, name, [], 0, lambda started: leaf.value)
    box = ((0,) * len(leaf.shape), leaf.shape)
    read = _LeafRead(ckpt, name, [box], math.prod(leaf.shape) * to_numpy_dtype(leaf.dtype).itemsize,
                     lambda started: started[box]())
    return read if leaf.prng_impl is None else _as_keys(read, leaf)


def _as_saved(ckpt: _Checkpoint, name: str) -> _LeafRead:
    """Leaf ``name`` as it was saved: a ``jax.Array`` on its saved sharding, or a host value."""
    leaf = ckpt.restorable(name)
    if leaf.kind == "scalar" or not leaf.was_jax:
        return _host_value(ckpt, name)
    data = _array_leaf_for(ckpt, name, leaf, jax.ShapeDtypeStruct(leaf.shape, to_numpy_dtype(leaf.dtype),
                                                                  sharding=_saved_sharding(name, leaf)))
    return data if leaf.prng_impl is None else _as_keys(data, leaf)


def _sharding_fields(sharding: Any) -> dict[str, Any]:
    """The leaf record's fields that let a restore without a target rebuild ``sharding``:
    a ``NamedSharding`` as JSON under "sharding" (its mesh's shape, axis names, axis types
    and device ids, and the partition spec), a ``SingleDeviceSharding``'s device id under
    "device" (a field of its own: releases before it read "sharding" as a mesh, and ignore
    "device"); none for other shardings and for axis names JSON cannot hold."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return {"device": int(next(iter(sharding.device_set)).id)}
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return {}
    spec = [list(part) if isinstance(part, tuple) else part for part in sharding.spec]
    names = list(sharding.mesh.axis_names)
    named = names + [axis for part in spec if part is not None for axis in (part if isinstance(part, list) else [part])]
    if not all(isinstance(axis, str) for axis in named):  # PartitionSpec.UNCONSTRAINED, say, is not one
        return {}
    record = {"mesh_shape": list(sharding.mesh.devices.shape), "axis_names": names,
              "device_ids": [int(i) for i in np.ravel(sharding.mesh.device_ids)], "spec": spec}
    # Explicit axes must come back Explicit: JAX refuses to compute with arrays on meshes that
    # differ in axis types. A tuple of AxisType as JAX 0.6 on gives them; any other form is left out.
    axis_types = getattr(sharding.mesh, "axis_types", None)
    if isinstance(axis_types, tuple) and all(isinstance(getattr(t, "name", None), str) for t in axis_types):
        record["axis_types"] = [t.name for t in axis_types]
    return {"sharding": record}


def _saved_sharding(name: str, leaf: _Leaf) -> jax.sharding.Sharding:
    """The sharding a ``jax.Array`` leaf was saved with where this run has every device of
    its mesh (or its one device, where this process has it), as Orbax restores without a
    target; otherwise this process's first device. A mesh is kept where its devices are
    all another process's: every process must give the same sharding to one global array,
    and the process holding none of it gets it without a shard. A single device is a
    process-local array's, which each process gets whole."""
    record = leaf.sharding
    if record is not None:
        try:
            by_id = {device.id: device for device in jax.devices()}
            ids = record["device_ids"]
            if all(i in by_id for i in ids):
                devices = np.array([by_id[i] for i in ids], dtype=object).reshape(record["mesh_shape"])
                spec = [tuple(part) if isinstance(part, list) else part for part in record["spec"]]
                return jax.sharding.NamedSharding(_mesh(devices, record), jax.sharding.PartitionSpec(*spec))
        except (KeyError, TypeError, ValueError) as exc:  # sealed, yet not as written
            raise CorruptCheckpointError(f"the saved sharding of {name} is malformed ({exc})") from None
    # Another process's device would leave this process's array without data.
    device = next((d for d in jax.local_devices() if d.id == leaf.device), jax.local_devices()[0])
    return jax.sharding.SingleDeviceSharding(device)


def _mesh(devices: np.ndarray, record: Mapping[str, Any]) -> jax.sharding.Mesh:
    """The mesh of a sharding record, with its axis types where it has them and this JAX
    knows them (before 0.6 there are none to give: every axis is Auto)."""
    names = tuple(record["axis_names"])
    types = record.get("axis_types")
    if types is None or not hasattr(jax.sharding, "AxisType"):
        return jax.sharding.Mesh(devices, names)
    return jax.sharding.Mesh(devices, names, axis_types=tuple(jax.sharding.AxisType[t] for t in types))


def _scalar_as(value: Any, target: Any, name: str) -> Any:
    """A Python number saved as a leaf, as the target asks for it: where the target is
    an array (abstract or concrete), an array of its dtype, on its sharding (as
    ``jax.eval_shape`` of an init that returns ``step=0`` asks for a step), so that the
    restored tree has the types the target has; where it is a Python number, a number of
    its type (as Orbax casts it); as saved otherwise."""
    if isinstance(value, (str, type(None))):
        return value
    number = _python_number_type(target)
    if number is not None:
        return _as_python_number(value, number, name)
    if not (hasattr(target, "shape") and hasattr(target, "dtype")):
        return value
    if tuple(target.shape) != ():
        raise ValueError(f"{name}: saved as the number {value!r}, the target has shape {tuple(target.shape)}")
    array = np.asarray(value, dtype=target.dtype)
    if isinstance(target, (np.ndarray, np.generic)):
        return array if isinstance(target, np.ndarray) else array[()]
    sharding = getattr(target, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.device_put(array, sharding)


def _python_number_type(target: Any) -> type | None:
    """The type of a target that is a Python number (bool, int, float), which asks for one
    back; None for any other (np.float64 is a float too, but numpy's)."""
    return type(target) if isinstance(target, (int, float)) and not isinstance(target, np.generic) else None


def _as_python_number(value: Any, number: type, name: str) -> Any:
    """``value`` cast to ``number`` as Orbax's restore casts it (2.5 into an int is 2)."""
    try:
        return number(value)
    except (OverflowError, ValueError):  # nan or inf into an int
        raise ValueError(f"{name}: saved as {value!r}, which the target's {number.__name__} cannot hold") from None


def _saved_names(ckpt: _Checkpoint, paths: Sequence[tuple]) -> list[str]:
    """The saved leaf each of a target's key paths restores from: the leaf saved at that
    key path, else the one of the same key names, as Orbax matches leaves (a dataclass
    field and a dict key of one name are one place, where ``keystr`` tells ``.params``
    from ``['params']``); a path matching neither keeps its name, for the error."""
    names = [jax.tree_util.keystr(path) for path in paths]
    if all(name in ckpt.leaves for name in names):  # the usual restore: no need to walk the saved structure
        return names
    by_key_names = _leaves_by_key_names(ckpt.structure)
    return [name if name in ckpt.leaves else by_key_names.get(tuple(map(_key_entry, path)), name)
            for name, path in zip(names, paths)]


def _leaves_by_key_names(spec: Any, keys: tuple = (), found: dict[tuple, str] | None = None) -> dict[tuple, str]:
    """Each leaf of a saved structure by the key names of its path (dict keys, sequence
    indices, the keys :func:`_key_entry` gave a custom node's children)."""
    found = {} if found is None else found
    kind = next(iter(spec))
    if kind == "leaf":
        found[keys] = spec["leaf"]
    elif kind in ("dict", "node"):
        for key, child in spec["dict"] if kind == "dict" else spec["children"]:
            _leaves_by_key_names(child, keys + (key,), found)
    elif kind in ("list", "tuple"):
        for i, child in enumerate(spec[kind]):
            _leaves_by_key_names(child, keys + (i,), found)
    return found


def _leaf_for(ckpt: _Checkpoint, name: str, target: Any) -> _LeafRead:
    """How leaf ``name`` is restored into the shape, dtype and sharding of ``target``."""
    leaf = ckpt.restorable(name)
    if leaf.kind == "scalar":
        return _LeafRead(ckpt, name, [], 0, lambda started: _scalar_as(leaf.value, target, name))
    if leaf.prng_impl is not None:
        return _key_leaf_for(ckpt, name, leaf, target)
    return _array_leaf_for(ckpt, name, leaf, target)


def _abstract_keys(leaf: _Leaf) -> jax.ShapeDtypeStruct:
    """The keys a leaf of key data holds, as shape and key dtype (nothing computed)."""
    return jax.eval_shape(lambda: jax.random.wrap_key_data(jax.numpy.zeros(leaf.shape, to_numpy_dtype(leaf.dtype)),
                                                           impl=leaf.prng_impl))


def _key_leaf_for(ckpt: _Checkpoint, name: str, leaf: _Leaf, target: Any) -> _LeafRead:
    """A typed PRNG key array: its key data restored as the target's keys lie (their
    shape; their sharding, with the data's trailing dimensions whole), then wrapped.
    A target of the key data's own shape and dtype gets keys too, as Orbax's restore
    gives them: it is what ``ocp.utils.to_shape_dtype_struct`` makes of keys, the usual
    abstract target. A target of another plain dtype or shape asks for the key data."""
    wanted = getattr(target, "dtype", None)
    if wanted is not None and not jax.dtypes.issubdtype(wanted, jax.dtypes.prng_key):
        data = _array_leaf_for(ckpt, name, leaf, target)
        as_data = (tuple(getattr(target, "shape", ())), np.dtype(wanted)) == (leaf.shape, to_numpy_dtype(leaf.dtype))
        return _as_keys(data, leaf) if as_data else data
    if wanted is not None:
        saved = _abstract_keys(leaf).dtype
        if saved != wanted:
            raise ValueError(f"{name}: saved as {saved} keys ({leaf.prng_impl}), the target asks for {wanted}")
    key_shape = tuple(getattr(target, "shape", leaf.shape[:-1]))
    if leaf.shape[:len(key_shape)] != key_shape or len(leaf.shape) == len(key_shape):
        raise ValueError(f"{name}: saved as keys of shape {leaf.shape[:-1]}, the target has {key_shape}")
    trailing = len(leaf.shape) - len(key_shape)
    sharding = getattr(target, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(key_shape) - len(sharding.spec) + trailing)
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return _as_keys(_array_leaf_for(ckpt, name, leaf, jax.ShapeDtypeStruct(leaf.shape, to_numpy_dtype(leaf.dtype),
                                                                           sharding=sharding)), leaf)


def _as_keys(data: _LeafRead, leaf: _Leaf) -> _LeafRead:
    """The read of a leaf's key data, finished as the keys (of its implementation)."""
    return dataclasses.replace(data, finish=lambda started: jax.random.wrap_key_data(data.finish(started),
                                                                                     impl=leaf.prng_impl))


# Releases of this adapter under JAX before 0.5 stored the implementation's tag, which
# ``wrap_key_data`` refuses; the tags of the implementations those JAX releases had.
_PRNG_NAMES_BY_TAG = {"fry": "threefry2x32", "urbg": "unsafe_rbg"}


def _prng_impl_name(keys: jax.Array) -> str:
    """The name ``jax.random.wrap_key_data(impl=)`` takes for the keys' implementation.
    Before JAX 0.5 ``key_impl`` gives a ``PRNGSpec``, whose ``str`` is a short tag
    ("fry" for threefry2x32) that ``wrap_key_data`` refuses."""
    impl = jax.random.key_impl(keys)
    return impl if isinstance(impl, str) else getattr(getattr(impl, "_impl", None), "name", None) or str(impl)


def _array_leaf_for(ckpt: _Checkpoint, name: str, leaf: _Leaf, target: Any) -> _LeafRead:
    shape = tuple(getattr(target, "shape", leaf.shape))
    if shape != leaf.shape:
        raise ValueError(f"{name}: saved with shape {leaf.shape}, the target has {shape}")
    dtype = np.dtype(getattr(target, "dtype", to_numpy_dtype(leaf.dtype)))
    itemsize = to_numpy_dtype(leaf.dtype).itemsize
    number = _python_number_type(target)
    if number is not None and shape != ():
        raise ValueError(f"{name}: saved with shape {shape}, the target is the number {target!r}")
    if isinstance(target, (np.ndarray, np.generic)) or (target is not None and not hasattr(target, "sharding")
                                                        and not isinstance(target, jax.ShapeDtypeStruct)):
        whole = ((0,) * len(shape), shape)

        def finish_host(started: dict[Box, Callable[[], np.ndarray]]) -> Any:
            array = started[whole]().astype(dtype, copy=False)
            if number is not None:
                return _as_python_number(array.item(), number, name)
            return array[()] if isinstance(target, np.generic) else array  # a numpy scalar asks for one

        return _LeafRead(ckpt, name, [whole], math.prod(shape) * itemsize, finish_host)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        # A target that says no sharding (a ShapeDtypeStruct without one) gets the saved
        # sharding, as from Orbax's restore, where an array was saved; else the first device.
        sharding = (_saved_sharding(name, leaf) if leaf.was_jax
                    else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    if not sharding.addressable_devices:
        # A pipeline stage on other processes' devices, say: this process has nothing to read.
        if not _CALLBACK_TAKES_DTYPE:
            raise ValueError(f"{name}: this process holds no device of the target's sharding ({sharding}), "
                             f"and JAX {jax.__version__} cannot make an array of which it holds no shard "
                             "(jax.make_array_from_callback takes a dtype from 0.5.3 on): upgrade JAX, or "
                             "restore onto devices of every process")
        # JAX calls the callback once for a replicated sharding even where it has no device to put it on.
        nothing = np.broadcast_to(np.zeros((), dtype), shape)
        return _LeafRead(ckpt, name, [], 0, lambda started: _from_callback(shape, sharding, lambda index: nothing,
                                                                           dtype))
    # Replicated shardings ask for the same box on several devices: it is read once.
    if sharding.is_fully_replicated:  # one device too: no need to map each device's index
        boxes = [((0,) * len(shape), shape)]
    else:
        indices = sharding.addressable_devices_indices_map(shape).values()
        boxes = list(dict.fromkeys(_box(index, shape) for index in indices))

    if len(boxes) == 1:  # every device's index selects the same box (one device, or replicated)
        def finish_one(started: dict[Box, Callable[[], np.ndarray]]) -> jax.Array:
            data = started[boxes[0]]().astype(dtype, copy=False)
            return _from_callback(shape, sharding, lambda index: data, dtype)

        return _LeafRead(ckpt, name, boxes, math.prod(boxes[0][1]) * itemsize, finish_one)

    def finish(started: dict[Box, Callable[[], np.ndarray]]) -> jax.Array:
        done: dict[Box, np.ndarray] = {}

        def callback(index: tuple) -> np.ndarray:
            box = _box(index, shape)
            if box not in done:
                read = started.get(box) or ckpt.start_box(name, *box)
                done[box] = read().astype(dtype, copy=False)
            return done[box]

        return _from_callback(shape, sharding, callback, dtype)

    return _LeafRead(ckpt, name, boxes, sum(math.prod(sizes) for _, sizes in boxes) * itemsize, finish)


# Without dtype= (JAX before 0.5.3) JAX takes the dtype from the first shard, and cannot
# make an array of which this process holds none.
_CALLBACK_TAKES_DTYPE = "dtype" in inspect.signature(jax.make_array_from_callback).parameters


def _from_callback(shape: tuple[int, ...], sharding: jax.sharding.Sharding, callback: Any,
                   dtype: np.dtype) -> jax.Array:
    if _CALLBACK_TAKES_DTYPE:
        return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)
    return jax.make_array_from_callback(shape, sharding, callback)


@checkpoint_args.register_with_handler(FerryCheckpointHandler, for_save=True)
@dataclasses.dataclass
class FerrySave(checkpoint_args.CheckpointArgs):
    """Save arguments for :class:`FerryCheckpointHandler`: ``item`` is the pytree."""

    item: Any


@checkpoint_args.register_with_handler(FerryCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class FerryRestore(checkpoint_args.CheckpointArgs):
    """Restore arguments: ``item`` is the target tree (abstract or concrete) or None.

    A number saved as a leaf (``step=0``) comes back as an array of the target's dtype and
    sharding where the target leaf is an array (``jax.eval_shape``'s ``ShapeDtypeStruct``);
    a number or a 0-d array saved comes back as a number of the target's type where that
    is a Python number (as Orbax casts it: 2.5 into ``0`` is ``2``), and as a numpy scalar of
    the target's dtype where that is one (``np.float32(0)``, which Orbax's restore refuses).

    ``mmap=True`` maps the stored chunks restored whole (those saved with the target's
    sharding) instead of reading them into new memory, as
    ``tensorferry.adapters.pytorch.load(mmap=True)`` does: checksums still verified, about
    half the CPU; on the CPU, JAX's arrays then alias the mapped file's pages (JAX never
    writes them; a donated buffer is copied page by page as XLA writes it). The files must
    not be truncated or rewritten in place while the arrays live.

    A target lacking some saved leaves is a ``ValueError`` naming them, as Orbax's
    ``StandardRestore`` refuses it; ``partial_restore=True`` (Orbax's name) restores the
    target's leaves alone."""

    item: Any = None
    mmap: bool = False
    partial_restore: bool = False


# ---- cross-framework ------------------------------------------------------------
def load_pytree(path: str | os.PathLike, *, engine: Engine | None = None, verify: bool = True,
                device: Any = None) -> dict[str, jax.Array]:
    """Loads every tensor of a safetensors file (one written by
    ``tensorferry.adapters.pytorch.save``, ``FSDPCheckpointer.save_consolidated``,
    :func:`save_pytree` or anyone) into a flat dict of JAX arrays by name.
    A checkpoint directory (``save_checkpoint``'s, or a Hugging Face folder) loads the
    same way, its files read in parallel (``tensorferry.load_checkpoint``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        arrays = load_checkpoint(path, engine=engine, verify=verify)
    else:
        with ShardReader(path, engine, verify=verify) as reader:
            arrays = reader.read_many()
    # make_array_from_callback, not device_put: a third of the cost per array (22-27 µs
    # against 69-77 for 512 KiB arrays), and on the CPU it keeps the aligned reads as they are.
    sharding = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
    return {name: jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a) for name, a in arrays.items()}


def save_pytree(path: str | os.PathLike, tree: Any, *, engine: Engine | None = None,
                metadata: Mapping[str, str] | None = None) -> None:
    """Writes a pytree of arrays as one consolidated safetensors file, tensors named by
    their key paths (``['params']['w']``). Every array must be fully addressable
    from this process. torch reads it with ``tensorferry.adapters.pytorch.load``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    with ShardWriter(path, engine, metadata=metadata, atomic=True) as writer:
        for keypath, value in leaves:
            name = jax.tree_util.keystr(keypath)
            if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                raise TypeError(f"{name} is a typed PRNG key array, which a plain safetensors file cannot mark "
                                "as keys: save jax.random.key_data(key), or use FerryCheckpointHandler")
            if isinstance(value, jax.Array):
                writer.add(name, _stored_dtype(name, value.dtype), value.shape, lambda value=value: np.asarray(value))
            else:
                array = np.asarray(value)
                _stored_dtype(name, array.dtype)  # refused here, naming the leaf
                writer.add(name, array)
