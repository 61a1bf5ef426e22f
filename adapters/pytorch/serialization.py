"""A drop-in for torch.save/torch.load of state dicts, without pickle.

Tensors go into one safetensors file (:func:`save`) or a checkpoint directory
(:func:`save_checkpoint`) at drive speed; the structure around them (nested dicts and
OrderedDicts with str or int keys, a state dict's ``_metadata``, lists, tuples,
``torch.Size``, numbers, strings, None, numpy arrays) goes into the metadata as JSON.
Any safetensors reader can open the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import OrderedDict
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Union

import numpy as np
import torch

from ...checkpoint import (DEFAULT_SHARD_BYTES, MAX_CONCURRENT_SHARDS, listed_by_manifest, load_with_manifest,
                           names_to_read, open_shard, read_manifest)
from ...checkpoint import load_checkpoint as _load_directory
from ...checkpoint import save_checkpoint as _save_directory
from ...dtypes import to_safetensors_dtype
from ...engine import Engine
from ...errors import CorruptCheckpointError
from ...layouts.huggingface import INDEX_SUFFIX
from ...pools import ThreadPool
from ...schema import MAX_STRUCTURE_DEPTH, STRUCTURE_KEY, check_structure, parse_json
from ...shard import DEFAULT_BUFFER_SIZE, Deferred, ShardReader, ShardWriter, StreamReader, gc_paused, write_order
from ...streams import file_behind, is_stream, require
from .staging import DeviceToHost, read_to_device
from .tensors import FROM_SAFETENSORS, from_array, host_array, refuse_wrapper_subclass, safetensors_dtype

TORCH_FORMAT = {"format": "pt"}  # what safetensors.torch writes, and transformers 4.x requires
_SCALARS = (bool, int, float, str, type(None))


def _storage_key(t: torch.Tensor) -> Any:
    """What makes two tensors one: the same memory seen the same way. ``state_dict()``
    returns a new tensor object per entry, so object identity misses tied weights. A lazy
    conjugate or negation (``x.conj()``, ``x.conj().imag``) sees the same memory another way."""
    if t.numel() == 0:
        return ("object", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride(),
            t.is_conj(), t.is_neg())


def _check_savable(tensor: torch.Tensor, where: str) -> None:
    """Refuses, naming the entry, what has no safetensors form: a DTensor or ShardedTensor
    (one rank's part of a tensor spread over ranks, which saved as it is would have each
    rank write its own shard under the full tensor's name), a dtype safetensors has no
    name for, a sparse or nested tensor, a meta tensor (no data), and a tensor subclass
    that wraps others (torchao's), whose bytes are not its own."""
    where = where or "the object"
    for module, name in _SPREAD_OVER_RANKS:  # first: a ShardedTensor answers few attributes
        kind = getattr(sys.modules.get(module), name, None)  # looked up, not imported: none exists unless imported
        if kind is not None and isinstance(tensor, kind):
            raise TypeError(f"{where} is a {name} (a shard of a tensor spread over ranks, as FSDP and tensor "
                            "parallelism make): save such a state with DCPWriter or FSDPCheckpointer, or gather "
                            "it first (torch.distributed.checkpoint.state_dict.get_model_state_dict with "
                            "StateDictOptions(full_state_dict=True, cpu_offload=True), as "
                            "FSDPCheckpointer.save_consolidated does)")
    safetensors_dtype(tensor.dtype, where)
    if tensor.is_nested:
        raise TypeError(f"{where} is a nested tensor: save its components (tensor.unbind()) instead")
    if tensor.layout != torch.strided:
        raise TypeError(f"{where} is a {str(tensor.layout).removeprefix('torch.')} tensor: safetensors holds "
                        "dense tensors; save tensor.to_dense(), or the sparse tensor's own index and value tensors")
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):  # torch's own error named no entry
        raise TypeError(f"{where} is an uninitialized parameter or buffer of a lazy module (LazyLinear, say): "
                        "run a forward pass to make its shape, or save the state dict without it")
    _check_has_data(tensor, where)
    refuse_wrapper_subclass(tensor, where)


def _check_has_data(tensor: torch.Tensor, where: str) -> None:
    # Apart, so that a test can let meta tensors stand in for device tensors.
    if tensor.device.type == "meta":
        raise TypeError(f"{where} is on the meta device and holds no data: materialize the model first "
                        "(model.to_empty(device=...) and load or initialize its weights)")


# FSDP2's and tensor parallelism's DTensor, FSDP1's ShardedTensor (whose device is "meta").
_SPREAD_OVER_RANKS = (("torch.distributed.tensor", "DTensor"),
                      ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"))


class _Encoder:
    """Flattens a nested object into named tensors (each stored once) and a JSON structure."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor | np.ndarray] = {}
        self._seen: dict[Any, str] = {}

    def _name(self, identity: Any, value: torch.Tensor | np.ndarray, where: str) -> str:
        if identity not in self._seen:
            key = where or "tensor"
            while key in self.tensors or key == "__metadata__":  # the safetensors header's own key
                key += "'"
            self._seen[identity] = key
            self.tensors[key] = value
        return self._seen[identity]

    def encode(self, value: Any, where: str = "", depth: int = 1) -> Any:
        if depth > MAX_STRUCTURE_DEPTH:  # what load would refuse as damaged
            raise ValueError(f"{where}: the object nests more than {MAX_STRUCTURE_DEPTH} levels deep")
        if isinstance(value, torch.Tensor):
            _check_savable(value, where)
            # As torch.load gives them back: a Parameter as a Parameter, with its
            # requires_grad, and a tensor that requires grad still requiring it (an
            # optimizer made over it would otherwise skip it without a word).
            if isinstance(value, torch.nn.Parameter):
                kind = "parameter" if value.requires_grad else "parameter_no_grad"
            else:
                kind = "tensor_requires_grad" if value.requires_grad else "tensor"
            return {kind: self._name(_storage_key(value), value, where)}
        if isinstance(value, np.str_):  # a str (its subclass), which the numpy branch took for an array
            return {"value": str(value)}
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            try:
                to_safetensors_dtype(array.dtype)
            except TypeError as exc:  # a number safetensors has no name for (complex128), or not a number
                why = exc if array.dtype.kind in "biufc" else \
                    f"cannot save a numpy array of dtype {array.dtype} without pickle"
                raise TypeError(f"{where or 'the object'}: {why}") from None
            array = array.astype(array.dtype.newbyteorder("="), order="C", copy=False)
            kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
            return {kind: self._name(("object", id(value)), array, where)}
        if isinstance(value, OrderedDict):  # before dict, its base: state_dict() returns one
            node = {"items": self._items(value, where, depth)}
            if hasattr(value, "_metadata"):  # the module versions load_state_dict migrates old state by
                node["_metadata"] = self.encode(value._metadata, f"{where}._metadata" if where else "_metadata",
                                                depth + 1)
            return {"ordered_dict": node}
        if isinstance(value, dict):
            return {"dict": self._items(value, where, depth)}
        if isinstance(value, torch.Size):  # before tuple, its base
            return {"size": list(value)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.encode(v, f"{where}.{i}" if where else str(i), depth + 1)
                           for i, v in enumerate(value)]}
        if isinstance(value, float) and value != value:
            return {"float": "nan"}
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return {"float": "inf" if value > 0 else "-inf"}
        if isinstance(value, _SCALARS):
            return {"value": value}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        raise TypeError(f"{where or 'the object'}: cannot save a {type(value).__name__} without pickle")

    def _items(self, mapping: dict, where: str, depth: int) -> list[list[Any]]:
        items = []
        for k, v in mapping.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{where or 'the object'}: key {k!r} is {type(k).__name__}; only str and int "
                                "keys can be saved without pickle")
            items.append([k, self.encode(v, f"{where}.{k}" if where else str(k), depth + 1)])
        return items


def _decode(structure: Any, arrays: Mapping[str, np.ndarray], where: str, map_location: Any) -> Any:
    """The object :class:`_Encoder` flattened, from the arrays the core read: each tensor
    made once (tied entries come back as one tensor) and moved to ``map_location``; numpy
    arrays as they were read. ``structure`` must have passed :func:`check_structure`."""
    return _Decoder(arrays, where, map_location).decode(structure)


class _Decoder:
    """:func:`_decode`'s walk. A method, not a closure that calls itself: such a closure is
    a reference cycle (function -> cell -> function) that kept every tensor it made alive
    until the collector's next pass."""

    def __init__(self, arrays: Mapping[str, np.ndarray], where: str, map_location: Any) -> None:
        self.arrays, self.where, self.map_location = arrays, where, map_location
        self.tensors: dict[tuple[str, str], torch.Tensor] = {}  # by (kind, name): tied entries stay one

    def _tensor(self, kind: str, name: str) -> torch.Tensor:
        made = self.tensors.get((kind, name))
        if made is not None:
            return made
        if kind == "tensor":
            made = _to_tensors({name: self.arrays[name]}, self.map_location)[name]
        elif kind == "tensor_requires_grad":  # its own leaf over the same memory
            made = self._tensor("tensor", name).detach().requires_grad_(True)
        else:
            made = torch.nn.Parameter(self._tensor("tensor", name), requires_grad=kind == "parameter")
        self.tensors[(kind, name)] = made
        return made

    def decode(self, node: Any) -> Any:
        (kind, value), = node.items()
        arrays = self.arrays
        if kind in _TENSOR_KINDS:
            return self._tensor(kind, value)
        if kind == "ndarray":
            return arrays[value]
        if kind == "npscalar":
            if arrays[value].shape != ():
                raise CorruptCheckpointError(f"{self.where}: the scalar {value!r} is stored with shape "
                                             f"{arrays[value].shape}")
            return arrays[value][()]
        if kind == "dict":
            return {k: self.decode(v) for k, v in value}
        if kind == "ordered_dict":
            made = OrderedDict((k, self.decode(v)) for k, v in value["items"])
            if "_metadata" in value:
                made._metadata = self.decode(value["_metadata"])  # type: ignore[attr-defined]
            return made
        if kind == "size":
            return torch.Size(value)
        if kind == "list":
            return [self.decode(v) for v in value]
        if kind == "tuple":
            return tuple(self.decode(v) for v in value)
        if kind == "float":
            return float(value)
        if kind == "value":
            return value
        dtype = getattr(torch, value, None)  # the one kind left: check_structure knows them all
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{self.where}: unknown dtype {value!r}")
        return dtype


_TENSOR_KINDS = ("tensor", "tensor_requires_grad", "parameter", "parameter_no_grad")


MapLocation = Union[str, torch.device, Mapping[str, Any], Callable[[torch.UntypedStorage, str], Any], None]
"""``torch.load``'s forms: a device or its name, a dict of location names, or a callable."""


def resolve_map_location(map_location: MapLocation) -> str | torch.device | None:
    """The device ``map_location`` sends tensors to, in any of ``torch.load``'s forms. A
    tensorferry or safetensors file keeps its tensors' bytes, not their devices: every
    tensor is taken as saved at location ``"cpu"``, which a dict maps
    (``{"cuda:0": "cpu"}`` leaves it there) and a callable is given, with an empty CPU
    storage (``lambda storage, loc: storage.cuda(rank)`` moves it)."""
    if map_location is None or isinstance(map_location, (str, torch.device)):
        return map_location
    if isinstance(map_location, Mapping):
        return map_location.get("cpu", None)
    if callable(map_location):
        moved = map_location(torch.UntypedStorage(0), "cpu")
        return None if moved is None else moved.device  # None: torch.load's default placement
    raise TypeError(f"map_location must be a device, a device name, a dict of location names or torch.load's "
                    f"callable, not a {type(map_location).__name__}")


def _to_tensors(arrays: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
    """Arrays the core read as CPU tensors (bf16 and fp8 included), moved to ``map_location``."""
    tensors = {name: a if isinstance(a, torch.Tensor) else from_array(a, to_safetensors_dtype(a.dtype))
               for name, a in arrays.items()}  # tensors already: those read in place
    if map_location is not None and torch.device(map_location).type != "cpu":
        tensors = {name: t.to(map_location) for name, t in tensors.items()}
    return tensors


def _on_meta(map_location: Any) -> bool:
    return map_location is not None and torch.device(map_location).type == "meta"


def _unread(infos: Iterable[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The tensors ``(name, safetensors dtype, shape)`` of a load to the meta device, which
    reads them not: meta tensors of that dtype and shape."""
    return {name: torch.empty(shape, dtype=FROM_SAFETENSORS[dtype], device="meta") for name, dtype, shape in infos}


@gc_paused(main_thread_only=True)  # the writes last as long as the drive takes
def save(obj: Any, path: str | os.PathLike | BinaryIO, *, metadata: dict[str, str] | None = None,
         engine: Engine | None = None, superseded: Callable[[], bool] | None = None) -> None:
    """Saves a state dict (or any nesting of dicts, lists, tuples, tensors, numpy arrays and
    scalars) as one safetensors file.

    The file replaces ``path`` atomically once it is complete and durable. A file object
    (``io.BytesIO``, an fsspec stream) gets the same bytes written from where it stands,
    as ``torch.save`` writes (:meth:`ShardWriter.write_to`); an empty file opened for
    writing (``open(path, "wb")``) is written as that file, by the engine, durable but
    in place. Tensors that share memory (tied weights) are stored once and load back as
    one tensor. Its metadata says ``{"format": "pt"}`` (unless ``metadata`` says
    otherwise), as safetensors' torch module writes and transformers asks. ``superseded``
    (a path only) is asked just before the file replaces ``path``: True drops the write
    and leaves ``path`` as it is.
    """
    encoder = _Encoder()
    structure = encoder.encode(obj)
    meta = {**TORCH_FORMAT, **(metadata or {})}
    meta[STRUCTURE_KEY] = json.dumps(structure, separators=(",", ":"))
    to_stream = is_stream(path)
    if to_stream:
        require(path, "write", "save")
    with file_behind(path, for_write=True) if to_stream else contextlib.nullcontext() as own:
        # Nothing is opened before close(), which cleans up after itself on failure. A stream
        # is handed over as one, not by its name, which may be a URL or another file's path.
        writer = ShardWriter(own or (path if to_stream else os.fspath(path)), engine,
                             metadata=meta, atomic=not to_stream, keep_on_failure=own is not None,
                             superseded=superseded)
        for key, t in _writable(encoder.tensors).items():
            writer.add(key, t)
        writer.close()


def _writable(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, Any]:
    """What a writer takes for each tensor: host bytes as they are, and device tensors as
    :class:`Deferred` sources of one :class:`DeviceToHost`, which copies them off the
    device in the order the writer writes them, several in flight, each written as soon
    as its own copy lands."""
    specs = {k: safetensors_dtype(t.dtype) for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    on_device = {k: i for i, k in enumerate(k for k in write_order(specs.items()) if tensors[k].device.type != "cpu")}
    stager = DeviceToHost([tensors[k] for k in on_device])
    writable: dict[str, Any] = {}
    for key, t in tensors.items():
        if key in on_device:
            writable[key] = Deferred(specs[key], tuple(t.shape), stager.source(on_device[key]))
        else:
            writable[key] = t if isinstance(t, np.ndarray) else host_array(t)
    return writable


@gc_paused()
def load(path: str | os.PathLike | BinaryIO, map_location: MapLocation = None, *,
         engine: Engine | None = None, verify: bool = True, mmap: bool = False,
         weights_only: bool | None = None) -> Any:
    """Loads what :func:`save` (a file) or :func:`save_checkpoint` (a directory) wrote, no
    pickle (``weights_only`` is taken as ``torch.load`` takes it, and changes nothing). A
    plain safetensors file, or a folder of another layout (a Hugging Face
    folder, or its ``model.safetensors.index.json``), loads as a flat dict of tensors. ``map_location``
    moves tensors to a device, in any of ``torch.load``'s forms (see
    :func:`resolve_map_location`); to a CUDA device, each read is copied over as soon as it
    lands, while later reads are in flight (numpy arrays in the structure stay on the host).

    ``mmap=True`` (host only) returns tensors over a private copy-on-write mapping of the
    file, as ``torch.load(mmap=True)`` does: about half the CPU (no new memory zeroed,
    nothing copied), checksums still verified, pages shared with the page cache; writing
    to a tensor copies just the pages written and never changes the file. Suits weights
    that are read, not trained. The file must not be truncated or rewritten in place
    while the tensors live (tensorferry's saves replace files whole).

    A file object is read once into new memory from where it stands through the file's
    last tensor, and the tensors are views of that memory; one opened on a file, at its
    start, is read as that file, up to its last tensor (the caller may have written on
    after a save). A path is read as the whole file: bytes after the last tensor are
    refused, as safetensors refuses them.

    To ``map_location="meta"``, as ``torch.load`` does, tensors come back on the meta
    device with their shapes and dtypes and nothing of them is read (a file object's
    bytes are read all the same); numpy arrays in the structure are read as ever."""
    map_location = resolve_map_location(map_location)
    meta = _on_meta(map_location)
    device = None if meta else _cuda_device(map_location, mmap)
    if is_stream(path):
        with file_behind(path) as own:
            if own is not None:  # read as that file, up to its last tensor: the caller may have written on
                reader = ShardReader(own, engine, verify=verify, ends_at_last_tensor=False)
                loaded = _load_shard(reader, map_location, meta, device, mmap)
                path.seek(reader.end)  # where a read through the stream stops: on to the object saved after it
                return loaded
        require(path, "read", "load")
        return _load_shard(StreamReader(path, verify=verify), map_location, meta, device, mmap)
    if os.path.isdir(path) or os.fspath(path).endswith(INDEX_SUFFIX):
        return load_checkpoint(path, map_location, engine=engine, verify=verify, mmap=mmap)
    return _load_shard(ShardReader(path, engine, verify=verify), map_location, meta, device, mmap)


def _load_shard(reader: ShardReader, map_location: str | torch.device | None, meta: bool,
                device: torch.device | None, mmap: bool) -> Any:
    """What :func:`load` returns for the one file ``reader`` reads (closed after), to the
    resolved ``map_location``: ``meta`` and ``device`` as :func:`load` works them out."""
    with reader:
        where = reader.path
        structure_text = reader.metadata.get(STRUCTURE_KEY)
        structure = None if structure_text is None else parse_json(structure_text, "saved structure", where)
        if structure is not None:
            check_structure(structure, where, reader.tensors)
        if meta and not isinstance(reader, StreamReader):
            on_host = _host_names(structure)
            arrays = _unread((n, t.dtype, t.shape) for n, t in reader.tensors.items() if n not in on_host)
            arrays.update(reader.read_many([n for n in reader.tensors if n in on_host]))
        elif mmap or isinstance(reader, StreamReader):  # a stream's tensors: views of the memory it was read into
            arrays = reader.map_many()
        elif device is None:
            arrays = reader.read_many(populate=False)  # one file, one thread: see read_many
        else:
            on_host = _host_names(structure)
            arrays = read_to_device(reader, [n for n in reader.tensors if n not in on_host], device)
            arrays.update(reader.read_many([n for n in reader.tensors if n in on_host]))
    if structure is None:
        return _to_tensors(arrays, map_location)
    return _decode(structure, arrays, where, map_location)


def _cuda_device(map_location: Any, mmap: bool, out: Mapping[str, torch.Tensor] | None = None) -> torch.device | None:
    """The CUDA device a load lands on (``map_location``'s, or that of the ``out``
    tensors), or None for a load to the host. Refuses one that cannot be: to any other
    device, mapping files (``mmap``: host memory), or to a GPU torch has not (else torch's
    own failure deep inside: "Torch not compiled with CUDA enabled")."""
    devices = {t.device for t in (out or {}).values() if t.device.type != "cpu"}
    if map_location is not None and torch.device(map_location).type != "cpu":
        devices.add(torch.device(map_location))
    if not devices:
        return None
    if len(devices) > 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"a load lands on the host or on one CUDA device, not on {sorted(map(str, devices))}")
    device = next(iter(devices))
    if mmap:
        raise ValueError(f"mmap=True maps files into host memory; to load to {device} leave it off")
    if not torch.cuda.is_available():
        raise RuntimeError(f"a load to {device}, but torch.cuda.is_available() is False: on a machine "
                           "without a GPU, load with map_location='cpu'")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _host_names(structure: Any) -> set[str]:
    """Names of the numpy arrays and scalars in a saved structure: they load on the host."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for kind, value in node.items():
                if kind in ("ndarray", "npscalar"):
                    found.add(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(structure)
    return found


@gc_paused(main_thread_only=True)  # the writes last as long as the drive takes
def save_checkpoint(directory: str | os.PathLike, obj: Any, metadata: Mapping[str, Any] | None = None, *,
                    engine: Engine | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    buffer_size: int = DEFAULT_BUFFER_SIZE, overwrite: bool = False,
                    superseded: Callable[[], bool] | None = None) -> str:
    """Saves a state dict (anything :func:`save` takes) as a checkpoint directory, atomically
    (:func:`tensorferry.save_checkpoint`: sharded, checksummed, a manifest); returns its path.

    Every safetensors dtype goes through, bf16 and fp8 included; tied tensors are stored
    once. ``metadata`` is any JSON-serialisable mapping, kept in the manifest. The
    directory carries ``model.safetensors.index.json`` and its files ``{"format": "pt"}``,
    so that transformers' ``from_pretrained`` opens it (with a ``config.json`` beside).
    ``superseded``: as :meth:`tensorferry.checkpoint.PendingCheckpoint.commit` takes it.
    """
    encoder = _Encoder()
    structure = encoder.encode(obj)
    meta = dict(metadata or {})
    meta[STRUCTURE_KEY] = structure
    return _save_directory(directory, _writable(encoder.tensors), meta, engine=engine, max_shard_bytes=max_shard_bytes,
                           buffer_size=buffer_size, overwrite=overwrite, shard_metadata=TORCH_FORMAT, hf_index=True,
                           superseded=superseded)


@gc_paused()
def load_checkpoint(directory: str | os.PathLike, map_location: MapLocation = None, *,
                    names: Iterable[str] | None = None, out: Mapping[str, torch.Tensor] | None = None,
                    engine: Engine | None = None, verify: bool = True, mmap: bool = False) -> Any:
    """Loads a checkpoint directory as torch tensors.

    What :func:`save_checkpoint` wrote comes back as it was saved; any other checkpoint
    directory (or one read with ``names`` or ``out``), a Hugging Face folder say, as a
    flat dict of tensors. Tensors named in ``out`` (tensors of the saved shape and dtype,
    all on the CPU or all on one CUDA device) are read in place. ``mmap=True``: as in
    :func:`load`, for tensorferry checkpoints and folders of safetensors files.
    """
    map_location = resolve_map_location(map_location)
    meta = _on_meta(map_location)
    device = None if meta else _cuda_device(map_location, mmap, out)
    if meta:
        if out:
            raise ValueError("out= reads the tensors into those given; map_location='meta' reads none")
        manifest, arrays = _directory_unread(directory, names, engine, verify)
    elif device is not None and listed_by_manifest(directory):
        manifest, arrays = _load_directory_to_device(directory, names, out, device, engine, verify)
    else:
        destinations = {name: host_array(t, writable=True, where=f"{os.fspath(directory)}: out[{name!r}]")
                        for name, t in (out or {}).items()}
        manifest, arrays = load_with_manifest(directory, names, out=destinations, engine=engine, verify=verify,
                                              mmap=mmap)
        arrays = {name: out[name] if out and name in out else a for name, a in arrays.items()}
    structure = manifest["metadata"].get(STRUCTURE_KEY) if manifest is not None else None
    if structure is None or names is not None or out:
        return _to_tensors(arrays, map_location)
    check_structure(structure, os.fspath(directory), arrays)
    return _decode(structure, arrays, os.fspath(directory), map_location)


def _directory_unread(directory: str | os.PathLike, names: Iterable[str] | None, engine: Engine | None,
                      verify: bool) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """:func:`load_checkpoint`'s arrays for the meta device, with the manifest they were
    listed by (None for another layout): stand-ins (:func:`_unread`) for the tensors,
    which are not read, and the structure's numpy arrays, read."""
    from ...layouts import detect  # the layouts build on the core this module imports

    manifest = read_manifest(directory) if listed_by_manifest(directory) else None
    structure = manifest["metadata"].get(STRUCTURE_KEY) if manifest is not None and names is None else None
    on_host = _host_names(structure)
    with detect(directory).open(engine=engine, verify=verify) as source:
        wanted, _ = names_to_read(os.fspath(directory), source.tensors, names, {})
        arrays = _unread((n, source.tensors[n].dtype, source.tensors[n].shape) for n in wanted if n not in on_host)
        arrays.update(source.read([n for n in wanted if n in on_host]))
    return manifest, {n: arrays[n] for n in wanted}


def _load_directory_to_device(directory: str | os.PathLike, names: Iterable[str] | None,
                              out: Mapping[str, torch.Tensor] | None, device: torch.device,
                              engine: Engine | None, verify: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load_checkpoint`'s tensors read into CUDA tensors, files in parallel (each
    through :func:`read_to_device`), with the manifest they were read by; the
    structure's numpy arrays are read to the host."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    tensors = manifest["tensors"]
    wanted, out = names_to_read(directory, tensors, names, out or {})
    structure = manifest["metadata"].get(STRUCTURE_KEY)
    if structure is not None:
        check_structure(structure, directory, tensors)
    on_host = _host_names(structure) - set(out)
    arrays: dict[str, Any] = {}
    if any(n in on_host for n in wanted):
        arrays.update(_load_directory(directory, [n for n in wanted if n in on_host], engine=engine, verify=verify))
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        if n not in on_host:
            by_file.setdefault(tensors[n]["file"], []).append(n)

    def read(filename: str) -> dict[str, torch.Tensor]:
        here = by_file[filename]
        with open_shard(directory, manifest, filename, engine=engine, verify=verify, names=here) as reader:
            return read_to_device(reader, here, device, out={n: out[n] for n in here if n in out})

    with ThreadPool(max_workers=min(MAX_CONCURRENT_SHARDS, max(1, len(by_file)))) as pool:
        for part in pool.map(read, by_file):
            arrays.update(part)
    return manifest, {n: arrays[n] for n in wanted}


__all__ = ["load", "load_checkpoint", "save", "save_checkpoint"]
